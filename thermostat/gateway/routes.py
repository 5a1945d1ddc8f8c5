"""The gateway's routes. Generation routes parse the body with serve's protocol models and run it
through the gateway's one generation path (generate.py); the agents' APIs join it through
agent_backend.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatCompletionRequest, CompletionRequest
from thermostat.api.request_params import read_body, to_sampling_params
from thermostat.api.responses import sse
from thermostat.api.tools import tool_constraint
from thermostat.gateway.generate import count_upstream_error as _count
from thermostat.gateway.generate import gateway_state as _state
from thermostat.gateway.generate import generate

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 once the upstream answered discovery and while it answers its health check (at
    most HEALTH_TTL_S old); 503 before, while it does not, while draining or failed."""
    state = _state(request)
    status = state.status
    if status == "ready" and not await state.upstream_alive():
        return JSONResponse({"status": "upstream_down"}, status_code=503)
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(_state(request).metrics.render(None), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The upstream's answer, as it is."""
    state = _state(request)
    try:
        r = await state.upstream.get_raw("/v1/models")
    except APIError as err:
        _count(state, err)
        raise
    kind = r.headers.get("content-type", "application/json")
    return Response(r.content, status_code=r.status_code, media_type=kind)


@router.get("/v1/sampling/defaults")
async def sampling_defaults(request: Request) -> dict[str, Any]:
    return _state(request).defaults.to_dict()


@router.post("/v1/sampling/explain")
async def sampling_explain(request: Request) -> dict[str, Any]:
    """The gateway's resolution of a body (what it would send upstream), without generating."""
    state = _state(request)
    body = await read_body(request)
    tools = tool_constraint(body) if isinstance(body, ChatCompletionRequest) else None
    resolved = state.defaults.resolve(to_sampling_params(body, tools))
    endpoint = "completions" if isinstance(body, CompletionRequest) else "chat"
    return {
        "model": state.defaults.info.model,
        "endpoint": endpoint,
        "sampling": resolved.to_dict(),
        "upstream": {"kind": state.defaults.kind.name, "sent": resolved.sent(state.defaults.kind)},
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return _answer(request, await generate(request, "chat", body, await request.json()), body)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return _answer(
        request, await generate(request, "completions", body, await request.json()), body
    )


def _answer(
    request: Request,
    answer: dict[str, Any] | AsyncIterator[dict[str, Any]],
    body: ChatCompletionRequest | CompletionRequest,
) -> Response:
    """The client's answer: the whole response, or its stream with usage only if asked for."""
    if isinstance(answer, dict):
        return JSONResponse(answer)
    wants_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        async for chunk in chunks:
            if chunk.get("usage") and not wants_usage:
                if not chunk.get("choices"):
                    continue
                del chunk["usage"]
            yield json.dumps(chunk)

    state = _state(request)
    return sse(events(answer), lambda err: _count(state, err))
