#!/usr/bin/env bash
# The runs of the multi-GPU issue (chapter 9 on several H200s), one command on a machine with N GPUs:
#   NCCL_NVLS_ENABLE=0 bash tools/recipes/multi_gpu_runs.sh [OUT_DIR]        (default benchmarks/results/ch9/multi_gpu)
# Steps (STEPS="topo correct scale ddp zero allreduce book" selects; each is bounded by STEP_TIMEOUT s):
#   topo       nvidia-smi topo -m, NCCL and CuPy versions
#   correct    N ranks vs 1 rank at the same global batch (bf16 fast step and fp32 book step; DP, ZeRO-1, ZeRO-2):
#              the loss curves, and their largest difference, into correct.json
#   scale      benchmarks/bench_ch9_step.py under torchrun on 1, 2, 4, 8 GPUs (<= N): GPT-2 124M, B=64 per GPU,
#              T=1024, bf16, the fast step as a CUDA graph; "plain" at world > 1 is the step without any
#              communication (the ceiling that shows how much of the all-reduce hides behind the backward pass)
#   ddp        benchmarks/bench_ch9_torch_ddp.py (PyTorch DDP + torch.compile, same model and batch) on the same counts
#   zero       the largest preset that trains per ZeRO stage (d48 = GPT-2 1.5B first), peak memory per rank
#   allreduce  benchmarks/bench_ch9_allreduce.py (our ring vs NCCL, 4 KiB - 1 GiB) on N GPUs, into the script's own
#              benchmarks/results/ch9/ch9_allreduce_<N>gpu.json, where chapter 9 (the book step) reads it
#   book       chapter 9 re-executed on this machine (tools/maintenance/execute_notebooks.py)
# NCCL_NVLS_ENABLE=0 must stay set on the multi-GPU hosts (NVLink multicast off); every launched rank inherits it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/ch9/multi_gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1 LLMGPU_DEVICE=gpu
N=$(nvidia-smi -L | wc -l)
STEPS=${STEPS:-"topo correct scale ddp zero allreduce book"}
T=${STEP_TIMEOUT:-900}
has() { [[ " $STEPS " == *" $1 "* ]]; }
counts() { for n in 1 2 4 8; do [[ $n -le $N ]] && echo "$n"; done; }
echo "==> $N GPU(s); results in $OUT"

if has topo; then
  { nvidia-smi topo -m; nvidia-smi -L; python3 -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())"; } > "$OUT/topo.txt" 2>&1
fi

if has correct; then
  common=(--preset tiny --batch 8 --seq 256 --steps 30 --warmup 5 --eval-every 0 --sample-tokens 0 --no-plot --log-every 1 --no-progress)
  for prec in "bf16" "fp32 --no-fast"; do
    tag=${prec%% *}
    timeout "$T" llmgpu train "${common[@]}" --dtype $prec --grad-accum "$N" --out "$OUT/correct/$tag-1rank" --overwrite
    for z in 0 1 2; do
      timeout "$T" llmgpu train --nproc "$N" "${common[@]}" --dtype $prec --zero $z --out "$OUT/correct/$tag-${N}ranks-zero$z" --overwrite
    done
  done
  python3 - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]) / "correct"
loss = lambda d: [json.loads(l)["loss"] for l in open(d / "log.jsonl") if '"train"' in l]
res = {}
for one in sorted(out.glob("*-1rank")):
    tag = one.name.split("-")[0]
    for d in sorted(out.glob(f"{tag}-*ranks-zero*")):
        a, b = loss(one), loss(d)
        res[d.name] = {"max_abs_diff": max(abs(x - y) for x, y in zip(a, b)), "steps": len(b), "final": b[-1], "ref_final": a[-1]}
json.dump(res, open(out.parent / "correct.json", "w"), indent=1)
print(json.dumps(res, indent=1))
EOF
fi

if has scale; then
  for n in $(counts); do
    timeout "$T" torchrun --nproc-per-node "$n" benchmarks/bench_ch9_step.py --out "$OUT/ch9_step_${n}gpu.json"
  done
fi

if has ddp; then
  for n in $(counts); do
    timeout "$T" torchrun --nproc-per-node "$n" benchmarks/bench_ch9_torch_ddp.py --out "$OUT/ch9_ddp_${n}gpu.json"
  done
fi

if has zero; then
  mkdir -p "$OUT/zero"
  for preset in d48 d36 d24; do
    for z in 0 1 2; do
      timeout "$T" llmgpu train --nproc "$N" --preset "$preset" --zero $z --batch 8 --seq 1024 --steps 5 --eval-every 0 \
        --sample-tokens 0 --no-plot --no-progress --out "$OUT/zero/$preset-zero$z" --overwrite > "$OUT/zero/$preset-zero$z.log" 2>&1 \
        && echo "$preset zero $z: trains" || echo "$preset zero $z: does not fit or failed (see the log)"
    done
  done | tee "$OUT/zero.txt"
fi

if has allreduce && [[ -f benchmarks/bench_ch9_allreduce.py ]]; then
  timeout "$T" torchrun --nproc-per-node "$N" benchmarks/bench_ch9_allreduce.py
fi

if has book; then
  timeout "$T" python3 tools/maintenance/execute_notebooks.py book/09_multi_gpu.ipynb
fi
echo "==> done: $OUT"
