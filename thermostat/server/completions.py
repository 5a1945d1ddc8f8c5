"""Text completion responses and stream chunks from a Job's outputs.

With `echo`, a choice's text starts with its prompt (verbatim when sent as text, decoded when
sent as token ids), and with `logprobs` its logprobs start with the prompt's tokens, the first
of them without a logprob: what lm-evaluation-harness's loglikelihood requests read.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

from thermostat.api.protocol import CompletionChoice, CompletionResponse
from thermostat.api.responses import ChunkTemplate
from thermostat.engine.steps import TokenLogprobs
from thermostat.server.logprobs import TokenText, completion_logprobs
from thermostat.server.prompts import Prompt
from thermostat.server.serving import Job


def _prompt_text(prompt: Prompt, tokens: TokenText) -> str:
    return prompt.text if prompt.text is not None else tokens.decode(prompt.token_ids)


def _logprobs(
    entries: Sequence[TokenLogprobs | None] | None,
    token_ids: list[int],
    prompt: Prompt | None,
    prompt_logprobs: list[TokenLogprobs | None] | None,
    tokens: TokenText,
    offset: int,
) -> dict[str, Any] | None:
    """Logprobs of generated tokens (`entries`, for `token_ids`), preceded by the prompt's when
    `prompt` is given; None when the request did not ask for logprobs."""
    if entries is None:
        return None
    if prompt is not None and prompt_logprobs is not None:
        entries = [*prompt_logprobs, *entries]
        token_ids = [*prompt.token_ids, *token_ids]
    return completion_logprobs(entries, token_ids[: len(entries)], tokens, offset)


def completion_response(job: Job, tokens: TokenText, echo: bool) -> CompletionResponse:
    choices = []
    for index in range(job.num_choices):
        choice = job.choices[index]
        prompt = job.prompt_of(index)
        logprobs = _logprobs(
            choice.logprobs,
            choice.token_ids,
            prompt if echo else None,
            job.prompt_logprobs.get(index),
            tokens,
            0,
        )
        choices.append(
            CompletionChoice(
                index=index,
                text=(_prompt_text(prompt, tokens) if echo else "") + choice.text,
                logprobs=logprobs,
                sampling=job.choice_sampling(index),
                **job.choice_end(index),
            )
        )
    return CompletionResponse(choices=choices, **job.final_fields())


async def completion_chunks(
    job: Job, tokens: TokenText, echo: bool, include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[str]:
    """Text deltas per choice (the echoed prompt in a choice's first chunk), as JSON texts; the
    chunk with a choice's finish_reason carries `sampling` and that choice's `quality`."""

    def chunk(choices: list[CompletionChoice], **extra: Any) -> str:
        if continuous_usage and choices:
            extra.setdefault("usage", job.usage())
        return CompletionResponse(choices=choices, **job.header(), **extra).model_dump_json()

    def text_only(index: int, text: str) -> CompletionResponse:  # the common chunk
        choice = CompletionChoice(index=index, text=text)
        return CompletionResponse(choices=[choice], **job.header())

    templates = [ChunkTemplate(functools.partial(text_only, i)) for i in range(job.num_choices)]
    offset = [0] * job.num_choices  # text_offset of the next token, per choice
    started = [False] * job.num_choices
    async for index, out in job.events():
        prompt = job.prompt_of(index) if echo and not started[index] else None
        started[index] = True
        text = (_prompt_text(prompt, tokens) if prompt else "") + out.new_text
        logprobs = _logprobs(
            out.new_logprobs, out.new_token_ids, prompt, out.prompt_logprobs, tokens, offset[index]
        )
        if logprobs is not None:
            offset[index] += sum(len(t) for t in logprobs["tokens"])
        if not out.finished:
            if logprobs is None and text and not continuous_usage:
                yield templates[index](text)
            elif text or (logprobs and logprobs["tokens"]):
                yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)])
            continue
        final = CompletionChoice(index=index, text=text, logprobs=logprobs, **job.choice_end(index))
        yield chunk([final], **job.last_chunk_fields(index))
    if include_usage:
        yield chunk([], usage=job.usage())
