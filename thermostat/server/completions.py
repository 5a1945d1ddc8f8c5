"""Text completion responses and stream chunks from a Job's outputs.

With `echo`, a choice's text starts with its prompt (verbatim when sent as text, decoded when
sent as token ids), and with `logprobs` its logprobs start with the prompt's tokens, the first
of them without a logprob: what lm-evaluation-harness's loglikelihood requests read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from thermostat.engine.outputs import RequestOutput
from thermostat.server.logprobs import TokenText, completion_logprobs
from thermostat.server.prompts import Prompt
from thermostat.server.protocol import CompletionChoice, CompletionResponse
from thermostat.server.serving import Job


def _prompt_text(prompt: Prompt, tokens: TokenText) -> str:
    return prompt.text if prompt.text is not None else tokens.decode(prompt.token_ids)


def _logprobs(
    out: RequestOutput, prompt: Prompt | None, start: int, tokens: TokenText, offset: int
) -> dict[str, Any] | None:
    """Logprobs of generated tokens [start:], preceded by the prompt's when `prompt` is given."""
    if out.logprobs is None:
        return None
    entries: list[Any] = []
    ids: list[int] = []
    if prompt is not None and out.prompt_logprobs is not None:
        entries += out.prompt_logprobs
        ids += prompt.token_ids
    entries += out.logprobs[start:]
    ids += out.token_ids[start : len(out.logprobs)]
    return completion_logprobs(entries, ids, tokens, offset)


def completion_response(job: Job, tokens: TokenText, echo: bool) -> CompletionResponse:
    choices = []
    for index in range(job.num_choices):
        out = job.finals[index]
        prompt = job.prompt_of(index)
        choices.append(
            CompletionChoice(
                index=index,
                text=(_prompt_text(prompt, tokens) if echo else "") + out.text,
                logprobs=_logprobs(out, prompt if echo else None, 0, tokens, 0),
                **job.choice_end(index, out),
            )
        )
    return CompletionResponse(choices=choices, **job.final_fields())


async def completion_chunks(
    job: Job, tokens: TokenText, echo: bool, include_usage: bool
) -> AsyncIterator[CompletionResponse]:
    """Text deltas per choice (the echoed prompt in a choice's first chunk); the chunk with a
    choice's finish_reason carries `sampling` and that choice's `quality`."""

    def chunk(choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(choices=choices, **job.header(), **extra)

    sent = [0] * job.num_choices  # logprob entries already sent, per choice
    offset = [0] * job.num_choices  # text_offset of the next token, per choice
    started = [False] * job.num_choices
    async for index, out in job.events():
        prompt = job.prompt_of(index) if echo and not started[index] else None
        started[index] = True
        text = (_prompt_text(prompt, tokens) if prompt else "") + out.delta
        logprobs = _logprobs(out, prompt, sent[index], tokens, offset[index])
        if logprobs is not None:
            sent[index] = len(out.logprobs or [])
            offset[index] += sum(len(t) for t in logprobs["tokens"])
        if not out.finished:
            if text or (logprobs and logprobs["tokens"]):
                yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs)])
            continue
        final = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            **job.choice_end(index, out),
        )
        yield chunk([final], **job.last_chunk_fields(index))
    if include_usage:
        yield chunk([], usage=job.usage())
