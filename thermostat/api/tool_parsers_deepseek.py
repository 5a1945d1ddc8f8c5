"""DeepSeek's tool-call formats (tool_parsers.py's table, continued), and which one a DeepSeek
checkpoint writes. Markers are spelled with U+FF5C (｜) and U+2581 (▁).

| parser         | checkpoints                    | a call as the model writes it        |
|----------------|--------------------------------|--------------------------------------|
| `deepseek_v3`  | V2.5, V3, V3-0324, R1, R1-0528 | `B function S N\\n```json\\n{...}\\n```E` |
| `deepseek_v31` | V3.1, V3.1-Terminus, V3.2-Exp  | `B N S {...} E`                       |
| `deepseek_v32` | V3.2                           | DSML, block `function_calls`         |
| `deepseek_v4`  | V4                             | DSML, block `tool_calls`             |

(B, S, E: `<｜tool▁call▁begin｜>`, `<｜tool▁sep｜>`, `<｜tool▁call▁end｜>`, written without
spaces; DSML: tool_dsml.py.)

In V3 and V3.1 the calls stand between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`,
right after the content; V3 joins two calls with a newline, V3.1 with nothing. All five
markers are added (not special) tokens of their tokenizers (ids 128806-128809 and 128814); the
forced call's grammar writes them as those tokens. Arguments are the model's JSON text. Sources:
the chat templates in the checkpoints' tokenizer_config.json (V3's writes `tool['type']`,
always "function", before the separator and fences the arguments; V3.1's writes the name
alone, and its model card gives the same form for the tool prompt).

Which one: the chat template's own writing of a call decides (the separator followed by a
```json fence: V3; the separator alone: V3.1; DSML: V3.2's `function_calls` block or V4's
`tool_calls` one), else the family's default (`DEEPSEEK_FAMILIES`: V3.2 and V4 ship no Jinja
template, their prompt encoders are Python; V3.2-Exp ships V3.1's template).
"""

from __future__ import annotations

import json
from typing import ClassVar

from thermostat.api.tool_base import ToolParser, split_at
from thermostat.api.tool_json import CallSoFar, skip_ws

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```json"
DSML = "｜DSML｜"

# config.json model_type -> the parser of its family when the chat template does not tell
DEEPSEEK_FAMILIES = {
    "deepseek_v2": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
}
# config.json architectures[0] -> model_type, for a config without model_type
DEEPSEEK_ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}


def deepseek_parser(default: str, template: str | None) -> str:
    """The parser of a DeepSeek checkpoint: the format its chat template writes, else
    `default` (its family's)."""
    if template:
        if DSML in template:
            return "deepseek_v32" if "function_calls" in template else "deepseek_v4"
        if SEP in template:
            return "deepseek_v3" if FENCE in template else "deepseek_v31"
    return default


def hold(text: str, marker: str) -> str:
    """`text` less its longest tail that could begin `marker` (held until it does or not)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class DeepSeekParser(ToolParser):
    """V3's and V3.1's shared reading: a call's header (`head`) up to its arguments, the
    arguments up to `<｜tool▁call▁end｜>` less the format's `TAIL`."""

    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    JOIN: ClassVar[str]  # between two calls
    TAIL: ClassVar[str]  # after the arguments, before <｜tool▁call▁end｜>

    def start(self, text: str) -> tuple[str, int | None]:
        return split_at(text, CALLS_BEGIN)

    def head(self, text: str, i: int) -> tuple[str | None, int | None]:
        """From `text[i]` (past `<｜tool▁call▁begin｜>`): the name once whole, and where the
        arguments begin (None while the header is not whole)."""
        raise NotImplementedError

    def calls_from(self, text: str, i: int) -> tuple[list[CallSoFar], int, int]:
        calls: list[CallSoFar] = []
        resume = i
        while (begin := text.find(CALL_BEGIN, i)) >= 0:
            name, args = self.head(text, begin + len(CALL_BEGIN))
            call = CallSoFar(name)
            if args is None:
                return [*calls, call], resume, len(calls)
            close = text.find(CALL_END, args)
            if close < 0:  # arguments so far: never shrink as the text grows
                call.arguments = hold(text[args:], self.TAIL + CALL_END).rstrip()
                return [*calls, call], resume, len(calls)
            call.arguments = text[args:close].rstrip().removesuffix(self.TAIL.strip()).rstrip()
            call.complete = parses(call.arguments)
            calls.append(call)
            i = resume = close + len(CALL_END)
        return calls, resume, len(calls)

    def frame(self, call: str, parallel: bool) -> str:
        join = f"{json.dumps(self.JOIN)} " if self.JOIN else ""
        more = f" ({join}tool_call)*" if parallel else ""
        begin, end = self.lit(CALLS_BEGIN), self.lit(CALLS_END)
        one = f"{self.lit(CALL_BEGIN)} ({call}) {self.lit(CALL_END)}"
        return f"start: {begin} tool_call{more} {end}\ntool_call: {one}"


class DeepSeekV3Parser(DeepSeekParser):
    name = "deepseek_v3"
    JOIN = "\n"
    TAIL = "\n```"

    def head(self, text: str, i: int) -> tuple[str | None, int | None]:
        sep = text.find(SEP, i)
        newline = text.find("\n", sep + len(SEP)) if sep >= 0 else -1
        if newline < 0:
            return None, None
        name, rest = text[sep + len(SEP) : newline].strip(), text[newline + 1 :]
        if FENCE.startswith(rest) and len(rest) < len(FENCE):
            return name, None  # the fence is not whole yet
        args = newline + 1 + (len(FENCE) if rest.startswith(FENCE) else 0)
        return name, skip_ws(text, args)

    def call_rule(self, name: str, args: str) -> str:
        head = json.dumps(f"{name}\n{FENCE}\n")
        return f'"function" {self.lit(SEP)} {head} {args} {json.dumps(self.TAIL)}'


class DeepSeekV31Parser(DeepSeekParser):
    name = "deepseek_v31"
    JOIN = ""
    TAIL = ""

    def head(self, text: str, i: int) -> tuple[str | None, int | None]:
        sep = text.find(SEP, i)
        if sep < 0:
            return None, None
        return text[i:sep].strip(), skip_ws(text, sep + len(SEP))

    def call_rule(self, name: str, args: str) -> str:
        return f"{json.dumps(name)} {self.lit(SEP)} {args}"
