"""Chat completion responses and stream chunks from a Job's outputs; with tools, each choice's
text is read for tool calls, whole or streamed, by server/tools.py's one rule (`answer`,
`finish_reason`)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from thermostat.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    DeltaMessage,
)
from thermostat.api.responses import ChunkTemplate
from thermostat.api.tool_parsers import ToolText
from thermostat.api.tools import ToolRequest, ToolStream, answer, finish_reason
from thermostat.server.logprobs import TokenText, chat_logprobs
from thermostat.server.serving import Job


def _end(job: Job, index: int, read: ToolText | None) -> dict[str, Any]:
    end = job.choice_end(index)
    end["finish_reason"] = finish_reason(end["finish_reason"], read)
    return end


def chat_response(
    job: Job, tokens: TokenText, tools: ToolRequest | None = None
) -> ChatCompletionResponse:
    """The whole response; every choice has finished."""
    choices = []
    for index in range(job.num_choices):
        choice = job.choices[index]
        logprobs = None if choice.logprobs is None else chat_logprobs(choice.logprobs, tokens)
        read = tools.parser.read(choice.text) if tools is not None and tools.parses else None
        choices.append(
            ChatChoice(
                index=index,
                message=answer(choice.text, read),
                logprobs=logprobs,
                sampling=job.choice_sampling(index),
                **_end(job, index, read),
            )
        )
    return ChatCompletionResponse(choices=choices, **job.final_fields())


async def chat_chunks(
    job: Job,
    tokens: TokenText,
    include_usage: bool,
    continuous_usage: bool = False,
    tools: ToolRequest | None = None,
) -> AsyncIterator[str]:
    """A role chunk per choice, content deltas (with tools: content and tool-call deltas),
    then per choice a chunk with its finish_reason that also carries `sampling` and that
    choice's `quality`; a usage chunk last if asked. JSON texts."""
    streams = {}
    if tools is not None and tools.parses:
        streams = {i: ToolStream(tools.parser) for i in range(job.num_choices)}

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> str:
        if continuous_usage and choices:
            extra.setdefault("usage", job.usage())
        return ChatCompletionChunk(choices=choices, **job.header(), **extra).model_dump_json()

    def content_only(index: int, text: str) -> ChatCompletionChunk:  # the common chunk
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text))
        return ChatCompletionChunk(choices=[choice], **job.header())

    templates = [ChunkTemplate(functools.partial(content_only, i)) for i in range(job.num_choices)]
    for index in range(job.num_choices):
        yield chunk(
            [ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]
        )
    async for index, out in job.events():
        logprobs = None if out.new_logprobs is None else chat_logprobs(out.new_logprobs, tokens)
        stream = streams.get(index)
        if stream is None and logprobs is None and not out.finished and not continuous_usage:
            if out.new_text:
                yield templates[index](out.new_text)
            continue
        delta = DeltaMessage(content=out.new_text) if out.new_text else DeltaMessage()
        if stream is not None:
            delta = stream.feed(out.new_text, out.finished) or DeltaMessage()
        if not out.finished:
            if delta.content or delta.tool_calls or (logprobs and logprobs["content"]):
                yield chunk([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
            continue
        read = stream.read if stream is not None else None
        final = ChatChunkChoice(
            index=index, delta=delta, logprobs=logprobs, **_end(job, index, read)
        )
        yield chunk([final], **job.last_chunk_fields(index))
    if include_usage:
        yield chunk([], usage=job.usage())
