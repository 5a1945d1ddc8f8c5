"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

| exception                          | answer                                                  |
|------------------------------------|---------------------------------------------------------|
| APIError                           | as it says (raised by the HTTP layer itself)            |
| InvalidRequest (thermostat.errors) | 400 naming `param` (sampling, prompts, engine admission)|
| EngineError                        | 500 `engine_error`: a step failed, logged by the engine |
| anything else (ValueError too)     | 500 `internal_error` with an error id, logged here      |

Bad input is a 4xx naming the parameter at fault, never a 500 and never a silent clamp; a bug of
ours is a 500, never a 400. Every 5xx is counted in `thermostat_server_errors_total`.

Under `/v1/messages` (Anthropic's API) the same error, with the same status, is written in
Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (`anthropic_error`).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from thermostat.api.disconnect import ClientGone
from thermostat.api.protocol import ErrorInfo, ErrorResponse
from thermostat.errors import InvalidRequest

log = logging.getLogger("thermostat.server")
request_log = logging.getLogger("thermostat.requests")
_TYPE_TAG = re.compile(r"(str|int|float|bool|list|dict|none)(\[.*\])?|[a-z-]+\[.*\]")


class APIError(Exception):
    """An error answered to the client as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})


class EngineError(RuntimeError):
    """The engine failed while serving a request (a server fault, not the client's)."""


def classify(exc: BaseException) -> APIError:
    """The APIError for an exception raised by resolution, the engine or the server. An
    unexpected one is logged with its traceback under a fresh error id, which the answer names
    (the traceback itself stays in the log)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    log.error("internal error %s: %r", error_id, exc, exc_info=exc)
    return APIError(
        500,
        f"internal server error (error id {error_id}; the server log has the details)",
        type="server_error",
        code="internal_error",
    )


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(err: APIError) -> dict[str, Any]:
    """Anthropic's shape of an error: its type from the status (as Anthropic's API types it)."""
    default = "api_error" if err.status >= 500 else "invalid_request_error"
    kind = ANTHROPIC_TYPES.get(err.status, default)
    return {"type": "error", "error": {"type": kind, "message": err.info.message}}


def error_body(err: APIError, path: str = "") -> dict[str, Any]:
    """The error's body in the shape of the API `path` belongs to."""
    if path.startswith(ANTHROPIC_PATH):
        return anthropic_error(err)
    return ErrorResponse(error=err.info).model_dump()


def error_response(err: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(error_body(err, path), status_code=err.status, headers=err.headers)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """400 for pydantic errors; `param` is the top-level body field at fault."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}", code="json_invalid")
    if not loc:
        return APIError(400, f"request body: {first.get('msg')}", code="invalid_body")
    param = str(loc[0])
    # drop pydantic's union-member tags ("str", "list[int]") from the location
    where = ".".join(str(p) for p in loc if not _TYPE_TAG.fullmatch(str(p)))
    got = "" if first.get("type") == "missing" else f" (got {repr(first.get('input'))[:60]})"
    return APIError(400, f"{where}: {first.get('msg')}{got}", param=param, code="invalid_type")


def refuse(request: Request, err: APIError) -> JSONResponse:
    """The error response, after the request's one log line (and, for a 5xx, the count)."""
    count_server_error(request, err)
    line = {
        "path": request.url.path,
        "status": err.status,
        "error": err.info.message,
        "param": err.info.param,
        "code": err.info.code,
    }
    request_log.info(json.dumps(line))
    return error_response(err, request.url.path)


def count_server_error(request: Request, err: APIError) -> None:
    """One more in `thermostat_server_errors_total{code}` if `err` is a server fault (5xx)."""
    state = getattr(request.app.state, "thermostat", None)
    if state is not None and err.status >= 500:
        state.metrics.server_errors.labels(err.info.code or "unknown").inc()


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app in the OpenAI shape."""

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return refuse(request, classify(exc))  # an APIError as it is

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return refuse(request, validation_error(list(exc.errors())))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        err = APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)
        return refuse(request, err)

    app.add_exception_handler(APIError, on_error)
    app.add_exception_handler(InvalidRequest, on_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)

    async def on_client_gone(_: Request, __: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it; counted as "client closed request"

    app.add_exception_handler(ClientGone, on_client_gone)
    app.add_exception_handler(Exception, on_error)
