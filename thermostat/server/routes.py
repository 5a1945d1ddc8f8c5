"""HTTP routes. Each converts its body to SamplingParams in one call (`to_sampling_params`),
builds the prompt, submits, and returns or streams; everything else lives in the modules named.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from importlib.metadata import version
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from thermostat.api.errors import (
    APIError,
    count_server_error,
)
from thermostat.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from thermostat.api.request_params import read_body, to_sampling_params
from thermostat.api.responses import sse
from thermostat.api.tools import ToolRequest
from thermostat.sampling import GreedyRejected, SamplingParams
from thermostat.sampling.fanout import Plan
from thermostat.server.chat import chat_chunks, chat_response
from thermostat.server.completions import completion_chunks, completion_response
from thermostat.server.disaggregation import PrefillRole, Rooms
from thermostat.server.prompts import Prompt
from thermostat.server.serving import Job
from thermostat.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.thermostat


def _json(model: BaseModel) -> Response:
    # pydantic writes non-finite floats (a banned token's -inf logprob) as null: valid JSON
    return Response(model.model_dump_json(), media_type="application/json")


def _sse(request: Request, chunks: AsyncIterator[str]) -> StreamingResponse:
    return sse(chunks, functools.partial(count_server_error, request))


def _stream_usage(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    """(a usage chunk last, usage on every chunk): vLLM's continuous_usage_stats needs
    include_usage too."""
    options = body.stream_options
    include = bool(options and options.include_usage)
    return include, include and bool(options and options.continuous_usage_stats)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 only when ready; 503 while loading, draining or failed."""
    status = _state(request).status
    return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    stats = state.engine.stats if state.engine else None
    return Response(state.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {
        "id": state.defaults.model,
        "object": "model",
        "created": state.started,
        "owned_by": "thermostat",
        "root": str(state.model_dir),
        "max_model_len": state.max_model_len,
    }
    return {"object": "list", "data": [card]}


async def submit(
    request: Request,
    endpoint: str,
    body: ChatCompletionRequest | CompletionRequest,
    prompts: list[Prompt],
    params: SamplingParams,
    cap_max_tokens: bool = False,
) -> Job | Response:
    """Queue the request as this server's role takes it: whole, or the prefill half (answered
    here, once handed off), or the decode half (once its prefill's KV is in hand).
    `cap_max_tokens`: Serving.plan's."""
    state = _state(request)
    role = state.role
    client = request.headers.get("user-agent")

    def plan() -> Plan:
        try:
            return state.serving.plan(body.model, prompts, params, cap_max_tokens)
        except APIError as err:
            if err.info.code == GreedyRejected.code:
                state.metrics.on_greedy_rejected(endpoint, client, err.info.message)
            raise

    if isinstance(role, PrefillRole):
        rooms = Rooms.of(body)
        try:
            planned = _disaggregated(plan())
            job = await state.serving.submit(
                endpoint, prompts, planned, handoff=True, client=client
            )
        except APIError as err:
            choices = len(prompts) * (params.n or 1)
            role.fail(rooms, choices, "prefill_refused", f"{err.status}: {err.info.message}")
            raise
        return JSONResponse(await role.serve(job, rooms, request))
    planned = plan()
    if role is None:
        return await state.serving.submit(endpoint, prompts, planned, client=client)
    handoffs, extra = await role.fetch(Rooms.of(body), _disaggregated(planned), request)
    return await state.serving.submit(
        endpoint, prompts, planned, handoffs=handoffs, sampling_extra=extra, client=client
    )


def _disaggregated(planned: Plan) -> Plan:
    """A plan a prefill/decode pair can serve: every choice generates."""
    if any(choice.effective.max_tokens == 0 for choice in planned.choices):
        raise APIError(400, "a disaggregated request must generate", param="max_tokens")
    return planned


def chat_params(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[SamplingParams, ToolRequest | None]:
    """A chat body's SamplingParams, its forced tool call (if any) one of its constraints."""
    tools = ToolRequest.of(body, state.tool_parser)
    return (tools.params(body) if tools else to_sampling_params(body)), tools


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    params, tools = chat_params(state, body)
    prompt = state.prompts.chat(body.messages, tools.shown if tools else None)
    job = await submit(request, "chat", body, [prompt], params)
    if isinstance(job, Response):
        return job
    if body.stream:
        return _sse(request, chat_chunks(job, state.tokens, *_stream_usage(body), tools=tools))
    await job.collect(request)
    return _json(chat_response(job, state.tokens, tools))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    params = to_sampling_params(body)
    prompts = state.prompts.completion(body.prompt)
    job = await submit(request, "completions", body, prompts, params)
    if isinstance(job, Response):
        return job
    echo = bool(body.echo)
    if body.stream:
        return _sse(request, completion_chunks(job, state.tokens, echo, *_stream_usage(body)))
    await job.collect(request)
    return _json(completion_response(job, state.tokens, echo))


@router.get("/v1/sampling/defaults")
async def sampling_defaults(request: Request) -> dict[str, Any]:
    """What a request that sends no sampling field gets, with the source of each value."""
    return _state(request).defaults.to_dict()


@router.post("/v1/sampling/explain")
async def sampling_explain(request: Request) -> dict[str, Any]:
    """The resolution of a chat or completions body, without generating. A body without
    `prompt` is read as chat; its messages may be left out."""
    state = _state(request)
    body = await read_body(request)
    if isinstance(body, ChatCompletionRequest):
        params = chat_params(state, body)[0]
    else:
        params = to_sampling_params(body)
    resolution = state.serving.explain(body.model, params)
    endpoint = "completions" if isinstance(body, CompletionRequest) else "chat"
    return {"model": state.defaults.model, "endpoint": endpoint, "sampling": resolution.to_dict()}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, Any]:
    """Forget every cached prefix block no request holds (vLLM's route, behind the API key), so
    the next benchmark run computes its prompts in full."""
    state = _state(request)
    if state.engine is None:
        raise APIError(503, "the engine is not running", type="server_error", code="unavailable")
    dropped = await state.engine.call(lambda engine: engine.blocks.reset_prefix_cache())
    return {"reset": True, "blocks_dropped": dropped}


# ---- the worker contract of SGLang's router (smg): registration, load, cache ----
# smg takes a worker that serves /server_info and no /version for an SGLang one, which is the
# PD protocol Thermostat speaks (same body to both halves, bootstrap fields added).


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request) -> dict[str, Any]:
    state = _state(request)
    cfg = state.config
    return {
        "server": "thermostat",
        "version": version("thermostat"),
        "model_path": str(state.model_dir),
        "served_model_name": state.defaults.model,
        "max_running_requests": cfg.engine.max_num_seqs,
        "max_num_seqs": cfg.engine.max_num_seqs,
        "max_model_len": state.max_model_len,
        "kv_cache_dtype": cfg.engine.kv_cache_dtype,
        **state.weights,  # weight_format, weight_bytes, weight_source
        **state.kv_bytes,  # KV bytes per token of context, fixed bytes per sequence
        "disaggregation_mode": cfg.disaggregation_mode or "null",
        "disaggregation_bootstrap_port": cfg.bootstrap_port,
        "sampling_defaults": state.defaults.to_dict(),
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {
        "model_path": str(state.model_dir),
        "tokenizer_path": str(state.model_dir),
        "served_model_name": state.defaults.model,
        "is_generation": True,
        "model_type": state.model_config.get("model_type"),
        "architectures": state.model_config.get("architectures"),
    }


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, int]]:
    """SGLang's load report (smg's power_of_two policy reads it): one data-parallel rank."""
    state = _state(request)
    stats = state.engine.stats if state.engine else None
    if stats is None:
        return [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    used = (stats.num_blocks - stats.num_free_blocks) * state.config.engine.block_size
    return [
        {
            "dp_rank": 0,
            "num_reqs": stats.num_running + stats.num_waiting,
            "num_waiting_reqs": stats.num_waiting,
            "num_tokens": used,
        }
    ]


@router.post("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    """SGLang's name for /reset_prefix_cache."""
    result = await reset_prefix_cache(request)
    return {"flushed": True, "blocks_dropped": result["blocks_dropped"]}
