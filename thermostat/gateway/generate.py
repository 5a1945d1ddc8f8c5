"""The gateway's generation path, the one every API it serves takes: a body resolved with serve's
resolver (`GatewayDefaults.resolve`), the effective values sent upstream (`forward.upstream_body`),
the answer annotated (relay.py), the traffic recorded; whole, folded (--stop-on-loop), or
streamed as chunk dicts."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from thermostat.api.disconnect import until_disconnected
from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatCompletionRequest, CompletionRequest
from thermostat.api.request_params import to_sampling_params
from thermostat.api.responses import response_quality
from thermostat.api.tools import tool_constraint
from thermostat.gateway.fold import Fold
from thermostat.gateway.forward import upstream_body
from thermostat.gateway.relay import Sampling, StreamAnnotator, annotate, choice_text
from thermostat.gateway.state import GatewayState
from thermostat.gateway.upstream import UpstreamError
from thermostat.sampling import GreedyRejected
from thermostat.sampling.resolve import fit_to_context

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.thermostat


def count_upstream_error(state: GatewayState, err: APIError) -> None:
    if isinstance(err, UpstreamError):
        state.metrics.upstream_errors.labels(err.kind).inc()


def _count_usage(state: GatewayState, usage: Any) -> None:
    """generation_tokens from an upstream's `usage`."""
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, int) and tokens > 0:
        state.metrics.on_tokens(tokens)


async def generate(
    request: Request,
    endpoint: str,
    body: ChatCompletionRequest | CompletionRequest,
    raw: dict[str, Any],
    prompt_len: int | None = None,
    opening: bool = False,
    listed_as: str | None = None,
) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
    """A body resolved, sent upstream and its answer annotated: the whole response, or its
    chunks (a usage chunk last, always asked of the upstream). For the agents' APIs:
    `prompt_len`, the prompt's tokens when known, so that a sent max_tokens larger than its
    room is cut (`fit_to_context`); `opening`: the first chunk carries `sampling`; `listed_as`:
    the API's name on the console ("responses", "messages"), as serve lists it."""
    state = gateway_state(request)
    listed = listed_as or endpoint
    tools = tool_constraint(body) if isinstance(body, ChatCompletionRequest) else None
    try:
        resolved = state.defaults.resolve(to_sampling_params(body, tools))
    except GreedyRejected as exc:
        state.metrics.on_greedy_rejected(listed, request.headers.get("user-agent"), str(exc))
        raise
    context_len = state.defaults.info.context_len
    if prompt_len is not None and context_len and "max_tokens" not in resolved.unknown:
        fitted = fit_to_context(resolved.resolution, prompt_len, context_len, cap_sent=True)
        resolved = dataclasses.replace(resolved, resolution=fitted)
    state.metrics.on_admitted(resolved.resolution, 0)
    sent = upstream_body(raw, resolved, state.defaults)
    sampling = Sampling(resolved.to_dict(), functools.partial(
        resolved.choice, n=body.n or 1, kind=state.defaults.kind))  # fmt: skip
    record = functools.partial(_record, state, listed, request.headers.get("user-agent"))
    if body.stream:
        return await _stream(state, PATHS[endpoint], sent, sampling, record, opening)
    with state.admitted() as start:
        if state.config.stop_on_loop:
            work = _folded(state, endpoint, sent, sampling)
        else:
            work = _whole(state, PATHS[endpoint], sent, sampling)
        try:
            data = await until_disconnected(work, request)
        except APIError as err:
            count_upstream_error(state, err)
            record("error", sampling.response, start)
            raise
        state.metrics.e2e.observe(time.monotonic() - start)
    choices = [c for c in data.get("choices", []) if isinstance(c, dict)]
    record(
        "ok",
        data.get("sampling", sampling.response),
        start,
        quality=data.get("quality", {}),
        finish_reasons=[c.get("finish_reason") for c in choices],
        texts=[choice_text(c, "message") for c in choices],
        usage=data.get("usage"),
        request_id=data.get("id"),
    )
    return data


def _record(
    state: GatewayState,
    endpoint: str,
    client: str | None,
    status: str,
    sampling: dict[str, Any],
    start: float,
    *,
    quality: dict[str, Any] | None = None,
    finish_reasons: list[str | None] | None = None,
    texts: list[str] | None = None,
    usage: Any = None,
    request_id: Any = None,
    ttft_s: float | None = None,
) -> None:
    """One finished request in the console's recent list."""
    usage = usage if isinstance(usage, dict) else {}

    def tokens(key: str) -> int:
        value = usage.get(key)
        return value if isinstance(value, int) else 0

    state.metrics.traffic.record(
        request_id=request_id if isinstance(request_id, str) else "",
        endpoint=endpoint,
        client=client,
        status=status,
        sampling=sampling,
        quality=quality or {},
        finish_reasons=finish_reasons or [],
        prompt_tokens=tokens("prompt_tokens"),
        completion_tokens=tokens("completion_tokens"),
        ttft_s=ttft_s,
        latency_s=round(time.monotonic() - start, 4),
        text=texts,
    )


async def _whole(
    state: GatewayState, path: str, sent: dict[str, Any], sampling: Sampling
) -> dict[str, Any]:
    data = await state.upstream.post(path, sent)
    state.metrics.upstream_latency.observe(state.upstream.last_latency_s)
    _count_usage(state, data.get("usage"))
    for report in annotate(data, *sampling):
        state.metrics.on_quality(report)
    return data


async def _folded(
    state: GatewayState, endpoint: str, sent: dict[str, Any], sampling: Sampling
) -> dict[str, Any]:
    """--stop-on-loop for a non-streamed request: the upstream streams, a loop is cut as on the
    streaming path (and the upstream closed), the client gets the whole response (fold.py)."""
    asked = sent | {"stream": True, "stream_options": {"include_usage": True}}
    response = await state.upstream.stream(PATHS[endpoint], asked)
    try:
        state.metrics.upstream_latency.observe(state.upstream.last_latency_s)
        annotator = StreamAnnotator(sampling.response, True, sampling.per_choice)
        fold = Fold(endpoint, sampling.response)
        async for chunk in annotator.run(state.upstream.events(response)):
            fold.add(chunk)
    finally:
        await response.aclose()  # a loop cut, a client gone: the upstream stops too
    for report in annotator.reports:
        state.metrics.on_quality(report)
    _count_usage(state, fold.usage)
    return fold.response()


async def _stream(
    state: GatewayState,
    path: str,
    sent: dict[str, Any],
    sampling: Sampling,
    record: Callable[..., None],
    opening: bool = False,
) -> AsyncIterator[dict[str, Any]]:
    """The upstream stream is opened before answering, so a refusal before its first byte
    (a 4xx, 502, 504) is a plain error answer; after that, errors are in-band. Usage is asked
    for always (generation_tokens). `opening`: the first chunk carries `sampling`."""
    options = sent.get("stream_options")
    options = options if isinstance(options, dict) else {}
    asked = sent | {"stream_options": options | {"include_usage": True}}
    admitted = contextlib.ExitStack()
    start = admitted.enter_context(state.admitted())
    try:
        response = await state.upstream.stream(path, asked)
    except APIError as err:
        admitted.close()
        count_upstream_error(state, err)
        record("error", sampling.response, start)
        raise
    state.metrics.upstream_latency.observe(state.upstream.last_latency_s)
    annotator = StreamAnnotator(sampling.response, state.config.stop_on_loop, sampling.per_choice)

    async def events() -> AsyncIterator[dict[str, Any]]:
        ttft: float | None = None
        usage, request_id, status = None, None, "aborted"
        try:
            async for chunk in annotator.run(state.upstream.events(response)):
                if opening and request_id is None:
                    chunk.setdefault("sampling", sampling.response)
                request_id = request_id or chunk.get("id")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    _count_usage(state, usage)
                if ttft is None and annotator.first_content:
                    ttft = time.monotonic() - start
                    state.metrics.on_first_token(ttft)
                yield chunk
            for report in annotator.reports:
                state.metrics.on_quality(report)
            status = "ok"
        except APIError:
            status = "error"
            raise
        finally:
            await response.aclose()  # a client gone, a loop cut: the upstream stops too
            admitted.close()
            done = sorted(annotator.finish_reasons)
            record(
                status,
                sampling.response,
                start,
                quality=response_quality(annotator.reports) if annotator.reports else {},
                finish_reasons=[annotator.finish_reasons[i] for i in done],
                texts=["".join(annotator.texts.get(i, [])) for i in done],
                usage=usage,
                request_id=request_id,
                ttft_s=None if ttft is None else round(ttft, 4),
            )

    return events()
