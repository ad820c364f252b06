"""ZeRO's bytes per rank (chapter 9): the paper's formulas, and llmgpu's against the buffers ZeroSync holds."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu.dist import LocalComm, ZeroSync
from llmgpu.dist.memory import zero2_gradient_split, zero_memory_bytes
from llmgpu.model import GPT, GPTConfig
from llmgpu.model.config import state_bytes_per_parameter
from llmgpu.optim import FlatParams
from llmgpu.train import TrainConfig, TrainStep

pytestmark = pytest.mark.ch9

PSI = 1_000_000


@pytest.mark.parametrize("N", [1, 2, 8, 64])
def test_paper_formulas(N):
    K = 12
    total = {s: zero_memory_bytes(PSI, N, s, "paper")["total"] for s in range(4)}
    assert total[0] == (2 + 2 + K) * PSI
    assert total[1] == pytest.approx(4 * PSI + K * PSI / N)
    assert total[2] == pytest.approx(2 * PSI + (2 + K) * PSI / N)
    assert total[3] == pytest.approx((2 + 2 + K) * PSI / N)


@pytest.mark.parametrize("working", ["bf16", "fp16", "fp32"])
def test_state_bytes_per_parameter_counts_the_buffers(rng, working):
    """The one statement of the state per parameter (18 B in 16-bit training, 16 in fp32) is what FlatParams
    allocates (master, gradient, m, v, working copy), and the stage-0 parts of zero_memory_bytes are it."""
    parts = state_bytes_per_parameter(working)
    assert sum(parts.values()) == (16 if working == "fp32" else 18)
    shapes = {f"w{i}": tuple(int(d) for d in rng.integers(1, 40, size=int(rng.integers(1, 3)))) for i in range(5)}
    P = FlatParams(shapes, xp=np, working_dtype=working)  # padding included: every buffer holds numel
    assert _live_bytes(P.working, P.data, P.grad, P.m, P.v) == sum(parts.values()) * P.numel
    stage0 = zero_memory_bytes(PSI, 4, 0, working=working)
    assert {k: v for k, v in stage0.items() if k != "total"} == {k: v * PSI for k, v in parts.items()}


def test_llmgpu_bytes_per_parameter():
    assert zero_memory_bytes(PSI, 4, 0)["total"] == 18 * PSI
    assert zero_memory_bytes(PSI, 4, 0, working="fp32")["total"] == 16 * PSI
    assert zero_memory_bytes(PSI, 4, 1)["total"] == pytest.approx(6 * PSI + 18 * PSI / 4)
    assert zero_memory_bytes(PSI, 4, 2, grad_split=(1000, 10))["total"] == pytest.approx(2 * PSI + 4 * 1020
                                                                                         + 18 * PSI / 4)
    with pytest.raises(ValueError, match="grad_split"):
        zero_memory_bytes(PSI, 4, 2)
    one = zero_memory_bytes(PSI, 1, 1)["total"]
    assert zero_memory_bytes(PSI, 1024, 1)["total"] < one  # sharding only helps
    with pytest.raises(ValueError, match="stages are 0-2"):
        zero_memory_bytes(PSI, 2, 3)
    with pytest.raises(ValueError, match="policy"):
        zero_memory_bytes(PSI, 2, 1, "deepspeed")


def _live_bytes(*arrays):
    seen, total = set(), 0
    for a in arrays:
        if a is None:
            continue
        base = a if a.base is None else a.base
        if id(base) not in seen:
            seen.add(id(base))
            total += base.nbytes
    return total


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_llmgpu_formula_counts_the_buffers(dtype, stage):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)  # every size a multiple of 16
    model = GPT(cfg, dtype=dtype, xp=np, seed=0)
    P = model.params
    sync = ZeroSync(LocalComm(np), P, stage=stage) if stage else None
    TrainStep(model, TrainConfig(lr=1e-3), grad_sync=sync)
    if stage:
        assert not P.has_moments  # a ZeRO rank never allocates the whole optimizer state
        sh = sync.shard
        held = [P.working, P.data, P.grad, sh.data, sh.grad, sh.m, sh.v, sh.working]
    else:
        held = [P.working, P.data, P.grad, P.m, P.v]
    assert P.numel == cfg.num_parameters()  # no padding: the formula's ψ is the buffer's length
    want = zero_memory_bytes(P.numel, 1, stage, working=dtype, grad_split=zero2_gradient_split(cfg))["total"]
    assert _live_bytes(*held) == want
