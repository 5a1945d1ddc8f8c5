"""The one place a request body becomes SamplingParams.

The fields both endpoints share are copied by a loop over the sampling field table. Fields the
client did not send stay None, so the resolver fills them from the server's layers;
nothing here supplies a default. Shape differences between the endpoints end here: chat's
`logprobs: bool` + `top_logprobs: int` and `max_completion_tokens`, completions' `logprobs: int`
and `echo` (which asks for the prompt's logprobs too).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from pydantic import ValidationError
from starlette.requests import Request

from thermostat.api.errors import APIError, validation_error
from thermostat.api.protocol import ChatCompletionRequest, CompletionRequest
from thermostat.errors import InvalidRequest
from thermostat.sampling import SamplingParamError, SamplingParams
from thermostat.sampling.fields import FIELDS
from thermostat.sampling.repetition_detection import RepetitionDetection
from thermostat.sampling.structured import ConstraintError, StructuredOutput

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


async def read_body(request: Request) -> ChatCompletionRequest | CompletionRequest:
    """A chat or completions body read from a request as `parse_body` reads it (routes that
    take either: /v1/sampling/explain); raises APIError 400 for malformed JSON or fields."""
    try:
        raw = json.loads(await request.body())
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="json_invalid") from exc
    try:
        return parse_body(raw)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from exc
    except InvalidRequest as exc:
        raise APIError(400, str(exc), code="invalid_body") from exc


def to_sampling_params(
    body: ChatCompletionRequest | CompletionRequest, tools: StructuredOutput | None = None
) -> SamplingParams:
    """Raises SamplingParamError (naming the field) for what only the HTTP shape can get wrong
    (top_logprobs without logprobs, more alternatives or samples than served). The values
    themselves are validated once, by `resolve`. `tools`: the constraint of a forced tool
    call (server/tools.py), one more output constraint."""
    values = {}
    for field in FIELDS:
        if field.body:
            values[field.name] = getattr(body, field.name)
            for alias in field.aliases:  # max_completion_tokens: chat only, wins over max_tokens
                if getattr(body, alias, None) is not None:
                    values[field.name] = getattr(body, alias)
    prompt_logprobs = None
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise SamplingParamError("top_logprobs", "requires logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        logprobs_field = "top_logprobs"
    else:
        logprobs = body.logprobs
        logprobs_field = "logprobs"
        if body.echo and logprobs is not None:
            prompt_logprobs = logprobs
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise SamplingParamError(logprobs_field, f"must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    if body.n is not None and body.n > MAX_N:
        raise SamplingParamError("n", f"must be at most {MAX_N}, got {body.n}")
    return SamplingParams(
        **values,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured_output(body, tools),
        repetition_detection=None
        if body.repetition_detection is None
        else RepetitionDetection.of(body.repetition_detection),
    )


def structured_output(
    body: ChatCompletionRequest | CompletionRequest, tools: StructuredOutput | None = None
) -> StructuredOutput | None:
    """The output constraint the body asks for: OpenAI's `response_format` or one of vLLM's
    `guided_*` / `structured_outputs` fields, or a forced tool call; at most one may be sent.
    Raises ConstraintError naming the field for a bad schema, regex or grammar."""
    asked: list[tuple[str, Callable[[], StructuredOutput]]] = []
    if tools is not None:
        asked.append(("tool_choice", lambda: tools))
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", lambda: StructuredOutput.json_object("response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        spec = fmt.json_schema
        if spec is None or spec.schema_ is None:
            raise ConstraintError(
                "response_format", "response_format: json_schema.schema is required"
            )
        schema = spec.schema_
        asked.append(
            ("response_format", lambda: StructuredOutput.json_schema(schema, "response_format"))
        )
    guided = body.structured_outputs
    prefix = "structured_outputs." if guided is not None else "guided_"
    json_schema = guided.json_ if guided is not None else body.guided_json
    regex = guided.regex if guided is not None else body.guided_regex
    choice = guided.choice if guided is not None else body.guided_choice
    grammar = guided.grammar if guided is not None else body.guided_grammar
    if json_schema is not None:
        param = prefix + "json"
        asked.append((param, lambda: StructuredOutput.json_schema(json_schema, param)))
    if regex is not None:
        asked.append((prefix + "regex", lambda: StructuredOutput.regex(regex, prefix + "regex")))
    if choice is not None:
        param_c = prefix + "choice"
        asked.append((param_c, lambda: StructuredOutput.choice(choice, param_c)))
    if grammar is not None:
        param_g = prefix + "grammar"
        asked.append((param_g, lambda: StructuredOutput.lark(grammar, param_g)))
    if guided is not None and guided.json_object:
        param_o = "structured_outputs.json_object"
        asked.append((param_o, lambda: StructuredOutput.json_object(param_o)))
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if guided is not None and getattr(body, name) is not None:
            raise ConstraintError(name, f"send {name} or structured_outputs, not both")
    if len(asked) > 1:
        names = ", ".join(param for param, _ in asked)
        raise ConstraintError(asked[1][0], f"send at most one output constraint, got {names}")
    return asked[0][1]() if asked else None
