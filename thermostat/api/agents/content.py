"""What the two agents' translations share: a content list's text, the chat tool of a custom
(freeform) tool and its input, the fields passed as chat names them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from thermostat.api.errors import APIError, validation_error
from thermostat.api.tool_base import FREEFORM_GRAMMAR
from thermostat.api.tool_base import FREEFORM_INPUT as CUSTOM_INPUT
from thermostat.sampling.fields import FIELDS

M = TypeVar("M", bound=BaseModel)
# chat body fields an agent's answer has no room for (one choice, no logprobs, its own max)
NOT_PASSED = {"max_tokens", "n", "logprobs", "top_logprobs", "prompt_logprobs"}


def invalid(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param.split(".")[0].split("[")[0])


# what SGLang's router adds to a body it sends to a prefill/decode pair (server/disaggregation.py)
BOOTSTRAP = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def validated(model: type[M], raw: Any) -> M:
    """`raw` as `model`; raises APIError 400 naming the field at fault."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from exc


def string_field(item: Mapping[str, Any], key: str, where: str) -> str:
    """`item[key]`, which must be a string (400 naming `where.key` otherwise)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{where}.{key}", "must be a string")
    return value


def passed_fields(raw: Mapping[str, Any], mapped: set[str]) -> dict[str, Any]:
    """The chat body's fields sent in an agent's body as chat names them: sampling fields
    (vLLM's extra fields: top_k, min_p, seed, repetition_detection, ...) besides those its API
    maps itself (`mapped`), and a PD router's bootstrap fields."""
    names = [*(f.name for f in FIELDS if f.body), "repetition_detection", *BOOTSTRAP]
    return {n: raw[n] for n in names if n in raw and n not in mapped | NOT_PASSED}


def parts_text(content: Any, where: str, text_types: Iterable[str]) -> str:
    """The text of a content that is a string or a list of text parts (of `text_types`); any
    other part (an image, a file) is refused, naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, f"must be a string or a list of parts, got {type(content).__name__}")
    kinds = tuple(text_types)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise invalid(f"{where}[{i}]", "must be an object")
        kind = part.get("type")
        if kind not in kinds:
            raise invalid(
                f"{where}[{i}].type",
                f"{kind!r} is not supported (text only: {', '.join(kinds)})",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}[{i}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def custom_tool_function(name: str, description: str | None, grammar: str | None) -> dict:
    """The chat tool a freeform tool is shown to the model as: its input is one string (what
    the families' templates know how to write), the grammar it follows stated in its
    description and carried in its schema, which a forced call is generated to
    (tool_base.py `args_rule`)."""
    text = description or ""
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT],
        "additionalProperties": False,
    }
    if grammar:
        text += f"\n\nThe `{CUSTOM_INPUT}` string follows this Lark grammar:\n{grammar}"
        parameters[FREEFORM_GRAMMAR] = grammar
    function = {"name": name, "description": text.strip(), "parameters": parameters}
    return {"type": "function", "function": function}


def custom_input(arguments: str) -> str:
    """A freeform tool's input from the chat call's arguments text (`{"input": "..."}`); the
    text as it is when the model wrote something else."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def tool_arguments(arguments: str) -> dict[str, Any]:
    """A call's arguments as an object (Anthropic's `input`); text that is not a JSON object
    (a call cut by max_tokens) is kept whole under `_raw`, never dropped."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw": arguments} if arguments else {}
    return value if isinstance(value, dict) else {"_raw": arguments}
