"""Run as N GPU ranks by tests/test_dist_multirank_gpu.py (through ``llmgpu.dist.launch``, NCCL, ranks that may
share one GPU): N ranks against one rank at the same global batch, and our ring against NCCL's all-reduce.

``argv``: ``equal OUT.json`` or ``ring OUT.json``. Rank 0 writes the results to OUT.json.

* ``equal``: for the bf16 fast step as one CUDA graph (60 steps: the graph with its collectives replayed) and the
  fp32 book step (8 steps), each with DP, ZeRO-1 and ZeRO-2, 2 micro-batches per rank and an active clip: every
  rank runs the one-rank reference (all W·2 micro-batches, no communicator), the same with the micro-batches in
  another order (the yardstick: what rounding alone does) and its own share through the seam; the losses,
  gradient norms and final master weights of the three.
* ``ring``: ``RingAllReduce`` against ``NcclComm.all_reduce`` on fresh random fp32 and bf16 buffers of odd sizes,
  and both against the float64 sum.
"""

import json
import sys
from dataclasses import replace

import numpy as np

from llmgpu import backend
from llmgpu.dist import DataParallelSync, RingAllReduce, ZeroSync, init_process_group
from llmgpu.model import GPT, FastGPT, GPTConfig
from llmgpu.optim.params import ALIGN
from llmgpu.train.config import TrainConfig
from llmgpu.train.step import TrainStep

mode, out_path = sys.argv[1], sys.argv[2]
ON_CPU = sys.argv[3:] == ["cpu"]  # a dry run of the worker under mpiexec (fp32 book step only), for its own tests
if ON_CPU:
    from llmgpu.dist import MPIComm

    cp, comm = np, MPIComm(timeout=120)
else:
    cp = backend.require_gpu()
    comm = init_process_group(cp)
W, r = comm.world_size, comm.rank
CFG = replace(GPTConfig.preset("tiny"), vocab_size=211, block_size=64, n_layer=3, n_embd=128, n_head=2)  # D = 64
ACCUM, B, T = 2, 4, 64


def wait(comm, what):
    if hasattr(comm, "wait_device"):  # NCCL: collectives are queued on the GPU; wait, bounded, for them
        comm.wait_device(what=what)


def run_case(fast: bool, zero: int, steps: int):
    tc = TrainConfig(lr=3e-3, grad_clip=0.3, weight_decay=0.1)
    data = np.random.default_rng(7).integers(0, CFG.vocab_size, size=(steps, W * ACCUM, 2, B, T)).astype(np.int32)

    def run(split: bool, order=None):
        cls, dtype = (FastGPT, "bf16") if fast else (GPT, "fp32")
        m = cls(CFG, dtype=dtype, xp=cp, seed=3, param_multiple=W * ALIGN)
        sync = None
        if split:
            sync = (ZeroSync(comm, m.params, stage=zero, bucket_bytes=96 * 1024) if zero else
                    DataParallelSync(comm, m.params, bucket_bytes=96 * 1024, multiple=W * ALIGN))
        st = TrainStep(m, tc, graph=fast, grad_sync=sync)
        recs = []
        for s in range(steps):
            ids = range(r * ACCUM, (r + 1) * ACCUM) if split else (order or range(W * ACCUM))
            recs.append(st([(cp.asarray(data[s, j, 0]), cp.asarray(data[s, j, 1])) for j in ids], tc.lr))
        if split:
            wait(comm, "the case's steps")
        host = backend.to_numpy(cp.stack(recs))
        return host, st.master_weights(), st

    ref, w_ref, _ = run(False)
    got, w_got, st = run(True)
    # the yardstick: one rank summing the same micro-batches in another order (rounding only, no communicator)
    alt, w_alt, _ = run(False, order=[*range(ACCUM, W * ACCUM), *range(ACCUM)])

    def rel_w(w):
        return max(float(np.abs(w_ref[k] - w[k]).max() / max(np.abs(w_ref[k]).max(), 1e-30)) for k in w_ref)

    return {"fast": fast, "zero": zero, "steps": steps, "graph": st.graph is not None,
            "graph_kernels": st.graph.kernel_count() if st.graph is not None else 0,
            "buckets": len(st.grad_sync.buckets), "loss_ref": ref[:, 0].tolist(), "loss": got[:, 0].tolist(),
            "norm_ref": ref[:, 1].tolist(), "norm": got[:, 1].tolist(), "loss_reordered": alt[:, 0].tolist(),
            "norm_reordered": alt[:, 1].tolist(), "clipped": int((ref[:, 1] > tc.grad_clip).sum()),
            "max_rel_dw": rel_w(w_got), "max_rel_dw_reordered": rel_w(w_alt)}


def ring_cases():
    out = []
    ring = RingAllReduce(comm)
    for dt in (np.float32,) if ON_CPU else (np.float32, backend.bfloat16):  # MPI sums no bf16
        for n in (1, 1001, 65_537, 1_000_003):
            rng = np.random.default_rng([n, 11])  # every rank draws every rank's buffer: the exact sum is known here
            host = [rng.standard_normal(n).astype(np.float32) for _ in range(W)]
            mine = cp.asarray(host[r]).astype(dt)
            a, b = mine.copy(), mine.copy()
            ring(a)
            comm.all_reduce(b)
            wait(comm, "the ring and NCCL's all-reduce")
            exact = np.sum([h.astype(dt).astype(np.float64) for h in host], axis=0)
            ga, gb = (backend.to_numpy(x.astype(np.float32)).astype(np.float64) for x in (a, b))
            # recursive summation's bound is per element, against the sum of the addends' magnitudes
            scale = np.sum([np.abs(h.astype(dt).astype(np.float64)) for h in host], axis=0)
            out.append({"dtype": np.dtype(dt).name, "n": n, "bitwise": bool(cp.all(a == b)),
                        "ring_rel": float(np.linalg.norm(ga - exact) / np.linalg.norm(exact)),
                        "nccl_rel": float(np.linalg.norm(gb - exact) / np.linalg.norm(exact)),
                        "ring_err_l1": float((np.abs(ga - exact) / scale).max()),
                        "nccl_err_l1": float((np.abs(gb - exact) / scale).max()),
                        "finite": bool(np.isfinite(ga).all())})
    return out


if mode == "equal":
    res = [] if ON_CPU else [run_case(True, z, 60) for z in (0, 1, 2)]
    res += [run_case(False, z, 8) for z in (0, 1, 2)]
elif mode == "ring":
    res = ring_cases()
else:
    raise SystemExit(f"unknown mode {mode!r}")
comm.barrier()
if r == 0:
    from llmgpu.dist import nccl_module

    v = None if ON_CPU else nccl_module().get_version()
    with open(out_path, "w") as f:
        device = "CPU (MPI)" if ON_CPU else backend.device_info(cp).summary()
        json.dump({"world": W, "nccl": v, "device": device, "cases": res}, f, indent=1)
