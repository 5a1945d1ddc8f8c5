"""`thermostat verify URL`: check from the outside how a server samples (the checks and what
each passes on: thermostat.quality.server_checks)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import httpx
from rich.console import Console
from rich.table import Table

from thermostat.quality.server_checks import ENDPOINTS, Client, verify

HELP = "check a running server's sampling from the outside (the case study's tests)"
EPILOG = """examples:
  thermostat verify http://127.0.0.1:8000
  thermostat verify http://gpu-box:30001 --model deepseek-v4 --api-key "$KEY"
  thermostat verify http://127.0.0.1:8080 --endpoint completions --json
  thermostat verify http://127.0.0.1:8000 --endpoint messages   # as Claude Code asks

exit status: 0 healthy, 1 a check failed (e.g. the default decoding is greedy), 2 unreachable.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--endpoint",
        choices=list(ENDPOINTS),
        default="chat",
        help="the API the probes go through (responses: OpenAI's Responses API, as Codex CLI "
        "speaks; messages: Anthropic's Messages API, as Claude Code speaks)",
    )
    p.add_argument("--max-tokens", type=int, default=48, help="per request (x4 for the probe)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        client = Client(args.url, args.model, args.api_key, args.endpoint)
        checks = verify(client, args.max_tokens)
    except (httpx.HTTPError, RuntimeError, KeyError, IndexError, json.JSONDecodeError) as exc:
        console.print(f"[red]error:[/] cannot verify {args.url}: {exc}")
        return 2
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        print(
            json.dumps(
                {
                    "url": args.url,
                    "model": client.model,
                    "healthy": not failed,
                    "checks": [asdict(c) for c in checks],
                },
                indent=2,
            )
        )
    else:
        colors = {"pass": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
        table = Table(title=f"verify {args.url} (model {client.model})")
        for col in ("check", "result", "detail"):
            table.add_column(col, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{colors[c.status]}]{c.status}[/]", c.detail)
        Console().print(table)
        Console().print("[red]unhealthy[/]" if failed else "[green]healthy[/]")
    return 1 if failed else 0
