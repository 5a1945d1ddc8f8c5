"""The agents' routes over a ChatBackend: OpenAI's Responses API and Anthropic's Messages API.

| route                                  | answer                                           |
|----------------------------------------|--------------------------------------------------|
| POST /v1/responses                     | a Response, or its events (`stream: true`)       |
| GET /v1/responses/{id}                 | a stored Response (404 naming it when not held)  |
| DELETE /v1/responses/{id}              | `{"id", "object": "response", "deleted": true}`  |
| POST /v1/responses/input_tokens        | `{"object": "response.input_tokens", "input_tokens"}` |
| POST /v1/messages                      | a Message, or its events (`stream: true`)        |
| POST /v1/messages/count_tokens         | `{"input_tokens"}`                               |
| HEAD /                                 | 200 (Claude Code's probe of its base URL)        |

Bodies are read here (a non-JSON content type is a 415, malformed JSON a 400), translated
(responses_input.py, messages_input.py), run by the backend as chat completions, and the chat
answer translated back (responses_output.py, messages_output.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from thermostat.api.agents import messages_input, responses_input
from thermostat.api.agents.backend import AgentCall, ChatBackend
from thermostat.api.agents.messages_output import MessageBuilder
from thermostat.api.agents.response_store import ResponseStore
from thermostat.api.agents.responses_events import response_events
from thermostat.api.agents.responses_output import ResponseBuilder
from thermostat.api.errors import APIError, anthropic_error, count_server_error
from thermostat.api.responses import named_sse

RESPONSES = AgentCall("responses")
MESSAGES = AgentCall("messages")


async def read_json(request: Request) -> Any:
    kind = request.headers.get("content-type", "application/json")
    if "json" not in kind.lower():
        raise APIError(
            415,
            f"the body must be JSON (Content-Type: application/json), got {kind!r}",
            code="unsupported_media_type",
        )
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="json_invalid") from exc


def _body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads its JSON itself (schemathesis fuzzes it)."""
    schema = model.model_json_schema()
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


RESPONSES_BODY = _body(responses_input.ResponsesRequest)
MESSAGES_BODY = _body(messages_input.MessagesRequest)


def agent_router(backend: ChatBackend, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    async def responses_plan(request: Request) -> responses_input.ResponsesPlan:
        raw = await read_json(request)
        try:
            body = responses_input.parse_body(raw)
            history = None
            if body.previous_response_id is not None:
                stored = store.get(body.previous_response_id, "previous_response_id")
                history = stored.conversation
            return responses_input.to_chat(body, raw, history)
        except APIError as err:
            backend.refused(request, raw, err)
            raise

    async def messages_plan(request: Request, count: bool = False) -> messages_input.MessagesPlan:
        raw = await read_json(request)
        if count and isinstance(raw, dict):
            raw = {"max_tokens": 1} | raw  # counting needs no max_tokens
        try:
            return messages_input.to_chat(messages_input.parse_body(raw), raw)
        except APIError as err:
            backend.refused(request, raw, err)
            raise

    def counted(request: Request) -> Callable[[APIError], None]:
        return lambda err: count_server_error(request, err)

    @router.post("/v1/responses", openapi_extra=RESPONSES_BODY)
    async def create_response(request: Request) -> Response:
        plan = await responses_plan(request)
        body = plan.body
        builder = ResponseBuilder(plan, backend.model_name(request))
        answer = await backend.complete(request, plan.chat, RESPONSES)
        if isinstance(answer, Response):
            return answer
        keep = body.store is not False
        if isinstance(answer, dict):
            response = builder.whole(answer)
            if keep:
                store.put(response, plan.messages)
            return JSONResponse(response)

        async def events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[tuple[str, dict]]:
            async for event in response_events(builder, chunks):
                if keep and event["type"] in ("response.completed", "response.incomplete"):
                    store.put(event["response"], plan.messages)
                yield event["type"], event

        def failed(err: APIError) -> tuple[str, dict[str, Any]]:
            response = builder.shell("failed") | {
                "error": {"code": err.info.code or err.info.type, "message": err.info.message}
            }
            return "response.failed", {"type": "response.failed", "response": response}

        return named_sse(events(answer), counted(request), failed)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        return store.get(response_id).response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/v1/responses/input_tokens", openapi_extra=RESPONSES_BODY)
    async def response_input_tokens(request: Request) -> dict[str, Any]:
        plan = await responses_plan(request)
        count = await backend.count_tokens(request, plan.chat)
        return {"object": "response.input_tokens", "input_tokens": count}

    @router.post("/v1/messages", openapi_extra=MESSAGES_BODY)
    async def create_message(request: Request) -> Response:
        plan = await messages_plan(request)
        builder = MessageBuilder(plan, backend.model_name(request))
        answer = await backend.complete(request, plan.chat, MESSAGES)
        if isinstance(answer, Response):
            return answer
        if isinstance(answer, dict):
            return JSONResponse(builder.whole(answer))

        def error(err: APIError) -> tuple[str, dict[str, Any]]:
            return "error", anthropic_error(err)

        return named_sse(builder.events(answer), counted(request), error)

    @router.head("/", include_in_schema=False)
    async def probe() -> Response:
        return Response()

    @router.post("/v1/messages/count_tokens", openapi_extra=MESSAGES_BODY)
    async def count_message_tokens(request: Request) -> dict[str, Any]:
        plan = await messages_plan(request, count=True)
        return {"input_tokens": await backend.count_tokens(request, plan.chat)}

    return router
