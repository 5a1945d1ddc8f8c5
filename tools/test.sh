#!/usr/bin/env bash
# Lint, format check, type check, the documentation site (strict: broken links and pages left out
# of the navigation fail), then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
.venv/bin/python -m pytest "$@"
