"""The Llama architecture (chapter 10) on the book's step: ``GPT``'s loop, checkpointing and seam, other pieces.

A block (pre-norm, no biases; Touvron et al. 2023, as Hugging Face's ``LlamaForCausalLM``)::

    h = rmsnorm(x)                                        input_layernorm
    q, k, v = h Wqᵀ, h Wkᵀ, h Wvᵀ                         k, v with n_kv_head heads (grouped-query attention)
    q, k = rope(q), rope(k)                               rotate each pair by the position's angle
    x ← x + attention(q, k, v) Woᵀ                        causal; K/V head j serves query heads j·G … j·G+G−1
    h = rmsnorm(x)                                        post_attention_layernorm
    x ← x + (silu(h Wgᵀ) · (h Wuᵀ)) Wdᵀ                   SwiGLU MLP of width ffn_dim

then ``model.norm`` and the LM head (the embedding when ``tie_embeddings``). The token embedding is the only
input: RoPE puts the position into q and k instead of adding a learned vector to x.

The backward pass is each op's backward in reverse order (ops/rmsnorm.py, ops/rope.py, ops/swiglu.py and the
grouped attention of ops/attention.py each derive theirs); every weight gradient is accumulated in fp32 straight
into the flat buffer, as in ``GPT``. ``forward_backward``, activation checkpointing and the ``grads_ready`` seam are
``GPT``'s: this class replaces the block, the embedding and the head only.
"""

from __future__ import annotations

from .. import backend
from ..instrument import region
from ..ops.attention import attention_backward, attention_forward
from ..ops.embedding import embedding_backward, embedding_forward
from ..ops.linear import linear_backward, linear_forward
from ..ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from ..ops.rope import rope_backward, rope_forward, rope_tables
from ..ops.swiglu import swiglu_backward, swiglu_forward
from .base import PAD_LOGIT
from .config import span_activation_bytes
from .gpt import GPT
from .llama_config import (
    BUFFERS,
    EMBED,
    LM_HEAD,
    NORM,
    LlamaConfig,
    block_names,
    llama_block_activation_bytes,
    llama_param_shapes,
)


class LlamaFamily:
    """What a Llama model is whatever its step (the book's ``Llama`` below, chapter 10's ``FastLlama`` in
    ``model/fast_llama.py``): its configuration and parameters, the RoPE tables, the activation formula, the names
    the step's hooks ask for. A mixin: it comes first in the bases, before ``GPT`` or ``FastGPT``."""

    config_type = LlamaConfig
    embedding_name = EMBED
    buffers = BUFFERS
    # GPTBase.init_weights: matrices N(0, 0.02) (Hugging Face's initializer_range), these two N(0, 0.02/√(2L)) as
    # GPT-2's, every vector a norm gain of 1 (there are no biases)
    norm_gains = ("norm.weight",)  # input_layernorm, post_attention_layernorm, model.norm
    residual_projections = ("o_proj.weight", "down_proj.weight")

    def __init__(self, config: LlamaConfig, **kwargs):
        super().__init__(config, **kwargs)
        table = backend.float64 if self.dtype == backend.float64 else backend.float32  # fp64: the FD reference
        self.rope_cos, self.rope_sin = rope_tables(self.config.block_size, self.config.head_dim,
                                                   self.config.rope_theta, xp=self.xp, dtype=table)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return llama_param_shapes(self.config)

    def activation_bytes(self, batch: int, seq: int, checkpoint_every: int | None = None) -> dict:
        """``stored`` and ``peak`` activation bytes (``model/llama_config.llama_block_activation_bytes`` per block;
        a checkpointed span keeps its input x, and with ``keeps_ln_1`` its input_norm output and inverse rms)."""
        k = self.checkpoint_every if checkpoint_every is None else checkpoint_every
        blk = llama_block_activation_bytes(self.config, batch, seq, self.dtype,
                                           attention="flash" if self.attention == "flash" else "math")
        span_input = blk["x (block input)"]
        if self.keeps_ln_1:
            span_input += blk["input_norm output"] + blk["RMSNorm inverse rms"] // 2
        return span_activation_bytes(self.config.n_layer, k, sum(blk.values()), span_input)

    def _block_names(self, i: int) -> list[str]:
        return list(block_names(i).values())

    def _norm_and_head_names(self) -> list[str]:
        """The gradients made final by the final norm's and the LM head's backward (a tied head's waits for the
        embedding's)."""
        return [NORM] + ([] if self.tied else [LM_HEAD])

    def _embed_backward(self, dx, idx) -> list[str]:
        """The lookup's gradient from the residual stream's ``dx`` (``[B, T, C]`` or ``[N, C]``): its rows added into
        their tokens' rows in fp32 (chapter 1's embedding backward without its position half: a Llama has none)."""
        B, T = idx.shape
        N, C, Vp = B * T, self.config.n_embd, self.config.padded_vocab_size
        with region("embedding bwd", bytes=N * C * self.dtype.itemsize + 4 * N + 8 * min(N, Vp) * C,
                    flops=float(N * C)):
            embedding_backward(dx.reshape(B, T, C), idx, Vp, T, method="counting", dwte_out=self.params.grad_of(EMBED),
                               accumulate=True, positions=False)
        return [EMBED]


class Llama(LlamaFamily, GPT):
    """A Llama-family model from the chapter 1–3 and 10 ops, on NumPy or CuPy (``GPT`` has the loop, ``GPTBase``
    the rest). Same constructor as ``GPT``; ``checkpoint_every`` as ``GPT``'s."""

    # ------------------------------------------------------------------ around the blocks

    def _embed(self, idx):
        # a gather: x [B, T, C]; no position rows (RoPE rotates q and k); ids past the vocabulary read NaN on a GPU
        return embedding_forward(idx, self.weight(EMBED), None, vocab_size=self.config.vocab_size)

    def _head(self, x):
        B, T, C = x.shape
        x2d = x.reshape(B * T, C)
        with region("norm fwd", bytes=2 * x2d.nbytes):
            hf, inv = rmsnorm_forward(x2d, self.weight(NORM), self.config.norm_eps)
        V, Vp = self.config.vocab_size, self.config.padded_vocab_size
        with region("lm_head fwd", flops=2.0 * B * T * C * Vp):
            logits = linear_forward(hf, self.weight(self._head_name))
        if Vp != V:
            logits[:, V:] = PAD_LOGIT
        return logits, (x2d, hf, inv)

    def _head_backward(self, dlogits, cache):
        x2d, hf, inv = cache
        G, W = self.params.grad_of, self._head_name
        with region("lm_head bwd", flops=4.0 * dlogits.shape[0] * self.config.n_embd * self.config.padded_vocab_size):
            dhf, _, _ = linear_backward(dlogits, hf, self.weight(W), bias=False, dw_out=G(W), accumulate=True)
        del dlogits, hf
        with region("norm bwd", bytes=3 * dhf.nbytes):
            dx, _ = rmsnorm_backward(dhf, x2d, self.weight(NORM), inv, dweight=G(NORM), accumulate=True)
        return dx, self._norm_and_head_names()

    # ------------------------------------------------------------------ one block

    def _heads(self, a, B: int, T: int, n_heads: int):
        """[N, n·D] (rows b·T + t) → contiguous [B, n, T, D]."""
        return self.xp.ascontiguousarray(a.reshape(B, T, n_heads, -1).transpose(0, 2, 1, 3))

    def _rows(self, a):
        """[B, n, T, D] → contiguous [N, n·D], the inverse of ``_heads``."""
        B, n, T, D = a.shape
        return self.xp.ascontiguousarray(a.transpose(0, 2, 1, 3)).reshape(B * T, n * D)

    def _block_forward(self, i: int, x, store: bool, need_output: bool = True):
        cfg, xp = self.config, self.xp
        B, T, C = x.shape
        n, W, eps = block_names(i), self.weight, cfg.norm_eps
        N = B * T
        x2d = x.reshape(N, C)
        cos, sin = self.rope_cos, self.rope_sin
        with region("input_norm fwd", bytes=2 * x2d.nbytes):
            h1, inv1 = rmsnorm_forward(x2d, W(n["input_layernorm.weight"]), eps)
        with region("attn.qkv fwd", flops=2.0 * N * C * (C + 2 * cfg.kv_dim)):
            q = self._heads(linear_forward(h1, W(n["self_attn.q_proj.weight"])), B, T, cfg.n_head)
            k = self._heads(linear_forward(h1, W(n["self_attn.k_proj.weight"])), B, T, cfg.n_kv_head)
            v = self._heads(linear_forward(h1, W(n["self_attn.v_proj.weight"])), B, T, cfg.n_kv_head)
        with region("rope fwd", bytes=2 * (q.nbytes + k.nbytes)):
            rope_forward(q, cos, sin, out=q)
            rope_forward(k, cos, sin, out=k)
        with region("attn.core fwd", flops=4.0 * B * cfg.n_head * T * T * cfg.head_dim):
            o, stats = attention_forward(q, k, v, causal=True)
            y = self._rows(o)
        with region("attn.proj fwd", flops=2.0 * N * C * C):
            a = linear_forward(y, W(n["self_attn.o_proj.weight"]))
        x2 = xp.add(x2d, a, out=a)  # residual; a's buffer is reused
        with region("post_norm fwd", bytes=2 * x2.nbytes):
            h2, inv2 = rmsnorm_forward(x2, W(n["post_attention_layernorm.weight"]), eps)
        with region("mlp.gate_up fwd", flops=4.0 * N * C * cfg.ffn_dim):
            g = linear_forward(h2, W(n["mlp.gate_proj.weight"]))
            u = linear_forward(h2, W(n["mlp.up_proj.weight"]))
        with region("swiglu fwd", bytes=3 * g.nbytes):
            s = swiglu_forward(g, u)
        out = None
        if need_output:
            with region("mlp.down fwd", flops=2.0 * N * C * cfg.ffn_dim):
                m = linear_forward(s, W(n["mlp.down_proj.weight"]))
            out = xp.add(x2, m, out=m).reshape(B, T, C)
        cache = None
        if store:
            cache = {"x": x2d, "h1": h1, "inv1": inv1, "q": q, "k": k, "v": v, "o": o, "stats": stats, "y": y,
                     "x2": x2, "h2": h2, "inv2": inv2, "g": g, "u": u, "s": s}
        return out, cache

    def _block_backward(self, i: int, dout, c):
        cfg, xp = self.config, self.xp
        B, T, C = dout.shape
        n, W, G = block_names(i), self.weight, self.params.grad_of
        N = B * T
        d2 = dout.reshape(N, C)

        def lin(dy, x, name):  # dx of a bias-free linear; its weight gradient accumulated into the flat buffer
            return linear_backward(dy, x, W(n[name]), bias=False, dw_out=G(n[name]), accumulate=True)[0]

        # MLP
        with region("mlp.down bwd", flops=4.0 * N * C * cfg.ffn_dim):
            ds = lin(d2, c["s"], "mlp.down_proj.weight")
        with region("swiglu bwd", bytes=5 * ds.nbytes):
            dg, du = swiglu_backward(ds, c["g"], c["u"])
        del ds
        with region("mlp.gate_up bwd", flops=8.0 * N * C * cfg.ffn_dim):
            dh2 = lin(dg, c["h2"], "mlp.gate_proj.weight")
            dh2 += lin(du, c["h2"], "mlp.up_proj.weight")
        del dg, du
        with region("post_norm bwd", bytes=3 * dh2.nbytes):
            dx2, _ = rmsnorm_backward(dh2, c["x2"], W(n["post_attention_layernorm.weight"]), c["inv2"],
                                      dweight=G(n["post_attention_layernorm.weight"]), accumulate=True)
        dx2 = xp.add(dx2, d2, out=dx2)  # the residual branch passes the gradient straight through
        # attention
        with region("attn.proj bwd", flops=4.0 * N * C * C):
            dy = lin(dx2, c["y"], "self_attn.o_proj.weight")
        with region("attn.core bwd", flops=8.0 * B * cfg.n_head * T * T * cfg.head_dim):
            do = self._heads(dy, B, T, cfg.n_head)
            dq, dk, dv = attention_backward(do, c["q"], c["k"], c["v"], c["o"], c["stats"], causal=True)
            del do
        del dy
        with region("rope bwd", bytes=2 * (dq.nbytes + dk.nbytes)):
            rope_backward(dq, self.rope_cos, self.rope_sin, out=dq)
            rope_backward(dk, self.rope_cos, self.rope_sin, out=dk)
        with region("attn.qkv bwd", flops=4.0 * N * C * (C + 2 * cfg.kv_dim)):
            dh1 = lin(self._rows(dq), c["h1"], "self_attn.q_proj.weight")
            dh1 += lin(self._rows(dk), c["h1"], "self_attn.k_proj.weight")
            dh1 += lin(self._rows(dv), c["h1"], "self_attn.v_proj.weight")
        del dq, dk, dv
        with region("input_norm bwd", bytes=3 * dh1.nbytes):
            dx, _ = rmsnorm_backward(dh1, c["x"], W(n["input_layernorm.weight"]), c["inv1"],
                                     dweight=G(n["input_layernorm.weight"]), accumulate=True)
        dx = xp.add(dx, dx2, out=dx)
        return dx.reshape(B, T, C)


__all__ = ["Llama", "LlamaFamily"]
