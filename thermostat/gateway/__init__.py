"""The gateway: Thermostat's sampling policy and degeneration monitoring in front of one
OpenAI-compatible upstream (vLLM, SGLang, llama.cpp, a router). Torch-free.

| module       | one concept                                                      |
|--------------|------------------------------------------------------------------|
| config.py    | GatewayConfig: the flags                                         |
| upstream.py  | the HTTP client to the upstream, and its failures as 502/504     |
| kinds.py     | per upstream kind: field names, what it cannot take              |
| discovery.py | what the upstream tells at startup: kind, model, defaults        |
| defaults.py  | the layers (the upstream one of them) and a request's resolution |
| forward.py   | the body sent upstream: effective values explicit                |
| relay.py     | responses and streams passed on with `sampling` and `quality`    |
| fold.py      | a stream folded into a whole response (--stop-on-loop)           |
| metrics.py   | serve's sampling metrics plus the upstream's errors and latency  |
| state.py     | lifecycle: discovery, readiness, in-flight count, drain          |
| generate.py  | the one generation path: resolve, send upstream, annotate, record|
| routes.py    | the HTTP routes                                                  |
| agent_backend.py | the Responses and Messages APIs (api/agents/) on that path   |
| app.py       | the FastAPI app                                                  |
| command.py   | `thermostat gateway`                                             |

Load balancing is not here: put the gateway in front of the router.
"""

from __future__ import annotations

from thermostat.gateway.app import create_gateway_app
from thermostat.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "create_gateway_app"]
