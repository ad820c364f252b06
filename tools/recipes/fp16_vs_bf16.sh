#!/usr/bin/env bash
# Chapter 8 §10: GPT-2 124M on GPT-2 tokens for 300 steps of the fast step in bf16 and in fp16 (loss scaler),
# same seed and data; writes benchmarks/results/ch8/ch8_bf16_vs_fp16.{json,png} (curves, skipped steps, val loss).
#   bash tools/recipes/fp16_vs_bf16.sh [WORKDIR] [STEPS]
# Text: the Python standard library's *.py files in GPT-2 tokens; offline, GPT-2's vocabulary comes from
# TIKTOKEN_CACHE_DIR or LLMGPU_GPT2_RANKS (llmgpu/train/tokenizers.py).
set -euo pipefail
WORK=${1:-/tmp/llmgpu-fp16-vs-bf16}
STEPS=${2:-300}
rm -rf "$WORK" && mkdir -p "$WORK"
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
python3 -m llmgpu prepare "$STDLIB"/*.py --out "$WORK/shards" --tokenizer gpt2 --val-fraction 0.05 --quiet
for d in bf16 fp16; do
  python3 -m llmgpu train --data "$WORK/shards" --preset gpt2 --fast --dtype "$d" --steps "$STEPS" --eval-every 100 \
      --sample-tokens 0 --no-plot --no-progress --out "$WORK/$d"
done
python3 tools/recipes/compare_runs.py "$WORK/bf16" "$WORK/fp16" --png benchmarks/results/ch8/ch8_bf16_vs_fp16.png \
    --json benchmarks/results/ch8/ch8_bf16_vs_fp16.json
