"""The agents' APIs through `thermostat gateway` in front of an upstream that speaks only chat
completions (Thermostat's `serve`, reached by the gateway on /v1/chat/completions and
/tokenize): the same answers as `serve` gives directly, the gateway's own resolution and
policies on them, tool calls, token counts, and Claude Code's max_tokens cut to the upstream's
context; and, opt-in, the same in front of llama.cpp's llama-server, which speaks chat completions
only (THERMOSTAT_LLAMA_SERVER, as tests/test_gateway.py). (In front of a real vLLM:
tests/test_gateway_vllm.py.)"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.server_utils import running_server
from tests.test_agent_apis import MESSAGES_TOOLS, RESPONSES_TOOLS, streamed_response
from tests.test_gateway import (
    GGUF,
    LLAMA_OPT_IN,
    LLAMA_SERVER,
    running_gateway,
    running_llama_server,
)
from tests.tool_models import write_tool_model
from thermostat.sampling import Policy

ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    path = write_tool_model(tmp_path_factory.mktemp("qwen"), "qwen3")
    with running_server(path) as s:
        yield s


@pytest.fixture(scope="module")
def gateway(upstream):
    with running_gateway(upstream.url, policy=Policy(min_temperature=0.1)) as url:
        yield url


def clients(url: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=60),
        anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=60),
    )


def test_the_same_answers_as_serve_with_the_gateways_policy(upstream, gateway):
    """Seeded: the gateway's min_temperature (0.1) is what the upstream runs with, so the
    direct request that sends 0.1 itself gets the same text."""
    via, _ = clients(gateway)
    direct, _ = clients(upstream.url)
    ask = dict(model=upstream.model, input="Hello", max_output_tokens=12,
               extra_body={"seed": 7})  # fmt: skip
    through = via.responses.create(**ask, temperature=0)
    assert through.sampling["effective"]["temperature"] == 0.1
    assert through.sampling["adjusted"][0]["policy"] == "min_temperature"
    assert through.sampling["upstream"]["source"]["temperature"] == "request"  # what it was sent
    assert through.output_text == direct.responses.create(**ask, temperature=0.1).output_text
    streamed, _ = streamed_response(via, **ask, temperature=0)
    assert streamed.output_text == through.output_text
    assert streamed.quality == through.quality


def test_forced_calls_and_a_round_trip_through_the_gateway(upstream, gateway):
    oai, claude = clients(gateway)
    forced = oai.responses.create(
        model=upstream.model, input=ASK, tools=RESPONSES_TOOLS, max_output_tokens=120,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (call,) = forced.output
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city", "unit"}
    ask = dict(model=upstream.model, max_tokens=120, tools=MESSAGES_TOOLS, messages=ASK,
               tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    with claude.messages.stream(**ask) as stream:
        message = stream.get_final_message()
    (use,) = message.content
    assert message.stop_reason == "tool_use" and set(use.input) == {"city", "unit"}
    turn = [
        *ASK,
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny"}]},
    ]  # fmt: skip
    answer = claude.messages.create(model=upstream.model, max_tokens=4, messages=turn,
                                    tools=MESSAGES_TOOLS)  # fmt: skip
    assert answer.usage.output_tokens >= 1 and answer.sampling["effective"]["temperature"] == 1.0


def test_counts_and_claude_codes_max_tokens(upstream, gateway):
    oai, claude = clients(gateway)
    _, direct = clients(upstream.url)
    count = dict(model=upstream.model, messages=ASK, tools=MESSAGES_TOOLS)
    assert (
        claude.messages.count_tokens(**count).input_tokens
        == direct.messages.count_tokens(**count).input_tokens
    )
    assert oai.responses.input_tokens.count(model=upstream.model, input="Hi").input_tokens > 0
    with claude.messages.stream(model=upstream.model, max_tokens=32000, messages=ASK) as stream:
        message = stream.get_final_message()
    (adjusted,) = [a for a in message.sampling["adjusted"] if a["param"] == "max_tokens"]
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    room = upstream.state.max_model_len - prompt
    assert adjusted == {"param": "max_tokens", "requested": 32000, "applied": room,
                        "policy": "context_length"}  # fmt: skip


@pytest.mark.skipif(not LLAMA_SERVER or not GGUF.is_file(), reason=LLAMA_OPT_IN)
def test_in_front_of_llama_server():
    """llama-server has no Responses or Messages API of its own here: the gateway translates,
    counts with its /apply-template and /tokenize, and cuts Claude Code's max_tokens to the room
    its context (-c 1024) leaves."""
    with running_llama_server() as up, running_gateway(up) as url:
        oai, claude = clients(url)
        ask = dict(model="m", input="Once upon a time", max_output_tokens=8, temperature=0)
        whole = oai.responses.create(**ask)
        streamed, _ = streamed_response(oai, **ask)
        message = claude.messages.create(model="m", max_tokens=8, messages=ASK,
                                         extra_body={"temperature": 0})  # fmt: skip
        with claude.messages.stream(model="m", max_tokens=32000, messages=ASK) as stream:
            long = stream.get_final_message()
        counted = claude.messages.count_tokens(model="m", messages=ASK).input_tokens
    assert whole.output_text and streamed.output_text == whole.output_text
    assert whole.sampling["source"]["temperature"] == "request"
    assert whole.sampling["source"]["top_k"] == "upstream"  # llama-server's own default, known
    assert message.content[0].text and message.quality["degenerate"] in (True, False)
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens > 0
    (adjusted,) = [a for a in long.sampling["adjusted"] if a["param"] == "max_tokens"]
    assert adjusted["requested"] == 32000 and adjusted["applied"] == 1024 - counted
