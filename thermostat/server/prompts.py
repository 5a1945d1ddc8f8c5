"""Prompts from request bodies: chat messages through the model's chat template, completion
prompts as text or token ids. Every prompt leaves here as token ids.

Chat: `apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=False)`
(an assistant message's tool calls with their `arguments` parsed from JSON, unless the template
joins them to strings with `+`, as DeepSeek's do: it gets the JSON text), then encoded
WITHOUT special tokens (the template already wrote them). Completions: text is encoded with the
tokenizer's special tokens (a BOS where the model has one), as the engine does for text.

Before anything is rendered or tokenized: a chat role must be one of OpenAI's (the template then
decides whether it accepts the conversation), and a text longer than the context could hold is
refused. No token of the vocabulary is longer than `max_token_chars` characters, so a text of
more than `max_model_len * max_token_chars` characters cannot fit: refusing it costs nothing,
where tokenizing a megabyte of text raises the process's memory for good (the allocator keeps
what the tokenizer took).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from thermostat.api.errors import APIError
from thermostat.api.protocol import ChatMessage


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    text: str | None = None  # as sent, when sent as text (echo returns it verbatim)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """An upper bound on the characters one token decodes to: its vocabulary entry's length
    (byte-level and SentencePiece entries spell a character with at least one symbol)."""
    return max(len(piece) for piece in tokenizer.get_vocab())


class PromptBuilder:
    """Turns messages or completion prompts into token ids; bad ones raise a 400 APIError."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max_token_chars(tokenizer)

    def check_length(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise APIError(
                400,
                f"{param}: {chars} characters cannot fit this model's context length of "
                f"{self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def chat_text(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[Any, Any]] | None = None,
    ) -> str:
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages", code="empty")
        for i, message in enumerate(messages):
            if message.role not in CHAT_ROLES:
                raise APIError(
                    400,
                    f"messages[{i}].role: {message.role!r} is not a chat role (one of "
                    f"{', '.join(CHAT_ROLES)})",
                    param="messages",
                    code="invalid_role",
                )
        if self.tokenizer.chat_template is None:
            raise APIError(
                400,
                "this model has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        parse = not JOINS_ARGUMENTS.search(str(self.tokenizer.chat_template))
        rendered = [_message_dict(i, m, parse) for i, m in enumerate(messages)]
        functions: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if tools is None else [*tools]
        )
        self.check_length(sum(len(m["content"]) for m in rendered), "messages")
        try:
            # ignore: transformers types the result as a union; with tokenize=False it is a str
            return self.tokenizer.apply_chat_template(  # type: ignore[return-value]
                rendered,
                tools=functions,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as exc:  # jinja raises for messages the template refuses
            raise APIError(
                400, f"messages: the chat template refused them: {exc}", param="messages"
            ) from exc

    def chat(
        self, messages: list[ChatMessage], tools: list[dict[Any, Any]] | None = None
    ) -> Prompt:
        text = self.chat_text(messages, tools=tools)
        return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)

    def completion(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
        """One Prompt per prompt of the request (a batch is a list of them)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            batch: list[Any] = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty")
        prompts = []
        for item in batch:
            if not item:
                raise APIError(400, "prompt must not be empty", param="prompt", code="empty")
            if isinstance(item, str):
                self.check_length(len(item), "prompt")
                prompts.append(Prompt(self.tokenizer.encode(item, add_special_tokens=True), item))
            else:
                prompts.append(Prompt(list(item)))
        return prompts


# a template that joins a call's arguments to a string: `... + tool['function']['arguments']`
JOINS_ARGUMENTS = re.compile(r"""\+\s*[\w.'"\[\]]*arguments['"]?\]?\s*\+""")


def _message_dict(index: int, message: ChatMessage, parse: bool = True) -> dict[str, Any]:
    """The template's view of a message: content as a string, extra keys kept; `parse`: tool
    calls' arguments as a mapping."""
    data = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                    param="messages",
                )
            texts.append(part.text)
        data["content"] = "".join(texts)
    elif content is None:
        data["content"] = ""
    calls = data.get("tool_calls")
    if parse and isinstance(calls, list):  # templates read arguments as a mapping (as vLLM)
        data["tool_calls"] = [_template_call(call) for call in calls]
    return data


def _template_call(call: Any) -> Any:
    """An assistant message's tool call with its JSON `arguments` text parsed."""
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return call | {"function": function | {"arguments": arguments}}
    return call
