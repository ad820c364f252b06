"""Before / after measurements of the fusions of chapter 8, at one layer's sizes.

Each comparison runs the *same math* two ways on the same data: the book path (separate kernels, as
``llmgpu.model.GPT`` calls them) and the fused one (as ``llmgpu.model.FastGPT`` calls it), checks
that the results agree, and times both (median of CUDA-event timings on the GPU, host clock on NumPy).

===========================  ===========================================  ==========================================
comparison                   separate (book)                              fused (chapter 8)
===========================  ===========================================  ==========================================
MLP up-projection forward    GEMM, bias add, GELU                         cuBLASLt GEMM with GELU_AUX_BIAS epilogue
MLP dgrad through GELU       GEMM, GELU backward                          cuBLASLt GEMM with DGELU epilogue
residual add + LayerNorm     add, LayerNorm forward                       ``add_layernorm_forward`` (one kernel)
LayerNorm backward           LayerNorm backward, residual add, 2 casts    ``layernorm_backward(dresidual=, ...)``
  + residual gradient        + adds of dγ, dβ into the fp32 gradient      accumulating dγ, dβ in place
causal attention fwd + bwd   chapter 2: batched GEMMs + softmax kernels,  cuDNN flash attention on strided views
                             [B,H,T,T] probabilities, transposing copies  (GPU, bf16/fp16 only)
===========================  ===========================================  ==========================================
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..gemm import gemm
from ..gemm.cublaslt import lt_gemm
from ..ops import flash_attention as fa
from ..ops.attention import attention_backward, attention_forward
from ..ops.gelu import gelu_backward, gelu_forward
from ..ops.layernorm import add_layernorm_forward, layernorm_backward, layernorm_forward
from ..ops.linear import linear_forward
from ..testing import rel_error
from .timing import time_fn


def _rand(rng, xp, dtype, *shape, scale=1.0):
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return backend.to_device(a, xp).astype(dtype)


def _f32(a):
    return np.asarray(backend.to_numpy(a), dtype=np.float64)


def compare_fusions(n: int = 8192, c: int = 768, *, heads: int = 12, seq: int = 1024, dtype="bf16", xp=None,
                    reps: int = 20, seed: int = 0, attention: bool = True) -> list[dict]:
    """Rows ``{comparison, variant ('separate'|'fused'), ms, speedup (fused rows), max_rel_diff}``.

    ``n`` tokens of width ``c`` (MLP width 4c); attention on ``[n // seq, heads, seq, c // heads]``
    (skipped when ``attention=False``, or on the GPU when the working dtype is fp32 or cuDNN is missing).
    """
    xp = xp or backend.default_xp()
    dt = backend.resolve_dtype(dtype)
    rng = np.random.default_rng(seed)
    f4 = 4 * c
    x = _rand(rng, xp, dt, n, c)
    a = _rand(rng, xp, dt, n, c)
    w1 = _rand(rng, xp, dt, f4, c, scale=0.02)
    b1 = _rand(rng, xp, dt, f4, scale=0.02)
    w2 = _rand(rng, xp, dt, c, f4, scale=0.02)
    dm = _rand(rng, xp, dt, n, c)
    gam = _rand(rng, xp, dt, c, scale=0.1) + 1
    bet = _rand(rng, xp, dt, c, scale=0.1)
    rows = []

    def add(name, sep, fused, check):
        t_sep = time_fn(sep, xp=xp, warmup=2, reps=reps).median_ms
        t_fused = time_fn(fused, xp=xp, warmup=2, reps=reps).median_ms
        diff = check()
        rows.append({"comparison": name, "variant": "separate", "ms": t_sep, "speedup": None, "max_rel_diff": diff})
        rows.append({"comparison": name, "variant": "fused", "ms": t_fused, "speedup": t_sep / t_fused,
                     "max_rel_diff": diff})

    # MLP up-projection: f = h W1ᵀ + b1, g = GELU(f)
    pre = xp.empty((n, f4), dtype=dt)
    g_fused = xp.empty((n, f4), dtype=dt)

    def up_sep():
        return gelu_forward(linear_forward(x, w1, b1))

    def up_fused():
        return lt_gemm(x, w1, trans_b=True, bias=b1, epilogue="gelu_bias", aux=pre, out=g_fused)

    add("MLP up-projection + GELU (forward)", up_sep, up_fused, lambda: rel_error(_f32(up_fused()), _f32(up_sep())))

    # dgrad through GELU: df = (dm W2) ⊙ GELU'(f)
    up_fused()
    f_pre = pre.copy()

    def dg_sep():
        return gelu_backward(lt_gemm(dm, w2) if xp is np else _gemm(dm, w2), f_pre)

    def dg_fused():
        return lt_gemm(dm, w2, epilogue="dgelu", aux=f_pre)

    add("MLP dgrad through GELU", dg_sep, dg_fused, lambda: rel_error(_f32(dg_fused()), _f32(dg_sep())))

    # residual add + LayerNorm forward
    s_buf = xp.empty_like(a)

    def ln_sep():
        s = xp.add(x, a, out=s_buf)
        return layernorm_forward(s, gam, bet)[0]

    def ln_fused():
        return add_layernorm_forward(x, a, gam, bet, residual_out=s_buf)[1]  # s_buf: a's sum, not a itself

    add("residual add + LayerNorm (forward)", ln_sep, ln_fused, lambda: rel_error(_f32(ln_fused()), _f32(ln_sep())))

    # LayerNorm backward + residual gradient + accumulation of dγ, dβ into fp32 gradients
    s, _, mean, rstd = add_layernorm_forward(x, a, gam, bet)
    dh = _rand(rng, xp, dt, n, c)
    dres = _rand(rng, xp, dt, n, c)
    g32, b32 = xp.zeros(c, dtype=np.float32), xp.zeros(c, dtype=np.float32)
    dx_buf, dx_fused = xp.empty_like(dh), xp.empty_like(dh)

    def lnb_sep():
        dx, dg, db = layernorm_backward(dh, s, gam, mean, rstd, dx_out=dx_buf)
        xp.add(g32, dg.astype(np.float32), out=g32)
        xp.add(b32, db.astype(np.float32), out=b32)
        return xp.add(dx, dres, out=dx)

    def lnb_fused():  # (the model passes dx_out=dresidual: in place; a separate buffer keeps dres for reruns)
        return layernorm_backward(dh, s, gam, mean, rstd, dresidual=dres, dx_out=dx_fused, dgamma_out=g32,
                                  dbeta_out=b32, accumulate_params=True, method="fast")[0]

    add("LayerNorm backward + residual gradient", lnb_sep, lnb_fused,
        lambda: rel_error(_f32(lnb_fused()), _f32(lnb_sep())))

    if attention:
        flash_ok = xp is np or (dt in (backend.float16, backend.bfloat16) and fa.available())
        B, H, T = max(1, n // seq), heads, seq
        D = c // heads
        if flash_ok:
            qkv = _rand(rng, xp, dt, B, T, 3 * c)
            dy = _rand(rng, xp, dt, B, T, c)
            q, k, v = fa.split_qkv(qkv, H)
            qc, kc, vc = (xp.ascontiguousarray(t) for t in (q, k, v))
            y = xp.empty((B, T, c), dtype=dt)
            dqkv = xp.empty_like(qkv)

            def att_sep():
                o, st = attention_forward(qc, kc, vc, causal=True)
                do = xp.ascontiguousarray(dy.reshape(B, T, H, D).transpose(0, 2, 1, 3))
                grads = attention_backward(do, qc, kc, vc, o, st, causal=True)
                return o, grads

            def att_fused():
                o, st = fa.flash_attention_forward(q, k, v, causal=True, out=fa.heads_view(y, H))
                dq, dk, dv = fa.split_qkv(dqkv, H)
                fa.flash_attention_backward(fa.heads_view(dy, H), q, k, v, o, st, causal=True, dq=dq, dk=dk, dv=dv)
                return o, (dq, dk, dv)

            def att_check():
                (o1, g1), (o2, g2) = att_sep(), att_fused()
                return max(rel_error(_f32(o2), _f32(o1)), *(rel_error(_f32(b), _f32(a_)) for a_, b in zip(g1, g2)))

            add("causal attention forward + backward", att_sep, att_fused, att_check)
    return rows


def _gemm(a, b):
    """The book's cuBLAS GEMM (``llmgpu.gemm``): what the separate path uses on the GPU."""
    return gemm(a, b)


__all__ = ["compare_fusions"]
