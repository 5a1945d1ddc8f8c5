"""`thermostat set-defaults`: edits generation_config.json the way the case study's fix did."""

from __future__ import annotations

import argparse
import json

from thermostat.commands import set_defaults
from thermostat.sampling.generation_config import read_generation_config

CASE_FILE = {
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 1.0,
}


def run(model_dir, *flags: str) -> int:
    parser = argparse.ArgumentParser()
    set_defaults.add_arguments(parser)
    return set_defaults.run(parser.parse_args([str(model_dir), *flags]))


def test_round_trip_keeps_backup_and_other_keys(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(CASE_FILE))
    assert run(tmp_path, "--temperature", "0.6", "--top-p", "0.95") == 0
    after = json.loads((tmp_path / "generation_config.json").read_text())
    assert after == CASE_FILE | {"temperature": 0.6, "top_p": 0.95}
    assert json.loads((tmp_path / "generation_config.json.bak").read_text()) == CASE_FILE
    assert read_generation_config(tmp_path).values == {"temperature": 0.6, "top_p": 0.95}
    assert not list(tmp_path.glob(".generation_config*"))  # no temporary file left behind


def test_refuses_out_of_range_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "generation_config.json").write_text(json.dumps(CASE_FILE))
    assert run(tmp_path, "--temperature", "3") == 2
    assert "temperature" in capsys.readouterr().err
    assert json.loads((tmp_path / "generation_config.json").read_text()) == CASE_FILE
    assert not (tmp_path / "generation_config.json.bak").exists()
    assert run(tmp_path) == 2  # nothing to set


def test_recommended_uses_the_family_table_and_creates_a_missing_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert run(tmp_path, "--recommended", "--top-p", "0.9") == 0
    after = json.loads((tmp_path / "generation_config.json").read_text())
    assert after["temperature"] == 0.6 and after["top_k"] == 20 and after["top_p"] == 0.9
    assert after["do_sample"] is True
    assert not (tmp_path / "generation_config.json.bak").exists()
