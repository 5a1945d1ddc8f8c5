"""Structured output: what a request constrains its output to, as an llguidance grammar.

A `StructuredOutput` is built from the request field that asked for it, checked once there
(a bad schema, an unsupported JSON Schema keyword or a grammar that does not compile is an
InvalidRequest naming that field), and carried by SamplingParams and EffectiveParams to the
engine, which compiles it against its tokenizer (engine/constraint.py). Torch-free.

| kind          | from (vLLM's `structured_outputs.*` too)                   | output         |
|---------------|------------------------------------------------------------|----------------|
| `json_object` | `response_format: {"type": "json_object"}`                 | any JSON object |
| `json_schema` | `response_format.json_schema.schema`, `guided_json`, tools | the schema's   |
| `regex`       | `guided_regex`                                             | the regex's    |
| `choice`      | `guided_choice`                                            | one string     |
| `grammar`     | `guided_grammar` (Lark, or llama.cpp's GBNF)               | the grammar's  |
| `tool_call`   | `tool_choice` required or named (server/tools.py)          | tool calls     |

JSON whitespace is bounded: between two tokens of the JSON text at most one space, or a
newline and up to `MAX_INDENT` spaces of indentation (pretty-printing up to depth 8 at indent
2). With unlimited whitespace a small model can stall emitting spaces.

A forced tool call's arguments are generated closed (`closed`): an object schema that lists
`properties` and says nothing of other keys gets `additionalProperties: false`, as xgrammar's
default `strict_mode` (vLLM's, SGLang's) does. Clients send tools without it (LangChain's
`bind_tools` unless `strict=True`), and a model free to add keys can spend its whole budget on
one; the closed outputs are a subset of the schema's, so they still validate.

The response's `sampling.constraint` is `to_dict()`: the kind, the field it came from and the
first 12 hex digits of the SHA-256 of its source (the schema as canonical JSON, or the text; a
forced tool call's: its call object's schema, server/tools.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from thermostat.errors import InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stubs only

MAX_INDENT = 16
WHITESPACE = rf"(?:[ ]|\n[ ]{{0,{MAX_INDENT}}})?"
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "whitespace_pattern": WHITESPACE,
}


_SCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "unevaluatedItems", "not",
                "if", "then", "else", "contains", "propertyNames")  # fmt: skip
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any, close: bool = True) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that lists
    `properties` and none of `_OPEN_KEYS`. The members of an `allOf` are not closed (each would
    refuse the others' properties), their subschemas are."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_KEYS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(sub, close=False) for sub in out["allOf"]]
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def canonical(schema: Any) -> str:
    """A JSON schema as the text its hash is of: sorted keys, no spaces."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class ConstraintError(InvalidRequest):
    """A structured-output request that cannot be compiled; `param` names the field."""

    code = "invalid_constraint"


@dataclass(frozen=True)
class StructuredOutput:
    """One request's output constraint: an llguidance grammar and where it came from."""

    kind: str  # json_object | json_schema | regex | choice | grammar | tool_call
    param: str  # the request field it came from (errors name it)
    grammar: str  # llguidance's serialized grammar
    digest: str  # 12 hex digits of the SHA-256 of the source

    def to_dict(self) -> dict[str, Any]:
        """The `sampling.constraint` object of a response."""
        return {"kind": self.kind, "source": self.param, "hash": self.digest}

    @classmethod
    def json_schema(cls, schema: Any, param: str, kind: str = "json_schema") -> StructuredOutput:
        """A JSON schema (a dict, or its JSON text as vLLM's guided_json allows)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(param, f"{param}: not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise ConstraintError(param, f"{param}: a JSON schema must be an object")
        source = canonical(schema)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise ConstraintError(param, f"{param}: {exc}") from exc
        return cls._checked(kind, param, grammar, source)

    @classmethod
    def json_object(cls, param: str) -> StructuredOutput:
        return cls.json_schema({"type": "object"}, param, kind="json_object")

    @classmethod
    def regex(cls, pattern: str, param: str) -> StructuredOutput:
        return cls._checked("regex", param, llguidance.grammar_from("regex", pattern), pattern)

    @classmethod
    def choice(cls, options: list[str], param: str) -> StructuredOutput:
        if not options:
            raise ConstraintError(param, f"{param}: must list at least one choice")
        source = json.dumps(options, ensure_ascii=False)
        return cls._checked("choice", param, llguidance.grammar_from("choice", source), source)

    @classmethod
    def lark(
        cls, text: str, param: str, kind: str = "grammar", source: str | None = None
    ) -> StructuredOutput:
        """A Lark grammar (llguidance's dialect), or a GBNF one (llama.cpp's), converted.
        `source`: what the hash is of, if not the text (a forced call's schema)."""
        try:
            lark = any_to_lark(text)
        except Exception as exc:  # the converter raises plain exceptions for bad GBNF
            raise ConstraintError(param, f"{param}: cannot read the grammar: {exc}") from exc
        grammar = llguidance.grammar_from("lark", lark)
        return cls._checked(kind, param, grammar, text if source is None else source)

    @classmethod
    def _checked(cls, kind: str, param: str, grammar: str, source: str) -> StructuredOutput:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise ConstraintError(param, f"{param}: {messages[0] if messages else 'invalid'}")
        digest = hashlib.sha256(source.encode(errors="surrogatepass")).hexdigest()[:12]
        return cls(kind, param, grammar, digest)
