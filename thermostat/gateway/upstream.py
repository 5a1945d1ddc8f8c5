"""The HTTP client to the one upstream, and the answer for each way it can fail.

| what happened                          | answer to the client                              |
|----------------------------------------|---------------------------------------------------|
| cannot connect                         | 502 `upstream_unreachable`                        |
| no byte for `timeout_s` (or connect)   | 504 `upstream_timeout`                            |
| not JSON, not the OpenAI shape, a cut  | 502 `upstream_bad_response`                       |
| a 4xx, or a 503 (its queue is full)    | the same status and error, passed through         |
| another 5xx                            | 502 `upstream_error`, naming the upstream's status |

The client's Authorization header never goes upstream; `--upstream-api-key` does.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from thermostat.api.errors import APIError

PASSED_THROUGH = {503}  # besides every 4xx


class UpstreamError(APIError):
    """An APIError caused by the upstream; `kind` labels thermostat_gateway_upstream_errors."""

    def __init__(self, status: int, message: str, kind: str, **extra: Any) -> None:
        super().__init__(status, message, type="server_error", code=kind, **extra)
        self.kind = kind


def transport_error(exc: httpx.HTTPError, url: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError(504, f"the upstream {url} did not answer in time ({exc!r})",
                             "upstream_timeout")  # fmt: skip
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError(502, f"cannot connect to the upstream {url} ({exc})",
                             "upstream_unreachable")  # fmt: skip
    return UpstreamError(502, f"the upstream {url} failed: {exc!r}", "upstream_bad_response")


def status_error(status: int, text: str, headers: httpx.Headers) -> APIError:
    """The answer for an upstream's error status (its body is `text`)."""
    try:
        info = json.loads(text).get("error")
    except (ValueError, AttributeError):
        info = None
    message = info.get("message") if isinstance(info, dict) else None
    message = str(message or text[:300] or f"status {status}")
    if status < 500 or status in PASSED_THROUGH:
        retry = {"Retry-After": headers["retry-after"]} if "retry-after" in headers else {}
        param = info.get("param") if isinstance(info, dict) else None
        code = info.get("code") if isinstance(info, dict) else None
        kind = "invalid_request_error" if status < 500 else "server_error"
        return APIError(status, message, param=param, code=code, type=kind, headers=retry)
    return UpstreamError(502, f"the upstream answered {status}: {message}", "upstream_error")


class Upstream:
    """One upstream base URL; every call bounded by `timeout_s` of silence."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=timeout, limits=limits
        )
        self.last_latency_s = 0.0

    async def close(self) -> None:
        await self.http.aclose()

    async def probe(self, path: str) -> Any:
        """The JSON of a GET answered 200, or None (any other answer, or not JSON)."""
        r = await self.get_raw(path)
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    async def alive(self, path: str, timeout_s: float) -> bool:
        """Whether a GET of `path` answers 200 within `timeout_s`."""
        try:
            r = await self.http.get(path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def models(self) -> list[dict[str, Any]]:
        """The /v1/models cards (empty when it serves none)."""
        got = await self.probe("/v1/models")
        data = got.get("data") if isinstance(got, dict) else None
        return [m for m in data if isinstance(m, dict) and "id" in m] if data else []

    async def get_raw(self, path: str) -> httpx.Response:
        try:
            return await self.http.get(path)
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.url) from exc

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A whole (non-streamed) response's JSON object; raises APIError."""
        data = await self.post_json(path, body)
        if not isinstance(data.get("choices"), list):
            raise bad_response(f"no choices in {json.dumps(data)[:80]!r}")
        return data

    async def post_json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON object a POST is answered with (/tokenize's); raises APIError."""
        r = await self._send(path, body, stream=False)
        if r.status_code >= 400:
            raise status_error(r.status_code, r.text, r.headers)
        try:
            data = r.json()
        except ValueError as exc:
            raise bad_response(f"not JSON: {r.text[:80]!r}") from exc
        if not isinstance(data, dict):
            raise bad_response(f"not a JSON object: {r.text[:80]!r}")
        return data

    async def stream(self, path: str, body: dict[str, Any]) -> httpx.Response:
        """An open streamed response (status checked); the caller must `aclose()` it."""
        r = await self._send(path, body, stream=True)
        if r.status_code >= 400:
            try:
                text = (await r.aread()).decode(errors="replace")
            except httpx.HTTPError:
                text = ""
            finally:
                await r.aclose()
            raise status_error(r.status_code, text, r.headers)
        return r

    async def _send(self, path: str, body: dict[str, Any], stream: bool) -> httpx.Response:
        """POST `body`; the time to the answer's head is `last_latency_s`."""
        start = time.monotonic()
        request = self.http.build_request("POST", path, json=body)
        try:
            r = await self.http.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.url) from exc
        self.last_latency_s = time.monotonic() - start
        return r

    async def events(self, response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
        """The JSON objects of an SSE stream up to `[DONE]`; raises UpstreamError for a cut,
        a silence past the timeout, or garbage."""
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` lines
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError as exc:
                    raise bad_response(f"a stream event that is not JSON: {data[:80]!r}") from exc
                if not isinstance(event, dict):
                    raise bad_response(f"a stream event that is not an object: {data[:80]!r}")
                yield event
        except httpx.HTTPError as exc:
            raise transport_error(exc, self.url) from exc


def bad_response(what: str) -> UpstreamError:
    return UpstreamError(502, f"the upstream's answer is not an OpenAI response: {what}",
                         "upstream_bad_response")  # fmt: skip
