"""Run under mpiexec by tests/test_dist.py: N ranks (DP or ZeRO) against one rank at the same global batch.

Every rank builds the same tiny GPT, runs ``steps`` steps on its slice of a fixed random batch stream and
prints (rank 0) one JSON line: the losses and gradient norms of both runs and the largest weight difference.
``argv``: zero stage, micro-batches per rank, and optionally ``mismatch`` (rank 1 asks for another model) or ``llama``
(a tiny Llama: grouped-query attention, untied head, instead of the tiny GPT-2).
"""

import json
import sys
from dataclasses import replace

import numpy as np

from llmgpu.dist import DataParallelSync, MPIComm, ZeroSync, check_same
from llmgpu.model import GPT, GPTConfig, Llama, LlamaConfig
from llmgpu.optim.params import ALIGN
from llmgpu.train.config import TrainConfig
from llmgpu.train.step import TrainStep

zero, accum = int(sys.argv[1]), int(sys.argv[2])
comm = MPIComm(timeout=60)
W, r = comm.world_size, comm.rank
cfg = replace(GPTConfig.preset("tiny"), vocab_size=61, block_size=16, n_layer=3, n_embd=32, n_head=2)
model_cls = GPT
if "llama" in sys.argv:
    cfg = replace(LlamaConfig.preset("llama-tiny"), vocab_size=61, block_size=16, n_layer=3, n_embd=32, n_head=4,
                  n_kv_head=2, ffn_dim=64)
    model_cls = Llama
if "mismatch" in sys.argv:
    check_same(comm, "model", replace(cfg, n_layer=4 if r == 1 else 3).as_dict())
tc = TrainConfig(lr=3e-3, grad_clip=0.05)  # a small clip so the clipping path is exercised
steps = 4
data = np.random.default_rng(0).integers(0, 61, size=(steps, W * accum, 2, 3, 16)).astype(np.int32)


def run(split: bool):
    m = model_cls(cfg, xp=np, seed=1, param_multiple=W * ALIGN)
    sync = None
    if split:
        sync = (ZeroSync(comm, m.params, stage=zero, bucket_bytes=8000) if zero
                else DataParallelSync(comm, m.params, bucket_bytes=8000, multiple=W * ALIGN))
    st = TrainStep(m, tc, grad_sync=sync)
    out = []
    for s in range(steps):
        ids = range(r * accum, (r + 1) * accum) if split else range(W * accum)
        out.append(np.asarray(st([(data[s, j, 0], data[s, j, 1]) for j in ids], 3e-3)).copy())
    return np.array(out), st.master_weights(), st


ref, w_ref, _ = run(False)
got, w_got, st = run(True)
nb = len(st.grad_sync.buckets)
if r == 0:
    print(json.dumps({"world": W, "zero": zero, "accum": accum, "buckets": nb,
                      "loss_ref": ref[:, 0].tolist(), "loss": got[:, 0].tolist(),
                      "norm_ref": ref[:, 1].tolist(), "norm": got[:, 1].tolist(),
                      "max_dw": float(max(np.abs(w_ref[k] - w_got[k]).max() for k in w_ref))}))
