"""GPT-2 assembled from the chapter 1–3 ops, with activation checkpointing (chapter 6).

The architecture is GPT-2's (Radford et al. 2019, as in nanoGPT and llm.c): learned token and
position embeddings; ``n_layer`` pre-LayerNorm blocks, each

    x ← x + c_proj(attention(c_attn(ln_1(x))))        causal multi-head self-attention
    x ← x + mlp.c_proj(gelu(mlp.c_fc(ln_2(x))))        MLP of width 4C, tanh-GELU

then ``ln_f`` and an LM head whose weight *is* the token embedding (tied). Every matrix product is a
``linear_forward``/``linear_backward`` call (cuBLAS on the GPU), every other layer one of our kernels.

Precision: the fp32 master weights, their gradients and AdamW's moments live in one ``FlatParams``
(chapter 4). The forward and backward passes read the working copy (``.weight(name)``: bf16, fp16 or
fp32, chapter 5) and keep activations in that dtype; weight gradients are accumulated in fp32
straight into the flat gradient buffer (``linear_backward(..., dw_out=, accumulate=True)``), so
gradient accumulation over micro-batches costs nothing extra.

Activation checkpointing (``checkpoint_every=k``, 0 = off). Without it, the forward pass keeps every
activation each block's backward needs (about ``17·B·T·C`` values per block, plus the ``B·H·T·T``
attention probabilities of the chapter 2 attention). With it,
the forward pass keeps only the *input* of every k-th block and throws the rest away as it goes. The
backward pass walks the spans of k blocks from the last to the first: it reloads the span's input,
reruns the span's forward pass storing its activations, then runs the span's backward. Memory: the
span inputs plus one span of activations instead of all of them; compute: one extra forward pass
(minus the last MLP projection of each span, whose output backward never reads). The recomputed
activations are produced by the same kernels from the same inputs, so the gradients are bitwise
identical to the run without checkpointing.

Configuration, parameters, the state dict, sampling and the loss are shared with the chapter 8 step
(``FastGPT``) through ``model/base.py``.
"""

from __future__ import annotations

from ..instrument import region
from ..ops.attention import attention_backward, attention_forward
from ..ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from ..ops.embedding import embedding_backward, embedding_forward
from ..ops.gelu import gelu_backward, gelu_forward
from ..ops.layernorm import layernorm_backward, layernorm_forward
from ..ops.linear import linear_backward, linear_forward
from ..optim.params import ALIGN
from .base import PAD_LOGIT, GPTBase, accumulate_grad, nbytes_of
from .config import LNF_B, LNF_W, WPE, WTE, GPTConfig, block_param_names


class GPT(GPTBase):
    """GPT-2 forward and backward from the chapter 1–3 ops, on NumPy or CuPy (``GPTBase`` has the rest).

    ``checkpoint_every``: 0 (off) or k ≥ 1 (keep every k-th block input, recompute the rest in backward).
    """

    def __init__(self, config: GPTConfig, *, dtype="fp32", checkpoint_every: int = 0, xp=None, seed: int = 0,
                 init: bool = True, param_multiple: int = ALIGN):
        self.checkpoint_every = checkpoint_every
        super().__init__(config, dtype=dtype, xp=xp, seed=seed, init=init, param_multiple=param_multiple)

    # ------------------------------------------------------------------ one block

    def _block_forward(self, i: int, x, store: bool, need_output: bool = True):
        """Block i on ``x [B,T,C]``; returns (output or None, cache or None)."""
        cfg, xp = self.config, self.xp
        B, T, C = x.shape
        H, D = cfg.n_head, cfg.head_dim
        n = block_param_names(i)
        N = B * T
        x2d = x.reshape(N, C)
        with region("ln_1 fwd", bytes=2 * x2d.nbytes):
            h1, mean1, rstd1 = layernorm_forward(x2d, self.weight(n["ln_1.weight"]), self.weight(n["ln_1.bias"]))
        with region("attn.qkv fwd", flops=6.0 * N * C * C):
            qkv = linear_forward(h1, self.weight(n["attn.c_attn.weight"]), self.weight(n["attn.c_attn.bias"]))
        with region("attn.core fwd", flops=4.0 * B * H * T * T * D):
            # [B,T,3,H,D] -> [3,B,H,T,D]: q, k, v as contiguous [B,H,T,D] arrays (one transposing copy)
            qkv5 = xp.ascontiguousarray(qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4))
            del qkv
            q, k, v = qkv5[0], qkv5[1], qkv5[2]
            o, stats = attention_forward(q, k, v, causal=True)
            y = xp.ascontiguousarray(o.transpose(0, 2, 1, 3)).reshape(N, C)
        with region("attn.proj fwd", flops=2.0 * N * C * C):
            a = linear_forward(y, self.weight(n["attn.c_proj.weight"]), self.weight(n["attn.c_proj.bias"]))
        with region("residual add", bytes=3 * a.nbytes):
            x2 = xp.add(x2d, a, out=a)  # residual; a's buffer is reused
        with region("ln_2 fwd", bytes=2 * x2.nbytes):
            h2, mean2, rstd2 = layernorm_forward(x2, self.weight(n["ln_2.weight"]), self.weight(n["ln_2.bias"]))
        with region("mlp.fc fwd", flops=8.0 * N * C * C):
            f = linear_forward(h2, self.weight(n["mlp.c_fc.weight"]), self.weight(n["mlp.c_fc.bias"]))
        with region("gelu fwd", bytes=2 * f.nbytes):
            g = gelu_forward(f)
        out = None
        if need_output:
            with region("mlp.proj fwd", flops=8.0 * N * C * C):
                m = linear_forward(g, self.weight(n["mlp.c_proj.weight"]), self.weight(n["mlp.c_proj.bias"]))
            with region("residual add", bytes=3 * m.nbytes):
                out = xp.add(x2, m, out=m).reshape(B, T, C)
        cache = None
        if store:
            cache = {"x": x2d, "h1": h1, "mean1": mean1, "rstd1": rstd1, "qkv5": qkv5, "o": o, "stats": stats,
                     "y": y, "x2": x2, "h2": h2, "mean2": mean2, "rstd2": rstd2, "f": f, "g": g}
        return out, cache

    def _block_backward(self, i: int, dout, c):
        """Gradients of block i: accumulates weight gradients, returns d(input) ``[B,T,C]``."""
        cfg, xp, P = self.config, self.xp, self.params
        B, T, C = dout.shape
        H, D = cfg.n_head, cfg.head_dim
        n = block_param_names(i)
        G = P.grad_of
        N = B * T
        d2 = dout.reshape(N, C)
        # MLP
        with region("mlp.proj bwd", flops=16.0 * N * C * C):
            dg, _, _ = linear_backward(d2, c["g"], self.weight(n["mlp.c_proj.weight"]),
                                       dw_out=G(n["mlp.c_proj.weight"]), db_out=G(n["mlp.c_proj.bias"]),
                                       accumulate=True)
        with region("gelu bwd", bytes=3 * dg.nbytes):
            df = gelu_backward(dg, c["f"])
        del dg
        with region("mlp.fc bwd", flops=16.0 * N * C * C):
            dh2, _, _ = linear_backward(df, c["h2"], self.weight(n["mlp.c_fc.weight"]), dw_out=G(n["mlp.c_fc.weight"]),
                                        db_out=G(n["mlp.c_fc.bias"]), accumulate=True)
        del df
        with region("ln_2 bwd", bytes=3 * dh2.nbytes):
            dx2, dgam, dbet = layernorm_backward(dh2, c["x2"], self.weight(n["ln_2.weight"]), c["mean2"], c["rstd2"])
            accumulate_grad(G(n["ln_2.weight"]), dgam)
            accumulate_grad(G(n["ln_2.bias"]), dbet)
        with region("residual add", bytes=3 * dx2.nbytes):
            dx2 = xp.add(dx2, d2, out=dx2)  # the residual branch passes the gradient straight through
        # attention
        with region("attn.proj bwd", flops=4.0 * N * C * C):
            dy, _, _ = linear_backward(dx2, c["y"], self.weight(n["attn.c_proj.weight"]),
                                       dw_out=G(n["attn.c_proj.weight"]), db_out=G(n["attn.c_proj.bias"]),
                                       accumulate=True)
        with region("attn.core bwd", flops=8.0 * B * H * T * T * D):
            do = xp.ascontiguousarray(dy.reshape(B, T, H, D).transpose(0, 2, 1, 3))
            del dy
            qkv5 = c["qkv5"]
            dq, dk, dv = attention_backward(do, qkv5[0], qkv5[1], qkv5[2], c["o"], c["stats"], causal=True)
            del do
            dqkv = xp.empty((B, T, 3, H, D), dtype=dq.dtype)
            for j, dpart in enumerate((dq, dk, dv)):
                dqkv[:, :, j] = dpart.transpose(0, 2, 1, 3)
            del dq, dk, dv
        with region("attn.qkv bwd", flops=12.0 * N * C * C):
            dh1, _, _ = linear_backward(dqkv.reshape(N, 3 * C), c["h1"], self.weight(n["attn.c_attn.weight"]),
                                        dw_out=G(n["attn.c_attn.weight"]), db_out=G(n["attn.c_attn.bias"]),
                                        accumulate=True)
        del dqkv
        with region("ln_1 bwd", bytes=3 * dh1.nbytes):
            dx, dgam, dbet = layernorm_backward(dh1, c["x"], self.weight(n["ln_1.weight"]), c["mean1"], c["rstd1"])
            accumulate_grad(G(n["ln_1.weight"]), dgam)
            accumulate_grad(G(n["ln_1.bias"]), dbet)
        with region("residual add", bytes=3 * dx.nbytes):
            dx = xp.add(dx, dx2, out=dx)
        return dx.reshape(B, T, C)


    # ------------------------------------------------------------------ the whole model

    # The pieces around the blocks, each a method so that a sibling architecture (model/llama.py) replaces them
    # and keeps forward_backward's loop, checkpointing included.

    def _embed(self, idx):
        """Token and position embeddings: x [B,T,C]."""
        return embedding_forward(idx, self.weight(WTE), self.weight(WPE), vocab_size=self.config.vocab_size)

    def _embed_backward(self, dx, idx) -> list[str]:
        """Accumulates the embeddings' gradients from dx [B,T,C]; returns their names."""
        cfg, G = self.config, self.params.grad_of
        dwte, dwpe = embedding_backward(dx, idx, cfg.padded_vocab_size, cfg.block_size)
        accumulate_grad(G(WTE), dwte)
        accumulate_grad(G(WPE), dwpe)
        return [WTE, WPE]  # the tied embedding: the LM head's gradient and the lookup's, both in

    def _head(self, x):
        """ln_f and the tied LM head on x [B,T,C]: (logits [B·T, Vp], what _head_backward needs)."""
        B, T, C = x.shape
        x2d = x.reshape(B * T, C)
        with region("ln_f fwd", bytes=2 * x2d.nbytes):
            hf, mean, rstd = layernorm_forward(x2d, self.weight(LNF_W), self.weight(LNF_B))
        V, Vp = self.config.vocab_size, self.config.padded_vocab_size
        with region("lm_head fwd", flops=2.0 * B * T * C * Vp):
            logits = linear_forward(hf, self.weight(WTE))
        if Vp != V:
            with region("lm_head pad"):
                logits[:, V:] = PAD_LOGIT
        return logits, (x2d, hf, mean, rstd)

    def _head_backward(self, dlogits, cache):
        """The LM head's and ln_f's backward: (dx [B·T, C], the names of the gradients made final here)."""
        x2d, hf, mean, rstd = cache
        G, C = self.params.grad_of, self.config.n_embd
        with region("lm_head bwd", flops=4.0 * dlogits.shape[0] * C * self.config.padded_vocab_size):
            dhf, _, _ = linear_backward(dlogits, hf, self.weight(WTE), bias=False, dw_out=G(WTE), accumulate=True)
        del dlogits, hf
        with region("ln_f bwd", bytes=3 * dhf.nbytes):
            dx, dgam, dbet = layernorm_backward(dhf, x2d, self.weight(LNF_W), mean, rstd)
            accumulate_grad(G(LNF_W), dgam)
            accumulate_grad(G(LNF_B), dbet)
        return dx, [LNF_W, LNF_B]

    def _trunk(self, idx):
        """Embeddings and all blocks without storing activations: the final residual x [B,T,C]."""
        x = self._embed(idx)
        for i in range(self.config.n_layer):
            x, _ = self._block_forward(i, x, store=False)
        return x

    def forward(self, idx, targets=None, *, last_only: bool = False):
        """Inference: logits ``[B, T, vocab]`` (``[B, vocab]`` with ``last_only``), and the mean loss
        (0-d device array) when ``targets`` is given. Stores no activations."""
        idx = self.check_idx(idx)
        x = self._trunk(idx)
        B, T, C = x.shape
        if last_only:
            x = self.xp.ascontiguousarray(x[:, -1:, :])
        logits, _ = self._head(x)
        return self.logits_and_loss(logits, targets, B, T, last_only)

    def forward_backward(self, idx, targets, dloss=1.0, *, grads_ready=None, keep=None):
        """One micro-batch: loss (0-d device array, unscaled) and gradients *added* into ``params.grad``.

        ``dloss`` seeds the backward pass (loss scale / number of micro-batches; a float or a 0-d
        fp32 device array). Zero the gradient yourself (``zero_grad``) before the first micro-batch.
        ``grads_ready(names)``: called as each group of gradients becomes final (``model/base.py``).
        ``keep``: a dict that receives activation gradients as the backward pass makes them, in the
        working dtype and times ``dloss``: ``"dlogits"`` ``[B·T, Vp]`` and, for each block i, ``"h.i"``
        ``[B, T, C]``, the gradient of the block's output (chapter 5's census of gradient magnitudes;
        kept arrays stay allocated until the dict lets them go).
        """
        ready = grads_ready or _ignore
        cfg = self.config
        idx, targets = self.check_batch(idx, targets)
        L, k = cfg.n_layer, self.checkpoint_every
        B, T = idx.shape

        # ---- forward
        with region("embedding fwd"):
            x = self._embed(idx)
        caches: list = [None] * L
        inputs: list = [None] * L  # checkpointed span inputs
        for i in range(L):
            if k == 0:
                x, caches[i] = self._block_forward(i, x, store=True)
            else:
                if i % k == 0:
                    inputs[i] = x
                x, _ = self._block_forward(i, x, store=False)
        stored = nbytes_of(caches) + nbytes_of(inputs)
        logits, head_cache = self._head(x)
        del x
        with region("cross_entropy fwd", bytes=logits.nbytes):
            loss, ce_cache = cross_entropy_forward(logits, targets.reshape(-1))
        del logits

        # ---- backward: LM head and ln_f (dlogits overwrite the logits: one [B·T, V] buffer, not two)
        with region("cross_entropy bwd", bytes=2 * ce_cache.logits.nbytes):
            dlogits = cross_entropy_backward(ce_cache, dloss, out=ce_cache.logits)
        del ce_cache
        if keep is not None:
            keep["dlogits"] = dlogits
        dx, names = self._head_backward(dlogits, head_cache)
        ready(names)
        del dlogits, head_cache
        dx = dx.reshape(B, T, -1)

        # ---- backward through the blocks
        peak = stored
        if k == 0:
            for i in reversed(range(L)):
                if keep is not None:
                    keep[f"h.{i}"] = dx
                dx = self._block_backward(i, dx, caches[i])
                caches[i] = None
                ready(self._block_names(i))
        else:
            for s in reversed(range(0, L, k)):
                e = min(s + k, L)
                xs, span = inputs[s], []
                for j in range(s, e):  # recompute the span, storing its activations
                    xs, c = self._block_forward(j, xs, store=True, need_output=j < e - 1)
                    span.append(c)
                peak = max(peak, nbytes_of(inputs) + nbytes_of(span))
                for j in reversed(range(s, e)):
                    if keep is not None:
                        keep[f"h.{j}"] = dx
                    dx = self._block_backward(j, dx, span[j - s])
                    span[j - s] = None
                    ready(self._block_names(j))
                inputs[s] = None

        # ---- embeddings
        with region("embedding bwd"):
            names = self._embed_backward(dx, idx)
        ready(names)
        self.stats = {"activation_bytes_stored": stored, "activation_bytes_peak": peak}
        return loss



def _ignore(names):
    """The default ``grads_ready``: nobody listens."""


__all__ = ["GPT"]
