"""A freeform tool's Lark grammar, moved inside a JSON string.

A custom (freeform) tool of the Responses API, Codex's `apply_patch`, declares its input's
language as a Lark grammar. The model passes that input as the one string argument of a JSON
call (`{"input": "*** Begin Patch\\n..."}`), so what must follow the grammar is the string's
decoded text, while the model writes its JSON-escaped form. `in_json_string` rewrites the
grammar to the escaped language (each terminal of the text becomes its escaped spelling), so a
forced call is generated to it with llguidance, as a JSON schema's arguments are.

| grammar piece             | rewritten as                                                   |
|---------------------------|----------------------------------------------------------------|
| rule names                | prefixed: two tools' grammars never collide                    |
| terminal names (`LF`)     | rule names (prefix + `t_lf`): a terminal's regex becomes rules |
| `"literal"`               | the literal's JSON-escaped text                                |
| `/regex/`                 | a rule expression over the escaped text, one lexeme a character|
|                           | (`.`: any escaped character but LF's `\\n`; a class by member)|
| `%import common.LF` (...) | the escaped terminal's rule                                    |

A grammar using what the rewrite does not know (lookarounds, backreferences, anchors, counted
repeats, `%ignore`, `%override`, flags) raises LarkStringError: the call then keeps a plain
string argument.
"""

from __future__ import annotations

import json
import re

ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b",
           "\f": "\\f"}  # fmt: skip
COMMON = {  # llguidance's and Lark's `common` terminals that grammars import, as plain text
    "LF": '"\\n"',
    "CR": '"\\r"',
    "NEWLINE": "/(\\r?\\n)+/",
    "WS_INLINE": "/[ \\t]+/",
    "WS": "/[ \\t\\f\\r\\n]+/",
    "DIGIT": "/[0-9]/",
    "INT": "/[0-9]+/",
    "LETTER": "/[A-Za-z]/",
    "WORD": "/[A-Za-z]+/",
}
# The grammar's tokens: comments, strings, regexes, names, directives, the rest one by one.
TOKEN = re.compile(
    r'(?P<comment>//[^\n]*|#[^\n]*)|(?P<string>"(?:\\.|[^"\\])*"i?)'
    r"|(?P<regex>/(?:\\.|[^/\\\n])+/[imsx]*)|(?P<name>[?!]?[_A-Za-z][_A-Za-z0-9.]*)"
    r"|(?P<directive>%[a-z]+[^\n]*)|(?P<space>\s+)|(?P<other>.)"
)


class LarkStringError(ValueError):
    """The grammar uses what the rewrite does not handle."""


def escape_text(text: str) -> str:
    """The text as JSON writes it inside a string (json.dumps, without the quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def in_json_string(grammar: str, prefix: str) -> tuple[str, str]:
    """(the rewritten grammar's rules, the name of its start rule). Raises LarkStringError."""
    out: list[str] = []
    for match in TOKEN.finditer(grammar):
        kind, text = match.lastgroup, match.group()
        if kind == "comment":
            continue
        if kind == "string":
            out.append(_literal(text))
        elif kind == "regex":
            out.append(_regex(text))
        elif kind == "name":
            out.append(_name(text, prefix))
        elif kind == "directive":
            out.append(_directive(text, prefix))
        else:
            out.append(text)
    return "".join(out), prefix + "start"


def _name(text: str, prefix: str) -> str:
    """A rule's name prefixed, after its sigils (`?`, `!`, leading `_`); a terminal's becomes a
    rule's (`prefix` + "t_" + its name in lower case)."""
    bare = text.lstrip("?!_")
    sigils = text[: len(text) - len(bare)]
    if "." in bare:
        raise LarkStringError(f"a dotted name outside %import: {bare}")
    if bare[:1].isupper():  # a terminal: a rule here (its regexes become rule expressions)
        return sigils.replace("_", "") + prefix + "t_" + bare.lower()
    return sigils + prefix + bare


def _directive(text: str, prefix: str) -> str:
    parts = text.split()
    if parts[0] != "%import" or len(parts) != 2 or not parts[1].startswith("common."):
        raise LarkStringError(f"unsupported directive: {text.strip()}")
    name = parts[1].removeprefix("common.")
    if name not in COMMON:
        raise LarkStringError(f"unsupported import: {parts[1]}")
    value = COMMON[name]
    rewritten = _literal(value) if value.startswith('"') else _regex(value)
    return f"{_name(name, prefix)}: {rewritten}"


def _literal(text: str) -> str:
    if text.endswith("i"):
        raise LarkStringError("case-insensitive literals")
    try:
        value = json.loads(text)  # Lark's escapes are JSON's for what grammars write
    except json.JSONDecodeError as exc:
        raise LarkStringError(f"a literal JSON cannot read: {text}") from exc
    return json.dumps(escape_text(value))


# An atom of a rewritten regex: one escaped character, as alternatives each a single-character
# regex ("regex") or an escape's fixed text ("text"). Pieces between atoms: ( ) | * + ?.
Atom = tuple[tuple[str, str], ...]
Piece = Atom | str
DOT: Atom = (("regex", r'[^"\\\x00-\x1f]'), ("regex", r'\\["\\/bfrt]'),
             ("regex", r"\\u[0-9a-fA-F]{4}"))  # fmt: skip
SPACE: Atom = (
    ("regex", r"[^\S\x00-\x1f]"),
    *(("text", escape_text(c)) for c in "\t\n\r\f\v\x1c\x1d\x1e\x1f"),
)


def _char(c: str) -> Atom:
    spelled = escape_text(c)
    return (("text", spelled),) if len(spelled) > 1 else (("regex", re.escape(c)),)


def _regex(text: str) -> str:
    """A /regex/ terminal as a Lark expression over the escaped text. One lexeme per escaped
    character: a terminal spanning several would have to be cut where an escape begins, and
    llguidance's lexer does not go back (`/(.+)/` then `"\\n"` dead-ends at the backslash)."""
    body, _, flags = text[1:].rpartition("/")
    if flags:
        raise LarkStringError(f"regex flags: {flags}")
    return "(" + " ".join(_lark(piece) for piece in _pieces(body)) + ")"


def _lark(piece: Piece) -> str:
    if isinstance(piece, str):
        return piece
    alternatives = [
        json.dumps(text) if kind == "text" else "/" + text.replace("/", "\\/") + "/"
        for kind, text in piece
    ]
    return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"


def _rewrite(regex: str) -> str:
    """The regex of the escaped text (what `_regex`'s expression matches), for tests."""

    def render(piece: Piece) -> str:
        if isinstance(piece, str):
            return "(?:" if piece == "(" else piece
        options = [re.escape(text) if kind == "text" else text for kind, text in piece]
        return "(?:" + "|".join(options) + ")"

    return "".join(render(piece) for piece in _pieces(regex))


def _pieces(regex: str) -> list[Piece]:
    """A regex over text as atoms and operators over its JSON-escaped spelling."""
    out: list[Piece] = []
    i = 0
    while i < len(regex):
        c = regex[i]
        if c == ".":
            out.append(DOT)
        elif c == "\\":
            i += 1
            out.append(_escaped_atom(regex[i]))
        elif c == "[":
            end, members, negated = _class(regex, i)
            out.append(_class_atom(members, negated))
            i = end
        elif c == "(":
            if regex.startswith("(?", i) and not regex.startswith("(?:", i):
                raise LarkStringError("lookarounds, named groups and inline flags")
            out.append("(")
            i += 2 if regex.startswith("(?:", i) else 0
        elif c in ")|*+?":
            if c == "?" and out and out[-1] in ("*", "+", "?"):
                i += 1  # a lazy quantifier: the language is the same
                continue
            out.append(c)
        elif c in "{^$":
            raise LarkStringError(f"{c!r} in a regex (counted repeats, anchors)")
        else:
            out.append(_char(c))
        i += 1
    return out


def _escaped_atom(c: str) -> Atom:
    # \d and \w: no member needs escaping; \s: the controls among its members are escaped
    if c in "dw":
        return (("regex", "\\" + c),)
    if c == "s":
        return SPACE
    if c in "DWSbB0123456789":
        raise LarkStringError(f"\\{c} in a regex")
    return _char({"n": "\n", "r": "\r", "t": "\t", "f": "\f"}.get(c, c))


def _class(regex: str, i: int) -> tuple[int, set[str], bool]:
    """The characters of the class opening at regex[i] (ranges expanded, within ASCII), where
    it closes, and whether it is negated."""
    j = i + 1
    negated = regex.startswith("^", j)
    j += negated
    chars: list[str] = []
    while j < len(regex) and (regex[j] != "]" or j == i + 1 + negated):
        c = regex[j]
        if c == "\\":
            j += 1
            c = {"n": "\n", "r": "\r", "t": "\t", "f": "\f"}.get(regex[j], regex[j])
            if regex[j] in "dwsDWS":
                raise LarkStringError(f"\\{regex[j]} inside a class")
        chars.append(c)
        j += 1
    if j >= len(regex):
        raise LarkStringError("an unclosed class")
    members: set[str] = set()
    k = 0
    while k < len(chars):
        if k + 2 < len(chars) and chars[k + 1] == "-":
            lo, hi = ord(chars[k]), ord(chars[k + 2])
            if hi > 127:
                raise LarkStringError("a class range beyond ASCII")
            members |= {chr(x) for x in range(lo, hi + 1)}
            k += 3
        else:
            members.add(chars[k])
            k += 1
    return j, members, negated


def _class_atom(members: set[str], negated: bool) -> Atom:
    """One escaped character of the class: plain members as a class, the rest as escapes."""
    specials = set(ESCAPES) | {chr(x) for x in range(32)}
    escaped = specials - members if negated else members & specials
    texts = tuple(("text", escape_text(c)) for c in sorted(escaped))
    plain = "".join(re.escape(c) for c in sorted(members - specials))
    if negated:
        return (("regex", f'[^"\\\\\\x00-\\x1f{plain}]'), *texts)
    return ((("regex", f"[{plain}]"),) if plain else ()) + texts or (("regex", "[^\\s\\S]"),)
