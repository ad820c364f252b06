"""Run under mpiexec -n 2 by tests/test_dist.py: how far 2 ranks drift from 1 rank over many steps, and why.

Four runs of the same tiny GPT on the same global batch of 8 sequences per step (data parallelism, CPU, fp32):

* ``ref``: one rank, two micro-batches of 4 (gradient accumulation)
* ``ranks``: two ranks, one micro-batch of 4 each, gradients all-reduced
* ``reversed``: one rank, the two micro-batches in the other order (the same sums, added in another order)
* ``whole``: one rank, one micro-batch of 8 (the same sums, cut differently inside the GEMMs)

Rank 0 prints one JSON line: the four loss curves, and after the first step which gradient tensors of ``ranks``
differ from ``ref`` and by how much. ``argv``: the number of steps.
"""

import json
import sys
from dataclasses import replace

import numpy as np

from llmgpu.dist import DataParallelSync, MPIComm
from llmgpu.model import GPT, GPTConfig
from llmgpu.optim.params import ALIGN
from llmgpu.train.config import TrainConfig
from llmgpu.train.step import TrainStep

steps = int(sys.argv[1])
comm = MPIComm(timeout=120)
W, r = comm.world_size, comm.rank
assert W == 2
cfg = replace(GPTConfig.preset("tiny"), vocab_size=61, block_size=16, n_layer=2, n_embd=32, n_head=2)
tc = TrainConfig(lr=1e-2, grad_clip=1.0, weight_decay=0.1)
data = np.random.default_rng(0).integers(0, 61, size=(steps, 8, 2, 16)).astype(np.int32)


def run(kind):
    m = GPT(cfg, xp=np, seed=1, param_multiple=W * ALIGN)
    st = TrainStep(m, tc, grad_sync=DataParallelSync(comm, m.params, bucket_bytes=8000, multiple=W * ALIGN)
                   if kind == "ranks" else None)
    losses, grads = [], None
    for s in range(steps):
        d = data[s]
        if kind == "ranks":
            micro = [d[4 * r:4 * r + 4]]
        elif kind == "whole":
            micro = [d]
        else:
            micro = [d[:4], d[4:]] if kind == "ref" else [d[4:], d[:4]]
        batches = [(b[:, 0], b[:, 1]) for b in micro]
        if s == 0:  # the first step's gradient, as the update will see it (after the reduction)
            st.grad_sync.finish = _keep(st.grad_sync.finish, m.params, out := {})
        losses.append(float(st(batches, tc.lr)[0]))
        if s == 0:
            grads = out
            del st.grad_sync.finish
    return losses, grads


def _keep(finish, P, out):
    def wrapped():
        finish()
        out.update({n: P.grad_of(n).copy() for n in P.names})
    return wrapped


res = {k: run(k) for k in ("ref", "ranks", "reversed", "whole")}
if r == 0:
    g_ref, g_dp = res["ref"][1], res["ranks"][1]
    differ = {n: float(np.abs(g_ref[n] - g_dp[n]).max() / np.abs(g_ref[n]).max()) for n in g_ref
              if not np.array_equal(g_ref[n], g_dp[n])}
    print(json.dumps({"losses": {k: v[0] for k, v in res.items()}, "grad_differ": differ}))
