"""Prefill/decode disaggregation: a prefill server hands each prompt's KV cache rows and first
token to the decode server that continues it, behind SGLang's router (smg).

- `wire`: the framed binary protocol (frames, tensor packing) over asyncio streams.
- `rooms`: the prefill's room table; `bootstrap`: its TCP server and the decode side's `claim`.
- `handoff`: what one choice's handoff carries, and the check that both halves agree.
- `router`: the `smg launch` command line, set to fail fast.
- `launcher`: `thermostat pd`, prefill + decode + smg on one host (`children`: its processes).

The server side of the two roles is `thermostat.server.disaggregation`.
"""
