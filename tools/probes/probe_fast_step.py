"""Probe the chapter 8 step on a GPU: speed of book / fast / graph steps, determinism, host synchronisation.

    python tools/probes/probe_fast_step.py [--batch 16] [--seq 1024] [--json out.json]

Prints, for GPT-2 small (vocabulary padded to 50304) in bf16:
* ms per step and tokens/s of the book step, the fast step, and the fast step replayed as a CUDA graph;
* whether two forward + backward passes from the same weights give bitwise-identical gradients
  (book and fast model): the condition for bit-exact resume;
* ``profile.host_runs_ahead`` for each step (does anything in it wait for the GPU?).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from llmgpu import backend
from llmgpu.bench import make_train_step
from llmgpu.model import GPTConfig
from llmgpu.perf import profile, timing
from llmgpu.perf.graphs import capture


def bitwise_repeatable(model, x, y) -> dict:
    """Two forward + backward passes from the same weights: are loss and gradient bitwise equal?"""
    model.zero_grad()
    l1 = float(model.forward_backward(x, y))
    g1 = model.params.grad.copy()
    model.zero_grad()
    l2 = float(model.forward_backward(x, y))
    g2 = model.params.grad.copy()
    model.zero_grad()
    diff = backend.to_numpy(g1 != g2)
    bad = {}
    if diff.any():
        P = model.params
        for name in P.names:
            n = int(diff[P.offsets[name]: P.offsets[name] + P.sizes[name]].sum())
            if n:
                bad[name] = n
    return {"loss_equal": l1 == l2, "grad_equal": not bool(diff.any()), "differing_elements": int(diff.sum()),
            "differing_tensors": bad}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    xp = backend.require_gpu()
    cfg = GPTConfig.preset("gpt2", pad_vocab_to=64)
    B, T = a.batch, a.seq
    print(backend.device_info(xp).summary(), flush=True)
    out = {"batch": B, "seq": T}
    steps = {}
    for name, fast in (("book", False), ("fast", True)):
        step, model = make_train_step(cfg, B, T, dtype="bf16", xp=xp, fast=fast)
        steps[name] = (step, model)
        ms = timing.time_fn(step, xp=xp, warmup=2, reps=10, host_ahead=False).median_ms
        out[f"{name}_ms"] = ms
        print(f"{name:>5} step: {ms:8.2f} ms  {B * T / ms * 1e3:12,.0f} tokens/s", flush=True)
    g = capture(steps["fast"][0], warmup=1)
    ms = timing.time_fn(g.replay, xp=xp, warmup=2, reps=10, host_ahead=False).median_ms
    out["graph_ms"] = ms
    out["graph_nodes"] = g.node_counts()
    print(f"graph step: {ms:8.2f} ms  {B * T / ms * 1e3:12,.0f} tokens/s  ({out['graph_nodes']})", flush=True)
    for name, fn in (("book", steps["book"][0]), ("fast", steps["fast"][0]), ("graph", g.replay)):
        r = profile.host_runs_ahead(fn, spin_ms=300)
        out[f"{name}_host_runs_ahead"] = r
        print(f"{name:>5} host_runs_ahead: {r}", flush=True)
    rng = np.random.default_rng(1)
    x = xp.asarray(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))
    y = xp.asarray(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))
    for name in ("book", "fast"):
        r = bitwise_repeatable(steps[name][1], x, y)
        out[f"{name}_repeatable"] = r
        print(f"{name:>5} repeatable: {r}", flush=True)
    from llmgpu.ops import flash_attention

    out["flash_backward_deterministic"] = flash_attention.backward_is_deterministic()
    print(f"cuDNN attention backward deterministic: {out['flash_backward_deterministic']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
