"""Tiny random models whose tokenizers hold their family's tool-call markers as the real ones do:
Qwen's `<tool_call>` / `</tool_call>` as added, non-special tokens; Llama 3's `<|python_tag|>`
and Mistral's `[TOOL_CALLS]` as special tokens; the demo model's as plain text."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

from thermostat.api.tool_parsers_deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    DSML,
    SEP,
)
from thermostat.random_model import build_tokenizer, write_model

DEEPSEEK_V3 = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]
MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>"],
    "llama3_json": ["<|python_tag|>"],
    "mistral": ["[TOOL_CALLS]"],
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v31": DEEPSEEK_V3,
    "deepseek_v32": [DSML],
    "deepseek_v4": [DSML],
}
# family -> (random_model kind, parser, how its tokenizer holds the markers)
FAMILIES = {
    "qwen3": ("qwen3", "hermes", "added"),
    "llama": ("llama", "llama3_json", "special"),
    "mistral": ("mistral", "mistral", "special"),
    "deepseek_v3": ("deepseek_v3", "deepseek_v3", "added"),
    "deepseek_v31": ("deepseek_v3", "deepseek_v31", "added"),
    "deepseek_v4": ("deepseek_v4", "deepseek_v4", "added"),
}
# The tool tests generate hundreds of tokens: V4 at two layers (a CSA and an HCA one) is enough.
SMALLER = {
    "deepseek_v4": {
        "num_hidden_layers": 2,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
    }
}
# Chat templates shaped like DeepSeek's (V3's and V3.1's tokenizer_config.json): a call written
# by string concatenation (`+`, its arguments as a string), from which the parser is told.
# V4 ships no Jinja template (its encoder is Python): its parser comes from model_type.
DEEPSEEK_CALLS = {
    "deepseek_v3": f"'{CALL_BEGIN}' + t['type'] + '{SEP}' + t['function']['name'] + '\\n```json"
    f"\\n' + t['function']['arguments'] + '\\n```{CALL_END}'",
    "deepseek_v31": f"'{CALL_BEGIN}' + t['function']['name'] + '{SEP}' + t['function']['arguments']"
    f" + '{CALL_END}'",
}
DEEPSEEK_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] }}"
    f"{{% if m['tool_calls'] %}}{{{{ '{CALLS_BEGIN}' }}}}{{% for t in m['tool_calls'] %}}"
    "{{ CALL }}{% endfor %}"
    f"{{{{ '{CALLS_END}' }}}}{{% endif %}}{{{{ '<|endoftext|>' }}}}"
    "{% elif m['role'] == 'tool' %}{{ '<｜tool▁output▁begin｜>' + m['content'] + "
    "'<｜tool▁output▁end｜>' }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def tool_tokenizer(parser: str, markers: str) -> PreTrainedTokenizerFast:
    """The test tokenizer with `parser`'s markers as `markers`: "plain" (text only), "added"
    (added, not special) or "special" tokens."""
    tokenizer = build_tokenizer()
    if markers != "plain":
        tokenizer.add_tokens(MARKERS[parser], special_tokens=markers == "special")
    return tokenizer


def write_tool_model(path: Path, family: str) -> Path | str:
    """A tiny random model of `family` (a FAMILIES key) with real-shaped markers, or "demo"."""
    if family == "demo":
        return "demo"
    kind, parser, markers = FAMILIES[family]
    write_model(path, kind, **SMALLER.get(kind, {}))
    tokenizer = tool_tokenizer(parser, markers)
    if parser in DEEPSEEK_CALLS:
        tokenizer.chat_template = DEEPSEEK_TEMPLATE.replace("CALL", DEEPSEEK_CALLS[parser])
    tokenizer.save_pretrained(path)
    return path
