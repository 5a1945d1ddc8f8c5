"""The Python API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.progress import Progress

from thermostat.engine.config import EngineConfig
from thermostat.engine.llm_engine import LLMEngine
from thermostat.engine.sampler import TokenLogprobs
from thermostat.sampling.fanout import per_sample
from thermostat.sampling.params import SamplingParams
from thermostat.sampling.recommendations import recommendation_for
from thermostat.sampling.resolve import Policy, Resolution, SamplingDefaults


@dataclass
class Completion:
    """One generated sequence."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class GenerationOutput:
    """The result for one prompt: `n` completions, and how sampling was resolved."""

    prompt_token_ids: list[int]
    completions: list[Completion]
    resolution: Resolution
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason

    @property
    def sampling(self) -> dict[str, Any]:
        """effective values, the source of each, policy adjustments (the HTTP `sampling` shape)."""
        return self.resolution.to_dict()


def build_sampling_defaults(
    engine_defaults: dict[str, Any],
    config_dict: dict[str, Any],
    operator: dict[str, Any] | str | None,
    policy: Policy,
) -> SamplingDefaults:
    """Layers for a model: operator values (or the word "recommended" to opt in to the
    family's published values) over the model's generation_config.json values."""
    recommended = None
    if operator == "recommended":
        rec = recommendation_for(config_dict)
        if rec is None:
            raise ValueError("no published recommendation is known for this model's family")
        recommended, operator = rec.values, None
    elif isinstance(operator, str):
        raise ValueError(f"sampling defaults must be a dict or 'recommended', got {operator!r}")
    return SamplingDefaults(
        operator=dict(operator or {}),
        recommended=recommended,
        generation_config=engine_defaults,
        policy=policy,
    )


class LLM:
    """Offline generation with the Thermostat engine.

    >>> llm = LLM("demo")
    >>> out = llm.generate(["To be, or not"], SamplingParams(max_tokens=16))[0]
    >>> out.text, out.sampling["source"]["temperature"]
    """

    def __init__(
        self,
        model: str = "demo",
        *,
        sampling_defaults: dict[str, Any] | str | None = None,
        min_temperature: float | None = None,
        greedy: str = "allow",
        **engine_options: Any,
    ) -> None:
        from thermostat.engine.loader import load_model

        config = EngineConfig(model=str(model), **engine_options)
        loaded = load_model(config.model, config.dtype, config.max_model_len, config.cpu_kernels)
        defaults = build_sampling_defaults(
            loaded.generation_config.values,
            loaded.config_dict,
            sampling_defaults,
            Policy(min_temperature=min_temperature, greedy=greedy),  # type: ignore[arg-type]
        )
        self.engine = LLMEngine(config, defaults, loaded)
        self.tokenizer = loaded.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids). `params` is one
        SamplingParams for all prompts or one per prompt; unset fields are resolved by the
        layered chain. Raises on invalid input before anything is queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        from thermostat.sampling.resolve import resolve

        resolutions = [resolve(p, self.engine.sampling_defaults) for p in params]
        results: dict[str, tuple[int, int]] = {}
        finals: dict[tuple[int, int], Any] = {}
        added: list[str] = []
        try:
            for i, (prompt, p, res) in enumerate(zip(prompts, params, resolutions, strict=True)):
                for j, child in enumerate(per_sample(res, p.n or 1)):
                    req_id, _ = self.engine.add_request(
                        prompt, p, req_id=f"gen-{i}-{j}-{id(self)}", resolution=child
                    )
                    results[req_id] = (i, j)
                    added.append(req_id)
        except Exception:
            for req_id in added:
                self.engine.abort(req_id)
            raise
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(results))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.req_id in results:
                        finals[results[out.req_id]] = out
                        bar.advance(task)
        outputs = []
        for i in range(len(prompts)):
            outs = [finals[(i, j)] for j in range(params[i].n or 1)]
            outputs.append(
                GenerationOutput(
                    prompt_token_ids=outs[0].prompt_token_ids,
                    completions=[
                        Completion(o.text, o.token_ids, o.finish_reason, o.stop_reason, o.logprobs)
                        for o in outs
                    ],
                    resolution=outs[0].sampling,
                    prompt_logprobs=outs[0].prompt_logprobs,
                    num_cached_tokens=outs[0].num_cached_tokens,
                )
            )
        return outputs
