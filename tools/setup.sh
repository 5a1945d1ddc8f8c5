#!/usr/bin/env bash
# Create .venv, install Thermostat with its test extras and build its CPU kernels for this
# machine (cached per source, torch, flags and CPU under ~/.cache/thermostat/kernels, so no server
# start compiles; says "off" and succeeds on a CPU without AVX-512 BF16). torch is pinned to the
# CPU build (2.13.0); nothing here may pull another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/python -m thermostat.kernels
