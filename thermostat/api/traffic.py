"""The console's memory of traffic: the last requests (a bounded ring) and counts per 10-second
bucket over the last hour. Fed from the same events as the Prometheus metrics (api/metrics.py);
read by the console (api/console.py). Prompt and output text are kept only when asked. The ring's
ids count from 1 in each process; `instance` names the process, so that a page still open from a
server that was restarted (or replaced on its port) starts its list over instead of waiting for
ids above the ones it had.

| series            | per bucket                                             |
|-------------------|--------------------------------------------------------|
| requests          | admitted requests, by the layer their temperature came |
| greedy            | admitted requests served with temperature 0            |
| degenerate        | degenerate responses (choices), by detector            |
| tokens            | generated tokens                                       |
| ttft              | time to first token: p50 and p95 of the bucket         |
| kv_usage          | the KV cache's usage, last sample of the bucket        |
"""

from __future__ import annotations

import bisect
import secrets
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

BUCKET_S = 10
WINDOW_S = 3600
RECENT = 500  # requests the ring keeps
TTFT_SAMPLES = 1000  # per bucket: percentiles of at most this many


@dataclass
class Bucket:
    start: int  # unix seconds, a multiple of BUCKET_S
    requests: Counter[str] = field(default_factory=Counter)
    greedy: int = 0
    degenerate: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)  # sorted
    kv_usage: float | None = None


@dataclass(frozen=True)
class RequestRecord:
    """One finished request as the console lists it: what was applied, what came out."""

    id: int  # the ring's sequence number
    request_id: str
    time: float  # unix seconds, when it finished
    endpoint: str
    client: str | None  # the User-Agent
    status: str  # ok | error | aborted | refused (by a policy)
    sampling: dict[str, Any]  # the response's `sampling` ({} if refused before resolution)
    quality: dict[str, Any]  # the response's `quality`
    finish_reasons: list[str | None]
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None
    latency_s: float | None
    text: list[str] | None  # each choice's output, only with --console-keep-text
    error: str | None = None  # why it was refused or failed

    @property
    def greedy(self) -> bool:
        return self.sampling.get("effective", {}).get("temperature") == 0

    @property
    def degenerate(self) -> bool:
        return bool(self.quality.get("degenerate"))

    def row(self) -> dict[str, Any]:
        """The list's columns: effective values with their sources, policies, verdict."""
        eff = self.sampling.get("effective", {})
        source = self.sampling.get("source", {})
        shown = ("temperature", "top_p", "top_k", "max_tokens")
        return {
            "id": self.id,
            "time": self.time,
            "endpoint": self.endpoint,
            "client": self.client,
            "status": self.status,
            "sampling": {k: {"value": eff.get(k), "source": source.get(k)} for k in shown},
            "policies": sorted({a.get("policy", "?") for a in self.sampling.get("adjusted", [])}),
            "finish_reasons": self.finish_reasons,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "greedy": self.greedy,
            "degenerate": self.degenerate,
            "reasons": list(self.quality.get("reasons") or []),
            "error": self.error,
        }

    def detail(self) -> dict[str, Any]:
        return asdict(self)


def percentile(ordered: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of sorted values, nearest rank; None for no values."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class Traffic:
    """Updated from the event loop only (as the metrics are)."""

    def __init__(self, keep_text: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.keep_text = keep_text
        self.clock = clock
        self.buckets: deque[Bucket] = deque(maxlen=WINDOW_S // BUCKET_S + 1)
        self.recent: deque[RequestRecord] = deque(maxlen=RECENT)
        self.instance = secrets.token_hex(8)  # what the ids count in
        self._next_id = 1

    def _bucket(self) -> Bucket:
        start = int(self.clock()) // BUCKET_S * BUCKET_S
        if not self.buckets or self.buckets[-1].start != start:
            self.buckets.append(Bucket(start))
        return self.buckets[-1]

    def on_admitted(self, temperature_source: str, greedy: bool) -> None:
        bucket = self._bucket()
        bucket.requests[temperature_source] += 1
        bucket.greedy += greedy

    def on_degenerate(self, flags: list[str]) -> None:
        self._bucket().degenerate.update(flags)

    def on_tokens(self, n: int) -> None:
        self._bucket().tokens += n

    def on_first_token(self, seconds: float) -> None:
        samples = self._bucket().ttft
        if len(samples) < TTFT_SAMPLES:
            bisect.insort(samples, seconds)

    def sample_kv(self, usage: float) -> None:
        self._bucket().kv_usage = usage

    def record(self, **fields: Any) -> RequestRecord:
        """Add a finished request (RequestRecord's fields but `id` and `time`)."""
        if not self.keep_text:
            fields["text"] = None
        record = RequestRecord(id=self._next_id, time=self.clock(), **fields)
        self._next_id += 1
        self.recent.append(record)
        return record

    @property
    def size(self) -> int:
        """How many requests the ring keeps."""
        return RECENT

    def find(self, record_id: int) -> RequestRecord | None:
        for record in reversed(self.recent):
            if record.id == record_id:
                return record
        return None

    def rows(self, after: int = 0) -> list[dict[str, Any]]:
        """The ring's requests with an id above `after`, oldest first."""
        return [r.row() for r in self.recent if r.id > after]

    def series(self) -> dict[str, Any]:
        """The last hour, one point per bucket (empty buckets count zero; a ratio or a
        percentile without data is None): what the console plots."""
        end = int(self.clock()) // BUCKET_S * BUCKET_S
        times = list(range(end - WINDOW_S + BUCKET_S, end + 1, BUCKET_S))
        by_start = {b.start: b for b in self.buckets}
        empty = Bucket(0)
        seen = [by_start.get(t, empty) for t in times]
        sources = sorted({s for b in seen for s in b.requests})
        detectors = sorted({d for b in seen for d in b.degenerate})
        per_minute = 60 / BUCKET_S
        totals = [sum(b.requests.values()) for b in seen]
        shares = [b.greedy / n if n else None for b, n in zip(seen, totals, strict=True)]
        return {
            "bucket_s": BUCKET_S,
            "time": times,
            "requests_per_min": {s: [b.requests[s] * per_minute for b in seen] for s in sources},
            "greedy_share": shares,
            "degenerate_per_min": {
                d: [b.degenerate[d] * per_minute for b in seen] for d in detectors
            },
            "tokens_per_s": [b.tokens / BUCKET_S for b in seen],
            "ttft_p50_s": [percentile(b.ttft, 0.5) for b in seen],
            "ttft_p95_s": [percentile(b.ttft, 0.95) for b in seen],
            "kv_usage": [b.kv_usage for b in seen],
            "totals": {
                "requests": sum(totals),
                "greedy": sum(b.greedy for b in seen),
                "degenerate": sum(sum(b.degenerate.values()) for b in seen),
                "tokens": sum(b.tokens for b in seen),
            },
        }
