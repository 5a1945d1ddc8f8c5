"""Chat completion responses and stream chunks from a Job's outputs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from thermostat.server.logprobs import TokenText, chat_logprobs
from thermostat.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    DeltaMessage,
)
from thermostat.server.serving import Job


def chat_response(job: Job, tokens: TokenText) -> ChatCompletionResponse:
    """The whole response; every choice has finished."""
    choices = []
    for index in range(job.num_choices):
        choice = job.choices[index]
        logprobs = None if choice.logprobs is None else chat_logprobs(choice.logprobs, tokens)
        choices.append(
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=choice.text),
                logprobs=logprobs,
                sampling=job.choice_sampling(index),
                **job.choice_end(index),
            )
        )
    return ChatCompletionResponse(choices=choices, **job.final_fields())


async def chat_chunks(
    job: Job, tokens: TokenText, include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[ChatCompletionChunk]:
    """A role chunk per choice, content deltas, then per choice a chunk with its finish_reason
    that also carries `sampling` and that choice's `quality`; a usage chunk last if asked."""

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
        if continuous_usage and choices:
            extra.setdefault("usage", job.usage())
        return ChatCompletionChunk(choices=choices, **job.header(), **extra)

    for index in range(job.num_choices):
        yield chunk(
            [ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
        )
    async for index, out in job.events():
        logprobs = None if out.new_logprobs is None else chat_logprobs(out.new_logprobs, tokens)
        delta = DeltaMessage(content=out.new_text) if out.new_text else DeltaMessage()
        if not out.finished:
            if out.new_text or (logprobs and logprobs["content"]):
                yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
            continue
        final = ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, **job.choice_end(index)
        )
        yield chunk([final], **job.last_chunk_fields(index))
    if include_usage:
        yield chunk([], usage=job.usage())
