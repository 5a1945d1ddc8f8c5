"""The two halves of a disaggregated server, between the routes and `Serving`.

SGLang's router (`smg --pd-disaggregation`) sends the same body to a prefill and a decode
server at once, adding `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (see `Rooms`).
It waits for both heads, drains the prefill's body and returns the decode's to the client.

| role    | per request                                                                          |
|---------|--------------------------------------------------------------------------------------|
| prefill | computes each prompt and samples its first token with the full sampling; parks each  |
|         | choice's handoff under its room (the KV blocks are freed at once); answers a short   |
|         | JSON. A room nobody claims expires after the disaggregation timeout.                  |
| decode  | claims each room from its prefill's bootstrap port, checks that both halves resolved |
|         | the choice alike (`disagg.handoff.disagreements`), then admits the choices with      |
|         | their handoffs and answers the client as a single server would.                      |

The decode's request enters the engine only once its KV is in hand: waiting costs no engine
step and no KV block. The errors of the decode, in the OpenAI shape:

| what                                              | status | code                  |
|---------------------------------------------------|--------|-----------------------|
| the halves disagree (sampling, model, KV, prompt) | 409    | `pd_mismatch`         |
| nothing listens on the bootstrap port / it closed | 502    | `prefill_unreachable` |
| the prefill refused the request (e.g. a 400)      | 502    | `prefill_refused`     |
| the room did not come within the timeout          | 504    | `prefill_timeout`     |

A mismatch is a 409: no retry can help, and smg does not retry it. smg hands the client its
message as a 500 (measured with smg 1.13.0) and, as for any failed request, counts it against
both workers' circuit breakers: until the pair is fixed, clients see either that message or
smg's 503 "no available workers" between the breakers' half-open probes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from thermostat.api.disconnect import ClientGone, until_disconnected
from thermostat.api.errors import APIError
from thermostat.api.metrics import Metrics
from thermostat.disagg.bootstrap import BootstrapServer, claim
from thermostat.disagg.handoff import disagreements, fingerprint, pack_handoff, unpack_handoff
from thermostat.disagg.rooms import RoomError, RoomTable
from thermostat.engine.steps import Handoff
from thermostat.sampling.fanout import Plan
from thermostat.server.serving import Job

log = logging.getLogger("thermostat.server")
ROOM_LIMIT = 2**63


@dataclass(frozen=True)
class Rooms:
    """Where a request's KV meets: its prefill's bootstrap host and port, and its room.

    smg adds one room per request, or a list of them whose length follows its own count of
    the batch (a list of prompts gives one per prompt; n > 1 on one prompt gives a single
    room for completions and a list for chat). Both halves get the same body, so they take the
    first entry and each choice meets under `key(index)`, derived from the room."""

    host: str
    port: int
    room: int

    @classmethod
    def of(cls, body: Any) -> Rooms:
        """From a body the router extended; raises APIError 400 naming the field at fault."""
        if body.bootstrap_room is None:
            raise APIError(
                400,
                "this server is one half of a prefill/decode pair: send requests through the "
                "router (smg), which adds bootstrap_host, bootstrap_port and bootstrap_room",
                param="bootstrap_room",
            )
        first: dict[str, Any] = {}
        for name in ("bootstrap_host", "bootstrap_port", "bootstrap_room"):
            value = getattr(body, name)
            if isinstance(value, list):
                if not value:
                    raise APIError(400, "must not be an empty list", param=name)
                value = value[0]
            if value is None:
                raise APIError(400, "required with bootstrap_room", param=name)
            first[name] = value
        if not 0 <= first["bootstrap_room"] < ROOM_LIMIT:
            raise APIError(400, "must be in [0, 2**63)", param="bootstrap_room")
        if not 0 < first["bootstrap_port"] <= 65535:
            raise APIError(400, "must be in [1, 65535]", param="bootstrap_port")
        return cls(first["bootstrap_host"], first["bootstrap_port"], first["bootstrap_room"])

    def key(self, index: int) -> int:
        """The room of choice `index` (a 63-bit hash of the request's room and the index)."""
        digest = hashlib.blake2b(f"{self.room}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1

    @property
    def prefill(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(eq=False)
class Role:
    """What both halves know: what they serve (for the fingerprint) and how long to wait."""

    model: dict[str, str]  # disagg.handoff.model_identity
    kv_cache: dict[str, object]  # KVCacheSpec.describe()
    timeout_s: float
    metrics: Metrics


@dataclass(eq=False)
class PrefillRole(Role):
    """Parks each choice's handoff under its room until its decode claims it."""

    def __post_init__(self) -> None:
        self.table = RoomTable(ttl_s=self.timeout_s)
        self.server = BootstrapServer(self.table, claim_timeout_s=self.timeout_s)

    async def start(self, host: str, port: int) -> None:
        await self.server.start(host, port)
        log.info("prefill: decodes claim KV at %s:%d (TCP)", host, self.server.port)

    async def close(self) -> None:
        await self.server.close()

    def fail(self, rooms: Rooms, num_choices: int, code: str, message: str) -> None:
        """Tell the decode waiting for these choices that they will not come."""
        for index in range(num_choices):
            self.table.fail(rooms.key(index), code, message)
        self.metrics.handoffs.labels("prefill", code).inc(num_choices)

    async def serve(self, job: Job, rooms: Rooms, request: Request) -> dict[str, Any]:
        """Run the job to its handoffs, park each under its room; the prefill's response."""
        try:
            await job.collect(request)
        except (ClientGone, APIError) as exc:
            message = f"the prefill did not complete: {exc!r}"
            self.fail(rooms, job.num_choices, "prefill_failed", message)
            raise
        for index in range(job.num_choices):
            room = rooms.key(index)
            handoff = job.handoffs.get(index)
            if handoff is None:  # cannot happen for a finished job: each choice hands off
                self.table.fail(room, "prefill_failed", "the prefill produced no handoff")
                continue
            prompt = job.prompt_of(index).token_ids
            mark = fingerprint(self.model, self.kv_cache, prompt, job.resolution(index).to_dict())
            self.table.put(room, pack_handoff(handoff, mark))
            self.metrics.handoff_bytes.labels("prefill").inc(handoff.rows.nbytes)
        self.metrics.handoffs.labels("prefill", "ok").inc(job.num_choices)
        self.metrics.rooms_parked.set(self.table.num_parked)
        return {
            "id": job.id,
            "object": "prefill",
            "model": job.model,
            "room": rooms.room,
            "choices": job.num_choices,
            "prompt_tokens": job.usage().prompt_tokens,
            "sampling": job.sampling(),
        }


@dataclass(eq=False)
class DecodeRole(Role):
    """Claims each choice's handoff and checks it before the choices are admitted."""

    name: str  # how this decode introduces itself to a prefill
    # the last request's handoff as the console shows it: its prefill, agreed or refused why
    last_handoff: dict[str, Any] | None = None

    async def fetch(
        self,
        rooms: Rooms,
        planned: Plan,
        request: Request,
    ) -> tuple[list[Handoff], dict[str, Any]]:
        """Each choice's handoff, checked against the plan this decode will run; and what joins
        the response's `sampling`. Raises APIError (502/504 as tabled, 409 on a mismatch)."""
        start = time.monotonic()
        choices = planned.choices

        async def one(index: int) -> Handoff:
            host, port = rooms.host, rooms.port
            try:
                packed = await claim(host, port, rooms.key(index), self.name, self.timeout_s)
                handoff, theirs = unpack_handoff(packed)
            except RoomError as exc:
                raise _room_error(exc) from exc
            except ValueError as exc:  # a malformed header: a peer of another version?
                raise APIError(409, str(exc), type="server_error", code="pd_mismatch") from exc
            prompt = list(planned.prompt_of(index))
            mine = fingerprint(self.model, self.kv_cache, prompt, choices[index].to_dict())
            if found := disagreements(theirs, mine):
                raise APIError(
                    409,
                    f"the prefill at {host}:{port} and this decode would serve choice {index} "
                    f"differently; refusing it: {'; '.join(found)}. Restart both with the same "
                    "model, --kv-cache-dtype and sampling defaults.",
                    type="server_error",
                    code="pd_mismatch",
                )
            return handoff

        try:
            handoffs = await until_disconnected(
                _all_or_none([one(i) for i in range(len(choices))]), request
            )
        except APIError as exc:
            self.metrics.handoffs.labels("decode", exc.info.code or "error").inc()
            self.last_handoff = {
                "time": time.time(),
                "prefill": rooms.prefill,
                "outcome": exc.info.code or "error",
                "message": exc.info.message,
            }
            raise
        self.last_handoff = {"time": time.time(), "prefill": rooms.prefill, "outcome": "agreed"}
        self.metrics.handoffs.labels("decode", "ok").inc(len(handoffs))
        self.metrics.handoff_bytes.labels("decode").inc(sum(p.rows.nbytes for p in handoffs))
        self.metrics.handoff_wait.observe(time.monotonic() - start)
        extra = {
            "disaggregation": {
                "prefill": rooms.prefill,
                "agreed": ["model", "kv_cache", "prompt", "sampling"],
                "kv_cache": self.kv_cache,
            }
        }
        return handoffs, extra


async def _all_or_none(claims: list[Coroutine[Any, Any, Handoff]]) -> list[Handoff]:
    """Every claim's result, or the first failure with the other claims cancelled."""
    tasks = [asyncio.ensure_future(c) for c in claims]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


_ROOM_ERRORS = {"timeout": (504, "prefill_timeout"), "refused": (502, "prefill_refused")}


def _room_error(exc: RoomError) -> APIError:
    status, code = _ROOM_ERRORS.get(exc.code, (502, "prefill_unreachable"))
    return APIError(status, str(exc), type="server_error", code=code)
