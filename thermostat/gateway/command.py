"""`thermostat gateway --upstream URL`: serve's sampling policy and monitoring in front of one
OpenAI-compatible upstream. Torch is never imported on this path."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from thermostat.api.arguments import (
    add_listen_arguments,
    add_operations_arguments,
    add_policy_arguments,
    add_stop_on_loop_argument,
)
from thermostat.api.config import edge_options
from thermostat.api.lifecycle import DrainingServer, serve_until_stopped
from thermostat.gateway.app import create_gateway_app
from thermostat.gateway.config import GatewayConfig
from thermostat.gateway.kinds import KINDS

HELP = "serve Thermostat's sampling policy in front of vLLM, SGLang, llama.cpp or any OpenAI API"
EPILOG = """examples:
  thermostat gateway --upstream http://127.0.0.1:30000 --sampling-defaults recommended \\
      --model ~/models/DeepSeek-V3                    # SGLang; its model's files known here
  thermostat gateway --upstream http://gpu:8000/ --sampling-defaults temperature=0.6,top_p=0.95
  thermostat gateway --upstream http://127.0.0.1:8080 --min-temperature 0.3 --stop-on-loop
  thermostat gateway --upstream https://api.example.com --upstream-kind openai \\
      --upstream-api-key "$UPSTREAM_KEY" --api-key "$KEY"

  curl localhost:8000/v1/sampling/defaults           # what the gateway sends for omitted fields
  thermostat verify http://127.0.0.1:8000            # the fix, checked from the outside

exit status: 0 after a clean shutdown, 1 the defaults cannot apply, 2 bad flags.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", required=True, metavar="URL", help="the upstream's base URL")
    p.add_argument("--upstream-kind", default="auto", choices=["auto", *KINDS],
                   help="how to name fields upstream (auto: found from its routes)")  # fmt: skip
    p.add_argument(
        "--upstream-api-key",
        default=os.environ.get("THERMOSTAT_UPSTREAM_API_KEY"),
        metavar="KEY",
        help="sent upstream as Bearer (the client's key never is; "
        "default: $THERMOSTAT_UPSTREAM_API_KEY)",
    )
    p.add_argument("--upstream-timeout", type=float, default=300.0, metavar="S",
                   help="the longest silence from the upstream before a 504")  # fmt: skip
    known = p.add_mutually_exclusive_group()
    known.add_argument("--generation-config", type=Path, metavar="PATH",
                       help="the model's generation_config.json")  # fmt: skip
    known.add_argument("--model", type=Path, metavar="DIR",
                       help="the model dir (generation_config.json, config.json)")  # fmt: skip
    add_listen_arguments(p)
    s = p.add_argument_group("sampling")
    add_policy_arguments(s)
    add_stop_on_loop_argument(s)
    add_operations_arguments(p.add_argument_group("operations"))


def config_from(args: argparse.Namespace) -> GatewayConfig:
    """Raises ValueError naming the bad flag."""
    return GatewayConfig(
        upstream=args.upstream,
        upstream_kind=args.upstream_kind,
        upstream_api_key=args.upstream_api_key,
        upstream_timeout_s=args.upstream_timeout,
        generation_config=args.generation_config or args.model,
        stop_on_loop=args.stop_on_loop,
        **edge_options(args),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"thermostat gateway: error: {exc}", file=sys.stderr)
        return 2
    return serve_until_stopped(DrainingServer(create_gateway_app(config), config))
