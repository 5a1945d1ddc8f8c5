"""Debian's Chromium under Playwright, as the console's tests, its benchmark and its screenshot
use it: as root on a machine with no network, so no sandbox and none of Chromium's own
connections (Playwright's own browser downloads cannot be fetched here; tools/setup.sh installs
Debian's chromium)."""

from __future__ import annotations

import os
from typing import Any

CHROMIUM = os.environ.get("THERMOSTAT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def launch(playwright: Any) -> Any:
    """A headless Chromium browser from a `sync_playwright()` context."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
