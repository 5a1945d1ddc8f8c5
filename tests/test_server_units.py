"""Server pieces without a running server: the --sampling-defaults parser, the defaults report
and its warnings, the CLI's exit codes and help."""

from __future__ import annotations

import json

import pytest

from tests.conftest import write_model
from thermostat.api.defaults import DefaultsReport
from thermostat.cli import main
from thermostat.sampling import Policy
from thermostat.sampling.spec import SpecError, parse_sampling_spec


def test_spec_pairs_file_and_recommended(tmp_path):
    assert parse_sampling_spec(None) is None
    assert parse_sampling_spec("recommended") == "recommended"
    assert parse_sampling_spec("temperature=0.6, top_p=0.95,top_k=20") == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
    path = tmp_path / "defaults.json"
    path.write_text(json.dumps({"temperature": 0.7, "min_p": 0.05}))
    assert parse_sampling_spec(str(path)) == {"temperature": 0.7, "min_p": 0.05}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("temperature=9", "temperature"),
        ("temperature=hot", "temperature must be a number"),
        ("top_k=0.5", "top_k must be an integer"),
        ("top_p=0", "top_p"),
        ("tempreature=0.5", "unknown sampling field 'tempreature'"),
        ("temperature", "key=value"),
        ("temperature=0.5,temperature=0.6", "twice"),
        ("missing.json", "not found"),
    ],
)
def test_spec_errors_are_clear(spec, match):
    with pytest.raises(SpecError, match=match):
        parse_sampling_spec(spec)


def test_spec_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SpecError, match="JSON object"):
        parse_sampling_spec(str(bad))
    bad.write_text('{"temperature": 7}')
    with pytest.raises(SpecError, match="bad.json: temperature"):
        parse_sampling_spec(str(bad))


def model_files(path, config: dict, generation_config: dict | None):
    """config.json and generation_config.json only: enough for the sampling layers."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def test_defaults_warn_about_greedy_and_do_sample(tmp_path):
    path = model_files(
        tmp_path / "m", {"model_type": "mistral"}, {"temperature": 0.0, "do_sample": False}
    )
    report = DefaultsReport.for_model(path, "m", None, Policy())
    warnings = report.warnings()
    assert any("greedy decoding" in w and "generation_config" in w for w in warnings)
    [do_sample] = [w for w in warnings if "do_sample" in w]
    assert "ignores do_sample" in do_sample and "omitted fields do not become greedy" in do_sample
    assert report.to_dict()["generation_config"]["do_sample"] is False
    assert report.to_dict()["recommended"] is None
    assert "temperature" in report.render_table()


def test_defaults_warn_about_generic_values_only_without_opt_in(tmp_path):
    path = model_files(tmp_path / "d", {"model_type": "deepseek_v3"}, None)
    generic = DefaultsReport.for_model(path, "d", None, Policy()).warnings()
    assert any("generic" in w and "deepseek" in w and "none set" in w for w in generic)
    opted = DefaultsReport.for_model(path, "d", "recommended", Policy())
    assert not opted.warnings()
    assert opted.baseline().effective.temperature == 0.6
    operator = DefaultsReport.for_model(path, "d", {"temperature": 0.5}, Policy())
    assert not any("generic" in w for w in operator.warnings())


def test_defaults_report_ignored_file_values_and_min_temperature(tmp_path):
    path = model_files(tmp_path / "q", {"model_type": "qwen2"}, {"temperature": 0.0, "top_p": 7})
    report = DefaultsReport.for_model(path, "q", None, Policy(min_temperature=0.2))
    body = report.to_dict()
    assert body["effective"]["temperature"] == 0.2
    assert body["adjusted"][0]["policy"] == "min_temperature"
    assert body["generation_config"]["ignored"].keys() == {"top_p"}
    assert any("top_p ignored" in w for w in report.warnings())
    assert not any("greedy decoding" in w for w in report.warnings())  # the policy raised it


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_help_has_examples(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "examples:" in capsys.readouterr().out


def test_serve_refuses_bad_sampling_defaults_with_exit_2(tmp_path, capsys):
    path = model_files(tmp_path / "m", {"model_type": "llama"}, None)
    assert main(["serve", "--model", str(path), "--sampling-defaults", "temperature=9"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["serve", "--model", str(path), "--sampling-defaults", "top_p=1,x=1"]) == 2
    assert "unknown sampling field 'x'" in capsys.readouterr().err
    assert main(["serve", "--model", str(path), "--min-temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_serve_recommended_without_a_known_family_exits_2(tmp_path, capsys):
    path = write_model(tmp_path / "mistral", "mistral")
    assert main(["serve", "--model", str(path), "--sampling-defaults", "recommended"]) == 2
    assert "no published recommendation" in capsys.readouterr().err


def test_serve_without_the_demo_model_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("thermostat.server.app.DEMO_MODEL_DIR", tmp_path / "demo")
    assert main(["serve"]) == 2
    assert "bundled demo model not found" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_json_depth_counts_brackets_outside_strings_only():
    from thermostat.api.body_limits import json_depth_exceeds

    nested = b'{"y": ' + b"[" * 70 + b"]" * 70 + b"}"
    assert json_depth_exceeds(nested, 64) and not json_depth_exceeds(nested, 71)
    assert json_depth_exceeds(b"[" * 100_000, 64)  # unclosed: refused before any parse
    assert json_depth_exceeds(b'{"a":' * 100_000, 64)
    in_strings = json.dumps({"x": ['\\"[[[[{{' * 50] * 100, "y": [[1]] * 100}).encode()
    assert not json_depth_exceeds(in_strings, 64)  # escaped quotes do not end a string


def test_sse_events_keep_line_break_characters_off_the_wire():
    """U+0085, U+2028 and U+2029 are legal raw in JSON strings but split lines in httpx's
    iter_lines: a token made of one must not cut its event in two."""
    import json

    from thermostat.api.responses import sse_event

    data = json.dumps({"text": "a\x85b\u2028c\u2029d"}, ensure_ascii=False)
    event = sse_event(data)
    assert event.startswith("data: ") and event.endswith("\n\n")
    line = event[len("data: ") : -2]
    assert line.splitlines() == [line]
    assert json.loads(line) == {"text": "a\x85b\u2028c\u2029d"}


TRICKY_TEXTS = ["", "w12", "héllo wörld", 'a"b\\c/d', "\n\t\r\x01\x1f\x7f", "😀 é", "a\x85b\u2028"]


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_chunk_templates_write_the_bytes_the_chunk_models_write(text):
    """A streamed token's chunk is written by splicing its text into the model's own JSON
    (ChunkTemplate): byte for byte what model_dump_json writes, for completions and chat, and
    still so (built whole) when the marker shows up elsewhere in the chunk."""
    from thermostat.api.protocol import (
        ChatChunkChoice,
        ChatCompletionChunk,
        CompletionChoice,
        CompletionResponse,
        DeltaMessage,
    )
    from thermostat.api.responses import ChunkTemplate

    def completion(value, model='my "model" ünï'):
        choices = [CompletionChoice(index=3, text=value)]
        return CompletionResponse(choices=choices, id="cmpl-1", created=1796278295, model=model)

    def chat(value):
        choice = ChatChunkChoice(index=0, delta=DeltaMessage(content=value))
        return ChatCompletionChunk(choices=[choice], id="chatcmpl-1", created=1, model="m")

    def marker_named(value):
        return completion(value, model=ChunkTemplate.MARKER)

    for build in (completion, chat, marker_named):
        assert ChunkTemplate(build)(text) == build(text).model_dump_json()
