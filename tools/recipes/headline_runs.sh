#!/usr/bin/env bash
# The comparisons against PyTorch that issues 36 and 37 set targets for, on the GPU at hand, each pair in one
# process (`llmgpu bench`, T=1024, bf16 storage, the same padded vocabulary on both sides):
#   fp8-pairs  chapter 5b: our bf16 step beside our FP8 step (delayed scaling) at d36 (B=16) and at d48 (B=8)
#   torchao    torchao float8 + torch.compile at each size, in a process of its own
#              (targets: our FP8 >= 1.2x our bf16 and >= 1.1x torchao; fp8 = both parts)
#   llama      chapter 10: the Llama fast step beside torch.compile's at SmolLM-360M (B=32) and SmolLM-135M (B=64)
#              (target: >= 1.1x in no more memory)
#   bash tools/recipes/headline_runs.sh [fp8|fp8-pairs|torchao|llama|all]
# Time on a fresh H100 (2026-12-07): the d36 pair 169 s (it compiles our kernels first), torchao at d36 172 s
# (torch.compile), the d48 pair 82 s, the 360M pair 135 s: split the parts across calls limited to 10 minutes.
# Writes benchmarks/results/ch5b/<card>_<size>_{bf16_and_fp8_delayed,torchao_fp8}.json and
# benchmarks/results/ch10/ch10_bench_smollm_<size>.json, which chapter 10 reads (card: h100, h200, ... from
# nvidia-smi, and the JSON names the GPU; OUT=DIR puts them all in DIR instead), each run's log beside its JSON,
# and at the end a table of the ratios between the runs of this call. A run that fails or outlives TIMEOUT seconds
# (default 300; the first run also compiles the kernels) is reported and the others go on.
set -uo pipefail
part=${1:-all}
case "$part" in
  fp8|fp8-pairs|torchao|llama|all) ;;
  *) echo "usage: $0 [fp8|fp8-pairs|torchao|llama|all]" >&2; exit 2;;
esac
wants() { case "$part" in all) return 0;; fp8) [ "$1" != llama ];; *) [ "$1" = "$part" ];; esac; }
cd "$(dirname "$0")/../.."
command -v nvidia-smi >/dev/null && gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
[ -n "${gpu:-}" ] || { echo "headline_runs.sh: no NVIDIA GPU here (nvidia-smi lists none)" >&2; exit 1; }
card=$(echo "$gpu" | grep -oE '[A-Z][0-9]{3}' | head -1 | tr 'A-Z' 'a-z'); card=${card:-gpu}
echo "$gpu, $(nvidia-smi --query-gpu=power.limit --format=csv,noheader | head -1) cap; card name '$card'"
written=()
run() {  # run PATH-WITHOUT-.json BENCH-ARGS...: one llmgpu bench process
  local path=${OUT:+$OUT/$(basename "$1")}; path=${path:-$1}; shift
  mkdir -p "$(dirname "$path")"
  local t0=$SECONDS
  echo "$(basename "$path"): running (log: $path.log) ..."
  timeout "${TIMEOUT:-300}" python3 -m llmgpu bench "$@" --json "$path.json" > "$path.log" 2>&1
  local rc=$?
  local said="done"; [ $rc = 0 ] || said="FAILED (exit $rc, see $path.log)"
  echo "$(basename "$path"): $said in $((SECONDS - t0)) s"
  [ $rc = 0 ] && written+=("$path.json")
}
for size_batch in "d36 16" "d48 8"; do
  read -r size batch <<< "$size_batch"
  wants fp8-pairs && run "benchmarks/results/ch5b/${card}_${size}_bf16_and_fp8_delayed" --preset "$size" \
    --batch "$batch" --modes llmgpu-fast-graph,llmgpu-fp8-graph --fp8-recipe delayed
  wants torchao && run "benchmarks/results/ch5b/${card}_${size}_torchao_fp8" --preset "$size" --batch "$batch" \
    --modes torch-compile-fp8
done
if wants llama; then
  run benchmarks/results/ch10/ch10_bench_smollm_360m --arch llama --preset smollm-360m --batch 32 \
    --modes llmgpu-fast-graph,torch-compile
  run benchmarks/results/ch10/ch10_bench_smollm_135m --arch llama --preset smollm-135m --batch 64 \
    --modes llmgpu-fast-graph,torch-compile
fi
[ ${#written[@]} -gt 0 ] || exit 1
echo
python3 tools/recipes/headline_table.py "${written[@]}"
