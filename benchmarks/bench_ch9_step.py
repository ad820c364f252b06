"""Chapter 9 benchmark: what the distributed step costs on one GPU, and the memory ZeRO saves per rank.

The training step of GPT-2 124M (the fast model, bf16, B=64, T=1024, vocabulary padded to 50304, as one CUDA
graph) four ways in one run: the plain step, data parallelism through NCCL at world size 1 (bucket
all-reduces on a communication stream, inside the graph), ZeRO-1 and ZeRO-2 through NCCL. At one rank the
collectives move nothing, so the ratio to the plain step is the price of the machinery (events, the
second stream, NCCL's kernels, ZeRO's extra passes): the target is within 2 %. With the step time, the
memory: the CuPy pool's peak and the bytes of parameter-sized state (weights, gradients, moments) per rank.

Run it on a machine with several GPUs under a launcher for the scaling figures (tokens/s per world size):

    python benchmarks/bench_ch9_step.py                       # one GPU: writes benchmarks/results/ch9/ch9_step.json
    torchrun --nproc-per-node 2 benchmarks/bench_ch9_step.py --out benchmarks/results/ch9/ch9_step_2gpu.json
    python benchmarks/bench_ch9_step.py --quick               # a small model (the default on a CPU)
"""

from __future__ import annotations

import time

import _common
import numpy as np

from llmgpu import backend
from llmgpu.dist import DataParallelSync, ZeroSync
from llmgpu.dist.comm import LocalComm
from llmgpu.model import FastGPT, GPTConfig
from llmgpu.optim.params import ALIGN
from llmgpu.train.config import TrainConfig
from llmgpu.train.ranks import connect
from llmgpu.train.step import TrainStep

RESULTS = _common.RESULTS_DIR / "ch9" / "ch9_step.json"
CASES = ("plain", "dp", "zero1", "zero2")


def comm_for(xp):
    """The communicator of this process, as ``llmgpu train`` makes it: NCCL on GPUs (even at world size 1),
    MPI on CPU ranks."""
    return connect(TrainConfig(dist_backend="auto" if xp is np else "nccl"), xp)


def state_bytes(step) -> int:
    """Bytes of parameter-sized arrays this rank holds: master, working, gradient, moments (and shards)."""
    P, seen, total = step.params, set(), 0
    sync = step.grad_sync
    arrays = [P.data, P.working, P.grad] + ([P.m, P.v] if P.has_moments else [])
    if isinstance(sync, ZeroSync):
        sh = sync.shard
        arrays += [sh.data, sh.working, sh.grad, sh.m, sh.v, sync._tmp if sync.zero_stage == 2 else None]
    for a in arrays:
        if a is not None and id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total


def run_case(case, cfg, xp, comm, batch, seq, reps):
    xp.get_default_memory_pool().free_all_blocks()
    m = FastGPT(cfg, dtype="bf16", xp=xp, seed=0, param_multiple=ALIGN * comm.world_size)
    sync = None
    if case == "dp":
        sync = DataParallelSync(comm, m.params)
    elif case.startswith("zero"):
        sync = ZeroSync(comm, m.params, stage=int(case[-1]))
    st = TrainStep(m, TrainConfig(lr=6e-4), graph=xp is not np, grad_sync=sync)
    rng = np.random.default_rng(comm.rank)
    batches = [tuple(backend.to_device(rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32), xp)
                     for _ in range(2))]
    pool = xp.get_default_memory_pool() if xp is not np else None
    for _ in range(4):  # two eager warm-up steps, the capture, one replay
        st(batches, 6e-4)
    backend.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = st(batches, 6e-4)
        backend.synchronize()
        times.append(time.perf_counter() - t)
    loss = float(backend.to_numpy(out)[0])
    peak = None
    if pool is not None:  # the pools keep freed blocks: their size is the high-water mark (llmgpu/bench.py)
        g = st.graph
        peak = int(pool.total_bytes()) + (int(g.pool.total_bytes()) if g is not None and g.pool else 0)
    med = float(np.median(times))
    res = {"case": case, "ms": med * 1e3, "tokens_per_s": batch * seq * comm.world_size / med, "loss": loss,
           "state_bytes": state_bytes(st), "pool_peak_bytes": peak,
           "buckets": len(getattr(st.grad_sync, "buckets", ()))}
    del st, m
    return res


def main():
    ap = _common.parser(__doc__, reps=20, no_torch=False)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    xp, on_gpu, quick = _common.setup(args)
    comm = comm_for(xp)
    if quick:
        cfg = GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=1000, block_size=256, pad_vocab_to=64)
        batch, seq, reps = 4, 256, min(args.reps, 5)
    else:
        cfg = GPTConfig.preset("gpt2")
        cfg = GPTConfig(**{**cfg.as_dict(), "pad_vocab_to": 64})
        batch, seq, reps = args.batch, 1024, args.reps
    if not on_gpu:
        print("FastGPT is a GPU model: on a CPU this benchmark has nothing to time")
        return
    rows = []
    for case in _common.names(args.cases):
        r = run_case(case, cfg, xp, comm, batch, seq, reps)
        rows.append(r)
        if comm.rank == 0:
            print(f"{case:6s} {r['ms']:8.2f} ms/step  {r['tokens_per_s'] / 1e3:8.1f} K tok/s  loss {r['loss']:.4f}  "
                  f"state {r['state_bytes'] / 2**30:6.2f} GiB  pool {(r['pool_peak_bytes'] or 0) / 2**30:6.2f} GiB")
    base = next((r for r in rows if r["case"] == "plain"), None)
    if base:
        for r in rows:
            r["ratio_to_plain"] = r["ms"] / base["ms"]
        if comm.rank == 0:
            print("step time / plain: " + ", ".join(f"{r['case']} {r['ratio_to_plain']:.3f}" for r in rows))
    path = args.out or (RESULTS if not quick and comm.world_size == 1 else None)
    if comm.rank == 0:
        _common.save(path, {"config": cfg.as_dict(), "batch": batch, "seq": seq, "world_size": comm.world_size,
                            "backend": "local" if isinstance(comm, LocalComm) else comm.backend, "rows": rows}, xp)


if __name__ == "__main__":
    main()
