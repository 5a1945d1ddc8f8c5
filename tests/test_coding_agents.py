"""The real coding agents against a real server: Codex CLI 0.171.0 (OpenAI's Responses API) and
Claude Code 2.1.197 (Anthropic's Messages API), the versions pinned in tools/agents/package.json
and installed by tools/setup.sh into tools/agents/node_modules (missing, they fail the tests).
Each runs a non-interactive turn ("say hi"), then a second one in the same conversation (the
history replayed), and must exit 0 while the server answers every request it sent with a 2xx:
the HTTP statuses (`thermostat_requests_total`), the errors inside a stream that went out as a
200 (`thermostat_server_errors_total`) and the request log ("thermostat.requests": every job
"ok", no refusal) are read around each run. Every request names the served model (the server
answers any other name with a 404): Codex's config and Claude Code's --model and background
model (ANTHROPIC_SMALL_FAST_MODEL) say it.

The model is tests/tool_models.py's Qwen3 (`<tool_call>` markers as added tokens) with a 32k
context: with the test tokenizer Codex's first request is 17.6k tokens and Claude Code's 10.8k
(the test chat template leaves the tools out of the prompt). A random model's answers run to
hundreds or thousands of tokens before EOS (or a greedy loop) ends them, tens of seconds on two
cores, so two hidden dimensions, which no layer writes, carry what the tests need: a constant
that makes EOS likely after every token (about 0.2: answers of a few tokens) but the generation
prompt's last one (no answer is empty), and one that keeps the tool markers and the ids past the
tokenizer out of the answers. The silent model answers nothing, ever: an empty answer, which
real models give too.

A turn in which the agent runs a tool is not tested: a random model cannot be made to call one
from the client (neither agent sends `tool_choice`), short of scripting the call in the weights.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from tests.server_utils import running_server
from tests.tool_models import tool_tokenizer
from thermostat.random_model import write_model

AGENTS = Path(__file__).resolve().parent.parent / "tools" / "agents"
CONTEXT = 32768  # tokens; Codex's first request is 17.6k with the test tokenizer
KV_GB = 32 * 2**-10  # 32 MiB: 64k tokens of this model (512 B/token), two whole contexts
AGENT_TIMEOUT_S = 120
SETTLE_S = 10  # how long the server may take to count a request once its client has exited
CONSTANT = 20.0  # the two hidden dimensions' value (the others' are about 0.2 to 2)
STOP_LOGIT = 1.5  # EOS's head weight on dimension 0: P(EOS) about 0.2 (2e-7 after the prompt)
NEVER_LOGIT = 8.0  # minus the markers' weight on dimension 1: P < 1e-8 for each
CATALOG_MODEL = "gpt-5.5"  # a model Codex 0.171.0 knows
CODEX_ERROR = "ERROR"  # what Codex's log lines on stderr say when a stream is off


def write_agent_model(path: Path, silent: bool = False) -> Path:
    """write_tool_model's Qwen3 with a CONTEXT-token context (its lm_head untied) that answers
    a few random tokens, never none and never a tool marker; `silent`: none, always. No layer
    writes hidden dimensions 0 and 1, so they hold what the embedding puts there: dimension 0
    is CONSTANT after every token but the generation prompt's last one (-3 CONSTANT there), and
    only EOS reads it from the head; dimension 1 is CONSTANT, read by the tool markers and the
    ids past the tokenizer as a large negative logit."""
    write_model(path, "qwen3", max_position_embeddings=CONTEXT, tie_word_embeddings=False)
    tokenizer = tool_tokenizer("hermes", "added")
    tokenizer.save_pretrained(path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    last = tokenizer(prompt, add_special_tokens=False).input_ids[-1]
    config = json.loads((path / "config.json").read_text())
    never = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    never += list(range(len(tokenizer), config["vocab_size"]))
    weights = load_file(path / "model.safetensors")
    for layer in range(config["num_hidden_layers"]):
        weights[f"model.layers.{layer}.self_attn.o_proj.weight"][:2] = 0
        weights[f"model.layers.{layer}.mlp.down_proj.weight"][:2] = 0
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embed[:, :2] = CONSTANT
    head[:, :2] = 0
    eos = config["eos_token_id"]
    if silent:
        head[eos, 0] = NEVER_LOGIT  # P(EOS) 1 - 1e-12 after every token
    else:
        embed[last, 0] = -3 * CONSTANT
        head[eos, 0] = STOP_LOGIT
    head[never, 1] = -NEVER_LOGIT
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def agent(name: str, package: str) -> Path:
    """The installed agent's executable, at the version tools/agents/package.json pins."""
    pinned = json.loads((AGENTS / "package.json").read_text())["dependencies"][package]
    manifest = AGENTS / "node_modules" / package / "package.json"
    executable = AGENTS / "node_modules" / ".bin" / name
    setup = "run tools/setup.sh (npm ci --prefix tools/agents) to install the coding agents"
    if not executable.exists() or not manifest.exists():
        pytest.fail(f"{name} ({package} {pinned}) is not installed in {AGENTS}: {setup}")
    installed = json.loads(manifest.read_text())["version"]
    if installed != pinned:
        pytest.fail(f"{package} {installed} is installed, tools/agents pins {pinned}: {setup}")
    if name == "codex" and shutil.which("node") is None:
        pytest.fail(f"codex needs Node.js (node on PATH): {setup}")
    return executable


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory) -> Path:
    return write_agent_model(tmp_path_factory.mktemp("agent-model"))


@pytest.fixture(scope="module")
def server(agent_model):
    with running_server(agent_model, max_model_len=CONTEXT, kv_cache_memory_gb=KV_GB) as s:
        yield s


@pytest.fixture(scope="module")
def catalog_server(agent_model):
    """The model served as a model of Codex's catalog (`codex debug models --bundled`)."""
    options = dict(max_model_len=CONTEXT, kv_cache_memory_gb=KV_GB)
    with running_server(agent_model, served_model_name=CATALOG_MODEL, **options) as s:
        yield s


@pytest.fixture(scope="module")
def silent_server(tmp_path_factory):
    path = write_agent_model(tmp_path_factory.mktemp("silent-model"), silent=True)
    with running_server(path, max_model_len=CONTEXT, kv_cache_memory_gb=KV_GB) as s:
        yield s


# ---- what the server saw ----


def counters(url: str) -> tuple[Counter[tuple[str, str]], float, float]:
    """HTTP requests by (endpoint, status), server errors, and the requests the engine holds."""
    requests: Counter[tuple[str, str]] = Counter()
    server_errors = held = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "thermostat_requests_total":
                requests[sample.labels["endpoint"], sample.labels["status"]] += sample.value
            elif sample.name == "thermostat_server_errors_total":
                server_errors += sample.value
            elif sample.name in ("thermostat_requests_running", "thermostat_requests_waiting"):
                held += sample.value
    return requests, server_errors, held


@dataclass
class Seen:
    """What a server answered while an agent ran."""

    requests: Counter[tuple[str, str]]  # (endpoint, status) -> count, GET /metrics left out
    server_errors: float
    log: list[dict]  # the request log's lines

    def bad(self) -> list[str]:
        statuses = [f"{n:g} x {e} {s}" for (e, s), n in self.requests.items() if int(s) >= 400]
        lines = [json.dumps(x) for x in self.log if x.get("status") != "ok"]
        errors = [f"thermostat_server_errors_total +{self.server_errors:g}"]
        return statuses + lines + (errors if self.server_errors else [])

    def describe(self) -> str:
        requests = ", ".join(f"{n:g} x {e} {s}" for (e, s), n in sorted(self.requests.items()))
        keys = ("endpoint", "path", "status", "error", "prompt_tokens", "completion_tokens")
        log = "\n".join(json.dumps({k: x[k] for k in keys if k in x}) for x in self.log)
        return f"requests: {requests}\nrequest log:\n{log}"


class Watch:
    """The server's counters and request log around an agent's run."""

    def __init__(self, url: str, caplog: pytest.LogCaptureFixture) -> None:
        self.url, self.caplog = url, caplog
        caplog.set_level(logging.INFO, logger="thermostat.requests")
        self.before = counters(url)
        self.first_record = len(caplog.records)

    def seen(self) -> Seen:
        """Once the server has counted what the agent sent: the counters stay the same between
        two reads and the engine holds no request (within SETTLE_S)."""
        deadline = time.monotonic() + SETTLE_S
        last = counters(self.url)
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = counters(self.url)
            settled = now[2] == 0 and _without_metrics(now[0]) == _without_metrics(last[0])
            last = now
            if settled:
                break
        requests = _without_metrics(last[0]) - _without_metrics(self.before[0])
        records = self.caplog.records[self.first_record :]
        log = [json.loads(r.getMessage()) for r in records if r.name == "thermostat.requests"]
        return Seen(requests, last[1] - self.before[1], log)


def _without_metrics(requests: Counter[tuple[str, str]]) -> Counter[tuple[str, str]]:
    return Counter({k: v for k, v in requests.items() if k[0] != "/metrics"})


# ---- running an agent ----


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without the agents' own settings, HOME in the test's directory."""
    own = ("ANTHROPIC_", "CLAUDE_", "CODEX_", "OPENAI_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(own)}
    home.mkdir(parents=True, exist_ok=True)
    return env | {"HOME": str(home)} | extra


def run_agent(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run an agent to its end (stdin empty), in its own process group, killed as a whole after
    AGENT_TIMEOUT_S (Codex's node wrapper starts the real binary as a child)."""
    cwd.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=AGENT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{command[0]} ran past {AGENT_TIMEOUT_S} s\n"
            f"stdout: {out[-2000:]}\nstderr: {err[-4000:]}"
        )
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def codex(server, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`codex exec ARGS` with a provider at the server (Responses API), no retries."""
    executable = agent("codex", "@openai/codex")
    home = tmp_path / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f"model = {json.dumps(server.model)}\n"
        'model_provider = "thermostat"\n'
        "\n"
        "[model_providers.thermostat]\n"
        'name = "thermostat"\n'
        f"base_url = {json.dumps(server.url + '/v1')}\n"
        'wire_api = "responses"\n'
        'env_key = "THERMOSTAT_API_KEY"\n'
        "request_max_retries = 0\n"
        "stream_max_retries = 0\n"
    )
    env = agent_env(tmp_path / "home", CODEX_HOME=str(home), THERMOSTAT_API_KEY="unused")
    command = [str(executable), "exec", "--skip-git-repo-check", *args]
    return run_agent(command, tmp_path / "work", env)


def claude(server, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`claude -p ARGS` at the server (Messages API); its background model (titles) is the
    served one too, and it sends no telemetry."""
    executable = agent("claude", "@anthropic-ai/claude-code")
    env = agent_env(
        tmp_path / "home",
        ANTHROPIC_BASE_URL=server.url,
        ANTHROPIC_API_KEY="unused",
        # the background model: ANTHROPIC_SMALL_FAST_MODEL, else (2.1.197) the main model or
        # the Haiku one, which ANTHROPIC_DEFAULT_HAIKU_MODEL names
        ANTHROPIC_SMALL_FAST_MODEL=server.model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=server.model,
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )
    command = [str(executable), "--model", server.model, "-p", *args]
    return run_agent(command, tmp_path / "work", env)


def check(proc: subprocess.CompletedProcess, seen: Seen, endpoint: str) -> None:
    """The agent exited 0, the server answered `endpoint` at least once and nothing with an
    error."""
    report = f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-4000:]}\n{seen.describe()}"
    assert proc.returncode == 0, f"{proc.args[0]} exited {proc.returncode}\n{report}"
    assert not seen.bad(), "the server answered errors:\n" + "\n".join(seen.bad()) + "\n" + report
    assert seen.requests[endpoint, "200"] >= 1, f"no {endpoint} answered 200\n{report}"
    jobs = {x["endpoint"] for x in seen.log if "endpoint" in x}
    assert jobs == {endpoint.removeprefix("/v1/")}, report


def codex_errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if CODEX_ERROR in line]


def session(proc: subprocess.CompletedProcess) -> str:
    """The session id Codex's banner names."""
    found = re.search(r"^session id: (\S+)$", proc.stderr, re.MULTILINE)
    assert found, proc.stderr[-4000:]
    return found[1]


def prompt_tokens(seen: Seen) -> int:
    return max(x["prompt_tokens"] for x in seen.log)


# ---- the agents ----


def test_codex_exec_says_hi_and_resumes(server, tmp_path, caplog):
    """A turn, then the session resumed: the second request replays the first answer (Codex
    stores nothing on the server: `store: false`, the history echoed with its item ids)."""
    watch = Watch(server.url, caplog)
    first = codex(server, tmp_path, "say hi")
    check(first, watch.seen(), "/v1/responses")
    assert not codex_errors(first), first.stderr[-4000:]
    watch = Watch(server.url, caplog)
    second = codex(server, tmp_path, "resume", "--last", "say it again")
    seen = watch.seen()
    check(second, seen, "/v1/responses")
    assert not codex_errors(second), second.stderr[-4000:]
    assert session(second) == session(first), second.stderr[-4000:]  # resumed, not a new one


def test_claude_print_says_hi_and_continues(server, tmp_path, caplog):
    """A turn (after its probe, HEAD /), then the conversation continued (`--continue`): the
    second request replays the first answer."""
    watch = Watch(server.url, caplog)
    first = claude(server, tmp_path, "say hi")
    before = watch.seen()
    check(first, before, "/v1/messages")
    watch = Watch(server.url, caplog)
    second = claude(server, tmp_path, "--continue", "say it again")
    seen = watch.seen()
    check(second, seen, "/v1/messages")
    # the history is replayed: the first answer and the roles' markers around it (a new
    # conversation's prompt would be about as long as the first: "say it again" for "say hi")
    assert prompt_tokens(seen) > prompt_tokens(before) + 10, seen.describe()


def test_codex_sends_a_catalog_models_request(catalog_server, tmp_path, caplog):
    """For a model of its catalog Codex sends another request: the apply_patch tool as a custom
    tool with a Lark grammar, tool_search, web_search with content types, that model's developer
    prompt (23.7k tokens here), a reasoning effort and a text verbosity."""
    watch = Watch(catalog_server.url, caplog)
    proc = codex(catalog_server, tmp_path, "say hi")
    check(proc, watch.seen(), "/v1/responses")
    assert "Model metadata" not in proc.stderr  # Codex knew the model
    assert not codex_errors(proc), proc.stderr[-4000:]


def test_codex_takes_an_empty_answer(silent_server, tmp_path, caplog):
    """An empty answer is an empty message item, added before its (absent) text: Codex logged
    'OutputTextDelta without active item' when the stream sent a delta first."""
    watch = Watch(silent_server.url, caplog)
    proc = codex(silent_server, tmp_path, "say hi")
    check(proc, watch.seen(), "/v1/responses")
    assert not codex_errors(proc), proc.stderr[-4000:]


def test_claude_takes_an_empty_answer(silent_server, tmp_path, caplog):
    """Claude Code takes an empty answer (it sends one more request after it)."""
    watch = Watch(silent_server.url, caplog)
    proc = claude(silent_server, tmp_path, "say hi")
    check(proc, watch.seen(), "/v1/messages")
