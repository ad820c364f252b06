"""Chapter 8: the backward's weight and bias gradients on a side stream give the serial step's bits."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.instrument import activate
from llmgpu.model import GPTConfig, fast
from llmgpu.model.config import block_param_names
from llmgpu.model.fast import FastGPT
from llmgpu.model.overlap import SideStream
from llmgpu.train import TrainConfig, Trainer, fast_path_available, read_log

pytestmark = pytest.mark.ch8

CFG = GPTConfig(n_layer=5, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=16)


def _batches(rng, cfg, B, T, xp, n=2):
    return [tuple(backend.to_device(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32), xp) for _ in range(2))
            for _ in range(n)]


def _run(monkeypatch, overlap, cfg, batches, dtype, xp, k=0, ready=False, rows=None):
    """(losses, gradient copy, names passed to grads_ready in order) of two micro-batches; ``overlap``:
    (OVERLAP_WEIGHT_GRADS, OVERLAP_HEAD_WGRAD); ``rows``: the LM head's chunk of rows."""
    monkeypatch.setattr(fast, "OVERLAP_WEIGHT_GRADS", overlap[0])
    monkeypatch.setattr(fast, "OVERLAP_HEAD_WGRAD", overlap[1])
    m = FastGPT(cfg, dtype=dtype, xp=xp, seed=2, checkpoint_every=k)
    if rows:
        m.lm_head_rows = rows
    told = []
    cb = told.extend if ready else None
    losses = [m.forward_backward(i, t, dloss=0.5, grads_ready=cb) for i, t in batches]
    return [float(v) for v in losses], m.params.grad.copy(), told


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("k", [0, 2])
def test_side_stream_gives_the_serial_gradients_bit_for_bit(monkeypatch, rng, dtype, k):
    """On NumPy the side tasks run at once, but the residual gradient alternates between two buffers as on
    the GPU: a wrong hand-over between them would change the gradients."""
    batches = _batches(rng, CFG, 3, 8, np)
    l0, g0, t0 = _run(monkeypatch, (False, False), CFG, batches, dtype, np, k, ready=True, rows=5)
    for overlap in ((True, False), (False, True), (True, True)):
        l1, g1, t1 = _run(monkeypatch, overlap, CFG, batches, dtype, np, k, ready=True, rows=5)
        assert l1 == l0 and np.array_equal(g1, g0), overlap
        assert t1 == t0 and set(block_param_names(0).values()) <= set(t1)


def test_spare_alternates_two_buffers_and_join_forgets_them():
    side = SideStream(np)
    a = np.zeros((4, 3), np.float32)
    b = side.spare(a)
    assert b is not a and b.shape == a.shape and b.dtype == a.dtype
    assert side.spare(b) is a and side.spare(a) is b
    assert side.spare(np.zeros((2, 3), np.float32)).shape == (2, 3)  # a new shape: a new buffer
    ran = []
    side.run(lambda: ran.append(1), a)
    assert ran == [1]
    side.join()
    assert side._spare is None and not side._tasks and not side._last_read


def test_an_op_timer_sees_the_serial_order(monkeypatch):
    """The per-op table of chapter 8 times one op after another: with a timer active, no side stream."""
    from llmgpu.perf.profile import OpTimer

    monkeypatch.setattr(fast, "OVERLAP_WEIGHT_GRADS", True)
    monkeypatch.setattr(fast, "OVERLAP_HEAD_WGRAD", False)
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=0)
    assert m._side_stream() is not None
    with activate(OpTimer(xp=np)):
        assert m._side_stream() is None
    monkeypatch.setattr(fast, "OVERLAP_WEIGHT_GRADS", False)
    assert m._side_stream() is None


def test_overlap_benchmark_script_runs_on_the_cpu(capsys):
    from test_fast_model import _run_benchmark

    assert _run_benchmark("bench_ch8_overlap.py", ["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "gradients bit for bit True" in out and "side stream" in out


# --------------------------------------------------------------------------- on the GPU


def _need_fast(cp):
    ok, why = fast_path_available(cp, "bf16")
    if not ok:
        pytest.skip(f"fast path unavailable: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("width", ["small", "gpt2"])
def test_gpu_side_stream_gives_the_serial_gradients_bit_for_bit(cp, rng, monkeypatch, width):
    """bf16, eager: two micro-batches, with and without checkpointing, with a grads_ready callback (the
    side stream is joined before it); "gpt2": two blocks at GPT-2's width and B = 16, T = 1024, where the
    weight-gradient GEMMs reduce over 16384 tokens."""
    _need_fast(cp)
    if width == "small":
        cfg, B, T = GPTConfig(n_layer=3, n_head=4, n_embd=128, vocab_size=211, block_size=128), 4, 128
    else:
        cfg, B, T = GPTConfig(n_layer=2, n_head=12, n_embd=768, vocab_size=1024, block_size=1024), 16, 1024
    batches = _batches(rng, cfg, B, T, cp)
    rows = B * T // 3 + 1  # three chunks of the LM head, the last one shorter
    for k, ready in ((0, False), (1, True)):
        l0, g0, t0 = _run(monkeypatch, (False, False), cfg, batches, "bf16", cp, k, ready, rows)
        for overlap in ((True, False), (True, True)):
            l1, g1, t1 = _run(monkeypatch, overlap, cfg, batches, "bf16", cp, k, ready, rows)
            assert l1 == l0 and t1 == t0, (k, overlap, l0, l1)
            assert bool(cp.all(g1 == g0)), f"checkpoint_every={k}, {overlap}: gradients differ"


@pytest.mark.gpu
def test_gpu_side_stream_graph_step_trains_like_the_serial_one(cp, tmp_path, monkeypatch):
    """``llmgpu train`` as one CUDA graph (the side stream captured as forks and joins): the same losses."""
    _need_fast(cp)
    losses = {}
    for overlap in (False, True):
        monkeypatch.setattr(fast, "OVERLAP_WEIGHT_GRADS", overlap)
        monkeypatch.setattr(fast, "OVERLAP_HEAD_WGRAD", overlap)
        out = tmp_path / f"o{overlap}"
        t = Trainer(TrainConfig(preset="tiny", device="gpu", dtype="bf16", batch=4, seq=64, steps=8, lr=3e-3,
                                warmup=2, eval_every=0, log_every=4, progress=False, sample_tokens=0, plot=False,
                                fast=True, graph=True, out=str(out)))
        t.run()
        assert t.step_fn.graph is not None
        losses[overlap] = [r["loss"] for r in read_log(out) if r["type"] == "train"]
    assert losses[True] == losses[False] and len(losses[True]) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("wait", [True, False])
def test_gpu_before_write_waits_for_the_side_streams_read(cp, wait):
    """The side stream spins, then copies ``a``; the main stream then overwrites ``a``. With ``before_write``
    the copy sees the old values; without it (the control: shows the test can fail) the new ones."""
    from llmgpu.perf.timing import gpu_spin

    side = SideStream(cp)
    a = cp.arange(1 << 20, dtype=cp.float32)
    seen = cp.empty_like(a)

    def late_copy():
        gpu_spin(50.0)
        seen[...] = a

    side.run(late_copy, a)
    if wait:
        side.before_write(a)
    a.fill(-1.0)
    side.join()
    cp.cuda.Device().synchronize()
    assert bool(cp.all(seen == cp.arange(1 << 20, dtype=cp.float32))) is wait


@pytest.mark.gpu
def test_gpu_reserved_workspace_lets_two_streams_gemm_at_once(cp):
    """Two weight-gradient GEMMs (split-K over 65536 rows: they use the workspace) at the same time on two
    streams, each with its own workspace: the serial results, bit for bit."""
    _need_fast(cp)
    from llmgpu.gemm import cublaslt

    cp.random.seed(0)
    dy = [cp.random.standard_normal((65536, n), dtype=cp.float32).astype(backend.bfloat16) for n in (768, 2304)]
    x = cp.random.standard_normal((65536, 768), dtype=cp.float32).astype(backend.bfloat16)
    serial = [cublaslt.lt_gemm(d, x, trans_a=True, out_dtype=cp.float32) for d in dy]
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    cublaslt.reserve_workspace(s1)
    cublaslt.reserve_workspace(s2)
    st = cublaslt._DEVICES[cp.cuda.Device().id]
    assert len({st.ws_ptr, st.stream_ws[s1.ptr][1], st.stream_ws[s2.ptr][1]}) == 3
    cp.cuda.Device().synchronize()
    outs = [cp.full_like(s, cp.nan) for s in serial]
    for _ in range(3):
        for s, d, o in ((s1, dy[0], outs[0]), (s2, dy[1], outs[1])):
            with s:
                cublaslt.lt_gemm(d, x, trans_a=True, out=o)
    cp.cuda.Device().synchronize()
    assert all(bool(cp.all(o == s)) for o, s in zip(outs, serial))
    p1 = s1.ptr
    del s1
    import gc

    gc.collect()
    assert p1 not in st.stream_ws  # released with its stream
