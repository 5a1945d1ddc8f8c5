"""The gate in front of every route: API key, readiness, draining; and per-endpoint counting.

| path                                       | API key  | while loading / draining |
|--------------------------------------------|----------|--------------------------|
| /health                                    | open     | answers 503 itself       |
| /metrics                                   | open     | served                   |
| /, /console, /console/assets/* (the page)  | open     | served                   |
| /v1/console/* (what the page shows)        | required | 503                      |
| /v1/*, /tokenize, /detokenize              | required | 503                      |
| /reset_prefix_cache, /flush_cache          | required | 503                      |
| /server_info, /model_info, /get_load, ...  | open     | 503                      |

A request admitted before draining began runs to the end: the drain waits for it.
"""

from __future__ import annotations

import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from thermostat.api.config import EdgeConfig
from thermostat.api.errors import APIError, error_response
from thermostat.api.metrics import Metrics


class GatedState(Protocol):
    """What the gate (and BodyLimitsMiddleware) read: the server's state or the gateway's."""

    @property
    def config(self) -> EdgeConfig: ...
    @property
    def status(self) -> str: ...
    @property
    def route_paths(self) -> set[str]: ...
    @property
    def metrics(self) -> Metrics: ...


PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/reset_prefix_cache", "/flush_cache")
ALWAYS_SERVED = ("/health", "/metrics", "/", "/console")  # and the console's assets


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: GatedState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is not None:
                await error_response(refusal, path)(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None)
            if endpoint is None:
                endpoint = path if path in self.state.route_paths else "unmatched"
            self.state.metrics.requests.labels(endpoint, str(status)).inc()

    def _refusal(self, scope: Scope, path: str) -> APIError | None:
        key = self.state.config.api_key
        if key is not None and path.startswith(PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            bearer = hmac.compare_digest(given, b"Bearer " + key.encode())
            # Anthropic's clients send the key as x-api-key
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode()):
                return APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "(or 'x-api-key: <key>')",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if path in ALWAYS_SERVED or path.startswith("/console/") or self.state.status == "ready":
            return None
        why = {"loading": "the model is loading", "draining": "the server is shutting down"}
        message = why.get(self.state.status, "the server cannot serve requests")
        return APIError(503, f"{message}; retry later", type="server_error", code="unavailable")
