"""verify and explain, as a user runs them: through `thermostat.cli.main`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import write_model
from tests.server_utils import running_server
from thermostat.cli import COMMANDS, main

CASE_FILE = {"temperature": 0.6, "top_p": 0.95, "eos_token_id": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("cmd"), "llama", generation_config=CASE_FILE)


def test_verify_passes_on_stochastic_defaults(model_dir, capsys):
    with running_server(model_dir) as server:
        code = main(
            ["verify", server.url, "--endpoint", "completions", "--max-tokens", "16", "--json"]
        )
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["default-sampling"]["status"] == "pass"
    assert checks["greedy"]["status"] == "pass" and checks["seed"]["status"] == "pass"
    assert "generation_config" in checks["defaults"]["detail"]
    # a random-weight model writes noise, which may or may not look degenerate; the sampling
    # checks above are what this test is about
    assert code == (1 if checks["degeneration"]["status"] == "fail" else 0)


def test_verify_fails_and_says_greedy_when_defaults_are_greedy(model_dir, capsys):
    with running_server(model_dir, sampling_defaults={"temperature": 0.0}) as server:
        code = main(["verify", server.url, "--endpoint", "completions", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 1
    assert "greedy" in out


def test_verify_unreachable_is_exit_2(capsys):
    assert main(["verify", "http://127.0.0.1:9", "--max-tokens", "4"]) == 2
    assert "cannot verify" in capsys.readouterr().err


def test_explain_offline_table_and_json(model_dir, tmp_path, capsys):
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"temperature": 0, "messages": []}))
    args = ["explain", "--model", str(model_dir), str(request), "--min-temperature", "0.3"]
    assert main([*args, "--json"]) == 0
    sampling = json.loads(capsys.readouterr().out)["sampling"]
    assert sampling["effective"]["temperature"] == 0.3
    assert sampling["source"]["top_p"] == "generation_config"
    assert sampling["adjusted"][0]["policy"] == "min_temperature"
    assert main(args) == 0
    assert "min_temperature" in capsys.readouterr().out
    assert main(["explain", "--model", str(model_dir), str(request), "--greedy", "reject"]) == 1
    request.write_text(json.dumps({"top_p": 5}))
    assert main(["explain", "--model", str(model_dir), str(request)]) == 2


def test_explain_against_a_server(model_dir, tmp_path, capsys):
    request = tmp_path / "req.json"
    request.write_text(json.dumps({"prompt": "hi"}))
    with running_server(model_dir, sampling_defaults={"top_p": 0.5}) as server:
        assert main(["explain", server.url, str(request), "--json"]) == 0
    sampling = json.loads(capsys.readouterr().out)["sampling"]
    assert sampling["source"]["top_p"] == "operator"
    assert sampling["source"]["temperature"] == "generation_config"


def test_a_command_line_imports_its_command_alone():
    """`thermostat serve ...` imports the serve command's module and no other command's (the
    others cost 0.4 s of every start); `thermostat --help` still lists every command."""
    probe = (
        "import sys, contextlib, io\n"
        "from thermostat.cli import COMMANDS, main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    main(sys.argv[1:])\n"
        "print(sorted(n for n, m in COMMANDS.items() if m in sys.modules))\n"
        "print(all(n in out.getvalue() for n in COMMANDS))\n"
    )
    run = [sys.executable, "-c", probe]
    one = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert one.stdout.splitlines()[0] == "['serve']", one.stderr
    every = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    imported, listed = every.stdout.splitlines()[:2]
    assert imported == str(sorted(COMMANDS)) and listed == "True"
