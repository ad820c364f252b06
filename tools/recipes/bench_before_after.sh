#!/usr/bin/env bash
# Before/after throughput in one call: `llmgpu bench` of another checkout (BEFORE, e.g. a `git archive` of
# the previous commit) and of this one, alternated ROUNDS times, so a change is judged against the spread of
# repeated runs on the same GPU, not against a number from another day.
#   bash tools/recipes/bench_before_after.sh BEFORE_DIR OUTDIR [ROUNDS] [-- extra llmgpu bench arguments]
# Default bench arguments: --pad-vocab 64 --modes llmgpu-fast-graph (GPT-2 124M, B=64, T=1024, bf16 on a GPU).
# Writes OUTDIR/{before,after}_<round>.json and prints one line per run and the medians.
set -uo pipefail
before=$1; out=$2; rounds=${3:-2}
shift $(( $# >= 3 ? 3 : $# )); [ "${1:-}" = "--" ] && shift
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--pad-vocab 64 --modes llmgpu-fast-graph)
here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$([ $side = before ] && echo "$before" || echo "$here")
    (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" python3 -m llmgpu bench "${args[@]}" --json "$out/${side}_$r.json") \
      > "$out/${side}_$r.log" 2>&1 || echo "$side round $r failed (see $out/${side}_$r.log)"
    grep -E "^llmgpu-fast-graph|^llmgpu " "$out/${side}_$r.log" | sed "s/^/$side $r: /"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for side in ("before", "after"):
    tps = []
    for r in range(1, rounds + 1):
        try:
            rows = json.load(open(f"{out}/{side}_{r}.json"))["results"]
        except (OSError, ValueError, KeyError):
            continue
        tps += [x["tokens_per_s"] for x in rows if x.get("framework") == "llmgpu" and x.get("tokens_per_s")]
    if tps:
        print(f"{side}: median {statistics.median(tps):,.0f} tokens/s over {len(tps)} runs "
              f"(min {min(tps):,.0f}, max {max(tps):,.0f})")
PY
