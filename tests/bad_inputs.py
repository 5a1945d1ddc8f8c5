"""The bad-input battery: one `Probe` per malformed, mistyped, out-of-range or oversized request,
on every route. The sampling probes are derived from `FIELDS`, so a new field is covered as soon
as it is in the table.

| probes                       | routes                                  | must get              |
|------------------------------|-----------------------------------------|-----------------------|
| malformed items, blocks,     | /v1/responses, /v1/messages (the agents'| 4xx naming the field, |
|   tools, tool choices        |   APIs)                                 |   in the API's shape  |
| sampling field wrong types,  | chat, completions, explain              | 400 naming the field  |
|   NaN, +-inf, 1e308, 2**63.. |                                         |                       |
| other fields' wrong types    | every POST route                        | 400 naming the field  |
| unknown model                | every POST route                        | 404 model_not_found   |
| malformed / non-object JSON, | every POST route                        | 400                   |
|   invalid UTF-8, deep nesting|                                         |                       |
| 20 MB body                   | every POST route                        | 413                   |
| lone surrogates              | every text field                        | 400 naming the field  |
| odd query strings, methods   | every route                             | 200 / 405             |
| unknown fields               | every POST route                        | 200                   |
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from thermostat.random_model import TEXT
from thermostat.sampling.fields import FIELDS, SamplingField, SamplingParamError

MAX_MODEL_LEN = 64  # the battery's server: a prompt of more tokens cannot fit
VOCAB = 320  # the test model's vocabulary (tests.conftest.write_model)

CHAT, COMPLETIONS, EXPLAIN = "/v1/chat/completions", "/v1/completions", "/v1/sampling/explain"
TOKENIZE, DETOKENIZE = "/tokenize", "/detokenize"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
POST_ROUTES = (CHAT, COMPLETIONS, EXPLAIN, TOKENIZE, DETOKENIZE, RESPONSES, MESSAGES)
GET_ROUTES = ("/v1/models", "/v1/sampling/defaults", "/health", "/metrics")
SAMPLING_ROUTES = (CHAT, COMPLETIONS, EXPLAIN)  # bodies that carry the sampling fields
SHORT = {
    CHAT: "chat",
    COMPLETIONS: "cmpl",
    EXPLAIN: "explain",
    TOKENIZE: "tok",
    DETOKENIZE: "detok",
    RESPONSES: "resp",
    MESSAGES: "msg",
}

HELLO = [{"role": "user", "content": "hello"}]
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"messages": HELLO, "max_tokens": 2},
    COMPLETIONS: {"prompt": "It was the", "max_tokens": 2},
    EXPLAIN: {"prompt": "It was the"},
    TOKENIZE: {"prompt": "It was the"},
    DETOKENIZE: {"tokens": [30, 31, 32]},
    RESPONSES: {"input": "hello", "max_output_tokens": 2},
    MESSAGES: {"messages": HELLO, "max_tokens": 2},
}
MEGABYTE_TEXT = (TEXT * (10**6 // len(TEXT) + 1))[: 10**6]
BIG_BODY = 20 * 2**20  # over any sane request size limit

WRONG_TYPES: dict[type, list[Any]] = {
    float: ["0.5", True, [0.5], {"v": 0.5}],
    int: [1.5, 2.0, "1", True, [1], {"v": 1}],
    bool: [1, 0, "true", [True]],
    str: [1, True, {"v": "x"}, [None], ""],
}
EXTREMES = [math.nan, math.inf, -math.inf, 1e308, -1e308, 2**63, -(2**63) - 1, 10**30]
LONE_SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800: valid JSON, no UTF-8


@dataclass(frozen=True)
class Probe:
    """One request and what it must get. `status`: the statuses allowed (empty: any below 500);
    `param`: the values allowed for error.param (empty: not checked); `says`: words the error
    message must contain; `code`: the error code it must have (empty: not checked)."""

    id: str
    method: str
    path: str
    content: bytes | Callable[[], bytes | Iterator[bytes]] | None = None
    status: tuple[int, ...] = ()
    param: tuple[str, ...] = ()
    says: str = ""
    code: str = ""
    content_type: str = "application/json"

    def body(self) -> bytes | Iterator[bytes] | None:
        return self.content() if callable(self.content) else self.content


def check_error(body: Any, path: str = "") -> dict[str, Any]:
    """`body` is `{"error": {"message", "type", "param", "code"}}` (under /v1/messages
    Anthropic's `{"type": "error", "error": {"type", "message"}}`, returned with param and code
    None); returns the error."""
    if path.startswith(MESSAGES):
        assert isinstance(body, dict) and body.get("type") == "error", body
        error = body["error"]
        assert set(error) == {"type", "message"} and error["message"] and error["type"], error
        return error | {"param": None, "code": None}
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), body
    error = body["error"]
    assert {"message", "type", "param", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    return error


def base(path: str, field: str) -> dict[str, Any]:
    """The valid body of `path` to set `field` in (/tokenize takes messages or a prompt)."""
    return {} if (path, field) == (TOKENIZE, "messages") else VALID[path]


def dump(body: Any) -> bytes:
    return json.dumps(body).encode()  # NaN and +-inf as the tokens NaN, Infinity, -Infinity


def post(id_: str, path: str, body: Any, status: tuple[int, ...] = (400,), **kw: Any) -> Probe:
    content = body if isinstance(body, bytes) or callable(body) else dump(body)
    return Probe(f"{SHORT[path]}-{id_}", "POST", path, content, status, **kw)


def accepts(field: SamplingField, value: Any) -> bool:
    try:
        field.check(value)
    except SamplingParamError:
        return False
    return True


def bad_values(field: SamplingField) -> list[Any]:
    """Wrong types and extreme numbers that `field` must refuse, shaped as its body value."""
    items = WRONG_TYPES[field.type] + (EXTREMES if field.type in (int, float) else [])
    if field.shape == "one":
        values = items
    elif field.shape == "list":
        values = [[v] for v in items] + ["1", 1, {"v": [1]}]
    else:
        values = items + [[v] for v in items] + [{"v": ["x"]}]
    return [v for v in values if not accepts(field, v)]


def number_probes(name: str, path: str, base: dict[str, Any], extra: list[Any]) -> list[Probe]:
    values = WRONG_TYPES[int] + EXTREMES + extra
    return [post(f"{name}={v!r}", path, base | {name: v}, param=(name,)) for v in values]


def sampling_probes() -> list[Probe]:
    probes = []
    for path in SAMPLING_ROUTES:
        for field in FIELDS:
            if not field.body:
                continue
            for value in bad_values(field):
                body = VALID[path] | {field.name: value}
                probes.append(post(f"{field.name}={value!r}", path, body, param=(field.name,)))
                for alias in field.aliases if path == CHAT else ():
                    body = VALID[path] | {alias: value}
                    probes.append(post(f"{alias}={value!r}", path, body, param=(field.name, alias)))
    chat_logprobs = VALID[CHAT] | {"logprobs": True}
    probes += number_probes("top_logprobs", CHAT, chat_logprobs, [-1, 21])
    probes += number_probes("logprobs", COMPLETIONS, VALID[COMPLETIONS], [-1, 21])
    for path, name in ((CHAT, "logprobs"), (COMPLETIONS, "echo")):
        for value in WRONG_TYPES[bool]:
            probes.append(
                post(f"{name}={value!r}", path, VALID[path] | {name: value}, param=(name,))
            )
    return probes


OTHER_WRONG_TYPES: dict[str, dict[str, list[Any]]] = {
    CHAT: {
        "messages": [
            "hi",
            {},
            None,
            [1],
            ["hi"],
            [{"content": "x"}],
            [{"role": 1, "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [1]}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        ],
        "stream": [1, "yes"],
        "stream_options": ["x", {"include_usage": "yes"}],
        "user": [1, []],
    },
    COMPLETIONS: {
        "prompt": [1, 1.5, True, None, {}, [1.5], [True], [None], [["a"]], [[1.5]], ["a", 1]],
        "stream": [1, "yes"],
        "stream_options": ["x", {"include_usage": "yes"}],
        "user": [1, []],
    },
    EXPLAIN: {"prompt": [1, True, {}, [1.5], [None]]},
    TOKENIZE: {
        "prompt": [1, True, ["a"], {}],
        "messages": ["x", [1], [{"content": "x"}]],
        "add_special_tokens": [1, "yes"],
        "add_generation_prompt": [1, "yes"],
    },
    DETOKENIZE: {"tokens": ["x", None, {}, [1.5], [True], ["a"], [[1]]]},
    RESPONSES: {
        "input": [
            1,
            True,
            {},
            [1],
            ["hi"],
            [{"type": "bogus"}],
            [{"type": "item_reference", "id": "x"}],
            [{"role": "wizard", "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            [{"role": "user", "content": [{"type": "input_text", "text": 5}]}],
            [{"type": "function_call", "name": 1, "call_id": "c", "arguments": "{}"}],
            [{"type": "function_call", "name": "f", "call_id": "c", "arguments": {}}],
            [{"type": "function_call_output", "output": "x"}],
            [{"type": "custom_tool_call_output", "call_id": "c", "output": 5}],
        ],
        "instructions": [1, []],
        "tools": [
            "x",
            [1],
            [{"name": "f"}],
            [{"type": "function"}],
            [{"type": "function", "name": "f", "parameters": "x"}],
            [{"type": "namespace", "name": "n", "tools": 1}],
            [{"type": "custom"}],
        ],
        "tool_choice": [1, ["auto"], {"type": "web_search"}],
        "text": ["x", {"format": 1}, {"format": {"type": "yaml"}}],
        "max_output_tokens": ["1", 1.5, True],
        "temperature": ["0.5", True],
        "top_p": ["0.5"],
        "stream": [1, "yes"],
        "store": [1, "x"],
        "previous_response_id": [1, []],
        "parallel_tool_calls": [1, "yes"],
        "metadata": ["x", {"a": 1}],
        "user": [1, []],
    },
    MESSAGES: {
        "messages": [
            "hi",
            {},
            None,
            [1],
            [{"content": "x"}],
            [{"role": "wizard", "content": "x"}],
            [{"role": "user", "content": 5}],
            [{"role": "user", "content": [1]}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            [{"role": "user", "content": [{"type": "tool_result"}]}],
            [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}],
            [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}],
                }
            ],  # fmt: skip
            [{"role": "user", "content": [{"type": "unknown_block"}]}],
        ],
        "system": [1, [1], [{"type": "image"}], [{"type": "text", "text": 1}]],
        "max_tokens": ["1", 1.5, True, 0, None],
        "tools": [
            "x",
            [1],
            [{"name": 1}],
            [{"name": "f"}],
            [{"name": "f", "input_schema": "x"}],
        ],
        "tool_choice": ["auto", {"type": "bogus"}],
        "stop_sequences": ["x", [1]],
        "temperature": ["0.5"],
        "top_k": [1.5, "1"],
        "stream": [1],
    },
}


def field_probes() -> list[Probe]:
    probes = []
    for path in POST_ROUTES:
        fields = OTHER_WRONG_TYPES[path] | {"model": [1, True, [], {"id": "x"}]}
        for name, values in fields.items():
            for value in values:
                body = base(path, name) | {name: value}
                probes.append(post(f"{name}={value!r}", path, body, param=(name,)))
        unknown = VALID[path] | {"model": "no-such-model"}
        probes.append(
            post("unknown-model", path, unknown, (404,), param=("model",), code="model_not_found")
        )
        extra = VALID[path] | {"frobnicate": 1, "x_nested": {"a": [1, {"b": None}]}}
        probes.append(post("unknown-fields", path, extra, (200,)))
    for path in (CHAT, TOKENIZE):
        for role in ("wizard", "", "ASSISTANT "):
            body = base(path, "messages") | {"messages": [{"role": role, "content": "hi"}]}
            probes.append(post(f"role={role!r}", path, body, param=("messages",), says="role"))
        probes.append(post("messages=[]", path, {"messages": []}, param=("messages",)))
    for prompt in ("", [""], []):
        probes.append(
            post(f"prompt={prompt!r}", COMPLETIONS, {"prompt": prompt}, param=("prompt",))
        )
    return probes


def prompt_probes() -> list[Probe]:
    """Prompts over the context and token ids outside the vocabulary."""
    over = {"param": ("prompt",), "says": "context"}
    chat_over = {"param": ("messages", "prompt"), "says": "context"}
    probes = [
        post("ids-over-context", COMPLETIONS, {"prompt": [30] * (MAX_MODEL_LEN + 1)}, **over),
        post("text-over-context", COMPLETIONS, {"prompt": TEXT}, **over),
        post("batch-over-context", COMPLETIONS, {"prompt": ["hi", TEXT]}, **over),
        post("1MB-prompt", COMPLETIONS, {"prompt": MEGABYTE_TEXT}, **over),
        post(
            "1MB-prompt-max_tokens=1",
            COMPLETIONS,
            {"prompt": MEGABYTE_TEXT, "max_tokens": 1},
            **over,
        ),
        post(
            "text-over-context",
            CHAT,
            {"messages": [{"role": "user", "content": TEXT}]},
            **chat_over,
        ),
        post("text-over-context", RESPONSES, {"input": TEXT}, **chat_over),
        post("1MB-input", RESPONSES, {"input": MEGABYTE_TEXT}, **chat_over),
        post(
            "1MB-content",
            MESSAGES,
            {"messages": [{"role": "user", "content": MEGABYTE_TEXT}], "max_tokens": 2},
            **chat_over,
        ),
        post(
            "1MB-content",
            CHAT,
            {"messages": [{"role": "user", "content": MEGABYTE_TEXT}]},
            **chat_over,
        ),
    ]
    for ids in ([1, VOCAB], [1, 10**6], [-1], [2**63], [-(2**63) - 1], [[30, 31], [32, -5]]):
        probes.append(
            post(f"prompt={ids}", COMPLETIONS, {"prompt": ids, "max_tokens": 2}, param=("prompt",))
        )
    for ids in ([-1], [10**6], [2**63], [10**30]):
        probes.append(post(f"tokens={ids}", DETOKENIZE, {"tokens": ids}, param=("tokens",)))
    return probes


def surrogate_probes() -> list[Probe]:
    """A lone surrogate (JSON escape \\ud800) in every text field."""
    s = LONE_SURROGATE
    must_refuse = [
        (COMPLETIONS, {"prompt": s}, "prompt"),
        (COMPLETIONS, {"prompt": ["hi", "x" + s]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": s}]}, "messages"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]},
            "messages",
        ),
        (CHAT, {"messages": [{"role": s, "content": "hi"}]}, "messages"),
        (TOKENIZE, {"prompt": s}, "prompt"),
        (TOKENIZE, {"messages": [{"role": "user", "content": s}]}, "messages"),
        (RESPONSES, {"input": s}, "input"),
        (RESPONSES, {"input": [{"role": "user", "content": s}]}, "input"),
        (MESSAGES, {"messages": [{"role": "user", "content": s}]}, "messages"),
        (MESSAGES, {"system": s}, "system"),
    ]
    probes = [
        post(f"surrogate-in-{name}", path, base(path, name) | body, param=(name,))
        for path, body, name in must_refuse
    ]
    for path in (CHAT, COMPLETIONS):  # a stop string nobody can type: refused, or never matches
        probes.append(
            post(
                "surrogate-in-stop", path, VALID[path] | {"stop": [s]}, (200, 400), param=("stop",)
            )
        )
    probes.append(
        post("surrogate-in-prompt", EXPLAIN, {"prompt": s}, (200, 400), param=("prompt",))
    )
    for path in POST_ROUTES:
        probes.append(
            post(
                "surrogate-in-model", path, VALID[path] | {"model": s}, (400, 404), param=("model",)
            )
        )
    return probes


TEXT_FIELD = {  # a body whose text field "@@" becomes bytes that are not UTF-8
    CHAT: {"messages": [{"role": "user", "content": "@@"}]},
    COMPLETIONS: {"prompt": "@@"},
    EXPLAIN: {"prompt": "@@"},
    TOKENIZE: {"prompt": "@@"},
    DETOKENIZE: {"tokens": [30], "model": "@@"},
    RESPONSES: {"input": "@@"},
    MESSAGES: {"messages": [{"role": "user", "content": "@@"}], "max_tokens": 2},
}
NON_OBJECTS = [b"[]", b"[1, 2]", b'"hello"', b"42", b"3.5", b"null", b"true"]
MALFORMED = [
    b'{"messages": [',
    b"{",
    b"",
    b'{"a": 1,}',
    b"{'a': 1}",
    b"not json",
    b"\x00",
    b'{"prompt": "It was"} trailing',
    b'{"prompt": "\\x41"}',
]


def _big_body(path: str) -> Callable[[], bytes]:
    def build() -> bytes:
        head = dump(VALID[path])[:-1] + b', "pad": "'
        return head + b"a" * BIG_BODY + b'"}'

    return build


def _big_chunks() -> Iterator[bytes]:
    """A 20 MB body without Content-Length (chunked): a limit must count what arrives."""
    yield b'{"prompt": "hi", "pad": "'
    for _ in range(BIG_BODY // 2**20):
        yield b"a" * 2**20
    yield b'"}'


def raw_probes() -> list[Probe]:
    """Bodies as bytes: malformed JSON, non-objects, invalid UTF-8, deep nesting, size."""
    probes = []
    for path in POST_ROUTES:
        for i, content in enumerate(MALFORMED):
            probes.append(post(f"malformed-{i}", path, content))
        for content in NON_OBJECTS:
            probes.append(post(f"non-object-{content.decode()}", path, content))
        probes.append(post("invalid-utf8", path, b'{"prompt": "\xff\xfe"}'))
        text_field = dump(TEXT_FIELD[path]).replace(b"@@", b"\xc3\x28\xff")
        probes.append(post("invalid-utf8-in-text-field", path, text_field))
        probes.append(post("nested-[", path, b"[" * 100_000))
        probes.append(post("nested-{", path, b'{"a":' * 100_000))
        key = next(iter(VALID[path]))  # the route's main field
        probes.append(post("nested-in-field", path, dump({key: 0})[:-2] + b"[" * 100_000))
        probes.append(post("20MB", path, _big_body(path), (413,)))
        dup = dump(VALID[path])[:-1] + b", " + dump({key: "x"})[1:]
        probes.append(post(f"duplicate-{key}", path, dup, (200, 400)))
        for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
            probes.append(
                Probe(
                    f"{SHORT[path]}-content-type={content_type!r}",
                    "POST",
                    path,
                    dump(VALID[path]),
                    content_type=content_type,
                )
            )
    probes.append(post("20MB-chunked", COMPLETIONS, _big_chunks, (413,)))
    return probes


QUERIES = ["?x=1&x=2", "?model=no-such-model", "?%ff=%fe", "?a=%00", "?;;&&==", "?" + "q" * 4000]


def method_probes() -> list[Probe]:
    probes = []
    for path in GET_ROUTES:
        for query in QUERIES:
            probes.append(Probe(f"GET-{path}{query[:20]}", "GET", path + query, status=(200,)))
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            probes.append(Probe(f"{method}-{path}", method, path, b"{}", (405,)))
    for path in POST_ROUTES:
        for method in ("GET", "PUT", "DELETE"):
            probes.append(Probe(f"{method}-{path}", method, path, status=(405,)))
    return probes


PROBES: list[Probe] = (
    sampling_probes() + field_probes() + prompt_probes() + surrogate_probes() + raw_probes()
) + method_probes()
