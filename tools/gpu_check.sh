#!/usr/bin/env bash
# Every GPU check of the project, in one command, on a machine with an NVIDIA GPU:
#   bash tools/gpu_check.sh [OUTDIR]          (default OUTDIR: gpu_results/)
# 1. device facts and the kernel compile check
# 2. pytest with LLMGPU_REQUIRE_GPU=1 (a GPU test that would skip is a failure here)
# 2b. compute-sanitizer memcheck and racecheck over tools/checks/sanitize_kernels.py: each of our kernels once at
#     small sizes plus a tiny GPT / FastGPT step without cuDNN; only our kernels are checked (library
#     GEMMs excluded); a missing compute-sanitizer is a failure (SANITIZE_TIMEOUT: seconds per tool, 150)
# 3. `llmgpu bench` against PyTorch (benchmarks/results/ch8/ch8_bench*.json, read by the chapter 8 notebook), its
#    scale table, the step and cuBLASLt probes, the 300-step bf16/fp16 comparison (tools/recipes/fp16_vs_bf16.sh)
# 4. the benchmarks (each writes benchmarks/results/<chapter>/*.json), the LayerNorm backward probe and dev/cuda's
#    wgmma probe and wgmma flash forward
# 5. nbval over every notebook (each runs top to bottom on the GPU backend)
# 6. the notebooks executed in place, so their committed outputs come from this GPU (and read step 3-4's results)
# 7. (multirank) several NCCL ranks on one GPU: NCCL 2.30 built from source (tools/recipes/nccl_multirank.sh; the
#    build, CPU work, runs beside steps 2-6), then the multi-rank GPU tests and benchmarks/bench_ch9_multirank.py
# then packs logs, executed notebooks and results into OUTDIR/gpu_results.tar.gz.
# STEPS="tests sanitize llmbench nbval execute bench multirank" selects steps; PYTEST_ARGS adds pytest arguments;
# STEP_TIMEOUT (seconds, default none) bounds each step, so one slow step cannot starve the rest.
# Without network (the lab's H200): wheels in ./.whl are installed first (tools/maintenance/gpu_wheels.sh fetches them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_results}
mkdir -p "$OUT/logs"
STEPS=${STEPS:-"tests sanitize llmbench nbval execute bench multirank"}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 LLMGPU_DEVICE=gpu  # no MPLBACKEND: notebooks need the inline backend
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
status=0
run() {  # run NAME CMD...: log to $OUT/logs/NAME.log, remember failures, keep going
  local name=$1; shift
  local t0=$SECONDS
  echo "==> $name: $*"
  timeout "${STEP_TIMEOUT:-0}" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/logs/$name.log"
  echo "<== $name: exit $rc ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || { status=1; echo "$name" >> "$OUT/logs/FAILED"; }
}
has() { [[ " $STEPS " == *" $1 "* ]]; }

if has multirank; then  # CPU work: beside the GPU steps, its own log
  echo "==> nccl_build (in the background; JOBS=${JOBS:-$(nproc)})"
  (bash tools/recipes/nccl_multirank.sh build > "$OUT/logs/nccl_build.log" 2>&1; echo $? > "$OUT/logs/nccl_build.rc") &
  build_pid=$!
fi
run device python3 -c "import llmgpu, cupy; print(llmgpu.device_info().summary()); print('cupy', cupy.__version__)"
run compile python3 -m llmgpu.kernels.compile_check -a sm_90
# pytest-xdist (in the test extra) spreads the suite over 8 processes sharing the GPU: 96 s instead of ~9 min
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
has tests && run pytest env LLMGPU_REQUIRE_GPU=1 python3 -m pytest -q -rs --durations=15 -p no:cacheprovider $xdist ${PYTEST_ARGS:-} tests
if has sanitize; then
  if san=$(python3 tools/checks/sanitize_kernels.py --find-sanitizer); then
    for tool in memcheck racecheck; do
      # shellcheck disable=SC2046  # the filter options are one word each
      run "sanitize_$tool" timeout "${SANITIZE_TIMEOUT:-150}" "$san" --tool "$tool" --error-exitcode 1 \
        $(python3 tools/checks/sanitize_kernels.py --filter-args "$tool") python3 tools/checks/sanitize_kernels.py \
        $([[ $tool == racecheck ]] && echo --no-library)
    done
  else
    echo "==> sanitize: compute-sanitizer not found (install the CUDA toolkit's, or put the"
    echo "    nvidia-cuda-sanitizer-api wheel in .whl: bash tools/maintenance/gpu_wheels.sh 'nvidia-cuda-sanitizer-api==13.*')"
    status=1; echo "sanitize (compute-sanitizer not found)" >> "$OUT/logs/FAILED"
  fi
fi
if has llmbench; then
  run llmgpu_bench python3 -m llmgpu bench --pad-vocab 0 --json benchmarks/results/ch8/ch8_bench.json  # unpadded torch (the pair of the padded run below)
  run llmgpu_bench_padded python3 -m llmgpu bench --pad-vocab 64 --modes llmgpu-fast-graph,torch-compile \
    --json benchmarks/results/ch8/ch8_bench_padded.json
  # chapter 8: the fair comparison (both padded, PyTorch's faster SDPA backend) and its unpadded pair
  run llmgpu_bench_fair python3 -m llmgpu bench --modes llmgpu-fast-graph,torch-compile,torch-compile-unpadded \
    --json benchmarks/results/ch8/ch8_bench_fair.json
  run llmgpu_bench_fair_chunked python3 -m llmgpu bench --modes llmgpu-fast-graph,torch-compile \
    --json benchmarks/results/ch8/ch8_bench_fair_chunked.json
  # the scale table one framework per process (after an out-of-memory error torch.compile's later tries in the
  # same process ran out of memory too); PyTorch from a batch that fits (2026-12-01, H200), each row saved at once
  for p in gpt2 d24 d36 d48; do
    run "scale_llmgpu_$p" python3 -m llmgpu bench --preset $p --scale-table --modes llmgpu-fast-graph --checkpoint-every 1
  done
  for pb in gpt2:256 d24:64 d36:32 d48:16; do
    run "scale_torch_${pb%%:*}" python3 -m llmgpu bench --preset "${pb%%:*}" --scale-table --modes torch-compile \
      --batch "${pb##*:}" --checkpoint-every 1
  done
  run probe_fast_step python3 tools/probes/probe_fast_step.py --json benchmarks/results/ch8/ch8_probe_step.json
  run probe_lt_algos python3 tools/probes/probe_lt_algos.py --json benchmarks/results/ch8/lt_algo_probe.json
  run probe_gelu_epilogue python3 tools/probes/probe_gelu_epilogue.py --json benchmarks/results/ch8/gelu_epilogue_probe.json
  run fp16_vs_bf16 bash tools/recipes/fp16_vs_bf16.sh
fi
# the benchmarks before the notebooks, which read their results
if has bench; then
  for b in benchmarks/bench_*.py; do
    [[ $b == *multirank* ]] && continue  # needs the NCCL that the multirank step builds
    run "bench_$(basename "$b" .py)" python3 "$b"
  done
  run probe_layernorm_backward python3 tools/probes/probe_layernorm_backward.py --json benchmarks/results/ch3/probe_layernorm_backward.json
  # issue 16's wgmma route: the layout facts first, then the forward built on them (dev/cuda/flash_wgmma_plan.md)
  run wgmma_probe python3 dev/cuda/wgmma_probe.py --json benchmarks/results/ch2b/wgmma_probe.json
  run flash_fwd_wgmma python3 dev/cuda/flash_fwd_wgmma.py --json benchmarks/results/ch2b/flash_fwd_wgmma.json
  # the flash kernels' launch order (heads in groups): every group size, bitwise checks (flash_launch.tile_group's rule)
  run flash_tile_order python3 dev/cuda/flash_tile_order.py --json benchmarks/results/ch2b/flash_tile_order.json
fi
has nbval && run nbval python3 -m pytest -q --nbval-lax --nbval-current-env -p no:cacheprovider book/
has execute && run execute python3 tools/maintenance/execute_notebooks.py book/*.ipynb
if has multirank; then
  wait "$build_pid"
  tail -n 3 "$OUT/logs/nccl_build.log"
  if [ "$(cat "$OUT/logs/nccl_build.rc")" = 0 ]; then
    cp .nccl/build.json "$OUT/logs/nccl_build.json"
    run multirank_tests bash tools/recipes/nccl_multirank.sh test "$OUT/logs/multirank"
    # shellcheck disable=SC2046  # the export lines
    run multirank_bench env $(bash tools/recipes/nccl_multirank.sh env | sed 's/^export //') \
      python3 benchmarks/bench_ch9_multirank.py
  else
    status=1; echo "nccl_build" >> "$OUT/logs/FAILED"
  fi
fi
tar czf "$OUT/gpu_results.tar.gz" "$OUT/logs" book/*.ipynb benchmarks/results 2>/dev/null
echo "packed $OUT/gpu_results.tar.gz; status $status"
[ -f "$OUT/logs/FAILED" ] && { echo "failed steps:"; cat "$OUT/logs/FAILED"; }
exit $status
