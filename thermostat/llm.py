"""The Python API: `LLM(model).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.progress import Progress

from thermostat.engine.config import EngineConfig
from thermostat.engine.llm_engine import LLMEngine
from thermostat.engine.outputs import Completion, QueuedRequest, RequestDelta
from thermostat.engine.steps import TokenLogprobs
from thermostat.sampling.defaults import build_sampling_defaults
from thermostat.sampling.params import SamplingParams
from thermostat.sampling.resolve import Policy, Resolution

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from thermostat.server.prompts import PromptBuilder

__all__ = ["LLM", "Completion", "GenerationOutput"]

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]]  # one prompt, or a list of them
Conversation = Sequence[Mapping[str, Any]]  # chat messages: {"role", "content", ...}


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
        """effective values, the source of each, policy adjustments (the HTTP `sampling` shape),
        and what speculation did for the first completion when it is on."""
        speculative = self.completions[0].speculative
        extra = {} if speculative is None else {"speculative": speculative}
        return self.resolution.to_dict() | extra


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
        from thermostat.engine.loader import load_configured

        config = EngineConfig(model=str(model), **engine_options)
        loaded = load_configured(config)
        defaults = build_sampling_defaults(
            loaded.generation_config.values,
            loaded.config_dict,
            sampling_defaults,
            Policy(min_temperature=min_temperature, greedy=greedy),  # type: ignore[arg-type]
        )
        self.engine = LLMEngine(config, defaults, loaded)
        self.tokenizer = loaded.tokenizer
        self._ids = itertools.count()
        self._prompts: PromptBuilder | None = None

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        """`generate` on chat messages (one conversation, or a list of them) rendered by the
        model's chat template as `serve` renders /v1/chat/completions (`tools` in OpenAI's form,
        as vLLM's `LLM.chat` takes them). Raises ValueError for messages the template refuses."""
        from thermostat.api.errors import APIError
        from thermostat.api.protocol import ChatMessage
        from thermostat.server.prompts import PromptBuilder

        if self._prompts is None:
            self._prompts = PromptBuilder(self.tokenizer, self.engine.max_model_len)
        conversations = [messages] if _one_conversation(messages) else messages
        prompts = []
        try:
            for conversation in conversations:
                parsed = [ChatMessage.model_validate(m) for m in conversation]
                text = self._prompts.chat_text(parsed, add_generation_prompt, tools)
                prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        except APIError as exc:
            raise ValueError(str(exc)) from exc
        return self.generate(prompts, params, progress=progress)

    def generate(
        self,
        prompts: Prompts,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, or a list of token ids). `params` is one
        SamplingParams for all prompts or one per prompt; unset fields are resolved by the
        layered chain. Raises on invalid input before anything is queued."""
        batch = [prompts] if _one_prompt(prompts) else prompts
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"{len(params)} SamplingParams for {len(batch)} prompts")
        groups: list[list[QueuedRequest]] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                planned = self.engine.plan([prompt], p)
                groups.append(self.engine.add_group(f"gen-{next(self._ids)}", planned))
        except BaseException:
            for group in groups:
                for item in group:
                    self.engine.abort(item.req_id)
            raise
        where = {item.req_id: (i, item.index) for i, g in enumerate(groups) for item in g}
        completions = [[Completion() for _ in group] for group in groups]
        firsts: dict[int, RequestDelta] = {}  # prompt index -> sample 0's first delta
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("generating", total=len(where))
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    if delta.req_id not in where:
                        continue  # another caller's request
                    i, j = where[delta.req_id]
                    completions[i][j].add(delta)
                    if j == 0:
                        firsts.setdefault(i, delta)
                    if delta.finished:
                        bar.advance(task)
        return [
            GenerationOutput(
                prompt_token_ids=group[0].prompt_token_ids,
                completions=completions[i],
                resolution=group[0].resolution,
                prompt_logprobs=firsts[i].prompt_logprobs,
                num_cached_tokens=firsts[i].num_cached_tokens,
            )
            for i, group in enumerate(groups)
        ]


def _one_conversation(
    messages: Conversation | Sequence[Conversation],
) -> TypeIs[Conversation]:
    return bool(messages) and isinstance(messages[0], Mapping)


def _one_prompt(prompts: Prompts) -> TypeIs[str | Sequence[int]]:
    """Text or token ids of one prompt, not a list of prompts."""
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
