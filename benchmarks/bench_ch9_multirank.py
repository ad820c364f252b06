"""Chapter 9 with several NCCL ranks on one GPU: N ranks against one rank, our ring against NCCL's all-reduce.

Runs tests/workers/dist_gpu.py as 2 and 4 ranks (``--worlds``) through llmgpu's GPU launcher, in both its modes,
and writes what rank 0 reports to benchmarks/results/ch9/ch9_multirank_one_gpu.json, with the NCCL build's
record (.nccl/build.json, from tools/recipes/nccl_multirank.sh). Needs an NCCL that lets ranks share a GPU:
run it under ``eval "$(bash tools/recipes/nccl_multirank.sh env)"``. No timings: ranks that share one GPU share its
SMs and bandwidth, so speed here says nothing about N GPUs. On a CPU it says why it cannot run and writes nothing.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
from pathlib import Path

import _common

from llmgpu import backend
from llmgpu.dist import ranks_may_share_gpus
from llmgpu.dist.launch import RANK_DIR_VAR, _launch_gpu

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "dist_gpu.py"
RESULTS = _common.RESULTS_DIR / "ch9" / "ch9_multirank_one_gpu.json"


def run_worker(world: int, mode: str) -> dict:
    import os

    with tempfile.TemporaryDirectory(prefix="llmgpu-multirank-") as d:
        out = Path(d) / "out.json"
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   **{RANK_DIR_VAR: d})
        rc = _launch_gpu(world, [sys.executable, str(WORKER), mode, str(out)], env, d, print)
        if rc != 0:
            raise SystemExit(f"{world} ranks, {mode}: the ranks exited with code {rc}")
        return json.loads(out.read_text())


def main():
    ap = _common.parser(__doc__, reps=None, no_torch=False)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="numbers of ranks (default 2 4)")
    args = ap.parse_args()
    if backend.gpu_unavailable_reason():
        print(f"needs a GPU: {backend.gpu_unavailable_reason()}")
        return
    cp = backend.require_gpu()
    why = ranks_may_share_gpus() if cp.cuda.runtime.getDeviceCount() < max(args.worlds) else None
    if why:
        raise SystemExit(f"{max(args.worlds)} ranks on this machine's GPUs: {why}")
    build = ROOT / ".nccl" / "build.json"
    res = {"date": datetime.date.today().isoformat(), "device": backend.device_info(cp).summary(),
           "nccl_build": json.loads(build.read_text()) if build.exists() else None, "worlds": {}}
    out = args.out or RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    for w in args.worlds:  # the file is rewritten after each world size: a run cut short keeps what it finished
        res["worlds"][str(w)] = {mode: run_worker(w, mode) for mode in ("equal", "ring")}
        res["nccl"] = res["worlds"][str(w)]["ring"]["nccl"]
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"{w} ranks: done, wrote {out}")


if __name__ == "__main__":
    main()
