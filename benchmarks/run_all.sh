#!/usr/bin/env bash
# Every benchmark that needs no outside peer, one after another, each recording its table in
# benchmarks/results/ (the docs' benchmarks page). Run it on a quiet machine: a second busy process
# makes 2-thread runs several times slower. Peers when given: VLLM_VENV=DIR (vLLM's CPU build, see
# setup_vllm.sh) adds its prefill rows. About an hour on 2 cores.
#   benchmarks/run_all.sh [NAME ...]       # all, or only these (e.g. bench_engine bench_http)
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
declare -A runs=(
  [bench_engine]="benchmarks/bench_engine.py --batches 1 32 --repeats 3"
  [bench_engine_formats]="benchmarks/bench_engine.py --formats bf16 int8 int4 --batches 1 32 --repeats 3 --skip-transformers"
  [bench_http]="benchmarks/bench_http.py --concurrency 1 32 --repeats 3"
  [bench_structured]="benchmarks/bench_structured.py"
  [bench_speculative]="benchmarks/bench_speculative.py --repeats 3"
  [bench_gateway]="benchmarks/bench_gateway.py --repeats 3"
  [bench_pd]="benchmarks/bench_pd.py"
  [bench_deepseek_v3]="benchmarks/bench_deepseek.py --family v3"
  [bench_deepseek_v4]="benchmarks/bench_deepseek.py --family v4"
  [bench_console]="benchmarks/bench_console.py --repeats 3"
  [quant_accuracy]="benchmarks/quant_accuracy.py"
  [calibrate_quality]="benchmarks/calibrate_quality.py --chunks 3000 --seed 0"
  [bench_long_context]="benchmarks/bench_long_context.py --repeats 1"
  [bench_prefill]="benchmarks/bench_prefill.py --repeats 2${VLLM_VENV:+ --vllm $VLLM_VENV}"
  [bench_chunk_budget]="benchmarks/bench_chunk_budget.py --repeats 2"
)
order=(bench_engine bench_engine_formats bench_http bench_structured bench_speculative bench_gateway
  bench_pd bench_deepseek_v3 bench_deepseek_v4 bench_console quant_accuracy calibrate_quality
  bench_long_context bench_prefill bench_chunk_budget)
for name in "$@"; do
  [[ -n "${runs[$name]:-}" ]] || { echo "unknown benchmark: $name (one of: ${order[*]})" >&2; exit 2; }
done
failed=()
for name in "${@:-${order[@]}}"; do
  echo "== $name: python ${runs[$name]}" >&2
  # shellcheck disable=SC2086  # the arguments are words
  $py ${runs[$name]} || failed+=("$name")
done
[[ ${#failed[@]} -eq 0 ]] || { echo "failed: ${failed[*]}" >&2; exit 1; }
