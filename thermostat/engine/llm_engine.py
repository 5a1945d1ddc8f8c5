"""The engine: groups of requests in, a step at a time, deltas out. Single-threaded; the server
drives it from its own thread.

A step is the scheduler's three calls (schedule, execute, update); `update` is where every
generation ends (stop token, stop string, loop, length). The engine then turns what each
request gained into a `RequestDelta` and forgets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch

from thermostat.engine.checkpoint import ModelLoadError
from thermostat.engine.config import EngineConfig, SchedulerConfig
from thermostat.engine.constraint import ConstraintCompiler
from thermostat.engine.kv_blocks import KVBlocks, size_pools
from thermostat.engine.loader import LoadedModel, load_configured
from thermostat.engine.model_runner import ModelRunner
from thermostat.engine.output_text import OutputText
from thermostat.engine.outputs import QueuedRequest, RequestDelta
from thermostat.engine.repetition import BreakerTokens
from thermostat.engine.request import Request
from thermostat.engine.scheduler import Scheduler
from thermostat.engine.speculative import no_next_n
from thermostat.engine.startup_log import log_ready
from thermostat.engine.steps import Handoff, RunnerOutput, TokenLogprobs
from thermostat.models.kv_cache import PagedKVCache
from thermostat.models.kv_spec import resolve_kv_dtype
from thermostat.models.registry import Drafter
from thermostat.sampling.fanout import Plan, plan
from thermostat.sampling.fields import SamplingParamError
from thermostat.sampling.params import SamplingParams
from thermostat.sampling.resolve import SamplingDefaults, resolve

log = logging.getLogger("thermostat.engine")


@dataclass
class _Emitting:
    """What the engine still owes the consumer of one request."""

    req: Request
    text: OutputText
    prompt_logprobs: list[TokenLogprobs | None] | None  # filled while the prompt is computed
    num_emitted: int = 0  # output tokens already in a delta


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        sampling_defaults: SamplingDefaults | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_configured(config)
        self.tokenizer = self.loaded.tokenizer
        self.sampling_defaults = sampling_defaults or SamplingDefaults(
            generation_config=self.loaded.generation_config.values
        )
        arch = self.loaded.arch
        spec = self.loaded.model.cache_spec(
            config.block_size, resolve_kv_dtype(config.kv_cache_dtype, self.loaded.dtype)
        )
        pools = size_pools(
            spec,
            int(config.kv_cache_memory_gb * 2**30),
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.loaded.max_model_len,
        )
        self.cache = PagedKVCache(spec, pools, self.loaded.dtype, self.loaded.ops)
        self.blocks = KVBlocks.for_spec(spec, pools, config.enable_prefix_caching)
        # what a token of context costs (the main pool) and what a sequence holds whatever its
        # length (the window pools), in bytes: the startup line and /server_info report them
        self.kv_bytes_per_token = spec.bytes_per_token
        self.kv_fixed_bytes_per_sequence = spec.fixed_bytes_per_sequence
        drafter = self._drafter()
        scheduling = SchedulerConfig.of(config, self.loaded.max_model_len)
        if drafter is not None:  # one token per next-n layer
            speculation = replace(scheduling.speculation, k=min(config.speculative_k, 1))
            scheduling = replace(scheduling, speculation=speculation)
        self.scheduler = Scheduler(scheduling, self.blocks)
        tokenizer, known = self.tokenizer, min(len(self.tokenizer), arch.vocab_size)
        self.runner = ModelRunner(
            self.loaded.model,
            self.cache,
            config.block_size,
            arch.sliding_window,
            drafter,
            BreakerTokens(lambda: tokenizer.batch_decode([[i] for i in range(known)])),
        )
        self.constraints = ConstraintCompiler(
            self.tokenizer, arch.vocab_size, self.loaded.eos_token_ids
        )
        self._emitting: dict[str, _Emitting] = {}
        log_ready(self, spec, pools)

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=True)
            return ids
        return list(prompt)

    def plan(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams) -> Plan:
        """Tokenize, resolve and fit: what `add_group` takes. Raises InvalidRequest
        (SamplingParamError, GreedyRejected) for what cannot be served."""
        resolution = resolve(params, self.sampling_defaults)
        prompt_ids = [self.tokenize(p) for p in prompts]
        return plan(resolution, prompt_ids, self.max_model_len, params.n or 1)

    def add_group(
        self,
        group_id: str,
        planned: Plan,
        *,
        handoff: bool = False,
        handoffs: Sequence[Handoff | None] | None = None,
    ) -> list[QueuedRequest]:
        """Queue every choice of `planned`, all or none; return them in index order.

        Request `index` runs choice `index` of the plan (sample `index % n` of prompt
        `index // n`), with id f"{group_id}-{index}". Raises SamplingParamError for token ids
        this model does not have; nothing stays queued then.

        Disaggregation: with `handoff` every request computes its prompt, samples its first
        token and ends with finish_reason "handoff", its last delta carrying that (`handoff`:
        the prompt's rows, the token, the generator state). `handoffs[index]` is such a handoff
        from another engine for request `index`, which then continues from its first token as
        if it had sampled it. Raises ValueError for rows that do not fit the prompt or the cache
        (the caller checked the peer's model and cache spec)."""
        self._check_tokens(planned)
        queued: list[QueuedRequest] = []
        try:
            for index, choice in enumerate(planned.choices):
                prompt = list(planned.prompt_of(index))
                item = QueuedRequest(f"{group_id}-{index}", index, prompt, choice)
                self._add(item, handoff, handoffs[index] if handoffs is not None else None)
                queued.append(item)
        except BaseException:
            for item in queued:
                self.abort(item.req_id)
            raise
        return queued

    def _check_tokens(self, planned: Plan) -> None:
        vocab = self.loaded.arch.vocab_size
        for prompt_ids in planned.prompts:
            if not prompt_ids:
                raise SamplingParamError("prompt", "must not be empty")
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
                raise SamplingParamError("prompt", f"token ids must be integers in [0, {vocab})")
        for choice in planned.choices:
            if any(not 0 <= t < vocab for t in choice.effective.stop_token_ids):
                raise SamplingParamError("stop_token_ids", f"token ids must be in [0, {vocab})")

    def _add(self, item: QueuedRequest, handoff: bool, from_handoff: Handoff | None) -> None:
        eff = item.resolution.effective
        if from_handoff is not None:
            self.cache.check_rows(from_handoff.rows, len(item.prompt_token_ids))
        prompt_ids = item.prompt_token_ids  # fitted: prompt + max_tokens <= max_model_len
        stop_ids = set(eff.stop_token_ids)
        if not eff.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        text = OutputText(
            self.tokenizer, prompt_ids, eff.skip_special_tokens, eff.stop, self.config.stop_on_loop
        )
        req = Request(
            item.req_id,
            prompt_ids,
            eff,
            frozenset(stop_ids),
            text=text,
            constraint=None if eff.structured is None else self.constraints.compile(eff.structured),
            handoff=handoff,
            from_handoff=from_handoff,
        )
        self.scheduler.add(req)
        prompt_logprobs: list[TokenLogprobs | None] | None = (
            None if eff.prompt_logprobs is None else [None] * len(prompt_ids)
        )
        if prompt_logprobs is not None and from_handoff and from_handoff.prompt_logprobs:
            prompt_logprobs = list(from_handoff.prompt_logprobs)
        self._emitting[item.req_id] = _Emitting(req, text, prompt_logprobs)

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._emitting.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self, before_forward: Callable[[], None] | None = None) -> list[RequestDelta]:
        """Run one scheduling step; return a delta for every request that generated tokens or
        finished. A handoff request's rows are read here, right after the update that freed its
        blocks: nothing writes a freed block before the next step runs. `before_forward`, if
        given, runs once the step's inputs are ready, right before the model's forward (not at
        all in a step without one)."""
        out = self.scheduler.schedule()
        result = self.runner.execute(out, before_forward)
        progressed = self.scheduler.update(out, result)
        deltas = []
        for req in progressed:
            emitting = self._emitting.get(req.req_id)
            if emitting is not None and (delta := self._delta(emitting, result)) is not None:
                deltas.append(delta)
        return deltas

    def _delta(self, e: _Emitting, result: RunnerOutput) -> RequestDelta | None:
        req = e.req
        if e.prompt_logprobs is not None:
            for pos, lp in result.prompt_logprobs.get(req.req_id, {}).items():
                e.prompt_logprobs[pos] = lp
        new_tokens = req.output_token_ids[e.num_emitted :]
        if not new_tokens and not req.finished:
            return None
        first = e.num_emitted == 0
        e.num_emitted = req.num_output_tokens
        new_logprobs = None
        if req.params.logprobs is not None:
            new_logprobs = [result.logprobs[req.req_id]] if req.req_id in result.logprobs else []
            new_logprobs += result.speculated_logprobs.get(req.req_id, [])
            new_logprobs = new_logprobs[: len(new_tokens)]
        if req.finished:
            del self._emitting[req.req_id]
        return RequestDelta(
            req_id=req.req_id,
            new_token_ids=new_tokens,
            new_text=e.text.take(req.finished),
            new_logprobs=new_logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            prompt_logprobs=e.prompt_logprobs if first else None,
            num_cached_tokens=req.num_cached_tokens,
            handoff=self._handoff(req, result, e.prompt_logprobs),
            speculative=self._speculative(req),
        )

    def _drafter(self) -> Drafter | None:
        """The model as `--speculative mtp`'s proposer (None for another method); ModelLoadError
        if it has no next-n layers."""
        if self.config.speculative != "mtp":
            return None
        if not getattr(self.loaded.model, "num_next_n", 0):
            raise ModelLoadError(no_next_n(self.loaded.path))
        return cast(Drafter, self.loaded.model)

    def _speculative(self, req: Request) -> dict[str, int | str] | None:
        """`sampling.speculative` of a request so far (None: speculation is off)."""
        spec = self.scheduler.speculation
        if not spec.on:
            return None
        return {
            "method": spec.method,
            "k": spec.k,
            "proposed": req.num_proposed,
            "accepted": req.num_accepted,
            "steps": req.num_verifications,
        }

    def _handoff(
        self,
        req: Request,
        result: RunnerOutput,
        prompt_logprobs: list[TokenLogprobs | None] | None,
    ) -> Handoff | None:
        if req.finish_reason != "handoff" or req.handoff_slots is None:
            return None
        return Handoff(
            rows=self.cache.export([torch.tensor(s, dtype=torch.int64) for s in req.handoff_slots]),
            first_token=req.output_token_ids[0],
            first_logprobs=result.logprobs.get(req.req_id),
            generator_state=self.runner.generator_state(req.req_id),
            prompt_logprobs=prompt_logprobs,
        )
