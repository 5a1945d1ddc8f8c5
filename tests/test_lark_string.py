"""A freeform tool's Lark grammar moved inside a JSON string (api/lark_string.py): its regexes
match a text's escaped spelling exactly when the originals match the text, and a forced call of
Codex's `apply_patch` is generated as `{"input": "..."}` whose decoded input the original
grammar accepts."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tool_models import tool_tokenizer
from thermostat.api.lark_string import LarkStringError, _rewrite, escape_text, in_json_string
from thermostat.api.protocol import ChatCompletionRequest
from thermostat.api.tool_parsers import PARSERS, marker_tokens
from thermostat.api.tools import ToolRequest
from thermostat.engine.constraint import ConstraintCompiler, allowed_ids
from thermostat.sampling.structured import StructuredOutput

# Codex CLI 0.171.0's apply_patch tool, as it sends it
APPLY_PATCH = """start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?
filename: /(.+)/
add_line: "+" /(.*)/ LF -> line
change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF
%import common.LF
"""
REGEXES = [r"(.+)", r"(.*)x", r'[^"\n]+', r'[a-c"\\]*', r"a/b", r"(?:x|y)+", r"\s\w"]
TEXT = st.text(alphabet=st.sampled_from(list('abcxy19 "\\/\n\t\r\x01é')), max_size=8)


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_a_rewritten_regex_matches_the_escaped_text_iff_the_original_matches_the_text(text):
    for regex in REGEXES:
        original = re.fullmatch(regex, text) is not None
        rewritten = re.fullmatch(_rewrite(regex), escape_text(text)) is not None
        assert original == rewritten, (regex, text, _rewrite(regex))


@pytest.mark.parametrize(
    "grammar",
    [
        "start: /(?=a)a/",  # a lookahead
        'start: "a"i',  # case-insensitive
        "start: A\n%ignore A\nA: /a/",
        "start: /^a/",
        "start: /a{2,3}/",
        "start: WORDX\n%import common.WORDX",
    ],
)
def test_what_the_rewrite_does_not_know_is_refused(grammar):
    with pytest.raises(LarkStringError):
        in_json_string(grammar, "p_")


def apply_patch_tool(grammar: str) -> dict:
    from thermostat.api.agents.content import custom_tool_function

    return custom_tool_function("apply_patch", "Edit files.", grammar)


def forced_call(grammar: str):
    """(tokenizer, parser, the compiled constraint of a forced call of apply_patch)."""
    tokenizer = tool_tokenizer("hermes", "added")
    parser = PARSERS["hermes"](marker_tokens(tokenizer.added_tokens_decoder))
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "Fix it."}],
            "tools": [apply_patch_tool(grammar)],
            "tool_choice": {"type": "function", "function": {"name": "apply_patch"}},
        }
    )
    request = ToolRequest.of(body, parser)
    assert request is not None
    assert "x-thermostat-lark" not in json.dumps(request.shown)  # the template sees prose
    spec = request.constraint()
    assert spec is not None
    return tokenizer, parser, ConstraintCompiler(tokenizer, 320, (0,)).compile(spec)


def walk(grammar: str, seed: int) -> str:
    """A random walk through the forced call's constraint: the call's decoded `input`. It
    leans towards what ends a line, a patch and the call (a uniform walk through `/(.*)/` meets
    an escaped line feed, two tokens, once in ~10^5 steps)."""
    tokenizer, parser, constraint = forced_call(grammar)
    rng = random.Random(seed)
    ids: list[int] = []
    while not constraint.complete and len(ids) < 3000:
        allowed = allowed_ids(constraint.mask(), 320)
        text = {t: tokenizer.decode([t]) for t in allowed}
        after_backslash = ids and tokenizer.decode(ids[-1:]) == "\\"
        lean = [t for t in allowed if text[t] == ("n" if after_backslash else "\\")]
        lean += [t for t in allowed if text[t] in ('"', "}", "*", "+") and not after_backslash]
        token = rng.choice(lean if lean and rng.random() < 0.7 else allowed)
        assert constraint.advance(token)
        ids.append(token)
    assert constraint.complete, "the walk did not end"
    (call,) = parser.read(tokenizer.decode(ids, skip_special_tokens=False)).calls
    return json.loads(call.arguments)["input"]


def accepts(grammar: str, text: str) -> bool:
    """Whether the original grammar accepts `text` (llguidance, token by token)."""
    tokenizer = tool_tokenizer("hermes", "plain")
    constraint = ConstraintCompiler(tokenizer, 320, (0,)).compile(
        StructuredOutput.lark(grammar, "test")
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(constraint.advance(t) for t in ids) and constraint.matcher.is_accepting()


PATCH = (
    '*** Begin Patch\n*** Update File: a/b "c".py\n@@ def f():\n-    return 1\n'
    "+    return '\\t'\n*** End Patch\n"
)


@pytest.mark.parametrize(
    ("patch", "valid"),
    [(PATCH, True), (PATCH.replace("*** Begin Patch\n", ""), False), (PATCH + "x", False)],
)
def test_a_forced_call_takes_a_patch_iff_the_grammar_accepts_it(patch, valid):
    tokenizer, _, constraint = forced_call(APPLY_PATCH)
    assert accepts(APPLY_PATCH, patch) == valid
    call = '\n{"name": "apply_patch", "arguments": ' + json.dumps({"input": patch}) + "}\n"
    ids = [300, *tokenizer.encode(call, add_special_tokens=False), 301]  # <tool_call> ...
    taken = all(constraint.advance(t) for t in ids) and constraint.complete
    assert taken == valid


@pytest.mark.parametrize("seed", range(3))
def test_a_forced_apply_patch_call_is_a_patch_the_grammar_accepts(seed):
    patch = walk(APPLY_PATCH, seed)
    assert patch.startswith("*** Begin Patch\n"), patch
    assert accepts(APPLY_PATCH, patch), patch


def test_a_grammar_the_rewrite_refuses_leaves_the_string_free():
    value = walk("start: /(?=a)a+/", 0)
    assert isinstance(value, str)
