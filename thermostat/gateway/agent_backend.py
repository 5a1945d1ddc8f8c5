"""The gateway's ChatBackend: the agents' APIs run as chat completions on the upstream, with
the gateway's resolution, policies and monitoring (routes.py `generate`), whatever the
upstream speaks besides chat completions.

A prompt's tokens are counted by the upstream's `/tokenize` (vLLM's, SGLang's and Thermostat's
take chat messages; llama-server's takes text, so its template is applied first with its
`/apply-template`). The count also fits a sent max_tokens to the prompt's room, where the
upstream's context length is known."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from thermostat.api.agents.backend import AgentCall, ChatAnswer
from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatCompletionRequest
from thermostat.api.tools import shown_tool
from thermostat.gateway.generate import generate
from thermostat.gateway.state import GatewayState


def _state(request: Request) -> GatewayState:
    return request.app.state.thermostat


class GatewayChat:
    def model_name(self, request: Request) -> str:
        return _state(request).defaults.info.model

    async def complete(
        self, request: Request, chat: ChatCompletionRequest, call: AgentCall
    ) -> ChatAnswer:
        state = _state(request)
        prompt_len = None
        if call.cap_max_tokens and chat.max_tokens is not None and state.defaults.info.context_len:
            prompt_len = await self.count_tokens(request, chat)
        raw = chat.model_dump(exclude_none=True, by_alias=True)
        if "tools" in raw:  # a freeform tool's grammar stays here (the upstream cannot use it)
            raw["tools"] = [shown_tool(t) for t in raw["tools"]]
        return await generate(
            request, "chat", chat, raw, prompt_len, opening=True, listed_as=call.endpoint
        )

    def refused(self, request: Request, raw: Any, err: APIError) -> None:
        """Nothing waits on the gateway's refusals."""

    async def count_tokens(self, request: Request, chat: ChatCompletionRequest) -> int:
        state = _state(request)
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        tools = [shown_tool(t.model_dump(exclude_none=True)) for t in chat.tools or []]
        model = chat.model or state.defaults.info.model
        body: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            body["tools"] = tools
        if state.defaults.kind.name == "llamacpp":
            template = await state.upstream.post_json("/apply-template", body)
            counted = await state.upstream.post_json(
                "/tokenize", {"content": template.get("prompt")}
            )
        else:
            counted = await state.upstream.post_json("/tokenize", body)
        if isinstance(counted.get("count"), int):
            return int(counted["count"])
        if isinstance(counted.get("tokens"), list):
            return len(counted["tokens"])
        raise APIError(502, "the upstream's /tokenize answered no count", type="server_error",
                       code="upstream_bad_response")  # fmt: skip
