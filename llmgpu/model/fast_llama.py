"""The chapter 10 fast step: the Llama model of ``model/llama.py`` with ``FastGPT``'s machinery (chapter 8).

``FastLlama`` is to ``Llama`` what ``FastGPT`` is to ``GPT``: the same parameters, the same function, another
step. It inherits ``FastGPT``'s loop (``forward_backward``: activation checkpointing with span inputs that hold the
block's normalized input, the ``grads_ready`` seam, the CUDA-graph capture), its chunked LM head with the fused
cross-entropy (the ``[N, Vp]`` logits never exist whole), its cuBLASLt GEMMs writing weight gradients straight into
the fp32 buffer, and its flash attention (``FastOptions.attention_kernel``; grouped-query attention: K/V with
``n_kv_head`` heads, which cuDNN takes as they are). What is Llama's:

* **Token-major heads, no copies.** q, k and v come out of their GEMMs as ``[B, T, heads, D]`` rows; RoPE rotates
  q and k in place in that layout (``rope_forward(..., seq_axis=1)``) and flash attention reads them through
  strided ``[B, H, T, D]`` views (``heads_view``), writing its output straight into the ``[N, C]`` rows the output
  projection reads. The book step makes four transposing copies per block instead.
* **RMSNorm with the residual stream.** The state entering block i is ``(x, rmsnorm(x), inv_rms)``, as FastGPT's
  is ``(x, ln_1(x), mean, rstd)``: each block ends with its residual add and the next block's input norm (the
  final norm after the last block), so a checkpointed span input already holds what its first block reads.
  The residual add and the norm after it are one kernel (``add_rmsnorm_forward``, the sum written over the
  branch output, as FastGPT's ``_add_ln``); in the backward the residual gradient is added to the norm's input
  gradient in the norm's kernel (``rmsnorm_backward(..., dresidual=)``, written over it).
* **SwiGLU between two GEMMs** (gate and up), its backward written over the saved gate and up (they are not
  read again).
* **Embedding**: a gather forward; backward adds the fp32 row sums of the tokens in the batch straight into the
  fp32 gradient (``embedding_backward(..., positions=False)``: there is no position table).

Every weight is bias-free, so no GEMM needs a bias epilogue and no bias gradient is summed. The gradients agree
with ``Llama``'s to rounding (the same ops in another order of rounding; in float64 on NumPy to ~1e-12).
"""

from __future__ import annotations

from ..instrument import region
from ..ops.flash_attention import heads_view
from ..ops.rmsnorm import add_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward, traffic_bytes
from ..ops.rope import rope_backward, rope_forward
from ..ops.swiglu import swiglu_backward, swiglu_forward
from .fast import FastGPT
from .llama import LlamaFamily
from .llama_config import EMBED, NORM, block_names


class FastLlama(LlamaFamily, FastGPT):
    """A Llama-family model with the chapter 8 step. Same constructor as ``FastGPT`` (``dtype`` default bf16,
    ``checkpoint_every``, ``options``: a ``FastOptions``, whose attention kernel applies; its embedding fields must
    keep their defaults: the fp32 row sums are the only embedding backward here)."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        o = self.options
        if not o.embedding_grad_into_fp32 or o.embedding_backward_method != "counting":
            raise ValueError("FastLlama adds the embedding's fp32 row sums into the gradient (embedding_grad_into_fp32="
                             "True, embedding_backward_method='counting'); those FastOptions fields are FastGPT's")

    # ------------------------------------------------------------------ pieces

    def _norm(self, x, w_name, *, name):
        """``(rmsnorm(x), inv_rms)`` of rows ``x [N, C]``."""
        with region(name, bytes=traffic_bytes(*x.shape, x.dtype), flops=4.0 * x.size):
            return rmsnorm_forward(x, self.weight(w_name), self.config.norm_eps)

    def _add_norm(self, x, a, w_name, *, name):
        """``(x + a written over a, rmsnorm(x + a), inv_rms)``: the residual add and the next norm in one pass."""
        with region(name, bytes=traffic_bytes(*x.shape, x.dtype, residual=True), flops=5.0 * x.size):
            return add_rmsnorm_forward(x, a, self.weight(w_name), self.config.norm_eps, residual_out=a)

    def _norm_backward(self, dh, x, w_name, inv, dres, *, name):
        """The norm's input gradient plus the residual gradient ``dres`` (None: none), written over ``dres`` by
        the norm's kernel; the gain's gradient accumulated in fp32 into the buffer."""
        with region(name, bytes=traffic_bytes(*x.shape, x.dtype, backward=True, residual=dres is not None),
                    flops=8.0 * x.size):
            dx, _ = rmsnorm_backward(dh, x, self.weight(w_name), inv, dweight=self.params.grad_of(w_name),
                                     accumulate=True, dresidual=dres, dx=dres)
            return dx

    def _rope(self, a, n_heads, B, T, *, inverse, name):
        """RoPE on rows ``a [N, n·D]`` seen as ``[B, T, n, D]``, in place."""
        rot = rope_backward if inverse else rope_forward
        with region(name, bytes=2 * a.nbytes, flops=6.0 * a.size):
            a4 = a.reshape(B, T, n_heads, self.config.head_dim)
            rot(a4, self.rope_cos, self.rope_sin, out=a4, seq_axis=1)

    def _attention_forward(self, q, k, v, B, T):
        """Causal grouped-query attention on rows q [N, C], k, v [N, kv_dim]: ``(y [N, C], state)``."""
        cfg = self.config
        H, Hk, C, D = cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.head_dim
        it = q.dtype.itemsize
        with region("attn.core fwd", flops=2.0 * B * H * T * T * D, bytes=(2 * q.size + 2 * k.size) * it):
            kh, vh = (heads_view(a.reshape(B, T, Hk * D), Hk) for a in (k, v))
            return self._attention_core(heads_view(q.reshape(B, T, C), H), kh, vh, B, T)

    def _attention_backward(self, dy, state, B, T):
        """``(dq [N, C], dk, dv [N, kv_dim])`` from ``dy [N, C]`` (dk, dv summed over each K/V head's group)."""
        cfg, xp = self.config, self.xp
        H, Hk, C, D = cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.head_dim
        it = dy.dtype.itemsize
        with region("attn.core bwd", flops=5.0 * B * H * T * T * D, bytes=4 * (dy.size + B * T * Hk * D) * it):
            dq = xp.empty((B, T, C), dtype=dy.dtype)
            dk, dv = (xp.empty((B, T, Hk * D), dtype=dy.dtype) for _ in range(2))
            self._attention_core_backward(dy, state, heads_view(dq, H), heads_view(dk, Hk), heads_view(dv, Hk), B, T)
            return dq.reshape(B * T, C), dk.reshape(B * T, -1), dv.reshape(B * T, -1)

    # ------------------------------------------------------------------ forward

    def _embed(self, idx):
        """The token rows and block 0's input norm: the state ``(x, rmsnorm(x), inv_rms)`` entering block 0."""
        B, T = idx.shape
        C = self.config.n_embd
        with region("embedding fwd", bytes=2 * B * T * C * self.dtype.itemsize + 4 * B * T):
            x = self.weight(EMBED)[idx.reshape(-1)].reshape(B * T, C)
        return (x, *self._norm(x, block_names(0)["input_layernorm.weight"], name="input_norm fwd"))

    def _block_forward(self, i: int, state, B: int, T: int, need_output: bool = True, keep_pre: bool = True):
        """Block i from its input state ``(x, rmsnorm(x), inv_rms)``: ``(cache, the next state)``, as FastGPT's
        (``need_output=False``: the last residual add and norm are not run). ``keep_pre=False`` (inference): the
        SwiGLU output is written over the gate (no backward reads them)."""
        x, h, inv = state
        cfg, L = self.config, self.config.n_layer
        H, Hk = cfg.n_head, cfg.n_kv_head
        n = block_names(i)
        q = self._linear(h, n["self_attn.q_proj.weight"], name="attn.q fwd")
        k = self._linear(h, n["self_attn.k_proj.weight"], name="attn.k fwd")
        v = self._linear(h, n["self_attn.v_proj.weight"], name="attn.v fwd")
        self._rope(q, H, B, T, inverse=False, name="rope q fwd")
        self._rope(k, Hk, B, T, inverse=False, name="rope k fwd")
        y, att = self._attention_forward(q, k, v, B, T)
        a = self._linear(y, n["self_attn.o_proj.weight"], name="attn.proj fwd")
        x2, h2, inv2 = self._add_norm(x, a, n["post_attention_layernorm.weight"], name="residual+post_norm fwd")
        g = self._linear(h2, n["mlp.gate_proj.weight"], name="mlp.gate fwd")
        u = self._linear(h2, n["mlp.up_proj.weight"], name="mlp.up fwd")
        with region("swiglu fwd", bytes=3 * g.nbytes, flops=5.0 * g.size):
            s = swiglu_forward(g, u, out=None if keep_pre else g)
        cache = {"x": x, "h1": h, "inv1": inv, "att": att, "y": y, "x2": x2, "h2": h2, "inv2": inv2,
                 "g": g, "u": u, "s": s}
        if not need_output:
            return cache, None
        m = self._linear(s, n["mlp.down_proj.weight"], name="mlp.down fwd")
        nxt = block_names(i + 1)["input_layernorm.weight"] if i + 1 < L else NORM
        return cache, self._add_norm(x2, m, nxt, name="residual+input_norm fwd" if i + 1 < L else "residual+norm fwd")

    # ------------------------------------------------------------------ backward

    def _block_backward(self, i: int, dx, c, B: int, T: int):
        """Block i's backward from the gradient of its output ``dx`` (updated in place and returned: the gradient
        of its input)."""
        n = block_names(i)
        # MLP: x3 = x2 + s W_dᵀ, s = silu(g) · u, g = h2 W_gᵀ, u = h2 W_uᵀ
        self._linear_grads(dx, c["s"], n["mlp.down_proj.weight"], None, name="mlp.down")
        ds = self._dgrad(dx, n["mlp.down_proj.weight"], name="mlp.down")
        with region("swiglu bwd", bytes=5 * ds.nbytes, flops=12.0 * ds.size):
            dg, du = swiglu_backward(ds, c["g"], c["u"], dgate=c["g"], dup=c["u"])  # over the saved g, u
        del ds
        self._linear_grads(dg, c["h2"], n["mlp.gate_proj.weight"], None, name="mlp.gate")
        self._linear_grads(du, c["h2"], n["mlp.up_proj.weight"], None, name="mlp.up")
        dh2 = self._dgrad(dg, n["mlp.gate_proj.weight"], name="mlp.gate")
        self._dgrad(du, n["mlp.up_proj.weight"], name="mlp.up", out=dh2, beta=1.0)
        del dg, du
        dx = self._norm_backward(dh2, c["x2"], n["post_attention_layernorm.weight"], c["inv2"], dx,
                                 name="post_norm+residual bwd")
        del dh2
        # attention: x2 = x + y W_oᵀ
        self._linear_grads(dx, c["y"], n["self_attn.o_proj.weight"], None, name="attn.proj")
        dy = self._dgrad(dx, n["self_attn.o_proj.weight"], name="attn.proj")
        dq, dk, dv = self._attention_backward(dy, c["att"], B, T)
        del dy
        self._rope(dq, self.config.n_head, B, T, inverse=True, name="rope q bwd")
        self._rope(dk, self.config.n_kv_head, B, T, inverse=True, name="rope k bwd")
        dh1 = None  # the three projections' input gradients, summed by the GEMMs (beta = 1 after the first)
        for d, short in ((dq, "q"), (dk, "k"), (dv, "v")):
            w = n[f"self_attn.{short}_proj.weight"]
            self._linear_grads(d, c["h1"], w, None, name=f"attn.{short}")
            dh1 = self._dgrad(d, w, name=f"attn.{short}", out=dh1, beta=0.0 if dh1 is None else 1.0)
        del dq, dk, dv
        return self._norm_backward(dh1, c["x"], n["input_layernorm.weight"], c["inv1"], dx,
                                   name="input_norm+residual bwd")

    def _final_norm_backward(self, dhf, state):
        x, _, inv = state
        dx = self._norm_backward(dhf, x, NORM, inv, None, name="norm bwd")
        return dx, self._norm_and_head_names()


__all__ = ["FastLlama"]
