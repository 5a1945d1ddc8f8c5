"""The bundled demo model: a real checkpoint that writes words, loops under greedy decoding,
and serves with no arguments."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import hf_greedy
from tests.server_utils import running_server
from tests.test_server_lifecycle import free_port
from thermostat import LLM, SamplingParams
from thermostat.cli import main
from thermostat.commands.diagnose import DEFAULT_PROMPTS
from thermostat.engine.loader import DEMO_MODEL_DIR

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The king looked out over the hall and said", "ROMEO.", "My lord, I have news"]


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM("demo", dtype="float32", stop_on_loop=False)


def test_demo_greedy_equals_transformers(demo):
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    for prompt, out in zip(PROMPTS, demo.generate(PROMPTS, params), strict=True):
        assert out.token_ids == hf_greedy(hf, demo.tokenizer.encode(prompt), 24)
        assert sum(c.isalpha() for c in out.text) > len(out.text) / 2  # words, not noise


def test_demo_generation_config_carries_the_generic_values_of_the_case(demo):
    out = demo.generate("ROMEO.", SamplingParams(max_tokens=4))[0]
    assert out.sampling["source"]["temperature"] == "generation_config"
    assert out.sampling["effective"]["temperature"] == 1.0
    assert out.sampling["effective"]["top_p"] == 1.0


def test_stop_on_loop_ends_greedy_loops_early():
    llm = LLM("demo", stop_on_loop=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=300))
    looped = [o for o in outs if o.completions[0].stop_reason == "loop"]
    assert looped, [o.text[-80:] for o in outs]
    for o in looped:
        assert o.finish_reason == "stop" and len(o.token_ids) < 300


def test_diagnose_names_greedy_decoding(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    # diagnose's own eight prompts and the demo's: on four alone, greedy's loops (1 of 8 after
    # 2026-12-07's attention rounding, 4 of 8 before) were too few to tell from chance
    extra = [*PROMPTS[1:], "It was late in the evening when"]
    prompts.write_text("\n".join(DEFAULT_PROMPTS + extra) + "\n")
    code = main(
        [
            "diagnose",
            "--model",
            "demo",
            "--prompts",
            str(prompts),
            "--max-tokens",
            "200",
            "--weights",
            "int8",
        ]
    )  # fmt: skip  (int8 weights: the case's cause survives quantization, and int8 is exercised)
    out = capsys.readouterr().out
    assert code == 1
    assert "cause: greedy decoding" in " ".join(out.split())


def test_serve_with_no_arguments_uses_the_demo_model():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "thermostat.cli", "serve", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, ready = time.monotonic() + 120, False
        while not ready and time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                time.sleep(0.2)
        assert ready
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] == "demo"
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["sampling"]["source"]["temperature"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def test_server_stops_a_greedy_loop_and_reports_it(caplog):
    caplog.set_level(logging.INFO, logger="thermostat.requests")
    with running_server(DEMO_MODEL_DIR, stop_on_loop=True) as server:
        messages = [{"role": "user", "content": "My lord, I have news from the north."}]
        r = server.client().chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=300
        )
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == "loop"
    assert r.usage.completion_tokens < 300
    assert r.quality["degenerate"] and "loop" in r.quality["flags"]
    assert "ends in a loop" in r.quality["reasons"][0]
    assert 'thermostat_degenerate_responses_total{reason="loop"} 1.0' in metrics
    lines = [json.loads(x.getMessage()) for x in caplog.records if x.name == "thermostat.requests"]
    assert lines[-1]["degenerate"] == [r.quality["flags"]]


def test_llm_chat_is_the_servers_chat():
    """`LLM.chat` renders messages as /v1/chat/completions does: the same greedy text, and the
    same `sampling`; one conversation or a list of them."""
    from thermostat import LLM, SamplingParams

    messages = [{"role": "user", "content": "My lord, I have news."}]
    llm = LLM("demo")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    (out,) = llm.chat(messages, params)
    with running_server(DEMO_MODEL_DIR) as server:
        r = server.client().chat.completions.create(
            model=server.model, messages=messages, temperature=0, max_tokens=12
        )
    assert out.text == r.choices[0].message.content
    assert out.sampling == r.sampling
    again = llm.chat([messages, messages + [{"role": "assistant", "content": "Speak."}]], params)
    assert again[0].text == out.text and len(again) == 2
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}])
