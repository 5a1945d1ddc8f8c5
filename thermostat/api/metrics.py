"""Prometheus metrics, in a registry of the app's own (two apps in a process never collide).

Counters carry the `_total` suffix on the wire. Engine gauges are refreshed from the engine
thread's latest stats snapshot at scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from thermostat.api.traffic import Traffic
from thermostat.sampling import Resolution


@dataclass(frozen=True)
class EngineStats:
    """The engine right after a step or a batch of commands (counts are requests / blocks)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks held by requests
    prefix_cache_queries: int = 0  # in blocks, since start
    prefix_cache_hits: int = 0


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Every family the server exports, and the console's `traffic` fed by the same events;
    updated from the event loop only."""

    def __init__(self) -> None:
        self.traffic = Traffic()
        disable_created_metrics()  # no `_created` series: half the output, no information
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "thermostat_requests",
            "HTTP requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "thermostat_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "thermostat_generation_tokens", "Generated tokens", registry=r
        )
        self.ttft = Histogram(
            "thermostat_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "thermostat_inter_token_latency_seconds",
            "Time between generated tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "thermostat_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("thermostat_requests_running", "Requests in the batch", registry=r)
        self.waiting = Gauge("thermostat_requests_waiting", "Requests queued", registry=r)
        self.kv_usage = Gauge(
            "thermostat_kv_cache_usage_ratio", "Fraction of KV blocks held by requests", registry=r
        )
        self.prefix_hit_rate = Gauge(
            "thermostat_prefix_cache_hit_rate",
            "Prefix cache hits / queries, in blocks",
            registry=r,
        )
        self.temperature_source = Counter(
            "thermostat_requests_by_temperature_source",
            "Requests by the layer their effective temperature came from",
            ["source"],
            registry=r,
        )
        self.greedy = Counter(
            "thermostat_greedy_requests", "Requests served with temperature 0", registry=r
        )
        self.adjustments = Counter(
            "thermostat_policy_adjustments",
            "Values changed (min_temperature) or requests refused (greedy_reject) by a policy",
            ["policy"],
            registry=r,
        )
        self.degenerate = Counter(
            "thermostat_degenerate_responses",
            "Completions flagged degenerate, by reason",
            ["reason"],
            registry=r,
        )
        self.handoffs = Counter(
            "thermostat_disagg_handoffs",
            "Prefill/decode handoffs by role and outcome (ok, or the error code)",
            ["role", "outcome"],
            registry=r,
        )
        self.handoff_bytes = Counter(
            "thermostat_disagg_handoff_bytes", "KV bytes handed over, by role", ["role"], registry=r
        )
        self.handoff_wait = Histogram(
            "thermostat_disagg_handoff_wait_seconds",
            "Decode: request arrival to its prefill's KV in hand",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rooms_parked = Gauge(
            "thermostat_disagg_rooms_parked", "Prefill: handoffs waiting for a decode", registry=r
        )
        self.server_errors = Counter(
            "thermostat_server_errors",
            "Requests answered with a server fault (5xx or an in-stream error), by code",
            ["code"],
            registry=r,
        )

        self.spec_proposed = Counter(
            "thermostat_speculative_proposed_tokens",
            "Tokens proposed by speculative decoding (--speculative) and checked by the model",
            registry=r,
        )
        self.spec_accepted = Counter(
            "thermostat_speculative_accepted_tokens",
            "Proposed tokens the model confirmed (each saved a decode step)",
            registry=r,
        )
        self.spec_steps = Counter(
            "thermostat_speculative_verification_steps",
            "Steps that checked a request's proposals (accepted tokens / steps: tokens a "
            "verification saved)",
            registry=r,
        )
        self.defaults_warning = Gauge(
            "thermostat_defaults_warning",
            "1 for each kind of warning the startup report gives about the sampling defaults",
            ["kind"],
            registry=r,
        )
        self.default_sampling = Gauge(
            "thermostat_default_sampling",
            "What a request that omits the field gets, by parameter and the layer it comes from",
            ["param", "source"],
            registry=r,
        )
        self.queue_limit = Gauge(
            "thermostat_queue_limit",
            "--max-queue: requests waiting beyond it are answered 503 (absent: unbounded)",
            registry=r,
        )

    def set_queue_limit(self, limit: int | None) -> None:
        if limit is None:
            self.registry.unregister(self.queue_limit)
        else:
            self.queue_limit.set(limit)

    def describe_defaults(self, report: dict[str, Any], kinds: list[str]) -> None:
        """The defaults report (`/v1/sampling/defaults`'s body) and its warnings' kinds."""
        for kind in kinds:
            self.defaults_warning.labels(kind).set(1)
        for param, value in report["effective"].items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.default_sampling.labels(param, report["source"][param]).set(value)

    def on_admitted(self, resolution: Resolution, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        source = resolution.source["temperature"]
        self.temperature_source.labels(source).inc()
        if resolution.effective.greedy:
            self.greedy.inc()
        for adjustment in resolution.adjusted:
            self.adjustments.labels(adjustment.policy).inc()
        self.traffic.on_admitted(source, resolution.effective.greedy)

    def on_greedy_rejected(self, endpoint: str, client: str | None, message: str) -> None:
        """A request refused by `--greedy reject`: counted, and listed on the console."""
        self.adjustments.labels("greedy_reject").inc()
        refused = {"param": "temperature", "requested": 0.0, "applied": None}
        self.traffic.record(
            request_id="",
            endpoint=endpoint,
            client=client,
            status="refused",
            sampling={
                "effective": {"temperature": 0.0},
                "source": {"temperature": "request"},
                "adjusted": [refused | {"policy": "greedy_reject"}],
            },
            quality={},
            finish_reasons=[],
            prompt_tokens=0,
            completion_tokens=0,
            ttft_s=None,
            latency_s=None,
            text=None,
            error=message,
        )

    def on_speculation(self, stats: dict[str, Any]) -> None:
        """A finished choice's speculation: tokens proposed and confirmed, steps that checked."""
        self.spec_proposed.inc(int(stats["proposed"]))
        self.spec_accepted.inc(int(stats["accepted"]))
        self.spec_steps.inc(int(stats.get("steps", 0)))

    def on_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self.traffic.on_tokens(n)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.traffic.on_first_token(seconds)

    def on_quality(self, report: dict[str, Any]) -> None:
        if report.get("degenerate"):
            flags = report.get("flags") or ["unspecified"]  # a small fixed set of names
            for flag in flags:
                self.degenerate.labels(flag).inc()
            self.traffic.on_degenerate(flags)

    def sample(self, stats: EngineStats | None) -> None:
        """The engine's gauges from its latest stats (at a scrape, a console refresh)."""
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            queries = stats.prefix_cache_queries
            self.prefix_hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
            self.traffic.sample_kv(stats.kv_cache_usage)

    def render(self, stats: EngineStats | None) -> bytes:
        self.sample(stats)
        return generate_latest(self.registry)
