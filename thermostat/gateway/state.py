"""What the gateway holds, and its lifecycle (api/lifecycle.py): ready once the upstream
answered discovery, failed if its defaults cannot apply (a bad `recommended`).

While the upstream does not answer, discovery is retried and /health answers 503; once ready,
an upstream that goes down is a 502 per request, not a change of status. /health asks the
upstream again (its /health; /v1/models for an `openai` kind), at most once per HEALTH_TTL_S:
503 `upstream_down` while it does not answer 200, 200 again once it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from thermostat.api.errors import APIError
from thermostat.api.lifecycle import Lifecycle
from thermostat.gateway.config import GatewayConfig
from thermostat.gateway.defaults import GatewayDefaults
from thermostat.gateway.discovery import UpstreamInfo, discover
from thermostat.gateway.metrics import GatewayMetrics
from thermostat.gateway.upstream import Upstream
from thermostat.sampling.generation_config import read_generation_config

log = logging.getLogger("thermostat.gateway")

HEALTH_TTL_S = 1.5  # an upstream check answers /health for this long
HEALTH_TIMEOUT_S = 2.0  # the longest an upstream check waits


class GatewayState(Lifecycle):
    def __init__(self, config: GatewayConfig) -> None:
        super().__init__(log)
        self.config = config
        self.metrics = GatewayMetrics()
        self.metrics.set_queue_limit(config.max_queue)
        self.upstream = Upstream(
            config.upstream, config.upstream_api_key, config.upstream_timeout_s
        )
        self.defaults: GatewayDefaults  # set once ready
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._health: tuple[float, bool] = (-HEALTH_TTL_S, True)  # (checked at, answered)
        self._health_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Any) -> AsyncIterator[None]:
        self._task = asyncio.create_task(self._discover())
        try:
            yield
        finally:
            self.begin_draining()
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            await self.drain()
            await self.upstream.close()

    async def _discover(self) -> None:
        cfg = self.config
        warned = False
        while True:
            try:
                info = await discover(self.upstream, cfg.upstream_kind)
                break
            except APIError as err:
                if not warned:
                    log.warning("upstream %s: %s; retrying", cfg.upstream, err.info.message)
                    warned = True
                await asyncio.sleep(cfg.discovery_retry_s)
        self._from_flags(info)
        try:
            self.defaults = GatewayDefaults.build(info, cfg.sampling_defaults, cfg.policy)
        except ValueError as exc:
            self.fail("sampling defaults cannot apply: %s; exiting", exc)
            return
        self.report()
        self.mark_ready()

    def _from_flags(self, info: UpstreamInfo) -> None:
        """--generation-config / --model beat what the upstream said."""
        path = self.config.generation_config
        if path is None:
            return
        info.generation_config = read_generation_config(path)
        config_json = (path if path.is_dir() else path.parent) / "config.json"
        if config_json.is_file():
            info.model_config = json.loads(config_json.read_text())
        info.notes.insert(0, f"generation_config.json from {path} (flag)")

    def report(self) -> None:
        """The startup report: what the gateway knows, each default with its source."""
        d = self.defaults
        log.info("upstream %s: kind %s, model %r", self.config.upstream, d.info.kind, d.info.model)
        for note in d.info.notes:
            log.info("upstream: %s", note)
        findings = d.findings()
        self.report_defaults(d.render_table(), [text for _, text in findings])
        self.metrics.describe_defaults(d.to_dict(), [kind for kind, _ in findings])

    async def upstream_alive(self) -> bool:
        """The upstream answered its health check, as of at most HEALTH_TTL_S ago."""
        async with self._health_lock:  # concurrent /health calls share one check
            checked, alive = self._health
            if time.monotonic() - checked >= HEALTH_TTL_S:
                path = "/v1/models" if self.defaults.kind.name == "openai" else "/health"
                alive = await self.upstream.alive(path, HEALTH_TIMEOUT_S)
                self._health = (time.monotonic(), alive)
            return alive

    def serving_line(self) -> str:
        return f"gateway to {self.config.upstream}"

    def console_facts(self) -> dict[str, Any]:
        checked, alive = self._health
        ready = self.status in ("ready", "draining")
        return {
            "server": "thermostat gateway",
            "upstream": self.config.upstream,
            "upstream kind": self.defaults.info.kind if ready else "not discovered yet",
            "model": self.defaults.info.model if ready else None,
            "upstream health": "never checked"
            if checked < 0
            else f"{'answering' if alive else 'NOT answering'} "
            f"(checked {time.monotonic() - checked:.0f} s ago)",
            "context length": self.defaults.info.context_len if ready else None,
            "requests in flight": self.in_flight,
            "max queue": self.config.max_queue,
            "what it learned": list(self.defaults.info.notes) if ready else [],
        }

    def console_defaults(self) -> dict[str, Any]:
        return self.defaults.to_dict()

    def console_sample(self) -> None:
        """No engine here: nothing to sample."""

    @contextlib.contextmanager
    def admitted(self) -> Any:
        """One request in flight (drain waits for it); 503 at --max-queue."""
        limit = self.config.max_queue
        if limit is not None and self.in_flight >= limit:
            raise APIError(
                503,
                f"the gateway has {self.in_flight} requests in flight (--max-queue); retry",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        self.in_flight += 1
        self.metrics.running.set(self.in_flight)
        self._idle.clear()
        start = time.monotonic()
        try:
            yield start
        finally:
            self.in_flight -= 1
            self.metrics.running.set(self.in_flight)
            if self.in_flight == 0:
                self._idle.set()

    async def drain(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        if self.in_flight:
            log.warning("drain timed out with %d requests in flight", self.in_flight)
