#!/usr/bin/env bash
# Create .venv and install Thermostat with its test extras. torch is pinned to the CPU build
# (2.13.0); nothing here may pull another torch.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test]'
