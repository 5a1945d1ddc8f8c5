"""/tokenize and /detokenize (vLLM's and SGLang's): the served model's tokenizer and chat
template, so a client can count what it sends."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from thermostat.api.errors import APIError
from thermostat.api.protocol import DetokenizeRequest, TokenizeRequest
from thermostat.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.thermostat
    return state


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.serving.check_model(body.model)
    tokenizer = state.prompts.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        gen_prompt = body.add_generation_prompt is not False
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = state.prompts.chat_text(body.messages, gen_prompt, tools)
        special = bool(body.add_special_tokens)
    else:
        text, special = body.prompt or "", body.add_special_tokens is not False
        state.prompts.check_length(len(text), "prompt")
    tokens = tokenizer.encode(text, add_special_tokens=special)
    return {
        "count": len(tokens),
        "max_model_len": state.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    state = _state(request)
    state.serving.check_model(body.model)
    vocab = len(state.prompts.tokenizer)
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens: ids must be in [0, {vocab})", param="tokens")
    return {"prompt": state.tokens.decode(body.tokens)}
