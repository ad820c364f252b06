"""Chapter 9 on one GPU: the NCCL code path at world size 1 (collectives, DP, ZeRO-1/2, CUDA graphs with the
collectives inside, the trainer with --dist-backend nccl). Several GPUs: tests/multi_gpu/ (the multi-GPU runs)."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu.model import FastGPT, GPTConfig
from llmgpu.train import TrainConfig, Trainer, fast_path_available
from llmgpu.train.report import read_log
from llmgpu.train.step import TrainStep

CFG = GPTConfig(n_layer=3, n_head=4, n_embd=128, vocab_size=211, block_size=64)


def _nccl(cp):
    from cupy.cuda import nccl

    from llmgpu.dist import NcclComm

    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library")
    return NcclComm(nccl.get_unique_id(), 0, 1, timeout=60)


def _need_fast(cp):
    ok, why = fast_path_available(cp, "bf16")
    if not ok:
        pytest.skip(f"fast path unavailable: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_nccl_collectives_at_world_size_1(cp, dtype):
    from llmgpu import backend

    comm = _nccl(cp)
    dt = backend.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = cp.asarray(np.random.default_rng(0).standard_normal(1001).astype(np.float32)).astype(dt)
    ref = x.copy()
    comm.all_reduce(x)
    out = cp.full(1001, 7, dt)
    comm.reduce_scatter(x, out)
    gathered = cp.full(1001, 7, dt)
    comm.all_gather(out, gathered)
    got = cp.full(1001, 7, dt)
    comm.sendrecv(gathered, 0, got, 0)
    comm.wait_device(what="the test's collectives")
    assert bool(cp.all(got == ref))


def _steps(cp, seam, *, graph, zero=0, accum=1, n=5):
    from llmgpu.dist import DataParallelSync, ZeroSync
    from llmgpu.optim.params import ALIGN

    m = FastGPT(CFG, dtype="bf16", xp=cp, seed=2, param_multiple=ALIGN)
    sync = None
    if seam is not None:
        sync = ZeroSync(seam, m.params, stage=zero, bucket_bytes=64 * 1024) if zero else \
            DataParallelSync(seam, m.params, bucket_bytes=64 * 1024)
    st = TrainStep(m, TrainConfig(lr=3e-3, grad_clip=0.5), graph=graph, grad_sync=sync)
    rng = np.random.default_rng(5)
    out = []
    for _ in range(n):
        b = [tuple(cp.asarray(rng.integers(0, CFG.vocab_size, (4, 64)).astype(np.int32)) for _ in range(2))
             for _ in range(accum)]
        out.append(cp.asnumpy(st(b, 3e-3)))
    return np.array(out), st


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_data_parallel_at_world_size_1_is_the_plain_step(cp, graph):
    _need_fast(cp)
    comm = _nccl(cp)
    ref, _ = _steps(cp, None, graph=graph, accum=2)
    got, st = _steps(cp, comm, graph=graph, accum=2)
    assert len(st.grad_sync.buckets) > 2
    if graph:
        assert st.graph is not None  # captured with the bucket all-reduces inside
    np.testing.assert_array_equal(got, ref)  # an all-reduce over one rank changes nothing: bit for bit


@pytest.mark.gpu
@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_zero_at_world_size_1_matches_the_plain_step(cp, zero, graph):
    _need_fast(cp)
    comm = _nccl(cp)
    ref, _ = _steps(cp, None, graph=graph, accum=2)
    got, st = _steps(cp, comm, graph=graph, zero=zero, accum=2)
    if zero == 2:
        assert st.params.grad.size < st.params.numel  # the block gradients live in two slots
    # the norm is √(Σ shard ‖g‖²) instead of one pass: clip factors differ in the last bits
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("zero", [0, 2])
def test_gpu_trainer_through_nccl(cp, tmp_path, zero):
    _need_fast(cp)
    _nccl(cp)
    base = dict(preset="tiny", device="gpu", dtype="bf16", batch=4, seq=64, lr=3e-3, warmup=2, eval_every=0,
                log_every=2, progress=False, sample_tokens=0, plot=False, steps=6)
    Trainer(TrainConfig(**base, out=str(tmp_path / "plain"))).run()
    t = Trainer(TrainConfig(**base, dist_backend="nccl", zero=zero, out=str(tmp_path / "nccl")))
    t.run()
    assert t.step_fn.graph is not None
    a = [r["loss"] for r in read_log(tmp_path / "plain") if r["type"] == "train"]
    b = [r["loss"] for r in read_log(tmp_path / "nccl") if r["type"] == "train"]
    np.testing.assert_allclose(b, a, rtol=1e-4)
    # the checkpoint holds whole tensors (gathered under ZeRO): it resumes without ZeRO
    r = Trainer(TrainConfig(resume=str(tmp_path / "nccl"), steps=8, zero=0, progress=False))
    r.run()
    assert r.step == 8
