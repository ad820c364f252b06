"""The chapter 10 fast step: the Llama model of ``model/llama.py`` with ``FastGPT``'s machinery (chapter 8).

``FastLlama`` is to ``Llama`` what ``FastGPT`` is to ``GPT``: the same parameters, the same function, another
step. It inherits ``FastGPT``'s loop (``forward_backward``: activation checkpointing with span inputs that hold the
block's normalized input, the ``grads_ready`` seam, the CUDA-graph capture), its chunked LM head with the fused
cross-entropy (the ``[N, Vp]`` logits never exist whole), its cuBLASLt GEMMs writing weight gradients straight into
the fp32 buffer, and its flash attention (``FastOptions.attention_kernel``; grouped-query attention: K/V with
``n_kv_head`` heads, which cuDNN takes as they are). What is Llama's:

* **Stacked projections.** q|k|v and gate|up are each one GEMM over the stacked weights (``FlatParams.stacked``:
  the pieces lie back to back in the flat buffers, so ``[W_q; W_k; W_v]`` is a view, and so is its fp32
  gradient): one ``[N, C + 2·kv_dim]`` and one ``[N, 2F]`` output, and in the backward one weight-gradient GEMM
  and one input-gradient GEMM each, where separate GEMMs (K/V with only ``kv_dim`` outputs) fill the GPU worse
  and the input gradients are summed through memory. A layout with padding between the pieces (some ZeRO shard
  counts) falls back to one GEMM each.
* **Token-major heads, no copies.** The q|k|v rows are ``[B, T, H + 2·H_kv, D]``; RoPE rotates q's and k's heads
  in place in that layout, in one pass (``rope_forward(..., seq_axis=1)`` on a row-strided view) and flash
  attention reads all three through strided ``[B, heads, T, D]`` views (``split_qkv``), writing its output
  straight into the ``[N, C]`` rows the output projection reads. The book step makes four transposing copies
  per block instead. In the backward, RoPE's inverse rotation of dq and dk is folded into flash attention's
  stores (``flash_attention_backward(..., rope=)``; our kernels do it in registers), not a pass of its own
  (``FastOptions.rope_in_attention_backward``).
* **RMSNorm with the residual stream.** The state entering block i is ``(x, rmsnorm(x), inv_rms)``, as FastGPT's
  is ``(x, ln_1(x), mean, rstd)``: each block ends with its residual add and the next block's input norm (the
  final norm after the last block), so a checkpointed span input already holds what its first block reads.
  The residual add and the norm after it are one kernel (``add_rmsnorm_forward``, the sum written over the
  branch output, as FastGPT's ``_add_ln``); in the backward the residual gradient is added to the norm's input
  gradient in the norm's kernel (``rmsnorm_backward(..., dresidual=)``, written over it).
* **SwiGLU on the gate|up rows** (``swiglu_forward`` on the two column halves), its backward written over the
  saved gate|up (they are not read again), which then is the stacked GEMMs' output gradient.
* **Embedding**: a gather forward (``embedding_forward`` without position rows: NaN rows for ids past the
  vocabulary, as GPT-2's); backward adds the fp32 row sums of the tokens in the batch straight into the
  fp32 gradient (``embedding_backward(..., positions=False)``: there is no position table).

Every weight is bias-free, so no GEMM needs a bias epilogue and no bias gradient is summed. The gradients agree
with ``Llama``'s to rounding (the same ops in another order of rounding; in float64 on NumPy to ~1e-12).
"""

from __future__ import annotations

from ..instrument import region
from ..ops.embedding import embedding_forward
from ..ops.flash_attention import split_qkv
from ..ops.rmsnorm import add_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward, traffic_bytes
from ..ops.rope import rope_backward, rope_forward
from ..ops.swiglu import swiglu_backward, swiglu_forward
from ..ops.swiglu import traffic_bytes as swiglu_bytes
from .fast import FastGPT
from .llama import LlamaFamily
from .llama_config import EMBED, NORM, block_names


class FastLlama(LlamaFamily, FastGPT):
    """A Llama-family model with the chapter 8 step. Same constructor as ``FastGPT`` (``dtype`` default bf16,
    ``checkpoint_every``, ``options``: a ``FastOptions``, whose attention kernel applies; its embedding fields must
    keep their defaults: the fp32 row sums are the only embedding backward here)."""

    runs_fp8 = False  # FastOptions.fp8: the GPT-2 family's blocks only, so far (model/fp8_linear.py)

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

    def _rope(self, heads, *, inverse, name):
        """RoPE on token-major heads ``[B, T, n, D]`` (a view of a GEMM's rows), in place."""
        rot = rope_backward if inverse else rope_forward
        with region(name, bytes=2 * heads.nbytes, flops=6.0 * heads.size):
            rot(heads, self.rope_cos, self.rope_sin, out=heads, seq_axis=1)

    def _stacked_linear(self, x, names, *, name):
        """``x [W_a; W_b; ...]ᵀ``: the projections of one input side by side in one ``[N, Σ out]`` buffer, by one
        GEMM over the stacked weights (they lie back to back in the flat buffers), else (a layout with padding
        between them, e.g. some ZeRO shards) by one GEMM each and a copy."""
        if self._stackable(names):
            return self._linear(x, names, name=name + " fwd")
        return self.xp.concatenate([self._linear(x, n, name=name + " fwd") for n in names], axis=1)

    def _stacked_backward(self, d, x, names, *, name):
        """The backward of ``_stacked_linear`` from ``d [N, Σ out]``: the weights' gradients accumulated into the
        buffer and the input's gradient ``d [W_a; W_b; ...]`` returned."""
        if self._stackable(names):
            self._linear_grads(d, x, names, None, name=name)
            return self._dgrad(d, names, name=name)
        dx, col = None, 0
        for n in names:  # one GEMM each on a contiguous copy of its columns; the input gradients summed (beta = 1)
            rows = self.params.shapes[n][0]
            dn = self.xp.ascontiguousarray(d[:, col:col + rows])
            col += rows
            self._linear_grads(dn, x, n, None, name=name)
            dx = self._dgrad(dn, n, name=name, out=dx, beta=0.0 if dx is None else 1.0)
        return dx

    def _stackable(self, names) -> bool:
        """Whether the weights ``names`` and their gradients each lie back to back (one stacked matrix)."""
        P = self.params
        return P.stacked(names) is not None and P.stacked(names, grad=True) is not None

    def _attention_forward(self, qkv, B, T):
        """Causal grouped-query attention on the ``[N, C + 2·kv_dim]`` q|k|v rows (RoPE applied):
        ``(y [N, C], state)``."""
        cfg = self.config
        H, Hk, D = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        with region("attn.core fwd", flops=2.0 * B * H * T * T * D, bytes=2 * qkv.nbytes):
            return self._attention_core(*split_qkv(qkv.reshape(B, T, -1), H, Hk), B, T)

    def _attention_backward(self, dy, state, B, T):
        """``dqkv [N, C + 2·kv_dim]`` from ``dy [N, C]`` (dk, dv summed over each K/V head's group), RoPE's backward
        applied to dq and dk: folded into flash attention's stores, else a pass after it."""
        cfg, xp = self.config, self.xp
        H, Hk, C, D = cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.head_dim
        width = C + 2 * Hk * D
        with region("attn.core bwd", flops=5.0 * B * H * T * T * D,
                    bytes=(2 * dy.size + 2 * B * T * width) * dy.dtype.itemsize):
            dqkv = xp.empty((B, T, width), dtype=dy.dtype)
            fold = self.options.rope_in_attention_backward
            rotated = self._attention_core_backward(dy, state, *split_qkv(dqkv, H, Hk), B, T,
                                                    rope=(self.rope_cos, self.rope_sin) if fold else None)
        dqkv = dqkv.reshape(B * T, width)
        if not rotated:
            self._rope(self._qk_heads(dqkv, B, T), inverse=True, name="rope q,k bwd")
        return dqkv

    def _qk_heads(self, qkv, B, T):
        """q's and k's heads of the q|k|v rows as one token-major ``[B, T, H + H_kv, D]`` view (RoPE turns them
        all, in one pass)."""
        cfg = self.config
        H, Hk = cfg.n_head, cfg.n_kv_head
        return qkv.reshape(B, T, H + 2 * Hk, cfg.head_dim)[:, :, :H + Hk]

    # ------------------------------------------------------------------ forward

    def _embed(self, idx):
        """The token rows and block 0's input norm: the state ``(x, rmsnorm(x), inv_rms)`` entering block 0."""
        B, T = idx.shape
        C = self.config.n_embd
        with region("embedding fwd", bytes=2 * B * T * C * self.dtype.itemsize + 4 * B * T):
            x = embedding_forward(idx, self.weight(EMBED), None, vocab_size=self.config.vocab_size).reshape(B * T, C)
        return (x, *self._norm(x, block_names(0)["input_layernorm.weight"], name="input_norm fwd"))

    def _block_forward(self, i: int, state, B: int, T: int, need_output: bool = True, keep_pre: bool = True):
        """Block i from its input state ``(x, rmsnorm(x), inv_rms)``: ``(cache, the next state)``, as FastGPT's
        (``need_output=False``: the last residual add and norm are not run). ``keep_pre`` is FastGPT's (its GELU
        pre-activation); a Llama block always writes gate|up, and drops it with the cache in inference."""
        x, h, inv = state
        cfg, L = self.config, self.config.n_layer
        n = block_names(i)
        F = cfg.ffn_dim
        qkv = self._stacked_linear(h, _names(n, QKV), name="attn.qkv")  # [N, C + 2·kv_dim]
        self._rope(self._qk_heads(qkv, B, T), inverse=False, name="rope q,k fwd")
        y, att = self._attention_forward(qkv, B, T)
        a = self._linear(y, n["self_attn.o_proj.weight"], name="attn.proj fwd")
        x2, h2, inv2 = self._add_norm(x, a, n["post_attention_layernorm.weight"], name="residual+post_norm fwd")
        gu = self._stacked_linear(h2, _names(n, GATE_UP), name="mlp.gate,up")  # [N, 2F]: gate | up
        g, u = gu[:, :F], gu[:, F:]
        with region("swiglu fwd", bytes=swiglu_bytes(g.size, g.dtype), flops=5.0 * g.size):
            s = swiglu_forward(g, u)
        cache = {"x": x, "h1": h, "inv1": inv, "att": att, "y": y, "x2": x2, "h2": h2, "inv2": inv2,
                 "gu": gu, "s": s}
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
        F = self.config.ffn_dim
        gu = c["gu"]
        with region("swiglu bwd", bytes=swiglu_bytes(ds.size, ds.dtype, backward=True), flops=12.0 * ds.size):
            swiglu_backward(ds, gu[:, :F], gu[:, F:], dgate=gu[:, :F], dup=gu[:, F:])  # dgate | dup over gate | up
        del ds
        dh2 = self._stacked_backward(gu, c["h2"], _names(n, GATE_UP), name="mlp.gate,up")
        dx = self._norm_backward(dh2, c["x2"], n["post_attention_layernorm.weight"], c["inv2"], dx,
                                 name="post_norm+residual bwd")
        del dh2
        # attention: x2 = x + y W_oᵀ
        self._linear_grads(dx, c["y"], n["self_attn.o_proj.weight"], None, name="attn.proj")
        dy = self._dgrad(dx, n["self_attn.o_proj.weight"], name="attn.proj")
        dqkv = self._attention_backward(dy, c["att"], B, T)  # RoPE's backward included
        del dy
        dh1 = self._stacked_backward(dqkv, c["h1"], _names(n, QKV), name="attn.qkv")
        del dqkv
        return self._norm_backward(dh1, c["x"], n["input_layernorm.weight"], c["inv1"], dx,
                                   name="input_norm+residual bwd")

    def _final_norm_backward(self, dhf, state):
        x, _, inv = state
        dx = self._norm_backward(dhf, x, NORM, inv, None, name="norm bwd")
        return dx, self._norm_and_head_names()


QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def _names(block: dict[str, str], short: tuple[str, ...]) -> tuple[str, ...]:
    """The full names of a block's tensors ``short``, in that order (a stacked GEMM's pieces)."""
    return tuple(block[k] for k in short)


__all__ = ["FastLlama"]
