"""`serve`'s ChatBackend: the agents' APIs run as chat completions on this server's engine,
through the same submit (and PD roles) as /v1/chat/completions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from fastapi.responses import Response
from starlette.requests import Request

from thermostat.api.agents.backend import AgentCall, ChatAnswer
from thermostat.api.agents.content import BOOTSTRAP
from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatCompletionRequest
from thermostat.api.tools import ToolRequest
from thermostat.server.chat import chat_chunks, chat_response
from thermostat.server.disaggregation import PrefillRole, Rooms
from thermostat.server.routes import chat_params, submit
from thermostat.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.thermostat


class ServeChat:
    def model_name(self, request: Request) -> str:
        return _state(request).defaults.model

    async def complete(
        self, request: Request, chat: ChatCompletionRequest, call: AgentCall
    ) -> ChatAnswer:
        state = _state(request)
        params, tools = chat_params(state, chat)
        prompt = state.prompts.chat(chat.messages, tools.shown if tools else None)
        job = await submit(request, call.endpoint, chat, [prompt], params, call.cap_max_tokens)
        if isinstance(job, Response):
            return job
        if chat.stream:

            async def chunks() -> AsyncIterator[dict[str, Any]]:
                opening = {"sampling": job.sampling()}  # the applied values, before any token
                async for text in chat_chunks(job, state.tokens, True, tools=tools):
                    yield json.loads(text) | opening
                    opening = {}

            return chunks()
        await job.collect(request)
        return chat_response(job, state.tokens, tools).model_dump(mode="json")

    def refused(self, request: Request, raw: Any, err: APIError) -> None:
        role = _state(request).role
        if not isinstance(role, PrefillRole) or not isinstance(raw, dict):
            return
        try:
            rooms = Rooms.of(SimpleNamespace(**{name: raw.get(name) for name in BOOTSTRAP}))
        except APIError:
            return  # no room to tell: nobody waits
        role.fail(rooms, 1, "prefill_refused", f"{err.status}: {err.info.message}")

    async def count_tokens(self, request: Request, chat: ChatCompletionRequest) -> int:
        state = _state(request)
        tools = ToolRequest.of(chat, state.tool_parser)
        return len(state.prompts.chat(chat.messages, tools.shown if tools else None).token_ids)
