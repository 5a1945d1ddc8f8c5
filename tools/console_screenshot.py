"""Make docs/console.png, the console page's screenshot (docs/console.md): `thermostat serve` on
the demo model, 100 s of mixed traffic from a few clients (40% greedy, which loops), the
10-minute window and a "Check now", in Debian's Chromium.

    .venv/bin/python tools/console_screenshot.py [OUT.png]
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tools.chromium import launch  # noqa: E402

PROMPTS = ["The king", "Enter HAMLET", "My lord,", "What say you", "O, ", "First Citizen:"]
CLIENTS = ["aider/0.86.0", "opencode/1.18", "OpenAI/Python 1.99.0", "curl/7.88.1"]


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "console.png"
    port = 18555
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "thermostat.cli", "serve", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rng = random.Random(0)
        end = time.time() + 100
        while time.time() < end:
            body: dict = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.choice([40, 80, 120])}
            if rng.random() < 0.4:
                body["temperature"] = 0
            elif rng.random() < 0.5:
                body["temperature"] = 0.7
            headers = {"User-Agent": rng.choice(CLIENTS)}
            httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
            time.sleep(rng.random() * 0.8)
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1400, "height": 1500}, color_scheme="light")
            page.goto(url + "/console")
            page.wait_for_selector("#requests-table tbody tr")
            page.select_option("#window", "600")
            page.click("#check-now")
            page.wait_for_selector("#check-result [data-verdict]", timeout=120_000)
            time.sleep(2.5)  # one more refresh
            page.screenshot(path=str(out))
            browser.close()
    finally:
        server.terminate()
        server.wait()
    print(out)


if __name__ == "__main__":
    main()
