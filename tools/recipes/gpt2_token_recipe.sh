#!/usr/bin/env bash
# The README's "GPT-2 tokens" recipe end to end on one GPU: prepare -> train -> eval -> sample -> export,
# and the export reloaded by transformers with the same logits (where transformers is installed).
#   bash tools/recipes/gpt2_token_recipe.sh [WORKDIR] [STEPS]
# Text: the Python standard library's *.py files (the embedded corpus, here tokenized with GPT-2's BPE).
# Offline, GPT-2's vocabulary comes from TIKTOKEN_CACHE_DIR or LLMGPU_GPT2_RANKS (llmgpu/train/tokenizers.py).
set -euo pipefail
WORK=${1:-/tmp/llmgpu-gpt2-recipe}
STEPS=${2:-300}
rm -rf "$WORK" && mkdir -p "$WORK"
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
set -x
python3 -m llmgpu prepare "$STDLIB"/*.py --out "$WORK/shards" --tokenizer gpt2 --val-fraction 0.05
python3 -m llmgpu train --data "$WORK/shards" --preset gpt2 --steps "$STEPS" --batch 16 --seq 1024 \
    --eval-every 100 --out "$WORK/run" --no-progress
cat "$WORK/run/summary.json"
python3 -m llmgpu eval --from "$WORK/run" --data "$WORK/shards" --json "$WORK/eval.json" --quiet
python3 -m llmgpu sample --from "$WORK/run" --prompt "def main(" --tokens 60 --num-samples 2
python3 -m llmgpu export --from "$WORK/run" --to "$WORK/hf"
set +x
python3 - "$WORK" <<'PY'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1])
print("eval:", json.loads((work / "eval.json").read_text()))
try:
    import torch, transformers
except ImportError:
    print("transformers is not installed: the export was not reloaded"); sys.exit(0)
import numpy as np
import llmgpu
model = transformers.GPT2LMHeadModel.from_pretrained(work / "hf").float().eval()
ids = np.random.default_rng(0).integers(0, 50257, size=(2, 64))
with torch.no_grad():
    theirs = model(torch.tensor(ids)).logits.numpy()
ours = llmgpu.from_pretrained(work / "hf", dtype="fp32", xp=np)
mine = np.asarray(ours.forward(ids)[0])[..., :50257]
err = float(np.max(np.abs(mine - theirs)))
print(f"exported model: transformers' fp32 logits vs llmgpu's (NumPy), max |diff| = {err:.2e}")
assert err < 1e-3
PY
