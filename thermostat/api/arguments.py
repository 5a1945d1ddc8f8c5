"""The flags `serve` and the gateway share, and what they mean."""

from __future__ import annotations

import argparse
import os


def add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """--host and --port (serve and gateway)."""
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on")


def add_stop_on_loop_argument(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--stop-on-loop",
        action="store_true",
        help="end a generation once it certainly loops (finish_reason stop, stop_reason loop)",
    )


def add_policy_arguments(s: argparse._ActionsContainer) -> None:
    """--sampling-defaults, --min-temperature, --greedy (serve and gateway): see `edge_options`."""
    s.add_argument(
        "--sampling-defaults",
        metavar="SPEC",
        help="operator defaults: key=value,... | a JSON file | 'recommended' (the family's "
        "published values); they beat generation_config.json. max_tokens=N caps requests that "
        "omit it (without it they run to the end of the context)",
    )
    s.add_argument(
        "--min-temperature",
        type=float,
        metavar="T",
        help="raise any lower temperature to T, an explicit 0 included (recorded as adjusted)",
    )
    s.add_argument(
        "--greedy",
        default="allow",
        choices=["allow", "reject"],
        help="what to do with an explicit temperature 0 (reject: 400 that explains why)",
    )


def add_operations_arguments(o: argparse._ActionsContainer) -> None:
    """--max-queue, --api-key, --drain-timeout, the console, --max-body-mb (serve and gateway)."""
    o.add_argument("--max-queue", type=int, metavar="N", help="503 + Retry-After at N waiting")
    o.add_argument(
        "--api-key",
        default=os.environ.get("THERMOSTAT_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 "
        "(default: $THERMOSTAT_API_KEY)",
    )
    o.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="on SIGTERM, seconds in-flight requests may take to finish",
    )
    o.add_argument("--no-console", action="store_true", help="do not serve the page at /console")
    o.add_argument(
        "--console-keep-text",
        action="store_true",
        help="the console's recent requests keep each output's text (default: not kept)",
    )
    o.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        metavar="MB",
        help="request bodies larger than this get a 413 before they are read",
    )
    o.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        metavar="N",
        help="/v1/responses keeps the last N stored responses (previous_response_id, GET); "
        "older ones are dropped, a request with store=false keeps nothing",
    )
