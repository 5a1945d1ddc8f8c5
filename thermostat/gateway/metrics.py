"""The gateway's Prometheus metrics: serve's sampling and quality families under the same names
(requests by temperature source, greedy requests, adjustments, degenerate responses, TTFT), plus
the upstream's errors and latency. The engine's gauges are not exported: there is no engine."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from thermostat.api.metrics import LATENCY_BUCKETS, Metrics

ENGINE_ONLY = ("kv_usage", "prefix_hit_rate", "waiting", "handoffs", "handoff_bytes",
               "handoff_wait", "rooms_parked", "itl", "prompt_tokens", "spec_proposed",
               "spec_accepted")  # fmt: skip


class GatewayMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        for name in ENGINE_ONLY:
            self.registry.unregister(getattr(self, name))
        r = self.registry
        self.running.set(0)  # here: requests in flight to the upstream
        self.upstream_errors = Counter(
            "thermostat_gateway_upstream_errors",
            "Upstream failures by kind (unreachable, timeout, bad_response, error status)",
            ["kind"],
            registry=r,
        )
        self.upstream_latency = Histogram(
            "thermostat_gateway_upstream_latency_seconds",
            "Request sent upstream to its response headers (streams) or whole body",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
