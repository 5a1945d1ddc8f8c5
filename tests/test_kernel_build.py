"""The kernels' build cache: one key per distinct build, and `python -m thermostat.kernels`
(what tools/setup.sh runs) says in one line whether they are built, found or off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from thermostat.kernels import build

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(
    source=b"int f() { return 1; }",
    torch_version="2.13.0+cpu",
    python_tag="cpython-311",
    build_flags=["-O3", "-march=native"],
    cpu_isa_flags={"avx512f", "avx512_bf16"},
)


def test_cache_key_is_stable_and_ignores_cpu_flag_order():
    key = build.cache_key(**BASE)
    assert len(key) == 16 and int(key, 16) >= 0
    assert build.cache_key(**BASE) == key
    assert build.cache_key(**{**BASE, "cpu_isa_flags": ["avx512_bf16", "avx512f"]}) == key


@pytest.mark.parametrize(
    "change",
    [
        {"source": b"int f() { return 2; }"},
        {"torch_version": "2.13.1+cpu"},
        {"python_tag": "cpython-312"},
        {"build_flags": ["-O2", "-march=native"]},
        {"build_flags": ["-march=native", "-O3"]},
        {"cpu_isa_flags": {"avx512f", "avx512_bf16", "amx_tile"}},
    ],
)
def test_cache_key_changes_with_each_input(change):
    assert build.cache_key(**{**BASE, **change}) != build.cache_key(**BASE)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("THERMOSTAT_KERNEL_CACHE", str(tmp_path))
    assert build.module_path("k").parent == tmp_path / "k"
    monkeypatch.delenv("THERMOSTAT_KERNEL_CACHE")
    assert build.cache_root() == Path.home() / ".cache" / "thermostat" / "kernels"


def setup_command(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "thermostat.kernels"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_setup_command_when_off_says_so_and_succeeds(tmp_path):
    proc = setup_command(THERMOSTAT_KERNELS="0", THERMOSTAT_KERNEL_CACHE=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "CPU kernels off: THERMOSTAT_KERNELS=0\n"
    assert list(tmp_path.iterdir()) == []


def test_setup_command_finds_a_build_without_compiling():
    if build.unavailable_reason() is not None:
        pytest.skip(f"CPU kernels off: {build.unavailable_reason()}")
    from thermostat import kernels

    assert kernels.ops() is not None, kernels.status()  # builds here if nothing had
    proc = setup_command()
    assert proc.returncode == 0, proc.stderr
    path = build.module_path(build.this_key())
    assert proc.stdout == f"CPU kernels already built at {path}\n"
