"""Checks of how a server samples, from the outside: the library under `thermostat verify`,
the console's "check now" and `thermostat diagnose`'s remote generator.

Works against any OpenAI-compatible server (Thermostat, a Thermostat gateway, vLLM, SGLang,
llama.cpp). The checks:

| check            | passes when                                                            |
|------------------|------------------------------------------------------------------------|
| default-sampling | two identical requests that omit temperature give different text       |
| greedy           | temperature 0 twice gives the same text (a warning otherwise)          |
| seed             | the same seed twice gives the same text (a warning otherwise)          |
| degeneration     | text generated at the server's defaults does not loop or repeat        |
| defaults         | informational: the server's reported defaults (GET /v1/sampling/defaults) |
| provenance       | no value this client left out reaches the server as sent (a warning)   |

The pair of default-sampling requests and the degeneration probes go at once (the server may batch
them); the greedy and seed pairs go one after the other.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from thermostat.quality import analyze

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Describe the sea at dawn.",
    "Tell me about the history of a small town.",
    "Write a letter to an old friend.",
]


@dataclass
class Check:
    name: str
    status: str  # "pass" | "warn" | "fail" | "info"
    detail: str


ENDPOINTS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",  # OpenAI's Responses API (Codex CLI's)
    "messages": "/v1/messages",  # Anthropic's Messages API (Claude Code's)
}


def _text_and_end(endpoint: str, data: dict[str, Any]) -> tuple[str | None, str | None]:
    """An answer's text and why it ended, in each API's shape."""
    if endpoint == "responses":
        texts = [
            part.get("text", "")
            for item in data.get("output", [])
            if item.get("type") == "message"
            for part in item.get("content", [])
        ]
        details = data.get("incomplete_details") or {}
        return "".join(texts), details.get("reason") or data.get("status")
    if endpoint == "messages":
        texts = [b.get("text", "") for b in data.get("content", []) if b.get("type") == "text"]
        return "".join(texts), data.get("stop_reason")
    choice = data["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    return text, choice.get("finish_reason")


class Client:
    """Minimal client of one endpoint (ENDPOINTS), bounded timeouts."""

    def __init__(
        self,
        url: str,
        model: str | None,
        api_key: str | None,
        endpoint: str,
        user_agent: str = "thermostat-verify",
    ):
        headers = {"User-Agent": user_agent}
        if api_key:  # both spellings: OpenAI's and Anthropic's
            headers["Authorization"] = f"Bearer {api_key}"
            headers["x-api-key"] = api_key
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=120)
        self.endpoint = endpoint
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return r.json()["data"][0]["id"]

    def complete(self, prompt: str, **fields: Any) -> dict:
        """Returns {"text", "sampling" (or None), "finish_reason"}; `fields` as chat names
        them (max_tokens, temperature, seed), sent as the endpoint's API names them."""
        body: dict[str, Any] = {"model": self.model, **fields}
        path = ENDPOINTS[self.endpoint]
        if self.endpoint == "completions":
            body["prompt"] = prompt
        elif self.endpoint == "responses":
            body["input"] = prompt
            if "max_tokens" in body:
                body["max_output_tokens"] = body.pop("max_tokens")
        else:  # chat, messages
            body["messages"] = [{"role": "user", "content": prompt}]
        r = self.http.post(path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
        data = r.json()
        text, finish = _text_and_end(self.endpoint, data)
        return {"text": text or "", "sampling": data.get("sampling"), "finish_reason": finish}

    def complete_all(self, prompts: list[str], **fields: Any) -> list[dict]:
        """`complete` for each prompt, all at once (the server batches them)."""
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: self.complete(p, **fields), prompts))

    def reported_defaults(self) -> dict | None:
        r = self.http.get("/v1/sampling/defaults")
        return r.json() if r.status_code == 200 else None


def check_default_sampling(client: Client, max_tokens: int) -> Check:
    a, b = client.complete_all([PROMPTS[0]] * 2, max_tokens=max_tokens)
    source = ""
    if a["sampling"]:
        eff, src = a["sampling"]["effective"], a["sampling"]["source"]
        source = f" (temperature {eff['temperature']} from {src['temperature']})"
    if a["text"] != b["text"]:
        return Check("default-sampling", "pass", f"omitted temperature samples{source}")
    return Check(
        "default-sampling",
        "fail",
        "omitted temperature gives identical outputs: the server's default decoding is greedy"
        f"{source}. Set the defaults on the server (thermostat: --sampling-defaults "
        "recommended; others: fix generation_config.json with thermostat set-defaults) or "
        "have the client send a temperature.",
    )


def check_provenance(client: Client, max_tokens: int) -> Check:
    """A request that sends only max_tokens: a field the server reports as sent by the request
    was set on the way by something between this client and the server (a router that fills
    in its own defaults beats the server's, as the case's override did)."""
    out = client.complete(PROMPTS[0], max_tokens=max_tokens)
    if not out["sampling"]:
        return Check("provenance", "info", "not reported (the answer has no `sampling`)")
    added = sorted(
        name
        for name, source in out["sampling"]["source"].items()
        if source == "request" and name != "max_tokens"
    )
    if not added:
        return Check("provenance", "pass", "every value this client left out came from the server")
    values = ", ".join(f"{n}={out['sampling']['effective'][n]}" for n in added)
    return Check(
        "provenance",
        "warn",
        f"the server saw {values} as sent by the request, which this client left out: something "
        "between them (a router, a proxy) set them, over the server's defaults",
    )


def check_greedy(client: Client, max_tokens: int) -> Check:
    a = client.complete(PROMPTS[1], max_tokens=max_tokens, temperature=0)
    b = client.complete(PROMPTS[1], max_tokens=max_tokens, temperature=0)
    if a["text"] == b["text"]:
        return Check("greedy", "pass", "temperature 0 is deterministic")
    return Check("greedy", "warn", "temperature 0 twice gave different text (not deterministic)")


def check_seed(client: Client, max_tokens: int) -> Check:
    fields = {"max_tokens": max_tokens, "temperature": 1.0, "seed": 1234}
    try:
        a, b = client.complete(PROMPTS[2], **fields), client.complete(PROMPTS[2], **fields)
    except RuntimeError as exc:  # a 4xx: `seed` is not a field of this API (smg's Responses)
        return Check("seed", "warn", f"a seeded request was refused: {exc}")
    if a["text"] == b["text"]:
        return Check("seed", "pass", "the same seed reproduces the same text")
    return Check("seed", "warn", "seed 1234 twice gave different text: seeds are not honoured")


def check_degeneration(client: Client, max_tokens: int) -> Check:
    flagged = []
    for prompt, out in zip(
        PROMPTS, client.complete_all(PROMPTS, max_tokens=max_tokens), strict=True
    ):
        report = analyze(out["text"])
        if report.degenerate:
            flagged.append(f"{prompt[:30]!r}: {'; '.join(report.reasons)}")
    if not flagged:
        return Check(
            "degeneration", "pass", f"{len(PROMPTS)} generations at the defaults look healthy"
        )
    return Check(
        "degeneration",
        "fail",
        f"{len(flagged)}/{len(PROMPTS)} generations at the server's defaults degenerate: "
        + " | ".join(flagged),
    )


def check_reported_defaults(client: Client) -> Check:
    reported = client.reported_defaults()
    if reported is None:
        return Check("defaults", "info", "not reported (GET /v1/sampling/defaults unavailable)")
    eff, src = reported["effective"], reported["source"]
    parts = [f"{k}={eff[k]} ({src[k]})" for k in ("temperature", "top_p", "top_k") if k in eff]
    status = "fail" if eff.get("temperature") == 0 else "info"
    return Check("defaults", status, "; ".join(parts))


def verify(client: Client, max_tokens: int) -> list[Check]:
    return [
        check_reported_defaults(client),
        check_default_sampling(client, max_tokens),
        check_provenance(client, max_tokens),
        check_greedy(client, max_tokens),
        check_seed(client, max_tokens),
        check_degeneration(client, 4 * max_tokens),
    ]
