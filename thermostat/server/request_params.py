"""The one place a request body becomes SamplingParams.

Fields the client did not send stay None, so the resolver fills them from the server's layers;
nothing here supplies a default. Shape differences between the endpoints end here: chat's
`logprobs: bool` + `top_logprobs: int` and `max_completion_tokens`, completions' `logprobs: int`
and `echo` (which asks for the prompt's logprobs too).
"""

from __future__ import annotations

from thermostat.errors import InvalidRequest
from thermostat.sampling import SamplingParamError, SamplingParams
from thermostat.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI and vLLM allow
MAX_N = 128  # samples per prompt


def parse_body(raw: object) -> ChatCompletionRequest | CompletionRequest:
    """A chat or completions body, as /v1/sampling/explain and `thermostat explain` read one:
    with `prompt` it is a completions body, otherwise chat (its messages may be left out).
    Raises InvalidRequest for a non-object, pydantic's ValidationError for bad fields."""
    if not isinstance(raw, dict):
        raise InvalidRequest(None, "the body must be a JSON object")
    if "prompt" in raw:
        return CompletionRequest.model_validate(raw)
    return ChatCompletionRequest.model_validate({"messages": []} | raw)


def to_sampling_params(body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    """Raises SamplingParamError (naming the field) for values no resolution could accept."""
    prompt_logprobs = None
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_tokens
        if body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if body.top_logprobs is not None and not body.logprobs:
            raise SamplingParamError("top_logprobs", "requires logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        max_tokens = body.max_tokens
        logprobs = body.logprobs
        logprobs_field = "logprobs"
        if body.echo and logprobs is not None:
            prompt_logprobs = logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise SamplingParamError(logprobs_field, f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if body.n is not None and body.n > MAX_N:
        raise SamplingParamError("n", f"must be at most {MAX_N}, got {body.n}")
    params = SamplingParams(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        n=body.n,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
    )
    params.validate()
    return params
