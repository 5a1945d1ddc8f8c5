"""The console: a page that shows what the server applies and what its traffic looks like, on
`serve`, each PD worker and the gateway alike (`--no-console` turns it off).

| route                          | key      | what                                                 |
|--------------------------------|----------|------------------------------------------------------|
| GET /  -> /console             | open     | a redirect                                           |
| GET /console, /console/assets/ | open     | the page and its scripts (package files, no CDN)     |
| GET /v1/console/state          | required | the server's facts and defaults, the last hour's     |
|                                |          | series, the recent requests after `?after=ID` (all   |
|                                |          | of them when `&instance=` names another process),    |
|                                |          | the last check and the last diagnose                 |
| GET /v1/console/requests/{id}  | required | one request's whole `sampling` and `quality`         |
| POST /v1/console/check         | required | runs `thermostat verify`'s checks on this server     |
| POST /v1/console/diagnose      | required | keeps a `thermostat diagnose --json` result to show  |

The page holds no data: everything it shows comes from /v1/console/*, behind `--api-key` like the
rest of the API (the page asks for the key and keeps it in the tab's sessionStorage). These
routes are the page's own, not the OpenAI surface: /openapi.json leaves them out (so the fuzzer
does not spend its budget there; tests/test_console.py sends them bad input). The page and its
assets are sent `Cache-Control: no-cache`: a browser asks again (a 304 when unchanged) instead of
running a cached copy from before an upgrade.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict

from thermostat.api.config import EdgeConfig
from thermostat.api.errors import APIError
from thermostat.api.metrics import Metrics

ASSETS = Path(__file__).with_name("console_assets")
ASSET_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
CHECK_MAX_TOKENS = 32  # per verify request (x4 for its degeneration probe)
REVALIDATE = {"Cache-Control": "no-cache"}


class ConsoleHost(Protocol):
    """What the console reads of an app's state (`serve`'s, a PD worker's, the gateway's)."""

    @property
    def config(self) -> EdgeConfig: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def address(self) -> str | None: ...
    @property
    def status(self) -> str: ...

    def console_facts(self) -> dict[str, Any]:
        """What this server is, for the page's first table: a name for each value."""
        ...

    def console_defaults(self) -> dict[str, Any]:
        """The body of GET /v1/sampling/defaults."""
        ...

    def console_sample(self) -> None:
        """Refresh the gauges the traffic plots (KV usage) from the engine, if there is one."""
        ...


class ConsoleRecords:
    """The last check and the last diagnose the console shows; one check runs at a time."""

    def __init__(self) -> None:
        self.check: dict[str, Any] | None = None
        self.diagnose: dict[str, Any] | None = None
        self.lock = asyncio.Lock()


router = APIRouter()


def _host(request: Request) -> ConsoleHost:
    return request.app.state.thermostat


def _records(request: Request) -> ConsoleRecords:
    return request.app.state.console


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    return RedirectResponse("/console")


@router.get("/console", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(ASSETS / "console.html", media_type="text/html", headers=REVALIDATE)


@router.get("/console/assets/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    path = ASSETS / name
    if "/" in name or path.suffix not in ASSET_TYPES or not path.is_file():
        raise APIError(404, f"no console asset {name!r}", code="not_found")
    return FileResponse(path, media_type=ASSET_TYPES[path.suffix], headers=REVALIDATE)


@router.get("/v1/console/state", include_in_schema=False)
async def state(request: Request, after: int = 0, instance: str | None = None) -> dict[str, Any]:
    """`after`: the last id the caller has; `instance`: of which ring (ids start over in each
    process: a page open across a restart gets the whole list of the new one)."""
    host, records = _host(request), _records(request)
    host.console_sample()
    traffic = host.metrics.traffic
    if instance is not None and instance != traffic.instance:
        after = 0
    return {
        "now": time.time(),
        "status": host.status,
        "instance": traffic.instance,
        "facts": host.console_facts(),
        "defaults": host.console_defaults(),
        "series": traffic.series(),
        "requests": traffic.rows(after),
        "keeps_text": traffic.keep_text,
        "check": records.check,
        "diagnose": records.diagnose,
    }


@router.get("/v1/console/requests/{record_id}", include_in_schema=False)
async def request_detail(request: Request, record_id: int) -> dict[str, Any]:
    record = _host(request).metrics.traffic.find(record_id)
    if record is None:
        raise APIError(
            404,
            f"request {record_id} is not among the last {_host(request).metrics.traffic.size}",
            code="not_found",
        )
    return record.detail()


@router.post("/v1/console/check", include_in_schema=False)
async def check(request: Request) -> dict[str, Any]:
    """`thermostat verify`'s checks, run from this process against its own address."""
    host, records = _host(request), _records(request)
    if records.lock.locked():
        raise APIError(409, "a check is already running; wait for its verdict", code="busy")
    if host.address is None:
        raise APIError(503, "the server is not listening yet", type="server_error")
    async with records.lock:
        records.check = await asyncio.to_thread(
            run_check, _reachable(host.address), host.config.api_key
        )
    return records.check


class DiagnoseResult(BaseModel):
    """`thermostat diagnose --json`'s output (cells as it writes them)."""

    model_config = ConfigDict(extra="allow")
    cause: str
    explanation: str = ""
    cells: list[dict[str, Any]]


@router.post("/v1/console/diagnose", include_in_schema=False)
async def keep_diagnose(result: DiagnoseResult, request: Request) -> dict[str, Any]:
    """Keeps what `thermostat diagnose --url` found (it posts its --json result here)."""
    _records(request).diagnose = result.model_dump() | {"time": time.time()}
    return {"kept": True}


def run_check(url: str, api_key: str | None) -> dict[str, Any]:
    """verify's checks and verdict; an unreachable or broken server is a failed check."""
    from dataclasses import asdict

    import httpx

    from thermostat.quality.server_checks import Client, verify

    start = time.time()
    try:
        client = Client(url, None, api_key, "chat", user_agent="thermostat-console-check")
        checks = [asdict(c) for c in verify(client, CHECK_MAX_TOKENS)]
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError, ValueError) as exc:
        checks = [{"name": "reachable", "status": "fail", "detail": f"{type(exc).__name__}: {exc}"}]
    return {
        "time": start,
        "seconds": round(time.time() - start, 2),
        "healthy": not any(c["status"] == "fail" for c in checks),
        "checks": checks,
    }


def _reachable(address: str) -> str:
    """The server's own address as a client on this host dials it."""
    return address.replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


def install_console(app: FastAPI, config: EdgeConfig) -> None:
    """The console's routes, unless --no-console; the recent requests keep text if asked."""
    app.state.thermostat.metrics.traffic.keep_text = config.console_keep_text
    if config.console:
        app.state.console = ConsoleRecords()
        app.include_router(router)
