"""The console page as a person uses it in Chromium (issue 41): a window narrower than the tests'
usual 1400 px, and a page left open while the server behind its address is restarted. Debian's
Chromium under Playwright, as in tests/test_console.py (whose `browser` fixture this uses)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import httpx

from tests import test_console
from tests.server_utils import running_server
from tests.test_console import LOOPING
from tests.test_gateway import running_gateway
from tests.waiting import HANG_GUARD_S
from thermostat.engine.loader import DEMO_MODEL_DIR

browser = test_console.browser  # its Chromium fixture, module-scoped here too
HALF_SCREEN = {"width": 960, "height": 900}  # a browser window beside a terminal on 1920 px
STATE = "/v1/console/state"
ROWS = "#requests-table tbody tr"
HI = [{"role": "user", "content": "hi"}]


def listed(page: Any) -> list[dict[str, Any]]:
    """The list's rows as shown: id, verdict (the second column), endpoint and where the verdict
    is on the screen."""
    return page.evaluate(
        """[...document.querySelectorAll('#requests-table tbody tr')].map((tr) => {
          const box = tr.cells[1].getBoundingClientRect();
          return {id: tr.dataset.id, verdict: tr.cells[1].innerText,
                  endpoint: tr.cells[2].innerText, left: box.left, right: box.right};
        })"""
    )


def test_degenerate_only_shows_the_degenerate_requests_marked_in_a_narrow_window(
    browser: Any,
) -> None:
    """The filter always kept the right rows, but the verdict was the last of eleven columns,
    ten of them unwrapped: below ~1150 px it was past the window's right edge, so the rows the
    filter kept showed nothing degenerate. Now it is the second column and the table scrolls."""
    with running_server(DEMO_MODEL_DIR) as server:
        assert httpx.get(server.url + "/console").headers["cache-control"] == "no-cache"
        client = server.client()
        client.completions.create(model="demo", **LOOPING)  # degenerate, whole and streamed
        list(client.completions.create(model="demo", stream=True, **LOOPING))
        client.chat.completions.create(model="demo", messages=HI, max_tokens=8, seed=1)
        list(client.chat.completions.create(model="demo", messages=HI, max_tokens=8, stream=True))
        rows = httpx.get(server.url + "/v1/console/state").json()["requests"]
        degenerate = {str(r["id"]) for r in rows if r["degenerate"]}
        assert 0 < len(degenerate) < len(rows), rows  # the precondition: both kinds listed

        page, errors = test_console.open_console(browser, server.url, HALF_SCREEN)
        page.wait_for_function(f"document.querySelectorAll('{ROWS}').length === {len(rows)}")
        page.check("#only-degenerate")
        shown = listed(page)
        assert {r["id"] for r in shown} == degenerate
        count = page.locator("#requests-count").inner_text()
        assert count == f"({len(degenerate)} shown of the last {len(rows)})"
        for row in shown:  # marked, and the mark is on the screen
            assert row["verdict"].startswith("DEGENERATE: ends in a loop"), row
            assert row["left"] >= 0 and row["right"] <= HALF_SCREEN["width"], row
        assert page.evaluate("document.documentElement.scrollWidth") <= HALF_SCREEN["width"]
        page.uncheck("#only-degenerate")
        assert len(listed(page)) == len(rows)
        assert errors == []


def test_a_request_through_a_restarted_gateway_shows_within_the_pages_refresh(
    browser: Any,
) -> None:
    """The list asked for ids above the last it had; a gateway restarted on the same address
    counts from 1 again, so its requests stayed hidden while the page said `ready`. The state
    names its process (`instance`); a page that finds another one starts its list over."""
    with running_server(DEMO_MODEL_DIR) as upstream:
        with running_gateway(upstream.url) as url:
            page, errors = test_console.open_console(browser, url, {"width": 1400, "height": 1000})
            for _ in range(3):
                httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 4})
            body = {"model": upstream.model, "max_tokens": 4, "messages": HI}
            assert httpx.post(f"{url}/v1/messages", json=body).status_code == 200
            page.wait_for_function(f"document.querySelectorAll('{ROWS}').length === 4")
            assert listed(page)[0]["endpoint"] == "messages"  # as serve lists the agents' APIs
        polls: list[str] = []  # the page's state answers, counted rather than timed
        page.on("response", lambda r: polls.append(r.url) if STATE in r.url else None)
        with running_gateway(upstream.url, port=urlsplit(url).port) as again:
            assert again == url
            sent = {"model": upstream.model, "messages": HI, "max_tokens": 4}
            answer = httpx.post(f"{url}/v1/chat/completions", json=sent, timeout=HANG_GUARD_S)
            assert answer.status_code == 200
            before = len(polls)
            page.wait_for_function(f"document.querySelectorAll('{ROWS}').length === 1")
            # shown by the first refresh after the answer (one more may land while this looks)
            assert len(polls) - before <= 2, polls[before:]
        assert [r["endpoint"] for r in listed(page)] == ["chat"]
        assert page.locator("#requests-count").inner_text() == "(1 shown of the last 1)"
        # while the gateway was down, Chromium logs each failed poll (the page says so itself)
        assert [e for e in errors if not e.startswith("Failed to load resource")] == []
