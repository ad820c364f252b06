"""Chapter 10: FastLlama computes Llama's function and gradients on FastGPT's step; the step is graph-capturable,
sync-free and bitwise repeatable on the GPU."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_fast_model import _batch, _losses, _need_fast  # the chapter 8 tests' helpers (tests/ is not a package)

from llmgpu import backend
from llmgpu.model import FastLlama, FastOptions, Llama, LlamaConfig
from llmgpu.testing import rel_error
from llmgpu.train import TrainConfig, Trainer

pytestmark = pytest.mark.ch10

# grouped-query (4 query heads, 2 K/V heads), an untied head, an unaligned vocabulary (FastGPT pads it to 64)
CFG = LlamaConfig(n_layer=3, n_head=4, n_kv_head=2, n_embd=32, ffn_dim=40, vocab_size=37, block_size=16,
                  tie_embeddings=False)


def _pair(cfg, dtype, *, xp=np, seed=1, book_dtype=None, book_xp=None, **fast_kw):
    """(FastLlama, Llama) holding the same weights (the book model's, its vocabulary unpadded)."""
    book = Llama(cfg, dtype=book_dtype or dtype, xp=book_xp or xp, seed=seed)
    fast = FastLlama(cfg, dtype=dtype, xp=xp, init=False, **fast_kw)
    fast.load_state_dict(book.state_dict(unpadded=True))
    return fast, book


def _grad_errors(fast, book):
    """Relative error of every gradient (the fast model's padded vocabulary rows cut to the book's)."""
    out = {}
    for name in book.params.names:
        g, ref = backend.to_numpy(fast.params.grad_of(name)), backend.to_numpy(book.params.grad_of(name))
        out[name] = rel_error(g[: ref.shape[0]], ref)
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("k", [0, 1, 2])
def test_fast_llama_matches_the_book_llama_in_float64(rng, tied, n_kv_head, k):
    """Same function, same gradients (fp64 on NumPy, to rounding), with and without checkpointing; MQA, GQA and
    MHA; a dloss other than 1."""
    cfg = replace(CFG, tie_embeddings=tied, n_kv_head=n_kv_head)
    fast, book = _pair(cfg, "fp64", checkpoint_every=k)
    assert fast.config.padded_vocab_size == 64 and book.config.padded_vocab_size == 37
    idx, tgt = _batch(rng, cfg, T=11)
    np.testing.assert_allclose(fast.forward(idx)[0], book.forward(idx)[0], rtol=0, atol=1e-12)
    lf = float(fast.forward_backward(idx, tgt, dloss=0.5))
    lb = float(book.forward_backward(idx, tgt, dloss=0.5))
    assert lf == pytest.approx(lb, rel=1e-12)
    errs = _grad_errors(fast, book)
    assert max(errs.values()) < 1e-11, errs
    assert not fast.grads()["model.embed_tokens.weight"][37:].any()  # the padded rows get no gradient


def test_fast_llama_rope_pass_or_fold_is_the_same_function_in_float64(rng):
    """On NumPy the fold is the reference's rope_backward after attention's: with and without it, the same
    gradients to float64 rounding."""
    idx, tgt = _batch(rng, CFG, T=11)
    grads = []
    for fold in (True, False):
        m = FastLlama(CFG, dtype="fp64", seed=2, options=FastOptions(rope_in_attention_backward=fold))
        m.forward_backward(idx, tgt)
        grads.append(m.params.grad.copy())
    assert rel_error(grads[0], grads[1]) < 1e-13 and np.any(grads[0])


@pytest.mark.parametrize("multiple", [16, 48])
def test_fast_llama_stacked_projections_and_their_fallback_give_the_same_gradients(rng, multiple):
    """q|k|v and gate|up are one GEMM each over the stacked weights when they lie back to back (the default
    layout); a layout with padding between them (``param_multiple=48``: 32·32 = 1024 elements is no multiple of
    48) runs one GEMM each instead. Both are the book model's function and gradients in float64."""
    from llmgpu.model.fast_llama import GATE_UP, QKV, _names
    from llmgpu.model.llama_config import block_names

    fast, book = _pair(CFG, "fp64", param_multiple=multiple)
    stacked = [fast._stackable(_names(block_names(i), s)) for i in range(CFG.n_layer) for s in (QKV, GATE_UP)]
    assert all(stacked) if multiple == 16 else not any(stacked)
    idx, tgt = _batch(rng, CFG, T=9)
    assert float(fast.forward_backward(idx, tgt)) == pytest.approx(float(book.forward_backward(idx, tgt)), rel=1e-12)
    errs = _grad_errors(fast, book)
    assert max(errs.values()) < 1e-11, errs


def test_fast_llama_checkpointing_gives_bitwise_identical_gradients_and_the_predicted_bytes(rng):
    """Recomputing a span runs the same ops on the same inputs: the gradients are the same bits (fp32 on NumPy);
    the activation bytes the model counts equal ``activation_bytes``'s formula, stored and peak."""
    idx, tgt = _batch(rng, CFG, T=16)
    grads = {}
    for k in (0, 1, 2, 3):
        m = FastLlama(CFG, dtype="fp32", xp=np, seed=5, checkpoint_every=k)
        m.forward_backward(idx, tgt)
        grads[k] = m.params.grad.copy()
        want = m.activation_bytes(2, 16)
        assert (m.stats["activation_bytes_stored"], m.stats["activation_bytes_peak"]) == (want["stored"],
                                                                                          want["peak"]), k
    for k in (1, 2, 3):
        np.testing.assert_array_equal(grads[k], grads[0])


def test_fast_llama_forward_last_only_and_accumulation(rng):
    fast, book = _pair(CFG, "fp64")
    idx, tgt = _batch(rng, CFG, T=11)
    full, _ = fast.forward(idx)
    last, _ = fast.forward(idx, last_only=True)
    np.testing.assert_allclose(last, full[:, -1], rtol=0, atol=1e-12)
    assert float(fast.forward(idx, tgt)[1]) == pytest.approx(float(book.forward(idx, tgt)[1]), rel=1e-12)
    i2, t2 = _batch(rng, CFG, T=7)  # a second micro-batch of another length accumulates like the book model's
    for m in (fast, book):
        m.forward_backward(idx, tgt)
        m.forward_backward(i2, t2)
    assert max(_grad_errors(fast, book).values()) < 1e-11


def test_fast_llama_refuses_the_embedding_options_it_does_not_run():
    with pytest.raises(ValueError, match="FastLlama adds the embedding's fp32 row sums"):
        FastLlama(CFG, dtype="fp32", xp=np, options=FastOptions(embedding_grad_into_fp32=False,
                                                                embedding_backward_method="optimized"))


def test_trainer_runs_the_fast_llama_on_the_cpu_when_asked(tmp_path):
    """--arch llama --fast on NumPy is refused (a GPU path), as GPT-2's; the plan picks FastLlama where it can."""
    from llmgpu.train import ConfigError

    with pytest.raises(ConfigError, match="--fast: the fast model is a GPU path"):
        Trainer(TrainConfig(arch="llama", preset="llama-tiny", device="cpu", fast=True, steps=1, progress=False,
                            out=str(tmp_path / "r")))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["auto", "ours", "cudnn", "math"])
@pytest.mark.parametrize("n_kv_head", [2, 4])
def test_gpu_fast_llama_bf16_matches_the_float64_book_llama(cp, rng, kernel, n_kv_head):
    """bf16 on the GPU (flash attention: ours with RoPE's backward folded in, cuDNN with a RoPE pass after, or
    "auto"'s choice; "math": chapter 2's kernels) against the fp64
    book model on NumPy: the loss to 1e-2 relative, every gradient to 5e-2 (bf16 rounds each activation to 8 bits
    of mantissa; the largest errors sit in the small norm gains)."""
    _need_fast(cp)
    cfg = replace(CFG, n_layer=2, n_head=4, n_kv_head=n_kv_head, n_embd=256, ffn_dim=352, vocab_size=211,
                  block_size=64)
    idx, tgt = _batch(rng, cfg, B=3, T=61)
    fast, book = _pair(cfg, "bf16", xp=cp, book_dtype="fp64", book_xp=np, options=FastOptions(attention_kernel=kernel))
    lf = float(fast.forward_backward(cp.asarray(idx), cp.asarray(tgt)))
    lb = float(book.forward_backward(idx, tgt))
    assert abs(lf - lb) <= 1e-2 * lb
    errs = _grad_errors(fast, book)
    assert max(errs.values()) < 5e-2, errs


@pytest.mark.gpu
def test_gpu_fast_llama_fp32_matches_the_fp32_book_llama(cp, rng):
    """fp32 on the GPU runs chapter 2's attention: the same function as the book model to fp32 rounding."""
    _need_fast(cp)
    fast, book = _pair(CFG, "fp32", xp=cp)
    assert not fast.flash
    idx, tgt = (cp.asarray(a) for a in _batch(rng, CFG, T=16))
    assert float(fast.forward_backward(idx, tgt)) == pytest.approx(float(book.forward_backward(idx, tgt)), rel=1e-5)
    errs = _grad_errors(fast, book)
    assert max(errs.values()) < 1e-4, errs


@pytest.mark.gpu
def test_gpu_fast_llama_is_bitwise_repeatable(cp, rng):
    """Bit-exact resume needs every kernel deterministic: SmolLM-135M's width (GQA 9/3 heads) at B = 8, T = 1024."""
    _need_fast(cp)
    cfg = replace(LlamaConfig.preset("smollm-135m"), n_layer=2, vocab_size=4096, block_size=1024)
    m = FastLlama(cfg, dtype="bf16", xp=cp, seed=3)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=8, T=1024))
    grads = []
    for _ in range(2):
        m.zero_grad()
        m.forward_backward(idx, tgt)
        grads.append(m.params.grad.copy())
    assert bool(cp.all(cp.isfinite(grads[0])))
    assert bool(cp.all(grads[0] == grads[1]))


@pytest.mark.gpu
def test_gpu_fast_llama_nondeterministic_attention_is_the_same_function(cp, rng):
    """``FastOptions(deterministic_attention=False)`` with cuDNN's attention: its default backward (dQ by atomics),
    the one PyTorch runs. The loss is the deterministic step's bit for bit (the forward is the same); every
    gradient agrees to bf16 rounding (dQ sums in another order)."""
    _need_fast(cp)
    from llmgpu.ops import cudnn_attention

    if not cudnn_attention.available():
        pytest.skip(f"cuDNN attention unavailable: {cudnn_attention.unavailable_reason()}")
    cfg = replace(CFG, n_layer=2, n_head=4, n_kv_head=2, n_embd=256, ffn_dim=352, vocab_size=211, block_size=64)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=3, T=64))
    losses, grads = [], []
    for det in (True, False):
        m = FastLlama(cfg, dtype="bf16", xp=cp, seed=4, options=FastOptions(attention_kernel="cudnn",
                                                                           deterministic_attention=det))
        losses.append(float(m.forward_backward(idx, tgt)))
        grads.append(m.params.grad.copy())
    assert losses[0] == losses[1]
    assert rel_error(backend.to_numpy(grads[1]), backend.to_numpy(grads[0])) < 1e-2
    assert not bool(cp.all(grads[0] == 0))


@pytest.mark.gpu
def test_gpu_rope_folded_into_attention_backward_is_the_same_function(cp, rng):
    """``FastOptions(rope_in_attention_backward=False)``, the separate RoPE pass, against the default fold (our
    kernels): the loss bit for bit (the forward is the same), every gradient to bf16 rounding (the fold rotates the
    fp32 accumulators, the pass the rounded dq, dk), not all zero."""
    _need_fast(cp)
    cfg = replace(CFG, n_layer=2, n_head=6, n_kv_head=2, n_embd=384, ffn_dim=352, vocab_size=211, block_size=128)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=3, T=127))
    losses, grads = [], []
    for fold in (True, False):
        m = FastLlama(cfg, dtype="bf16", xp=cp, seed=4, options=FastOptions(attention_kernel="ours",
                                                                           rope_in_attention_backward=fold))
        losses.append(float(m.forward_backward(idx, tgt)))
        grads.append(m.params.grad.copy())
    assert losses[0] == losses[1]
    assert rel_error(backend.to_numpy(grads[0]), backend.to_numpy(grads[1])) < 1e-2
    assert not bool(cp.all(grads[0] == grads[1])) and not bool(cp.all(grads[0] == 0))


def _gpu_cfg(**kw):
    return {**dict(arch="llama", preset="llama-tiny", device="gpu", dtype="bf16", batch=4, seq=64, lr=3e-3, warmup=2,
                   eval_every=0, log_every=4, progress=False, sample_tokens=0, plot=False), **kw}


@pytest.mark.gpu
def test_gpu_llama_graph_step_matches_the_eager_fast_step_and_resumes_bitwise(cp, tmp_path):
    """llmgpu train --arch llama on the GPU takes FastLlama as one CUDA graph by default; its losses equal the eager
    fast step's (the same kernels, replayed), they fall, and a run stopped and resumed gives the same losses."""
    _need_fast(cp)
    graphed = Trainer(TrainConfig(**_gpu_cfg(steps=8, out=str(tmp_path / "g"))))
    assert type(graphed.model).__name__ == "FastLlama" and graphed.cfg.graph
    graphed.run()
    assert graphed.step_fn.graph is not None and graphed.step_fn.graph.kernel_count() > 50
    eager = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=False, out=str(tmp_path / "e"))))
    eager.run()
    le, lg = _losses(tmp_path / "e"), _losses(tmp_path / "g")
    assert len(le) == len(lg) == 8 and lg[-1] < lg[0]
    np.testing.assert_allclose(lg, le, rtol=2e-3)
    Trainer(TrainConfig(**_gpu_cfg(steps=8, out=str(tmp_path / "p")))).run(stop_at=4)
    Trainer(TrainConfig(resume=str(tmp_path / "p"), progress=False)).run()
    assert _losses(tmp_path / "p") == lg


@pytest.mark.gpu
def test_gpu_llama_train_step_never_waits_for_the_gpu(cp, tmp_path):
    from llmgpu.perf.profile import host_runs_ahead

    _need_fast(cp)
    t = Trainer(TrainConfig(**_gpu_cfg(steps=10, out=str(tmp_path / "s"))))
    for s in range(3):  # warm-up and capture
        t.train_step(t.lr_at(s))
    r = host_runs_ahead(lambda: t.train_step(t.lr_at(3)), spin_ms=300.0)
    assert r["spin_still_running"], r
    assert r["host_ms"] < r["spin_ms"], r
