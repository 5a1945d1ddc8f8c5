"""What goes upstream: the client's body with every sampling value replaced by the effective
one, named as the upstream's kind names it; and the client's disconnect, which cancels it.

| body field                           | sent upstream                                       |
|--------------------------------------|-----------------------------------------------------|
| the layered fields (temperature ...) | the effective value (absent when unknown)           |
| max_tokens / max_completion_tokens   | the effective max_tokens, as max_tokens             |
| seed                                 | as sent                                             |
| model                                | as sent, else the upstream's first model            |
| everything else (messages, stop ...) | as sent                                             |
"""

from __future__ import annotations

from typing import Any

from thermostat.gateway.defaults import GatewayDefaults, Resolved
from thermostat.sampling import LAYERED_FIELDS

_REPLACED = (*LAYERED_FIELDS, "max_tokens", "max_completion_tokens", "seed", "repeat_penalty")


def upstream_body(raw: dict[str, Any], resolved: Resolved, defaults: GatewayDefaults) -> dict:
    body = {k: v for k, v in raw.items() if k not in _REPLACED}
    body.update(resolved.sent(defaults.kind))
    if body.get("model") is None and defaults.info.models:
        body["model"] = defaults.info.model
    return body
