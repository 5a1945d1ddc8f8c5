"""The engine: requests in, a step at a time, outputs out. Single-threaded; the server drives
it from its own thread."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass

import torch

from thermostat import kernels
from thermostat.engine.block_manager import BlockManager
from thermostat.engine.config import EngineConfig
from thermostat.engine.detokenizer import IncrementalDetokenizer
from thermostat.engine.loader import LoadedModel, load_model
from thermostat.engine.model_runner import ModelRunner
from thermostat.engine.outputs import RequestOutput
from thermostat.engine.request import Request
from thermostat.engine.sampler import TokenLogprobs
from thermostat.engine.scheduler import Scheduler, SchedulerConfig
from thermostat.models.kv_cache import PagedKVCache, resolve_kv_dtype
from thermostat.quality.streaming import StreamingAnalyzer
from thermostat.sampling.params import SamplingParamError, SamplingParams
from thermostat.sampling.resolve import Resolution, SamplingDefaults, resolve

log = logging.getLogger("thermostat.engine")

# stop_reason of a generation ended by stop_on_loop. finish_reason stays "stop", which every
# client understands (vLLM reports its own finish_reason "repetition", which clients map to
# "stop"); the response's `quality` says which cycle it was.
LOOP_STOP_REASON = "loop"


@dataclass
class _Tracked:
    """Output-side state of one request: detokenizer and logprobs."""

    req: Request
    resolution: Resolution
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None = None  # a list when the request asked for them
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # indexed by prompt position
    num_seen: int = 0  # output tokens already reported
    loops: StreamingAnalyzer | None = None  # with stop_on_loop

    def __post_init__(self) -> None:
        eff = self.resolution.effective
        if eff.logprobs is not None:
            self.logprobs = []
        if eff.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * self.req.num_prompt_tokens


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
        self.loaded = loaded or load_model(
            config.model, config.dtype, config.max_model_len, config.cpu_kernels
        )
        self.tokenizer = self.loaded.tokenizer
        self.sampling_defaults = sampling_defaults or SamplingDefaults(
            generation_config=self.loaded.generation_config.values
        )
        arch = self.loaded.arch
        spec = self.loaded.model.cache_spec(
            config.block_size, resolve_kv_dtype(config.kv_cache_dtype, self.loaded.dtype)
        )
        num_blocks = spec.num_blocks_for(int(config.kv_cache_memory_gb * 2**30))
        self.cache = PagedKVCache(spec, num_blocks, self.loaded.dtype, self.loaded.ops)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.loaded.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
            ),
            self.blocks,
        )
        self.runner = ModelRunner(
            self.loaded.model, self.cache, config.block_size, arch.sliding_window
        )
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        log.info(
            "engine ready: %s (%s, %s), KV cache %d blocks x %d tokens (%s), CPU kernels %s",
            self.loaded.path,
            arch.architecture,
            self.loaded.dtype,
            num_blocks,
            config.block_size,
            spec.dtype,
            kernels.status() if config.cpu_kernels else "off (cpu_kernels=False)",
        )

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        req_id: str | None = None,
        resolution: Resolution | None = None,
    ) -> tuple[str, Resolution]:
        """Validate, resolve and queue a request. Raises SamplingParamError (bad input),
        GreedyRejected (policy) or ValueError (does not fit). Nothing is queued on error."""
        resolution = resolution or resolve(params, self.sampling_defaults)
        prompt_ids = self.tokenize(prompt)
        vocab = self.loaded.arch.vocab_size
        if not prompt_ids:
            raise SamplingParamError("prompt", "must not be empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise SamplingParamError("prompt", f"token ids must be integers in [0, {vocab})")
        if any(not 0 <= t < vocab for t in resolution.effective.stop_token_ids):
            raise SamplingParamError("stop_token_ids", f"token ids must be in [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        eff = resolution.effective
        if params.max_tokens is not None and eff.max_tokens > room:
            raise SamplingParamError(
                "max_tokens",
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({eff.max_tokens}) exceeds the "
                f"context length ({self.max_model_len})",
            )
        if room <= 0 and eff.max_tokens > 0:
            raise SamplingParamError(
                "prompt", f"prompt of {len(prompt_ids)} tokens fills the context length"
            )
        if params.max_tokens is None and eff.max_tokens > room:
            resolution = dataclasses.replace(
                resolution, effective=dataclasses.replace(eff, max_tokens=room)
            )
            eff = resolution.effective
        stop_ids = set(eff.stop_token_ids)
        if not eff.ignore_eos:
            stop_ids.update(self.loaded.eos_token_ids)
        req_id = req_id or f"req-{next(self._ids)}"
        req = Request(req_id, prompt_ids, eff, frozenset(stop_ids))
        self.scheduler.add(req)
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt_ids, eff.skip_special_tokens, eff.stop
        )
        loops = StreamingAnalyzer() if self.config.stop_on_loop else None
        self._tracked[req_id] = _Tracked(req, resolution, detok, loops=loops)
        return req_id, resolution

    def abort(self, req_id: str) -> None:
        self.scheduler.abort(req_id)
        self._tracked.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return an output for every request that progressed."""
        out = self.scheduler.schedule()
        result = self.runner.execute(out)
        progressed = self.scheduler.update(out, result)
        outputs = []
        for req in progressed:
            tracked = self._tracked.get(req.req_id)
            if tracked is None:
                continue
            for pos, lp in result.prompt_logprobs.get(req.req_id, {}).items():
                tracked.prompt_logprobs[pos] = lp
            if req.req_id in result.logprobs and tracked.logprobs is not None:
                tracked.logprobs.append(result.logprobs[req.req_id])
            output = self._output(tracked)
            if output is not None:
                outputs.append(output)
        return outputs

    def _output(self, t: _Tracked) -> RequestOutput | None:
        req = t.req
        new_tokens = req.output_token_ids[t.num_seen :]
        t.num_seen = req.num_output_tokens
        delta = ""
        for token in new_tokens:
            if token in req.stop_ids:
                continue  # a stop/EOS token ends the text without appearing in it
            delta += t.detok.add(token)
        stop_reason: str | int | None = t.detok.stop_reason
        if stop_reason is None and t.loops is not None and t.loops.update(delta).loop_detected:
            stop_reason = LOOP_STOP_REASON
        if stop_reason is not None and not req.finished:
            self.scheduler.finish(req, "stop")
        if req.finished:
            delta += t.detok.flush()
            if stop_reason is None and req.finish_reason == "stop":
                stop_reason = req.output_token_ids[-1]
            del self._tracked[req.req_id]
        elif not new_tokens:
            return None
        return RequestOutput(
            req_id=req.req_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids),
            text=t.detok.text,
            delta=delta,
            new_token_ids=new_tokens,
            finished=req.finished,
            finish_reason=req.finish_reason,
            stop_reason=stop_reason,
            sampling=t.resolution,
            logprobs=t.logprobs,
            prompt_logprobs=t.prompt_logprobs,
            num_cached_tokens=req.num_cached_tokens,
        )
