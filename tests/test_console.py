"""The console (issue 21): its memory of traffic (pure), its routes, and the page itself in a real
browser: Debian's Chromium driven by Playwright (tools/setup.sh installs both; nothing here is
skipped when they are missing). Screenshots land in build/screenshots/."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_utils import running_server
from tests.waiting import HANG_GUARD_S
from thermostat.api.traffic import BUCKET_S, RECENT, WINDOW_S, Traffic, percentile
from thermostat.engine.loader import DEMO_MODEL_DIR
from tools.chromium import CHROMIUM, launch

SCREENSHOTS = Path(__file__).resolve().parent.parent / "build" / "screenshots"
GUARD_MS = HANG_GUARD_S * 1000
# Greedy decoding of this prompt loops on the demo model (the case in one request).
# a prompt that is itself a loop: greedy decoding carries it on whatever the CPU's rounding (a
# free prompt's greedy text loops too, but after how many tokens varies between kernel builds)
LOOPING = {
    "prompt": "[Enter a Messenger.]\n\n[Enter a Messenger.]\n\n",
    "temperature": 0,
    "max_tokens": 120,
}


# --- the traffic memory, with a clock of our own ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_series_buckets_counts_and_percentiles() -> None:
    clock = Clock()
    traffic = Traffic(clock=clock)
    traffic.on_admitted("request", greedy=True)
    traffic.on_admitted("generation_config", greedy=False)
    traffic.on_tokens(30)
    for ttft in (0.3, 0.1, 0.2):
        traffic.on_first_token(ttft)
    traffic.on_degenerate(["loop", "repetitive"])
    traffic.sample_kv(0.25)
    clock.now += BUCKET_S
    traffic.on_admitted("request", greedy=True)

    s = traffic.series()
    assert len(s["time"]) == WINDOW_S // BUCKET_S and s["time"][-1] == int(clock.now)
    assert s["requests_per_min"]["request"][-2:] == [6.0, 6.0]  # one per 10 s = 6 per minute
    assert s["requests_per_min"]["generation_config"][-2:] == [6.0, 0.0]
    assert s["greedy_share"][-2:] == [0.5, 1.0] and s["greedy_share"][0] is None
    assert s["degenerate_per_min"] == {
        "loop": [0.0] * 358 + [6.0, 0.0],
        "repetitive": [0.0] * 358 + [6.0, 0.0],
    }
    assert s["tokens_per_s"][-2] == 3.0
    assert (s["ttft_p50_s"][-2], s["ttft_p95_s"][-2], s["ttft_p50_s"][-1]) == (0.2, 0.3, None)
    assert s["kv_usage"][-2:] == [0.25, None]
    assert s["totals"] == {"requests": 3, "greedy": 2, "degenerate": 2, "tokens": 30}

    clock.now += WINDOW_S  # an hour later the window is empty
    assert traffic.series()["totals"] == {"requests": 0, "greedy": 0, "degenerate": 0, "tokens": 0}


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.95) == 1.0
    values = [float(i) for i in range(101)]
    assert (percentile(values, 0.5), percentile(values, 0.95)) == (50.0, 95.0)


def record(traffic: Traffic, **changes: Any) -> Any:
    fields: dict[str, Any] = dict(
        request_id="cmpl-1",
        endpoint="completions",
        client="ua",
        status="ok",
        sampling={"effective": {"temperature": 0.0}, "source": {"temperature": "request"}},
        quality={"degenerate": False},
        finish_reasons=["length"],
        prompt_tokens=2,
        completion_tokens=3,
        ttft_s=0.1,
        latency_s=0.2,
        text=["secret"],
    )
    return traffic.record(**(fields | changes))


def test_recent_requests_are_bounded_and_keep_text_only_when_asked() -> None:
    traffic = Traffic()
    for _ in range(RECENT + 5):
        record(traffic)
    assert len(traffic.recent) == RECENT
    assert traffic.find(1) is None and traffic.find(RECENT + 5) is not None
    assert [r["id"] for r in traffic.rows(after=RECENT + 3)] == [RECENT + 4, RECENT + 5]
    assert traffic.recent[-1].text is None  # not kept by default
    row = traffic.rows()[-1]
    assert row["greedy"] and not row["degenerate"]
    assert row["sampling"]["temperature"] == {"value": 0.0, "source": "request"}
    assert row["sampling"]["top_p"] == {"value": None, "source": None}

    keeping = Traffic(keep_text=True)
    assert record(keeping).text == ["secret"]


# --- the routes ---------------------------------------------------------------------------------


def test_console_routes_behind_the_key_and_refusals() -> None:
    with running_server(DEMO_MODEL_DIR, api_key="k3y") as server:
        url, key = server.url, {"Authorization": "Bearer k3y"}
        root = httpx.get(url + "/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/console"
        page = httpx.get(url + "/console")  # the page is open: it holds no data
        assert page.status_code == 200 and "Thermostat console" in page.text
        js = httpx.get(url + "/console/assets/uPlot.iife.min.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        for bad in ("nope.js", "..%2Fconsole.py", "uPlot.LICENSE"):
            assert httpx.get(url + "/console/assets/" + bad).status_code == 404
        assert httpx.get(url + "/v1/console/state").status_code == 401
        state = httpx.get(url + "/v1/console/state", headers=key)
        assert state.status_code == 200
        assert (
            state.json()["defaults"] == httpx.get(url + "/v1/sampling/defaults", headers=key).json()
        )
        missing = httpx.get(url + "/v1/console/requests/99", headers=key)
        assert missing.status_code == 404 and "not among the last" in missing.text
        for bad in ({"cells": 3}, "not json"):
            diag = httpx.post(url + "/v1/console/diagnose", headers=key, content=json.dumps(bad))
            assert diag.status_code == 400, diag.text
        diag = httpx.post(url + "/v1/console/diagnose", headers=key, content=b"{")
        assert diag.status_code == 400, diag.text
        assert httpx.get(url + "/v1/console/state", headers=key).json()["diagnose"] is None


def test_no_console_turns_it_off() -> None:
    with running_server(DEMO_MODEL_DIR, console=False) as server:
        assert httpx.get(server.url + "/console").status_code == 404
        assert httpx.get(server.url + "/v1/console/state").status_code == 404


# --- the page in a real browser -----------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert shutil.which(CHROMIUM) or Path(CHROMIUM).is_file(), (
        f"no Chromium at {CHROMIUM}: run tools/setup.sh (installs Debian's chromium)"
    )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


def open_console(
    browser: Any, url: str, viewport: dict[str, int] | None = None, **context: Any
) -> tuple[Any, list[str]]:
    """A new page on the console, and the list its console errors and page errors go to."""
    page = browser.new_page(viewport=viewport or {"width": 1400, "height": 1600}, **context)
    page.set_default_timeout(GUARD_MS)
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    return page, errors


def defaults_table(page: Any) -> dict[str, tuple[str, str]]:
    rows = page.locator("#defaults-table tbody tr")
    out = {}
    for i in range(rows.count()):
        row = rows.nth(i)
        out[row.get_attribute("data-param")] = (
            row.locator("td.value").inner_text(),
            row.locator("td.source").inner_text(),
        )
    return out


def shown(value: Any) -> str:
    """How the page prints a value (JavaScript's String())."""
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_page_shows_defaults_traffic_and_requests(browser: Any) -> None:
    with running_server(DEMO_MODEL_DIR, console_keep_text=True) as server:
        page, errors = open_console(browser, server.url)
        page.wait_for_selector("#defaults-table tbody tr")
        reported = httpx.get(server.url + "/v1/sampling/defaults").json()
        table = defaults_table(page)
        assert table == {
            name: (shown(value), shown(reported["source"].get(name)))
            for name, value in reported["effective"].items()
        } | {"max_tokens": ("prompt's room", "context_length")}  # as the startup table says
        assert reported["effective"]["max_tokens"] is None
        warnings = page.locator("#warnings li").all_inner_texts()
        assert warnings == reported["warnings"] and "generic" in warnings[0]
        assert page.locator("#facts").inner_text().count("demo") >= 1

        client = server.client()
        looped = client.completions.create(model="demo", **LOOPING)
        assert looped.model_extra["quality"]["degenerate"]  # the precondition of this test
        sampled = client.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8, seed=1
        )
        page.wait_for_function("document.querySelectorAll('#requests-table tbody tr').length === 2")
        page.wait_for_function(
            "document.querySelector('[data-total=requests] b').textContent === '2'"
        )
        totals = page.locator("#totals").inner_text()
        assert "1 (50%)" in totals and "greedy" in totals  # one greedy of two
        assert page.locator("[data-total=degenerate] b").inner_text() == "1"
        assert page.locator("#plot-requests canvas").count() == 1
        legend = page.locator("#plot-degenerate .u-legend").inner_text()
        assert "loop" in legend  # the detector that fired is a series of its own
        plotted = "state.plots['plot-requests'].data"
        total = f"{plotted}.slice(1).flat().reduce((a, b) => a + b, 0)"
        points = page.evaluate(f"[{plotted}[0].length, {plotted}.length - 1, {total}]")
        assert points == [WINDOW_S // BUCKET_S, 2, 12]  # two sources, 6 per minute each
        page.select_option("#window", "600")
        page.wait_for_function(f"{plotted}[0].length === {600 // BUCKET_S}")

        rows = page.locator("#requests-table tbody tr")
        newest, oldest = rows.nth(0), rows.nth(1)
        assert newest.get_attribute("data-greedy") == "false" and "chat" in newest.inner_text()
        assert oldest.get_attribute("data-degenerate") == "true"
        assert "DEGENERATE" in oldest.inner_text() and "(greedy)" in oldest.inner_text()
        assert "python" in newest.inner_text().lower()  # the openai client's User-Agent

        page.check("#only-degenerate")
        assert rows.count() == 1 and rows.nth(0).get_attribute("data-degenerate") == "true"
        page.uncheck("#only-degenerate")
        page.check("#only-greedy")
        assert rows.count() == 1 and rows.nth(0).get_attribute("data-greedy") == "true"
        page.uncheck("#only-greedy")
        assert rows.count() == 2

        rows.nth(0).click()
        page.wait_for_selector("#detail[open]")
        detail = json.loads(page.locator("#detail-sampling").inner_text())
        assert detail == sampled.model_extra["sampling"]
        assert page.locator("#detail-text").inner_text() == sampled.choices[0].message.content
        page.click("#detail-close")

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "console-light.png"), full_page=True)
        page.emulate_media(color_scheme="dark")
        page.evaluate("localStorage.clear()")
        page.reload()
        page.wait_for_function("document.querySelectorAll('#requests-table tbody tr').length === 2")
        assert page.evaluate("document.documentElement.dataset.theme") == "dark"
        page.screenshot(path=str(SCREENSHOTS / "console-dark.png"), full_page=True)
        assert errors == []


@pytest.mark.parametrize(
    ("defaults", "verdict"), [("temperature=0", "fail"), ("recommended", "pass")]
)
def test_check_now_verdict(browser: Any, defaults: str, verdict: str) -> None:
    """A greedy-by-default server fails `verify`'s checks; the family's recommendation passes."""
    from thermostat.sampling.spec import parse_sampling_spec

    with running_server(DEMO_MODEL_DIR, sampling_defaults=parse_sampling_spec(defaults)) as s:
        page, errors = open_console(browser, s.url)
        page.click("#check-now")
        result = page.wait_for_selector("#check-result [data-verdict]")
        assert result.get_attribute("data-verdict") == verdict
        checks = page.locator("#check-result .check-table").inner_text()
        assert "default-sampling" in checks
        if verdict == "fail":
            assert "FAIL" in page.locator("#check-result").inner_text()
        assert errors == []


def test_api_key_page_shows_nothing_until_the_key(browser: Any) -> None:
    with running_server(DEMO_MODEL_DIR, api_key="s3cret") as server:
        page, _ = open_console(browser, server.url)  # 401s are console errors: expected here
        page.wait_for_selector("#key-panel:not([hidden])")
        assert page.locator("#main").is_hidden()
        page.fill("#key-input", "wrong")
        page.click("#key-form button")
        page.wait_for_function("document.querySelector('#key-error').textContent.includes('401')")
        assert page.locator("#main").is_hidden()
        page.fill("#key-input", "s3cret")
        page.click("#key-form button")
        page.wait_for_selector("#main:not([hidden])")
        page.wait_for_selector("#defaults-table tbody tr")
        assert page.evaluate("sessionStorage.getItem('thermostat.apiKey')") == "s3cret"


def test_gateway_page_shows_its_upstream(browser: Any) -> None:
    from tests.test_gateway import running_gateway

    with (
        running_server(DEMO_MODEL_DIR) as upstream,
        running_gateway(upstream.url, sampling_defaults={"temperature": 0.7}) as url,
    ):
        page, errors = open_console(browser, url)
        page.wait_for_selector("#defaults-table tbody tr")
        facts = page.locator("#facts").inner_text()
        assert "thermostat gateway" in facts and upstream.url in facts and "thermostat" in facts
        assert defaults_table(page)["temperature"] == ("0.7", "operator")
        assert "no engine" in page.locator("#kv-caption").inner_text()
        httpx.post(f"{url}/v1/completions", json={"prompt": "The king", "max_tokens": 8})
        page.wait_for_function("document.querySelectorAll('#requests-table tbody tr').length === 1")
        assert errors == []
