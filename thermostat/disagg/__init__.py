"""Prefill/decode disaggregation: moving a prompt's KV cache rows from a prefill server to a
decode server.

- `wire`: the framed binary protocol (frames, tensor packing) over asyncio streams.
- `bootstrap`: the prefill side's room table and bootstrap server, and the decode side's `claim`.
"""
