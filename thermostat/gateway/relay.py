"""An upstream's response, passed on with `sampling` and `quality` added as `serve` adds them.

Whole responses: each choice gets its `quality` (of its text), the response gets `sampling`
(the gateway's resolution) and `quality` (the first degenerate choice's, else choice 0's); a
choice whose own `sampling` differs (a later sample's seed, kinds.py) carries it, as `serve`'s
do. A `sampling` the upstream itself reported (a Thermostat upstream's) moves to
`sampling.upstream`.

Streams: chunks pass through as they come; each choice's text feeds a StreamingAnalyzer, and
the chunk with a choice's finish_reason gains `quality` (on the choice and the chunk) and
that choice's `sampling`. Under --stop-on-loop a choice whose text certainly loops is finished there
(finish_reason stop, stop_reason "loop"); once every choice has finished the upstream stream is
closed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from thermostat.api.responses import response_quality
from thermostat.gateway.upstream import bad_response
from thermostat.quality import StreamingAnalyzer, quality_report


def choice_text(choice: dict[str, Any], part: str) -> str:
    """A choice's text: chat `message.content` (part "message") or a chunk's `delta.content`
    (part "delta"), else completions `text`."""
    inner = choice.get(part)
    text = inner.get("content") if isinstance(inner, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _with_sampling(data: dict[str, Any], sampling: dict[str, Any]) -> dict[str, Any]:
    own = data.get("sampling")
    return sampling | {"upstream": own} if isinstance(own, dict) else sampling


PerChoice = Callable[[int], dict[str, Any]]  # a choice's index -> its `sampling`


class Sampling(NamedTuple):
    """A request's `sampling` objects: the response's, and each choice's by index."""

    response: dict[str, Any]
    per_choice: PerChoice


def annotate(
    data: dict[str, Any], sampling: dict[str, Any], per_choice: PerChoice | None = None
) -> list[dict[str, Any]]:
    """Add `sampling` and `quality` to a whole response in place; returns the reports."""
    reports = []
    for choice in data["choices"]:
        if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
            raise bad_response("a choice that is not an object")
        theirs = choice.pop("sampling", None)  # the upstream's per-choice view
        mine = per_choice(choice.get("index", 0)) if per_choice else sampling
        if mine != sampling:
            choice["sampling"] = mine | ({"upstream": theirs} if isinstance(theirs, dict) else {})
        choice["quality"] = quality_report(choice_text(choice, "message"))
        reports.append(choice["quality"])
    data["sampling"] = _with_sampling(data, sampling)
    data["quality"] = response_quality(reports)
    return reports


class StreamAnnotator:
    """Per-stream state: one analyzer per choice, which choices have finished."""

    def __init__(
        self, sampling: dict[str, Any], stop_on_loop: bool, per_choice: PerChoice | None = None
    ) -> None:
        self.sampling = sampling
        self.per_choice = per_choice
        self.stop_on_loop = stop_on_loop
        self.analyzers: dict[int, StreamingAnalyzer] = {}
        self.finished: set[int] = set()
        self.reports: list[dict[str, Any]] = []
        self.finish_reasons: dict[int, str] = {}  # by choice, once finished
        self.texts: dict[int, list[str]] = {}  # by choice, its text so far in pieces
        self.first_content = False  # a chunk with text has passed (TTFT)
        self.cut = False  # a choice was finished here on a loop

    @property
    def done(self) -> bool:
        """Every choice seen has finished (the upstream stream may be closed)."""
        return bool(self.analyzers) and self.finished >= set(self.analyzers)

    def chunk(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to send for an upstream event (None: nothing left to send of it)."""
        choices = event.get("choices")
        if not isinstance(choices, list):
            if "error" in event:
                return event  # an in-band error passes as is
            raise bad_response("a stream chunk without choices")
        own = event.pop("sampling", None)
        kept = []
        for choice in choices:
            if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
                raise bad_response("a stream choice that is not an object")
            index = choice.get("index", 0)
            if index in self.finished:
                continue  # stopped here on a loop: the upstream's rest is dropped
            analyzer = self.analyzers.setdefault(index, StreamingAnalyzer())
            text = choice_text(choice, "delta")
            self.first_content = self.first_content or bool(text)
            self.texts.setdefault(index, []).append(text)
            state = analyzer.update(text)
            choice.pop("sampling", None)
            if choice.get("finish_reason") is None and self.stop_on_loop and state.loop_detected:
                choice["finish_reason"], choice["stop_reason"] = "stop", "loop"
                self.cut = True
            if choice.get("finish_reason") is not None:
                self.finished.add(index)
                self.finish_reasons[index] = choice["finish_reason"]
                report = analyzer.report().to_dict()
                self.reports.append(report)
                choice["quality"] = report
                mine = self.per_choice(index) if self.per_choice else self.sampling
                event["sampling"] = mine | ({"upstream": own} if own else {})
                event["quality"] = report
            kept.append(choice)
        if choices and not kept:
            return None
        event["choices"] = kept
        return event

    async def run(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """Annotated chunks until the upstream's [DONE], or until every choice finished on a
        loop; raises UpstreamError if the stream ends with a choice unfinished."""
        async for event in events:
            out = self.chunk(event)
            if out is not None:
                yield out
            if self.done and self.cut:
                return  # the caller closes the upstream stream
        if not self.done and self.analyzers:
            raise bad_response("the stream ended before every choice finished")
