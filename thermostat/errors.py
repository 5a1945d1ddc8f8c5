"""The one exception type for bad input, shared by every layer (no torch here).

| raised                      | by                               | the server answers              |
|-----------------------------|----------------------------------|---------------------------------|
| `InvalidRequest` (subclass) | sampling, the engine's admission | 4xx naming `param`              |
| anything else               | a bug (ours)                     | 500 + error id, logged, counted |

A plain `ValueError` is never taken for bad input: an engine bug that raises one must not turn
into a client's 400.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as sent; `param` names the field at fault (or None)."""

    code = "invalid_value"

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
