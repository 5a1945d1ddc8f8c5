"""What a product gives the agents' routes: a way to run a chat completions body and to count a
chat prompt's tokens. `serve` runs it on its engine (server/agent_backend.py), the gateway on
its upstream (gateway/agent_backend.py); the translations above it are the same."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi.responses import Response
from starlette.requests import Request

from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatCompletionRequest

# A whole chat completion (dict), its stream of chunks (dicts; the first carries the request's
# `sampling`, the finishing one `sampling` and `quality`, a usage chunk last), or an answer
# already made (a PD prefill role's reply to its router).
ChatAnswer = dict[str, Any] | AsyncIterator[dict[str, Any]] | Response


@dataclass(frozen=True)
class AgentCall:
    """How a translated chat body is served."""

    endpoint: str  # "responses" | "messages": the metrics' and the console's name for the API
    # A max_tokens larger than the room the prompt leaves is cut to the room (an `adjusted`
    # entry, policy "context_length") instead of refused: agents send one number for every
    # model (Claude Code 32,000).
    cap_max_tokens: bool = True


class ChatBackend(Protocol):
    def model_name(self, request: Request) -> str:
        """The served model's name (what answers carry as `model`)."""
        ...

    async def complete(
        self, request: Request, chat: ChatCompletionRequest, call: AgentCall
    ) -> ChatAnswer:
        """Run `chat` (whole, or streamed when `chat.stream`); raises APIError (4xx/5xx) for
        what cannot be served before anything is sent."""
        ...

    async def count_tokens(self, request: Request, chat: ChatCompletionRequest) -> int:
        """The tokens of `chat`'s prompt (messages and tools, as templated)."""
        ...

    def refused(self, request: Request, raw: Any, err: APIError) -> None:
        """A body refused before it was run (`raw`: as sent): a PD prefill tells the decode
        waiting for it, as a refused chat body does."""
        ...
