"""`thermostat explain`: the resolution of a request, field by field, with the source of each
value and the policies that changed it. Offline from a model directory, or asked of a server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from thermostat.sampling import GreedyRejected, Policy, resolve
from thermostat.sampling.spec import parse_sampling_spec

HELP = "show how a request's sampling values are resolved, and where each comes from"
EPILOG = """examples:
  thermostat explain --model demo                                 # a request with no fields
  thermostat explain --model demo request.json --sampling-defaults recommended
  echo '{"temperature": 0}' | thermostat explain --model DIR - --min-temperature 0.3
  thermostat explain http://127.0.0.1:8000 request.json           # ask a running server

REQUEST.json is a chat or completions body (with "prompt" it is read as completions).
exit status: 0 resolved, 1 the server's policy rejects the request, 2 bad input.
"""


class RequestRefused(Exception):
    """The server refused the request (4xx): a policy or a bad value."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "target", nargs="?", help="a server URL; omit it and give --model to explain offline"
    )
    p.add_argument("request", nargs="?", help="REQUEST.json, or - for stdin (default: {})")
    p.add_argument("--model", help="model directory ('demo' for the bundled model)")
    p.add_argument("--sampling-defaults", metavar="SPEC", help="as for serve")
    p.add_argument("--min-temperature", type=float, metavar="T", help="as for serve")
    p.add_argument("--greedy", choices=["allow", "reject"], default="allow", help="as for serve")
    p.add_argument("--api-key", help="with a URL: sent as Authorization: Bearer KEY")
    p.add_argument("--json", action="store_true", help="print the table as JSON")


def _read_request(arg: str | None) -> Any:
    if arg is None:
        return {}
    text = sys.stdin.read() if arg == "-" else Path(arg).read_text()
    return json.loads(text)


def explain_offline(args: argparse.Namespace, raw: Any) -> dict[str, Any]:
    from thermostat.api.defaults import DefaultsReport
    from thermostat.api.request_params import parse_body, to_sampling_params
    from thermostat.engine.loader import model_config_dict, resolve_model_path

    model_dir = resolve_model_path(args.model)
    policy = Policy(min_temperature=args.min_temperature, greedy=args.greedy)
    operator = parse_sampling_spec(args.sampling_defaults)
    config_dict = model_config_dict(model_dir)
    defaults = DefaultsReport.for_model(model_dir, model_dir.name, operator, policy, config_dict)
    resolution = resolve(to_sampling_params(parse_body(raw)), defaults.layers)
    return {"model": str(model_dir), "sampling": resolution.to_dict()}


def explain_remote(args: argparse.Namespace, raw: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.post(
        f"{args.target.rstrip('/')}/v1/sampling/explain", json=raw, headers=headers, timeout=30
    )
    if r.status_code >= 400:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise RequestRefused(f"the server answered {r.status_code}: {message}")
    return r.json()


def render(result: dict[str, Any]) -> Table:
    sampling = result["sampling"]
    adjusted = {a["param"]: a for a in sampling["adjusted"]}
    table = Table(title=f"sampling resolution ({result['model']})")
    for col in ("parameter", "value", "source", "adjusted by policy"):
        table.add_column(col)
    for name, value in sampling["effective"].items():
        adj = adjusted.get(name)
        note = f"{adj['requested']} -> {adj['applied']} ({adj['policy']})" if adj else ""
        source = sampling["source"].get(name, "request" if value is not None else "-")
        shown = "prompt's room" if source == "context_length" and value is None else value
        table.add_row(name, str(shown), source, note)
    return table


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    remote = args.target is not None and args.target.startswith(("http://", "https://"))
    if not remote and args.target is not None:  # `explain REQUEST.json --model DIR`
        args.request, args.target = args.target, None
    if not remote and args.model is None:
        console.print("[red]error:[/] give a server URL, or --model DIR to explain offline")
        return 2
    try:
        raw = _read_request(args.request)
        result = explain_remote(args, raw) if remote else explain_offline(args, raw)
    except (GreedyRejected, RequestRefused) as exc:
        console.print(f"[yellow]refused:[/] {exc}")
        return 1
    except (OSError, ValueError, httpx.HTTPError) as exc:  # ValueError: bad JSON, spec or fields
        console.print(f"[red]error:[/] {exc}")
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        Console().print(render(result))
    return 0
