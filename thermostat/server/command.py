"""`thermostat serve`: flags -> ServerConfig -> the app under uvicorn.

Configuration errors (a bad --sampling-defaults, a missing model directory, a `recommended` for a
family without one) are reported on stderr with exit status 2 before anything loads.
"""

from __future__ import annotations

import argparse
import sys

from thermostat.api.arguments import (
    add_listen_arguments,
    add_operations_arguments,
    add_policy_arguments,
    add_stop_on_loop_argument,
)
from thermostat.api.config import edge_options
from thermostat.api.lifecycle import DrainingServer, serve_until_stopped
from thermostat.api.tool_parsers import PARSERS
from thermostat.engine.config import QUANTIZATIONS, EngineConfig
from thermostat.engine.speculative import METHODS
from thermostat.server.config import ServerConfig

HELP = (
    "serve a model over the OpenAI API (chat, completions, Responses) and Anthropic's Messages API"
)
EPILOG = """examples:
  thermostat serve                                    # the bundled demo model on 127.0.0.1:8000
  thermostat serve --model ~/models/Qwen3-0.6B --sampling-defaults recommended
  thermostat serve --model DIR --sampling-defaults temperature=0.6,top_p=0.95
  thermostat serve --model DIR --sampling-defaults defaults.json --min-temperature 0.3
  thermostat serve --model DIR --greedy reject --max-queue 64 --api-key "$KEY"
  thermostat serve --model DIR --port 30001 --disaggregation-mode prefill \
      --disaggregation-bootstrap-port 8998             # behind smg, with a decode server
  thermostat serve --model DIR --port 30002 --disaggregation-mode decode

  curl localhost:8000/v1/sampling/defaults           # what a request that omits fields gets
  ANTHROPIC_BASE_URL=http://127.0.0.1:8000 claude --model demo   # Claude Code (Messages API)
  # Codex CLI: a model provider with base_url http://127.0.0.1:8000/v1, wire_api "responses"

exit status: 0 after a clean shutdown, 1 the model failed to load, 2 bad flags or configuration.
"""
ENGINE_DEFAULTS = EngineConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo", help="model directory, or 'demo' (the default)")
    p.add_argument("--served-model-name", help="the name clients use (default: directory name)")
    add_listen_arguments(p)
    e = p.add_argument_group("engine")
    e.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the compute dtype (auto: the one config.json declares, float32 if none)",
    )
    e.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "fp8_e4m3"],
        help="the KV cache dtype (auto: the compute dtype; fp8_e4m3: a scale per head vector)",
    )
    e.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="serve the weights in int8 (blocks of 32, q8_0's arithmetic) or int4 (4-bit, "
        "blocks of 32), quantized at load (default: as the checkpoint stores them)",
    )
    e.add_argument(
        "--speculative",
        choices=METHODS,
        default=ENGINE_DEFAULTS.speculative,
        help="ngram: requests propose the tokens that followed their last n-gram earlier in the "
        "prompt or output; mtp: the checkpoint's multi-token-prediction layer proposes "
        "(DeepSeek-V3); the model checks the proposals in one step (greedy and seeded output "
        "the same, sampled output the same distribution)",
    )
    e.add_argument(
        "--speculative-k",
        type=int,
        default=ENGINE_DEFAULTS.speculative_k,
        metavar="K",
        help="tokens proposed per step at most",
    )
    e.add_argument(
        "--speculative-max-running",
        type=int,
        default=ENGINE_DEFAULTS.speculative_max_running,
        metavar="N",
        help="requests propose only while at most N run (a step's cost grows with its rows "
        "once the weights' reading no longer dominates)",
    )
    e.add_argument(
        "--max-num-seqs",
        type=int,
        default=ENGINE_DEFAULTS.max_num_seqs,
        help="sequences running at once at most",
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=ENGINE_DEFAULTS.max_num_batched_tokens,
        help="tokens per engine step at most (longer prompts are prefilled in chunks)",
    )
    e.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=ENGINE_DEFAULTS.kv_cache_memory_gb,
        help=(
            "memory for K/V; sets the number of KV blocks (at most twice what --max-num-seqs "
            "sequences of the full context hold)"
        ),
    )
    e.add_argument("--max-model-len", type=int, help="default: the model's context length")
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of a prompt's prefix that an earlier request computed",
    )
    e.add_argument("--num-threads", type=int, help="torch threads (default: all cores)")
    add_stop_on_loop_argument(e)
    s = p.add_argument_group("sampling")
    add_policy_arguments(s)
    s.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        help="the tool-call format the model writes (default: by model family: Llama 3 "
        "llama3_json, Mistral mistral, DeepSeek deepseek_v3/v31/v32/v4 by model type and chat "
        "template, others hermes)",
    )
    add_operations_arguments(p.add_argument_group("operations"))

    d = p.add_argument_group("disaggregation (behind SGLang's router, smg --pd-disaggregation)")
    d.add_argument(
        "--disaggregation-mode",
        choices=["prefill", "decode"],
        help="serve one half of each request: prefill hands the prompt's KV and first token "
        "to the decode that claims it; decode continues from there and answers the client",
    )
    d.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        metavar="N",
        help="prefill: the TCP port decodes claim KV from (the port given to smg --prefill)",
    )
    d.add_argument(
        "--disaggregation-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="decode: how long to wait for a prefill's KV; prefill: how long to keep it",
    )


def config_from(args: argparse.Namespace) -> ServerConfig:
    """Raises ValueError (SpecError and SamplingParamError among them) naming the bad flag."""
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        num_threads=args.num_threads,
        stop_on_loop=args.stop_on_loop,
        speculative=args.speculative,
        speculative_k=args.speculative_k,
        speculative_max_running=args.speculative_max_running,
    )
    return ServerConfig(
        engine=engine,
        served_model_name=args.served_model_name,
        **edge_options(args),
        disaggregation_mode=args.disaggregation_mode,
        bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_timeout_s=args.disaggregation_timeout,
        tool_call_parser=args.tool_call_parser,
    )


def run(args: argparse.Namespace) -> int:
    from thermostat.server.app import create_app  # the engine and torch: not for `--help`

    try:
        config = config_from(args)
        app = create_app(config)  # reads config.json and generation_config.json; no weights
    except ValueError as exc:  # ModelLoadError is one
        print(f"thermostat serve: error: {exc}", file=sys.stderr)
        return 2
    return serve_until_stopped(DrainingServer(app, config))
