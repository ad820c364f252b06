"""Chapter 8: FastGPT computes GPT's function and gradients; the step is graph-capturable and sync-free."""

from __future__ import annotations

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.model import GPT, FastOptions, GPTConfig
from llmgpu.model.fast import FastGPT
from llmgpu.testing import assert_close
from llmgpu.train import ConfigError, TrainConfig, Trainer, fast_path_available, read_log

pytestmark = pytest.mark.ch8

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=16)


def _batch(rng, cfg, B=2, T=None, xp=np):
    T = T or cfg.block_size
    idx = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    tgt = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    return backend.to_device(idx, xp), backend.to_device(tgt, xp)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _compare(fast, book, idx, tgt, tol):
    lf = fast.forward_backward(idx, tgt, dloss=0.5)
    lb = book.forward_backward(idx, tgt, dloss=0.5)
    assert abs(float(lf) - float(lb)) <= tol * abs(float(lb))
    for name in book.params.names:
        err = _rel(backend.to_numpy(fast.params.grad_of(name)), backend.to_numpy(book.params.grad_of(name)))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@pytest.mark.parametrize("dtype,tol", [("fp64", 1e-10), ("fp32", 2e-5)])
def test_fast_model_matches_book_model_on_numpy(rng, dtype, tol):
    # fp64: the two passes compute the same function and gradients up to float64 rounding
    for T in (8, 5, 1):
        idx, tgt = _batch(rng, CFG, B=3, T=T)
        _compare(FastGPT(CFG, dtype=dtype, xp=np, seed=1), GPT(CFG, dtype=dtype, xp=np, seed=1), idx, tgt, tol)


def test_fast_model_forward_and_gradient_accumulation(rng):
    fast, book = FastGPT(CFG, dtype="fp64", xp=np, seed=2), GPT(CFG, dtype="fp64", xp=np, seed=2)
    idx, tgt = _batch(rng, CFG, B=2, T=7)
    lf, lossf = fast.forward(idx, tgt)
    lb, lossb = book.forward(idx, tgt)
    assert lf.shape == (2, 7, CFG.vocab_size)
    assert _rel(lf, lb) < 1e-12 and abs(float(lossf) - float(lossb)) < 1e-12
    last, _ = fast.forward(idx, last_only=True)
    assert _rel(last, lf[:, -1]) < 1e-12
    # two micro-batches accumulate into the gradient buffer like the book model's
    i2, t2 = _batch(rng, CFG, B=2, T=7)
    for m in (fast, book):
        m.zero_grad()
        m.forward_backward(idx, tgt)
        m.forward_backward(i2, t2)
    assert _rel(fast.params.grad, book.params.grad) < 1e-10
    assert fast.generate([1, 2], 3, temperature=0, seed=0) == book.generate([1, 2], 3, temperature=0, seed=0)


@pytest.mark.parametrize("dtype,tol", [("fp64", 1e-12), ("fp32", 2e-6)])
def test_lm_head_in_chunks_of_rows_gives_the_whole_batchs_loss_and_gradients(rng, dtype, tol):
    """forward_backward makes the logits lm_head_rows rows at a time: the loss is the mean over the whole
    batch and every gradient is the unchunked one (chunks of 1, 5, 7 rows; 21 rows in all: a partial chunk)."""
    idx, tgt = _batch(rng, CFG, B=3, T=7)
    whole = FastGPT(CFG, dtype=dtype, xp=np, seed=5)
    lw = whole.forward_backward(idx, tgt, dloss=0.5)
    for rows in (1, 5, 7, 20):
        m = FastGPT(CFG, dtype=dtype, xp=np, seed=5, options=FastOptions(lm_head_rows=rows))
        lc = m.forward_backward(idx, tgt, dloss=0.5)
        assert abs(float(lc) - float(lw)) <= tol * abs(float(lw)), rows
        for name in m.params.names:
            assert _rel(m.params.grad_of(name), whole.params.grad_of(name)) <= tol, (rows, name)
    m = FastGPT(CFG, dtype=dtype, xp=np, seed=5, options=FastOptions(lm_head_rows=21))  # one chunk: the unchunked path
    assert float(m.forward_backward(idx, tgt, dloss=0.5)) == float(lw)  # bit for bit
    assert np.array_equal(m.params.grad, whole.params.grad)


def _head_variants(rng, dtype, rows, *, xp=np, cfg=CFG, B=3, T=7, combos=((False, False), (True, False))):
    """{(fused_cross_entropy, embedding_grad_into_fp32): (loss, flat gradient, params)} for one batch with ignored
    targets, one model per combination (its FastOptions)."""
    from llmgpu.ops.cross_entropy import IGNORE_INDEX

    idx, tgt = _batch(rng, cfg, B=B, T=T)
    tgt[0, :3] = IGNORE_INDEX
    tgt[-1, -2] = IGNORE_INDEX
    idx, tgt = backend.to_device(idx, xp), backend.to_device(tgt, xp)
    res = {}
    for fused, emb in combos:
        kw = {"lm_head_rows": rows} if rows else {}
        opts = FastOptions(fused_cross_entropy=fused, embedding_grad_into_fp32=emb, **kw)
        m = FastGPT(cfg, dtype=dtype, xp=xp, seed=5, options=opts)
        res[fused, emb] = (float(m.forward_backward(idx, tgt, dloss=0.5)), backend.to_numpy(m.params.grad).copy(),
                           m.params)  # (loss, gradient copy, the params: grad_of by name)
    return res


@pytest.mark.parametrize("dtype,tol", [("fp64", 1e-12), ("fp32", 2e-6)])
@pytest.mark.parametrize("rows", [None, 1, 5, 7])
def test_fused_cross_entropy_head_matches_the_unfused_one(rng, dtype, tol, rows):
    """fused_cross_entropy on NumPy: the same loss (one chunk: bit for bit; several: the chunks' sums added
    instead of their means weighted back) and bit for bit the same gradients (the same reference backward,
    divided by the whole batch's count), with ignored targets."""
    res = _head_variants(rng, dtype, rows)
    (l0, g0, _), (l1, g1, _) = res[False, False], res[True, False]
    if rows is None:
        assert l1 == l0
    assert abs(l1 - l0) <= tol * abs(l0)
    assert np.array_equal(g1, g0)


def test_fused_cross_entropy_head_all_targets_ignored_gives_zero():
    idx = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 8)).astype(np.int32)
    for rows in (16, 5):
        m = FastGPT(CFG, dtype="fp32", xp=np, seed=1, options=FastOptions(fused_cross_entropy=True, lm_head_rows=rows))
        loss = m.forward_backward(idx, np.full((2, 8), -100, np.int32))
        assert float(loss) == 0.0 and np.isfinite(m.params.grad).all()
        assert not m.params.grad_of("transformer.ln_f.weight").any()  # no gradient reaches the trunk


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16"])
def test_embedding_grads_into_fp32_match_the_cast_and_add(rng, dtype):
    """embedding_grad_into_fp32 on NumPy: fp64/fp32 bit for bit the gradients of the cast-and-add path (the
    same sums added once per row); bf16: close (the sum is no longer rounded to bf16 before the add)."""
    res = _head_variants(rng, dtype, None, combos=((True, False), (True, True)))
    (l0, g0, p0), (l1, g1, p1) = res[True, False], res[True, True]
    assert l1 == l0
    if dtype != "bf16":
        assert np.array_equal(g1, g0)
        return
    for name in p0.names:  # the embedding backward runs last: only its two gradients can differ
        a, b = p1.grad_of(name), p0.grad_of(name)
        if name in ("transformer.wte.weight", "transformer.wpe.weight"):
            assert 0 < _rel(a, b) < 1e-2, name
        else:
            assert np.array_equal(a, b), name


@pytest.mark.parametrize("field,value,match", [
    ("attention_kernel", "flash", "attention_kernel must be one of auto, ours, cudnn, math, got 'flash'"),
    ("attention_kernel", "scalar", "attention_kernel must be one of"),  # forward-only: the backward has no such
    ("fused_cross_entropy", 1, "fused_cross_entropy must be True or False, got 1"),
    ("embedding_grad_into_fp32", "yes", "embedding_grad_into_fp32 must be True or False"),
    ("lm_head_rows", 0, "lm_head_rows must be an int >= 1, got 0"),
    ("lm_head_rows", 8.0, "lm_head_rows must be an int"),
    ("lm_head_rows", True, "lm_head_rows must be an int"),
    ("layernorm_backward_method", "turbo", "layernorm_backward_method must be one of naive, optimized, fast"),
    ("cross_entropy_method", None, "cross_entropy_method must be one of"),
    ("embedding_backward_method", "optimized", "embedding_grad_into_fp32 adds into the fp32 gradients with the "
                                               "'counting'"),
])
def test_fast_options_refuse_a_bad_value_in_one_line(field, value, match):
    with pytest.raises(ValueError, match=match):
        FastOptions(**{field: value})


def test_fast_options_are_frozen_and_the_models_own():
    import dataclasses

    o = FastOptions()
    assert (o.attention_kernel, o.fused_cross_entropy, o.embedding_grad_into_fp32, o.lm_head_rows) == \
        ("auto", True, True, 8192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.lm_head_rows = 1
    FastOptions(embedding_grad_into_fp32=False, embedding_backward_method="optimized")  # a valid pair
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=0, options=FastOptions(lm_head_rows=3))
    assert m.options.lm_head_rows == 3 and FastGPT(CFG, dtype="fp32", xp=np).options == FastOptions()
    with pytest.raises(AttributeError):
        m.options = FastOptions()  # fixed for the model's life
    with pytest.raises(TypeError, match="options must be a FastOptions, got dict"):
        FastGPT(CFG, dtype="fp32", xp=np, options={"lm_head_rows": 3})


def test_math_attention_option_runs_chapter_2s_attention(rng):
    """attention_kernel="math": the chapter 2 kernels (probabilities kept, contiguous q, k, v copies) inside the
    fast step; the same function and gradients as the flash path (fp64 NumPy)."""
    idx, tgt = _batch(rng, CFG, B=2, T=7)
    flash = FastGPT(CFG, dtype="fp64", xp=np, seed=4)
    math_ = FastGPT(CFG, dtype="fp64", xp=np, seed=4, options=FastOptions(attention_kernel="math"))
    assert flash.flash and not math_.flash and math_.attention == "math-copy"
    assert abs(float(flash.forward_backward(idx, tgt)) - float(math_.forward_backward(idx, tgt))) < 1e-12
    assert _rel(math_.params.grad, flash.params.grad) < 1e-10
    assert "runs on NumPy" in math_.capture_blocker()


def test_fast_model_passes_its_attention_kernel_and_choices(monkeypatch, rng):
    """Every flash attention call gets the options' kernel and the model's own record of what "auto" resolved."""
    from llmgpu.model import fast

    calls = []

    def spy(real):
        return lambda *a, **kw: calls.append((real.__name__, kw["kernel"], kw["choices"])) or real(*a, **kw)

    monkeypatch.setattr(fast, "flash_attention_forward", spy(fast.flash_attention_forward))
    monkeypatch.setattr(fast, "flash_attention_backward", spy(fast.flash_attention_backward))
    m = FastGPT(CFG, dtype="fp32", xp=np, seed=0, options=FastOptions(attention_kernel="cudnn"))
    m.forward_backward(*_batch(rng, CFG, B=2, T=5))
    assert [c[0] for c in calls] == ["flash_attention_forward"] * 2 + ["flash_attention_backward"] * 2
    assert all(k == "cudnn" and ch is m.kernel_choices for _, k, ch in calls)
    assert len(m.kernel_choices) == 0  # NumPy runs the reference: nothing resolved


def test_fast_model_pads_an_unaligned_vocabulary_and_computes_the_same_function(rng):
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=37, block_size=8)  # no padding asked for
    fast, book = FastGPT(cfg, dtype="fp64", xp=np, init=False), GPT(cfg, dtype="fp64", xp=np, seed=3)
    assert fast.config.padded_vocab_size == 64 and book.config.padded_vocab_size == 37
    fast.load_state_dict(book.state_dict())  # the unpadded embedding is zero-padded
    idx, tgt = _batch(rng, cfg, B=2, T=8)
    lf, lb = fast.forward_backward(idx, tgt), book.forward_backward(idx, tgt)
    assert abs(float(lf) - float(lb)) < 1e-12
    g = fast.params.grad_of("transformer.wte.weight")
    assert np.all(g[37:] == 0) and _rel(g[:37], book.params.grad_of("transformer.wte.weight")) < 1e-10
    assert fast.state_dict(unpadded=True)["transformer.wte.weight"].shape == (37, 16)


@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16", "fp16"])
def test_fast_model_checkpointing_gives_bitwise_identical_gradients(rng, dtype):
    """The span input keeps x and ln_1(x) (the fused add + LayerNorm crosses the block boundary); the
    recomputed spans run the same kernels on the same inputs: loss and every gradient bit for bit."""
    cfg = GPTConfig(n_layer=5, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=16)
    idx, tgt = _batch(rng, cfg, B=3)
    ref = FastGPT(cfg, dtype=dtype, xp=np, seed=2)
    loss0 = ref.forward_backward(idx, tgt, dloss=0.5)
    assert ref.checkpoint_every == 0
    for k in (1, 2, 3, 5, 7):
        m = FastGPT(cfg, dtype=dtype, xp=np, seed=2, checkpoint_every=k)
        loss = m.forward_backward(idx, tgt, dloss=0.5)
        assert np.array_equal(loss, loss0)
        assert np.array_equal(m.params.grad, ref.params.grad), f"checkpoint_every={k}"
        assert m.stats["activation_bytes_stored"] < ref.stats["activation_bytes_stored"]
        est = m.activation_bytes(3, 8)  # the formula counts what the model kept, span inputs with ln_1(x)
        assert est["stored"] == m.stats["activation_bytes_stored"]
        assert est["peak"] == m.stats["activation_bytes_peak"]
    assert ref.activation_bytes(3, 8) == {"stored": ref.stats["activation_bytes_stored"],
                                          "peak": ref.stats["activation_bytes_peak"]}
    # switched on an existing model, and two micro-batches accumulate the same way
    i2, t2 = _batch(rng, cfg, B=3)
    ref.zero_grad()
    ref.forward_backward(idx, tgt)
    ref.forward_backward(i2, t2)
    m = FastGPT(cfg, dtype=dtype, xp=np, seed=2)
    m.checkpoint_every = 2
    m.forward_backward(idx, tgt)
    m.forward_backward(i2, t2)
    assert np.array_equal(m.params.grad, ref.params.grad)


def test_fast_model_checkpointing_matches_the_book_model_and_keeps_the_span_state():
    cfg = GPTConfig(n_layer=4, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=16)
    rng = np.random.default_rng(5)
    idx, tgt = _batch(rng, cfg, B=2)
    for k in (1, 3):
        _compare(FastGPT(cfg, dtype="fp64", xp=np, seed=1, checkpoint_every=k),
                 GPT(cfg, dtype="fp64", xp=np, seed=1, checkpoint_every=k), idx, tgt, 1e-10)
    # what a span input costs: x and ln_1(x) (2 B·T·C) plus two fp32 row statistics, against GPT's x alone
    fast, book = (c(cfg, dtype="bf16", xp=np, checkpoint_every=1) for c in (FastGPT, GPT))
    B, T, C = 4, 8, cfg.n_embd
    assert fast.activation_bytes(B, T)["stored"] == cfg.n_layer * (2 * 2 * B * T * C + 2 * 4 * B * T)
    assert book.activation_bytes(B, T)["stored"] == cfg.n_layer * 2 * B * T * C
    with pytest.raises(ValueError, match="checkpoint_every"):
        FastGPT(CFG, xp=np, checkpoint_every=-1)
    with pytest.raises(ValueError, match="checkpoint_every"):
        fast.checkpoint_every = -2


@pytest.mark.parametrize("k", [0, 1])
def test_fast_model_fp16_step_skips_an_overflow_and_backs_off(k):
    """--fast --dtype fp16: the dynamic loss scaler of chapter 5 on the fast step (NumPy here, the same
    TrainStep on the GPU). A clean step applies and counts a good step; a scale that overflows fp16
    gradients is detected (found_inf), the update skipped (weights and AdamW state untouched) and the
    scale halved; the next clean step applies again."""
    import warnings

    from llmgpu.train import TrainStep

    m = FastGPT(CFG, dtype="fp16", xp=np, seed=0, checkpoint_every=k)
    step = TrainStep(m, TrainConfig(lr=1e-3))
    assert step.scaler.enabled and float(step.scaler.scale) == 2.0**16
    rng = np.random.default_rng(0)
    x = rng.integers(0, CFG.vocab_size, (2, 8)).astype(np.int32)
    batch = [(x, np.roll(x, -1, axis=1))]
    loss, norm, inf = step(batch, 1e-3)
    assert inf == 0 and np.isfinite(norm) and int(step.scaler.good_steps) == 1
    w, mom = m.params.data.copy(), m.params.m.copy()
    step.scaler.scale[...] = 2.0**40  # the backward pass now overflows fp16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy says so about the inf it computes
        _, _, inf = step(batch, 1e-3)
    assert inf == 1
    assert np.array_equal(m.params.data, w) and np.array_equal(m.params.m, mom), "a skipped step changed the state"
    assert float(step.scaler.scale) == 2.0**39 and int(step.scaler.good_steps) == 0
    assert not m.params.grad.any()  # zeroed for the next step all the same
    step.scaler.scale[...] = 2.0**16
    _, _, inf = step(batch, 1e-3)
    assert inf == 0 and not np.array_equal(m.params.data, w)


def test_trainer_fast_flags_on_the_cpu(tmp_path):
    base = dict(preset="tiny", device="cpu", batch=2, seq=16, steps=2, progress=False, sample_tokens=0, plot=False,
                eval_every=0)
    t = Trainer(TrainConfig(**base, out=str(tmp_path / "a")))
    assert t.cfg.fast is False and t.cfg.graph is False and type(t.model) is GPT  # auto: the book model on CPU
    with pytest.raises(ConfigError, match="--fast"):
        Trainer(TrainConfig(**base, fast=True, out=str(tmp_path / "b")))
    with pytest.raises(ConfigError, match="--graph needs the fast model"):
        Trainer(TrainConfig(**base, graph=True, out=str(tmp_path / "c")))


# --------------------------------------------------------------------------- GPU


def _need_fast(cp):
    ok, why = fast_path_available(cp, "bf16")
    if not ok:
        pytest.skip(f"fast path unavailable: {why}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_gpu_fast_model_matches_numpy_reference(cp, rng, dtype, tol):
    _need_fast(cp)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=101, block_size=32, pad_vocab_to=64)
    for T in (32, 29, 1):
        idx, tgt = _batch(rng, cfg, B=3, T=T)
        ref = GPT(cfg, dtype="fp64", xp=np, seed=4)
        lr = ref.forward_backward(idx, tgt)
        m = FastGPT(cfg, dtype=dtype, xp=cp, seed=4)
        assert m.flash == (dtype == "bf16")  # fp32 on the GPU: the chapter 2 attention kernels
        lg = m.forward_backward(cp.asarray(idx), cp.asarray(tgt))
        assert abs(float(lg) - float(lr)) / float(lr) < tol
        for name in ref.params.names:
            err = _rel(cp.asnumpy(m.params.grad_of(name)), ref.params.grad_of(name))
            assert err < tol * (5 if dtype == "bf16" else 1), f"T={T} {name}: {err:.2e}"


def _gpu_cfg(**kw):
    return {**dict(preset="tiny", device="gpu", dtype="bf16", batch=4, seq=64, lr=3e-3, warmup=2, eval_every=0,
                   log_every=4, progress=False, sample_tokens=0, plot=False), **kw}


def _losses(out):
    return [r["loss"] for r in read_log(out) if r["type"] == "train"]


@pytest.mark.gpu
def test_gpu_lm_head_chunks_match_the_whole_head(cp, rng):
    """bf16 on the GPU: the chunked LM head (chunks of 96 rows of 4 x 50 tokens) against one chunk."""
    _need_fast(cp)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=211, block_size=64)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=4, T=50))
    res = {}
    for rows in (96, 200):
        m = FastGPT(cfg, dtype="bf16", xp=cp, seed=3, options=FastOptions(lm_head_rows=rows))
        res[rows] = (float(m.forward_backward(idx, tgt)), m.params.grad.copy())
    assert abs(res[96][0] - res[200][0]) <= 1e-5 * abs(res[200][0])
    assert _rel(cp.asnumpy(res[96][1]), cp.asnumpy(res[200][1])) < 1e-5  # fp32 sums of the chunks' wgrads


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [96, 200])
def test_gpu_fused_head_and_embedding_grads_match_the_step_before(cp, rng, rows):
    """bf16 on the GPU, 4 x 50 tokens with ignored targets, chunks of 96 rows (three, the last partial) or one:
    the four settings of fused_cross_entropy x embedding_grad_into_fp32 against both off. The forward is
    the same kernels, so the loss differs only in the order of its sum; the gradients by bf16 roundings of
    dlogits (exp2 instead of expf) and of the embedding sums (no longer rounded before the fp32 add)."""
    _need_fast(cp)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=211, block_size=64)
    combos = ((False, False), (True, False), (False, True), (True, True))
    res = _head_variants(rng, "bf16", rows, xp=cp, cfg=cfg, B=4, T=50, combos=combos)
    l0, g0, p0 = res[False, False]
    for key in combos[1:]:
        l1, g1, p1 = res[key]
        assert abs(l1 - l0) <= 1e-5 * abs(l0), key
        assert _rel(g1, g0) < 1e-2, key
        for name in p0.names:
            err = _rel(cp.asnumpy(p1.grad_of(name)), cp.asnumpy(p0.grad_of(name)))
            assert err < 5e-2, f"{key} {name}: {err:.2e}"
        if not key[0]:  # the embedding switch alone changes only the embedding gradients
            for name in p0.names:
                if name not in ("transformer.wte.weight", "transformer.wpe.weight"):
                    assert bool(cp.all(p1.grad_of(name) == p0.grad_of(name))), name


@pytest.mark.gpu
def test_gpu_inference_forward_keeps_no_pre_activation(cp, rng):
    """forward() (no backward) runs the MLP's GEMM without keeping f (GELU_BIAS): the same function as the training
    forward, to bf16 rounding; the training step keeps f, and its loss is the forward's."""
    _need_fast(cp)
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=211, block_size=64)
    m = FastGPT(cfg, dtype="bf16", xp=cp, seed=3)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=4, T=50))
    x = m._embed(idx)
    c_inf, s_inf = m._block_forward(0, x, 4, 50, keep_pre=False)
    c_trn, s_trn = m._block_forward(0, x, 4, 50)
    assert c_inf["f"] is None and c_trn["f"].shape == (200, 512)
    for a, b in zip(s_inf, s_trn):
        assert_close(a, b, "bf16")
    _, loss = m.forward(idx, tgt)
    assert abs(float(loss) - float(m.forward_backward(idx, tgt))) <= 2e-3 * abs(float(loss))


@pytest.mark.gpu
@pytest.mark.parametrize("width", ["small", "gpt2"])
def test_gpu_fast_model_is_bitwise_repeatable(cp, rng, width):
    """Bit-exact resume needs every kernel deterministic, cuDNN's attention backward included; "gpt2": one
    block at GPT-2's width and B = 64, T = 1024, so the weight-gradient GEMMs reduce over the 65536 tokens of
    the real step, where cuBLASLt may pick split-K algorithms."""
    _need_fast(cp)
    from llmgpu.ops import flash_attention

    if width == "small":
        cfg, B, T = GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=211, block_size=128), 4, 128
    else:
        cfg, B, T = GPTConfig(n_layer=1, n_head=12, n_embd=768, vocab_size=1024, block_size=1024), 64, 1024
    m = FastGPT(cfg, dtype="bf16", xp=cp, seed=3)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=B, T=T))
    grads = []
    for _ in range(2):
        m.zero_grad()
        m.forward_backward(idx, tgt)
        grads.append(m.params.grad.copy())
    assert flash_attention.backward_is_deterministic() is True
    assert bool(cp.all(grads[0] == grads[1]))


@pytest.mark.gpu
def test_gpu_fast_graph_resume_is_bitwise(cp, tmp_path):
    _need_fast(cp)
    full = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=True, out=str(tmp_path / "full"))))
    full.run()
    Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=True, out=str(tmp_path / "part")))).run(stop_at=4)
    Trainer(TrainConfig(resume=str(tmp_path / "part"), progress=False)).run()
    assert _losses(tmp_path / "full") == _losses(tmp_path / "part")


@pytest.mark.gpu
def test_gpu_resume_pins_the_attention_kernels_of_its_checkpoint(cp, tmp_path, monkeypatch):
    """The checkpoint keeps what attention "auto" resolved to; a resumed run (a fresh process record, an empty
    machine cache) runs exactly those kernels without timing anything, and saves them again."""
    from llmgpu.ops import flash_attention as fa
    from llmgpu.train.checkpoint import load_checkpoint

    _need_fast(cp)
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path / "cache"))
    part = Trainer(TrainConfig(**_gpu_cfg(steps=6, fast=True, graph=True, out=str(tmp_path / "part"))))
    part.run(stop_at=3)
    saved = load_checkpoint(tmp_path / "part", with_optim=False)[1]["attention_kernels"]
    assert saved == part.model.kernel_choices.as_dict() and {k.split()[0] for k in saved} == {"fwd", "bwd"}
    monkeypatch.setattr(fa, "_PROCESS_CHOICES", {})
    monkeypatch.setenv("LLMGPU_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(fa, "_time_ms", lambda *a: pytest.fail("a resumed run runs its checkpoint's kernels"))
    resumed = Trainer(TrainConfig(resume=str(tmp_path / "part"), progress=False))
    assert resumed.model.kernel_choices == fa.KernelChoices.from_dict(saved)
    resumed.run()
    assert load_checkpoint(tmp_path / "part", with_optim=False)[1]["attention_kernels"] == saved


@pytest.mark.gpu
def test_gpu_graph_step_matches_the_eager_fast_step(cp, tmp_path):
    _need_fast(cp)
    eager = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=False, out=str(tmp_path / "e"))))
    eager.run()
    graphed = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=True, out=str(tmp_path / "g"))))
    graphed.run()
    assert graphed.step_fn.graph is not None and graphed.step_fn.graph.kernel_count() > 50
    le, lg = _losses(tmp_path / "e"), _losses(tmp_path / "g")
    assert len(le) == len(lg) == 8 and lg[-1] < lg[0]
    np.testing.assert_allclose(lg, le, rtol=2e-3)  # the same kernels, replayed
    # the graph with gradient accumulation: micro-batches copied into its static inputs
    acc = Trainer(TrainConfig(**_gpu_cfg(steps=4, fast=True, graph=True, grad_accum=2, out=str(tmp_path / "a"))))
    acc.run()
    assert np.all(np.isfinite(_losses(tmp_path / "a")))


@pytest.mark.gpu
@pytest.mark.parametrize("fast,graph", [(False, False), (True, False), (True, True)])
def test_gpu_train_step_never_waits_for_the_gpu(cp, tmp_path, fast, graph):
    """A 300 ms spin kernel is queued before the step: had anything in the step synchronised, the step
    would have waited for it. The spin kernel must still be running when train_step returns."""
    from llmgpu.perf.profile import host_runs_ahead

    if fast:
        _need_fast(cp)
    t = Trainer(TrainConfig(**_gpu_cfg(steps=10, fast=fast, graph=graph, out=str(tmp_path / "s"))))
    for s in range(3):  # warm-up (and capture, with graph)
        t.train_step(t.lr_at(s))
    r = host_runs_ahead(lambda: t.train_step(t.lr_at(3)), spin_ms=300.0)
    assert r["spin_still_running"], r
    assert r["host_ms"] < r["spin_ms"], r


def test_resume_keeps_the_runs_fast_choice_and_falls_back_where_it_cannot_run(tmp_path, capsys):
    """A resumed run takes --fast/--graph from the checkpoint (bit-exact resume needs the same kernels);
    where the fast step cannot run (here: the CPU) it continues on the book step and says so."""
    import json

    base = dict(preset="tiny", device="cpu", batch=2, seq=16, steps=4, progress=False, sample_tokens=0, plot=False,
                eval_every=0, out=str(tmp_path / "run"))
    Trainer(TrainConfig(**base)).run(stop_at=2)
    meta_path = next((tmp_path / "run").rglob("meta.json"))
    meta = json.loads(meta_path.read_text())
    assert meta["train_config"]["fast"] is False  # the resolved choice is saved
    meta["train_config"].update(fast=True, graph=True)  # as if the run had used the fast step on a GPU
    meta_path.write_text(json.dumps(meta))
    t = Trainer(TrainConfig(resume=str(tmp_path / "run"), progress=False))
    assert t.cfg.fast is False and t.cfg.graph is False and type(t.model) is GPT
    assert "resuming with the book step" in capsys.readouterr().err
    t.run()
    assert t.step == 4


def test_attention_kernels_go_into_the_checkpoint_and_are_pinned_on_resume(monkeypatch, rng):
    """attention_kernels_of / pin_attention_kernels (train/checkpoint.py): the model's record round-trips through
    meta.json; a kernel this machine cannot run is left out with a note; the book model has no record."""
    import json

    from llmgpu.ops import flash_attention as fa
    from llmgpu.train.checkpoint import attention_kernels_of, pin_attention_kernels

    m = FastGPT(CFG, dtype="fp32", xp=np, seed=0)
    keys = [(d, int(rng.integers(1, 9)), 2, int(rng.integers(1, 2048)), 64, "bf16", True) for d in ("fwd", "bwd")]
    m.kernel_choices.record(keys[0], "cudnn")
    m.kernel_choices.record(keys[1], "ours")
    meta = json.loads(json.dumps({"attention_kernels": attention_kernels_of(m)}))  # as meta.json holds it
    monkeypatch.setattr(fa, "unavailable_reason", lambda: None)  # as on a GPU machine
    monkeypatch.setattr(fa.cudnn_attention, "unavailable_reason", lambda: None)
    fresh, notes = FastGPT(CFG, dtype="fp32", xp=np, seed=0), []
    assert pin_attention_kernels(fresh, meta, note=notes.append) == [] and notes == []
    assert fresh.kernel_choices == m.kernel_choices
    monkeypatch.setattr(fa.cudnn_attention, "unavailable_reason", lambda: "cuDNN is not installed")
    fresh = FastGPT(CFG, dtype="fp32", xp=np, seed=0)
    (note,) = pin_attention_kernels(fresh, meta, note=notes.append)
    assert notes == [note] and "ran cudnn for 1 shape(s), unavailable here (cuDNN is not installed)" in note
    assert dict(fresh.kernel_choices.items()) == {keys[1]: "ours"}  # the cuDNN shape is decided anew
    book = GPT(CFG, dtype="fp32", xp=np)
    assert attention_kernels_of(book) == {} and pin_attention_kernels(book, meta) == []
    with pytest.raises(ValueError, match="not of the form"):
        pin_attention_kernels(FastGPT(CFG, dtype="fp32", xp=np), {"attention_kernels": {"fwd T=3": "ours"}})


def test_attention_kernel_setting(tmp_path, capsys):
    """--attention-kernel is a TrainConfig field (a generated flag); checked, kept in the checkpoint's config."""
    import json

    from llmgpu.cli import main
    from llmgpu.train import checkpoint, resolve

    assert TrainConfig().attention_kernel == "auto"
    with pytest.raises(ConfigError, match="--attention-kernel must be one of auto, ours, cudnn"):
        resolve(TrainConfig(attention_kernel="flash", device="cpu"), np)
    assert main(["train", "--attention-kernel", "flash"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llmgpu: error: argument --attention-kernel: invalid choice: 'flash'" in err
    base = dict(preset="tiny", device="cpu", batch=2, seq=16, steps=2, progress=False, sample_tokens=0, plot=False,
                eval_every=0, out=str(tmp_path / "run"), attention_kernel="ours")
    Trainer(TrainConfig(**base)).run()
    meta = checkpoint.load_checkpoint(tmp_path / "run", with_optim=False)[1]
    assert meta["train_config"]["attention_kernel"] == "ours" and meta["attention_kernels"] == {}  # the book model
    meta_path = next((tmp_path / "run").rglob("meta.json"))
    meta["attention_kernels"] = {"fwd B=2": "ours"}  # a damaged record: the checkpoint does not fit its run
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its own configuration"):
        Trainer(TrainConfig(resume=str(tmp_path / "run"), progress=False))


# --------------------------------------------------------------------------- CUDA-graph capture: refused up front


def test_check_capturable_numpy():
    from llmgpu.train import TrainStep

    for cls in (GPT, FastGPT):
        m = cls(CFG, dtype="fp32", xp=np)
        with pytest.raises(ValueError, match="NumPy"):
            m.check_capturable()
    with pytest.raises(ValueError, match="GPU"):
        TrainStep(FastGPT(CFG, dtype="fp32", xp=np), graph=True)


@pytest.mark.gpu
def test_gpu_graph_step_of_fp32_fast_model_refused_at_construction(cp):
    """FastGPT in fp32 falls back to chapter 2's attention (CuPy's cuBLAS refuses capture): TrainStep(graph=True)
    says so when it is built, instead of failing inside the capture."""
    from llmgpu.train import TrainStep

    m = FastGPT(CFG, dtype="fp32", xp=cp)
    assert m.capture_blocker() is not None
    with pytest.raises(ValueError, match=r"fp32.*(bf16|fp16)"):
        m.check_capturable()
    with pytest.raises(ValueError, match="cuBLAS"):
        TrainStep(m, graph=True)
    TrainStep(m, graph=False)  # eager is fine
    with pytest.raises(ValueError, match="cuBLAS"):
        TrainStep(GPT(CFG, dtype="bf16", xp=cp), graph=True)  # the book model: CuPy's cuBLAS throughout


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_gpu_fast_model_16bit_is_capturable(cp, dtype):
    _need_fast(cp)
    from llmgpu.train import TrainStep

    m = FastGPT(CFG, dtype=dtype, xp=cp)
    assert m.capture_blocker() is None
    m.check_capturable()
    TrainStep(m, graph=True)


# --------------------------------------------------------------------------- activation checkpointing on the GPU


@pytest.mark.gpu
def test_gpu_fast_checkpointing_is_bitwise_in_bf16(cp, rng):
    """bf16 on the GPU, cuDNN's deterministic attention backward: every gradient bit for bit, for each k,
    and the CuPy pool's high-water mark of a forward + backward smaller with checkpointing."""
    _need_fast(cp)
    from llmgpu.ops import flash_attention

    cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=211, block_size=256)
    idx, tgt = (cp.asarray(a) for a in _batch(rng, cfg, B=8, T=256))
    grads, peaks = {}, {}
    for k in (0, 1, 2, 3, 4):
        m = FastGPT(cfg, dtype="bf16", xp=cp, seed=3, checkpoint_every=k)
        m.forward_backward(idx, tgt)  # warm-up: plans, cuDNN graphs
        m.zero_grad()
        cp.cuda.Device().synchronize()
        # the step's allocations from a pool of their own: its size is the step's high-water mark (the
        # default pool can serve them from free parts of chunks it holds, and then does not grow)
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc):
            loss = m.forward_backward(idx, tgt, dloss=0.5)
            cp.cuda.Device().synchronize()
        peaks[k] = pool.total_bytes()
        grads[k] = (float(loss), m.params.grad.copy())
        del m
    assert flash_attention.backward_is_deterministic() is True
    for k in (1, 2, 3, 4):
        assert grads[k][0] == grads[0][0], k
        assert bool(cp.all(grads[k][1] == grads[0][1])), f"checkpoint_every={k}: gradients differ"
    assert peaks[1] < peaks[0], peaks


@pytest.mark.gpu
def test_gpu_fast_checkpointed_step_captures_and_trains_like_the_plain_one(cp, tmp_path):
    """``llmgpu train --fast --checkpoint-every k`` (eager and one CUDA graph): the same losses bit for bit."""
    _need_fast(cp)
    losses = {}
    for graph in (False, True):
        for k in (0, 1, 3):
            t = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=graph, checkpoint_every=k,
                                               out=str(tmp_path / f"g{graph}k{k}"))))
            assert type(t.model) is FastGPT and t.model.checkpoint_every == k and t.cfg.fast
            t.run()
            if graph:
                assert t.step_fn.graph is not None
            losses[graph, k] = _losses(tmp_path / f"g{graph}k{k}")
    for graph in (False, True):
        assert losses[graph, 1] == losses[graph, 0] and losses[graph, 3] == losses[graph, 0], graph
    assert fast_path_available(cp, "bf16", checkpoint_every=2)[0]


def _run_benchmark(script: str, argv) -> int:
    """``benchmarks/<script>``'s ``main(argv)``, with the folder on the path for its ``_common``."""
    import runpy
    import sys
    from pathlib import Path

    bench_dir = str(Path(__file__).resolve().parents[1] / "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        return runpy.run_path(str(Path(bench_dir) / script), run_name="bench")["main"](argv)
    finally:
        sys.path.remove(bench_dir)


def test_checkpointing_benchmark_script_runs_on_the_cpu(capsys):
    assert _run_benchmark("bench_ch8_checkpointing.py", ["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "every 1" in out and "checkpointing every block" in out and "smoke test" in out


@pytest.mark.gpu
def test_gpu_fast_fp16_graph_step_skips_an_overflow(cp, tmp_path):
    """The fp16 fast step as one CUDA graph: the scaler's state lives on the device and is read by the
    graph, so an overflow is skipped and the scale halved inside the replay; the trainer logs skipped steps."""
    _need_fast(cp)
    from llmgpu.train import TrainStep

    m = FastGPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, vocab_size=211, block_size=64), dtype="fp16", xp=cp)
    step = TrainStep(m, TrainConfig(lr=1e-3), graph=True)
    x = cp.asarray(np.random.default_rng(0).integers(0, 211, (4, 64)).astype(np.int32))
    batch = [(x, cp.roll(x, -1, axis=1))]
    for _ in range(4):  # two eager, the capture, a replay
        rec = cp.asnumpy(step(batch, 1e-3))
        assert rec[2] == 0 and np.isfinite(rec[1])
    assert step.graph is not None
    w = m.params.data.copy()
    step.scaler.scale[...] = 2.0**40
    rec = cp.asnumpy(step(batch, 1e-3))
    assert rec[2] == 1 and bool(cp.all(m.params.data == w)) and float(step.scaler.scale) == 2.0**39
    s = Trainer(TrainConfig(**_gpu_cfg(steps=8, fast=True, graph=True, dtype="fp16", out=str(tmp_path / "f")))).run()
    assert np.isfinite(s["train_loss"]) and s["skipped_steps"] >= 0
    recs = [r for r in read_log(tmp_path / "f") if r["type"] == "train"]
    assert len(recs) == 8 and all("skipped" in r for r in recs)


def test_precision_benchmark_script_runs_on_the_cpu(capsys):
    assert _run_benchmark("bench_ch8_precision.py", ["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "fp16:" in out and "fp16 / " in out and "smoke test" in out  # against fp32 on NumPy, bf16 on a GPU


def test_lm_head_benchmark_script_runs_on_the_cpu(capsys):
    assert _run_benchmark("bench_ch8_lm_head.py", ["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "all 256 rows at once" in out and "chunked / whole" in out and "smoke test" in out


def test_head_items_benchmark_script_runs_on_the_cpu(capsys):
    assert _run_benchmark("bench_ch8_head_items.py", ["--quick", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "fused CE on  / emb->fp32 on" in out and "both on / both off" in out and "smoke test" in out
