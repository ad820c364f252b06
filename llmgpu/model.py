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

Vocabulary padding (``pad_vocab_to=64/128``): the embedding/LM-head matrix gets
``padded_vocab_size`` rows (llm.c pads 50257 → 50304) so the largest GEMM has friendly sizes. The
padded rows start at zero; their logits are set to -1e4 before the cross-entropy, so their softmax
probability is exactly 0 and their gradient too: the padded model computes the same function.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np

from . import backend
from .ops.attention import attention_backward, attention_forward
from .ops.cross_entropy import cross_entropy_backward, cross_entropy_forward
from .ops.embedding import embedding_backward, embedding_forward
from .ops.gelu import gelu_backward, gelu_forward
from .ops.layernorm import layernorm_backward, layernorm_forward
from .ops.linear import linear_backward, linear_forward
from .params import FlatParams, gpt2_param_shapes
from .profile import region

PAD_LOGIT = -1.0e4  # logit of padded vocabulary columns: exp(-1e4 - max) == 0 in fp32


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyperparameters. ``GPTConfig.preset('gpt2')`` etc. give the standard sizes."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024  # maximum sequence length (rows of the position embedding)
    pad_vocab_to: int = 0  # 0 or 1: no padding; e.g. 64 or 128 pads the vocabulary to a multiple

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.pad_vocab_to < 0:
            raise ValueError(f"pad_vocab_to must be >= 0, got {self.pad_vocab_to}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        p = self.pad_vocab_to
        return self.vocab_size if p <= 1 else -(-self.vocab_size // p) * p

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return replace(base, **overrides) if overrides else base

    def num_parameters(self) -> int:
        """Parameters counted once (the tied LM head is the token embedding)."""
        C, L = self.n_embd, self.n_layer
        return self.padded_vocab_size * C + self.block_size * C + L * (12 * C * C + 13 * C) + 2 * C

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token (forward + backward, no recompute): 6·N + 12·L·C·T (PaLM, appendix B).

        N excludes the position embedding (a lookup, no FLOPs) but includes the LM head.
        """
        n = self.num_parameters() - self.block_size * self.n_embd
        return 6.0 * n + 12.0 * self.n_layer * self.n_embd * seq


PRESETS: dict[str, GPTConfig] = {
    # byte-level (vocabulary 256), trains in a few minutes on a laptop CPU with the NumPy backend
    "tiny": GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=128),
    "d6": GPTConfig(n_layer=6, n_head=6, n_embd=384),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),  # GPT-2 small, 124M
    "d12": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "d24": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 medium, 350M
    "d36": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # GPT-2 large, 774M
    "d48": GPTConfig(n_layer=48, n_head=25, n_embd=1600),  # GPT-2 XL, 1558M
}


def _block_names(i: int) -> dict[str, str]:
    p = f"transformer.h.{i}."
    return {k: p + k for k in (
        "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
        "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight",
        "mlp.c_proj.bias")}  # fmt: skip


WTE, WPE, LNF_W, LNF_B = "transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", \
    "transformer.ln_f.bias"


# --------------------------------------------------------------------------- the model


class GPT:
    """GPT-2 forward and backward on NumPy or CuPy, parameters in a ``FlatParams``.

    ``dtype``: working precision of the forward/backward pass ('fp32', 'bf16', 'fp16'; the master
    weights are always fp32). 'fp64' (NumPy only) makes weights, gradients and activations float64:
    the reference for finite-difference checks of the whole model. ``checkpoint_every``: 0 (off) or
    k ≥ 1 (keep every k-th block input, recompute the rest in backward). ``xp``: NumPy or CuPy
    (default: the active backend). ``seed``: the initialization's seed. ``init=False`` leaves the
    weights at zero (for loading).
    """

    def __init__(self, config: GPTConfig, *, dtype="fp32", checkpoint_every: int = 0, xp=None, seed: int = 0,
                 init: bool = True):
        self.config = config
        self.xp = xp or backend.default_xp()
        self.dtype = backend.resolve_dtype(dtype)
        self.checkpoint_every = int(checkpoint_every)
        shapes = gpt2_param_shapes(config.n_layer, config.n_embd, config.padded_vocab_size, config.block_size)
        if self.dtype == backend.float64:
            self.params = _float64_params(shapes, self.xp)
        else:
            self.params = FlatParams(shapes, xp=self.xp, working_dtype=self.dtype)
        self.stats: dict = {}  # activation-memory accounting of the last forward_backward
        if init:
            self.init_weights(seed)

    # ------------------------------------------------------------------ parameters

    @property
    def checkpoint_every(self) -> int:
        return self._ckpt

    @checkpoint_every.setter
    def checkpoint_every(self, k: int):
        if int(k) < 0:
            raise ValueError(f"checkpoint_every must be 0 (off) or >= 1, got {k}")
        self._ckpt = int(k)

    def num_parameters(self) -> int:
        return self.params.num_parameters

    def init_weights(self, seed: int = 0):
        """GPT-2 initialization: weights N(0, 0.02), the two residual projections per block N(0, 0.02/√(2L)),
        biases 0, LayerNorm gains 1; padded vocabulary rows 0. Deterministic for a given seed."""
        cfg, P = self.config, self.params
        rng = np.random.default_rng(seed)
        std_resid = 0.02 / math.sqrt(2 * cfg.n_layer)
        d = {}
        for name in P.names:
            shape = P.shapes[name]
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                d[name] = np.ones(shape, np.float32)
            elif len(shape) == 1:
                d[name] = np.zeros(shape, np.float32)
            else:
                std = std_resid if name.endswith("c_proj.weight") else 0.02
                d[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        d[WTE][cfg.vocab_size:] = 0.0
        P.load_dict(d)

    def state_dict(self, unpadded: bool = False) -> dict:
        """nanoGPT names and PyTorch layouts (``nn.Linear`` weights ``[out, in]``), fp32 copies on the backend.

        ``lm_head.weight`` is the same array as ``transformer.wte.weight`` (tied, as in PyTorch's
        state_dict). ``unpadded=True`` drops the padded vocabulary rows.
        """
        xp, P = self.xp, self.params
        out = {n: P.param(n).copy() for n in P.names}
        if unpadded:
            out[WTE] = out[WTE][: self.config.vocab_size].copy()
        out["lm_head.weight"] = out[WTE]
        return {n: backend.to_device(a, xp) for n, a in out.items()}

    def load_state_dict(self, sd: dict, strict: bool = True):
        """Load nanoGPT-named weights (NumPy, CuPy or PyTorch tensors; any float dtype).

        ``lm_head.weight`` is optional (tied); an unpadded token embedding is zero-padded. Keys such
        as ``attn.bias`` (nanoGPT's causal-mask buffer) are ignored.
        """
        cfg, P = self.config, self.params
        d = {}
        for k, v in sd.items():
            if k == "lm_head.weight" or k.endswith((".attn.bias", ".attn.masked_bias")):
                continue
            d[k] = _to_host(v)
        if WTE in d and d[WTE].shape[0] != cfg.padded_vocab_size and d[WTE].shape[1:] == (cfg.n_embd,):
            if d[WTE].shape[0] > cfg.padded_vocab_size:
                raise ValueError(f"{WTE} has {d[WTE].shape[0]} rows, the model's vocabulary is "
                                 f"{cfg.padded_vocab_size}")
            pad = np.zeros((cfg.padded_vocab_size, cfg.n_embd), np.float32)
            pad[: d[WTE].shape[0]] = d[WTE]
            d[WTE] = pad
        if "lm_head.weight" in sd and WTE not in sd:
            d[WTE] = _to_host(sd["lm_head.weight"])
        P.load_dict(d, strict=strict)

    def grads(self) -> dict:
        """name → fp32 gradient view (nanoGPT names), as accumulated by the last backward passes."""
        return {n: self.params.grad_of(n) for n in self.params.names}

    def zero_grad(self):
        self.params.zero_grad()

    # ------------------------------------------------------------------ one block

    def _w(self, name):
        return self.params.weight(name)

    def _block_forward(self, i: int, x, store: bool, need_output: bool = True):
        """Block i on ``x [B,T,C]``; returns (output or None, cache or None)."""
        cfg, xp = self.config, self.xp
        B, T, C = x.shape
        H, D = cfg.n_head, cfg.head_dim
        n = _block_names(i)
        N = B * T
        x2d = x.reshape(N, C)
        with region("ln_1 fwd", bytes=2 * x2d.nbytes):
            h1, mean1, rstd1 = layernorm_forward(x2d, self._w(n["ln_1.weight"]), self._w(n["ln_1.bias"]))
        with region("attn.qkv fwd", flops=6.0 * N * C * C):
            qkv = linear_forward(h1, self._w(n["attn.c_attn.weight"]), self._w(n["attn.c_attn.bias"]))
        with region("attn.core fwd", flops=4.0 * B * H * T * T * D):
            # [B,T,3,H,D] -> [3,B,H,T,D]: q, k, v as contiguous [B,H,T,D] arrays (one transposing copy)
            qkv5 = xp.ascontiguousarray(qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4))
            del qkv
            q, k, v = qkv5[0], qkv5[1], qkv5[2]
            o, stats = attention_forward(q, k, v, causal=True)
            y = xp.ascontiguousarray(o.transpose(0, 2, 1, 3)).reshape(N, C)
        with region("attn.proj fwd", flops=2.0 * N * C * C):
            a = linear_forward(y, self._w(n["attn.c_proj.weight"]), self._w(n["attn.c_proj.bias"]))
        with region("residual add", bytes=3 * a.nbytes):
            x2 = xp.add(x2d, a, out=a)  # residual; a's buffer is reused
        with region("ln_2 fwd", bytes=2 * x2.nbytes):
            h2, mean2, rstd2 = layernorm_forward(x2, self._w(n["ln_2.weight"]), self._w(n["ln_2.bias"]))
        with region("mlp.fc fwd", flops=8.0 * N * C * C):
            f = linear_forward(h2, self._w(n["mlp.c_fc.weight"]), self._w(n["mlp.c_fc.bias"]))
        with region("gelu fwd", bytes=2 * f.nbytes):
            g = gelu_forward(f)
        out = None
        if need_output:
            with region("mlp.proj fwd", flops=8.0 * N * C * C):
                m = linear_forward(g, self._w(n["mlp.c_proj.weight"]), self._w(n["mlp.c_proj.bias"]))
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
        n = _block_names(i)
        G = P.grad_of
        N = B * T
        d2 = dout.reshape(N, C)
        # MLP
        with region("mlp.proj bwd", flops=16.0 * N * C * C):
            dg, _, _ = linear_backward(d2, c["g"], self._w(n["mlp.c_proj.weight"]),
                                       dw_out=G(n["mlp.c_proj.weight"]), db_out=G(n["mlp.c_proj.bias"]),
                                       accumulate=True)
        with region("gelu bwd", bytes=3 * dg.nbytes):
            df = gelu_backward(dg, c["f"])
        del dg
        with region("mlp.fc bwd", flops=16.0 * N * C * C):
            dh2, _, _ = linear_backward(df, c["h2"], self._w(n["mlp.c_fc.weight"]), dw_out=G(n["mlp.c_fc.weight"]),
                                        db_out=G(n["mlp.c_fc.bias"]), accumulate=True)
        del df
        with region("ln_2 bwd", bytes=3 * dh2.nbytes):
            dx2, dgam, dbet = layernorm_backward(dh2, c["x2"], self._w(n["ln_2.weight"]), c["mean2"], c["rstd2"])
            _acc(G(n["ln_2.weight"]), dgam)
            _acc(G(n["ln_2.bias"]), dbet)
        with region("residual add", bytes=3 * dx2.nbytes):
            dx2 = xp.add(dx2, d2, out=dx2)  # the residual branch passes the gradient straight through
        # attention
        with region("attn.proj bwd", flops=4.0 * N * C * C):
            dy, _, _ = linear_backward(dx2, c["y"], self._w(n["attn.c_proj.weight"]),
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
            dh1, _, _ = linear_backward(dqkv.reshape(N, 3 * C), c["h1"], self._w(n["attn.c_attn.weight"]),
                                        dw_out=G(n["attn.c_attn.weight"]), db_out=G(n["attn.c_attn.bias"]),
                                        accumulate=True)
        del dqkv
        with region("ln_1 bwd", bytes=3 * dh1.nbytes):
            dx, dgam, dbet = layernorm_backward(dh1, c["x"], self._w(n["ln_1.weight"]), c["mean1"], c["rstd1"])
            _acc(G(n["ln_1.weight"]), dgam)
            _acc(G(n["ln_1.bias"]), dbet)
        with region("residual add", bytes=3 * dx.nbytes):
            dx = xp.add(dx, dx2, out=dx)
        return dx.reshape(B, T, C)

    # ------------------------------------------------------------------ the whole model

    def _check_idx(self, idx, name="idx"):
        xp = self.xp
        if backend.get_array_module(idx) is not xp:
            raise TypeError(f"{name} must live on the model's device ({'cupy' if xp is not np else 'numpy'})")
        if idx.ndim != 2:
            raise ValueError(f"{name} must be [B, T], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"{name} has T={idx.shape[1]} > block_size={self.config.block_size}")
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids, got {idx.dtype}")
        if idx.dtype != np.int32:
            idx = idx.astype(np.int32)
        return xp.ascontiguousarray(idx)

    def _head(self, x):
        """ln_f and the tied LM head on x [B,T,C]: (hf, mean, rstd, logits [B·T, Vp])."""
        B, T, C = x.shape
        x2d = x.reshape(B * T, C)
        with region("ln_f fwd", bytes=2 * x2d.nbytes):
            hf, mean, rstd = layernorm_forward(x2d, self._w(LNF_W), self._w(LNF_B))
        V, Vp = self.config.vocab_size, self.config.padded_vocab_size
        with region("lm_head fwd", flops=2.0 * B * T * C * Vp):
            logits = linear_forward(hf, self._w(WTE))
        if Vp != V:
            with region("lm_head pad"):
                logits[:, V:] = PAD_LOGIT
        return hf, mean, rstd, logits

    def _trunk(self, idx):
        """Embeddings and all blocks without storing activations: the final residual x [B,T,C]."""
        x = embedding_forward(idx, self._w(WTE), self._w(WPE))
        for i in range(self.config.n_layer):
            x, _ = self._block_forward(i, x, store=False)
        return x

    def forward(self, idx, targets=None, *, last_only: bool = False):
        """Inference: logits ``[B, T, vocab]`` (``[B, vocab]`` with ``last_only``), and the mean loss
        (0-d device array) when ``targets`` is given. Stores no activations."""
        idx = self._check_idx(idx)
        x = self._trunk(idx)
        B, T, C = x.shape
        if last_only:
            x = self.xp.ascontiguousarray(x[:, -1:, :])
        _, _, _, logits = self._head(x)
        return self._logits_and_loss(logits, targets, B, T, last_only)

    def _logits_and_loss(self, logits, targets, B: int, T: int, last_only: bool):
        """``forward``'s result from the ``[B·T', Vp]`` head output (T' = 1 with ``last_only``): the loss
        against ``targets`` if given, and the logits reshaped to ``[B, T, vocab]`` (``[B, vocab]``)."""
        loss = None
        if targets is not None:
            targets = self._check_idx(targets, "targets")
            loss, _ = cross_entropy_forward(logits, targets.reshape(-1))
        Tl = 1 if last_only else T
        logits = logits.reshape(B, Tl, -1)[:, :, : self.config.vocab_size]
        if last_only:
            logits = logits[:, 0]
        return logits, loss

    def loss(self, idx, targets):
        """Mean cross-entropy loss (0-d device array) without storing activations: validation."""
        return self.forward(idx, targets)[1]

    def forward_backward(self, idx, targets, dloss=1.0):
        """One micro-batch: loss (0-d device array, unscaled) and gradients *added* into ``params.grad``.

        ``dloss`` seeds the backward pass (loss scale / number of micro-batches; a float or a 0-d
        fp32 device array). Zero the gradient yourself (``zero_grad``) before the first micro-batch.
        """
        cfg = self.config
        idx = self._check_idx(idx)
        targets = self._check_idx(targets, "targets")
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        L, k = cfg.n_layer, self.checkpoint_every
        B, T = idx.shape
        G = self.params.grad_of

        # ---- forward
        with region("embedding fwd"):
            x = embedding_forward(idx, self._w(WTE), self._w(WPE))
        caches: list = [None] * L
        inputs: list = [None] * L  # checkpointed span inputs
        for i in range(L):
            if k == 0:
                x, caches[i] = self._block_forward(i, x, store=True)
            else:
                if i % k == 0:
                    inputs[i] = x
                x, _ = self._block_forward(i, x, store=False)
        stored = _nbytes(caches) + _nbytes(inputs)
        hf, meanf, rstdf, logits = self._head(x)
        with region("cross_entropy fwd", bytes=logits.nbytes):
            loss, ce_cache = cross_entropy_forward(logits, targets.reshape(-1))
        del logits

        # ---- backward: LM head and ln_f (dlogits overwrite the logits: one [B·T, V] buffer, not two)
        with region("cross_entropy bwd", bytes=2 * ce_cache.logits.nbytes):
            dlogits = cross_entropy_backward(ce_cache, dloss, out=ce_cache.logits)
        del ce_cache
        C = cfg.n_embd
        with region("lm_head bwd", flops=4.0 * B * T * C * cfg.padded_vocab_size):
            dhf, _, _ = linear_backward(dlogits, hf, self._w(WTE), bias=False, dw_out=G(WTE), accumulate=True)
        del dlogits, hf
        with region("ln_f bwd", bytes=3 * dhf.nbytes):
            dx, dgam, dbet = layernorm_backward(dhf, x.reshape(B * T, C), self._w(LNF_W), meanf, rstdf)
            _acc(G(LNF_W), dgam)
            _acc(G(LNF_B), dbet)
        del dhf, x
        dx = dx.reshape(B, T, C)

        # ---- backward through the blocks
        peak = stored
        if k == 0:
            for i in reversed(range(L)):
                dx = self._block_backward(i, dx, caches[i])
                caches[i] = None
        else:
            for s in reversed(range(0, L, k)):
                e = min(s + k, L)
                xs, span = inputs[s], []
                for j in range(s, e):  # recompute the span, storing its activations
                    xs, c = self._block_forward(j, xs, store=True, need_output=j < e - 1)
                    span.append(c)
                peak = max(peak, _nbytes(inputs) + _nbytes(span))
                for j in reversed(range(s, e)):
                    dx = self._block_backward(j, dx, span[j - s])
                    span[j - s] = None
                inputs[s] = None

        # ---- embeddings
        with region("embedding bwd"):
            dwte, dwpe = embedding_backward(dx, idx, cfg.padded_vocab_size, cfg.block_size)
            _acc(G(WTE), dwte)
            _acc(G(WPE), dwpe)
        self.stats = {"activation_bytes_stored": stored, "activation_bytes_peak": peak}
        return loss

    # ------------------------------------------------------------------ activation memory model

    def activation_bytes(self, batch: int, seq: int, checkpoint_every: int | None = None) -> dict:
        """``activation_bytes(config, ...)`` for this model's dtype and (default) checkpointing."""
        k = self.checkpoint_every if checkpoint_every is None else checkpoint_every
        return activation_bytes(self.config, batch, seq, k, self.dtype)

    # ------------------------------------------------------------------ sampling

    def generate(self, prompt, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, rng: np.random.Generator | None = None) -> list[int]:
        """Autoregressive sampling: the prompt's token ids plus ``max_new_tokens`` new ones.

        Each step runs the model on the last ``block_size`` tokens and samples from
        ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (temperature 0: argmax).
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        rng = rng or np.random.default_rng(seed)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        V = self.config.vocab_size
        if max(ids) >= V or min(ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {V})")
        for _ in range(max_new_tokens):
            ctx = np.asarray(ids[-self.config.block_size:], dtype=np.int32)[None, :]
            logits, _ = self.forward(backend.to_device(ctx, self.xp), last_only=True)
            ids.append(sample_token(backend.to_numpy(logits[0]).astype(np.float64), temperature, top_k, rng))
        return ids


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """One token from ``softmax(logits / temperature)`` over the ``top_k`` largest logits (host NumPy)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


# --------------------------------------------------------------------------- helpers


def _acc(dst, src):
    """dst (fp32 gradient view) += src (any float dtype)."""
    if src.dtype != dst.dtype:
        src = src.astype(dst.dtype)
    dst += src


def _nbytes(objs) -> int:
    """Bytes held by the arrays in a list of caches (dicts) / arrays (None entries skipped). Views of one
    buffer (q, k, v of qkv5) are counted once; other objects (the attention stats) by their ``nbytes``."""
    seen, total = set(), 0
    for o in objs:
        if o is None:
            continue
        for a in (o.values() if isinstance(o, dict) else [o]):
            if not hasattr(a, "base"):
                total += int(getattr(a, "nbytes", 0))
                continue
            base = a
            while getattr(base, "base", None) is not None:
                base = base.base
            if id(base) not in seen:
                seen.add(id(base))
                total += int(base.nbytes)
    return total


def _float64_params(shapes, xp) -> FlatParams:
    """A FlatParams whose buffers are float64 (NumPy only): the finite-difference reference model."""
    if xp is not np:
        raise TypeError("dtype fp64 is a NumPy-only reference (finite-difference checks); use fp32/bf16/fp16 on GPU")
    P = FlatParams(shapes, xp=np, working_dtype="fp32")
    for name in ("data", "grad", "m", "v"):
        setattr(P, name, np.zeros(P.numel, dtype=np.float64))
    P.working = P.data
    P.working_dtype = backend.float64
    return P


def _to_host(v) -> np.ndarray:
    """NumPy float32 copy of a NumPy/CuPy array or a PyTorch tensor."""
    if hasattr(v, "detach") and hasattr(v, "cpu"):  # torch.Tensor, without importing torch
        v = v.detach().float().cpu().numpy()
    return np.asarray(backend.to_numpy(v), dtype=np.float32)


# --------------------------------------------------------------------------- chapter 6 measurement


def block_activation_bytes(config: GPTConfig, batch: int, seq: int, dtype="bf16") -> dict:
    """Bytes one block keeps for its backward pass, by array (what ``GPT._block_forward`` caches)."""
    N, C, H = batch * seq, config.n_embd, config.n_head
    it = backend.resolve_dtype(dtype).itemsize
    return {
        "x (block input)": it * N * C, "ln_1 output": it * N * C, "q, k, v": 3 * it * N * C,
        "attention output o": it * N * C, "o as [N, C] (y)": it * N * C, "x + attention": it * N * C,
        "ln_2 output": it * N * C, "MLP pre-activation f": 4 * it * N * C, "GELU output g": 4 * it * N * C,
        "LayerNorm mean, rstd (fp32)": 4 * 4 * N, "attention probabilities P": it * batch * H * seq * seq,
    }


def activation_bytes(config: GPTConfig, batch: int, seq: int, checkpoint_every: int = 0, dtype="bf16") -> dict:
    """Bytes of block activations kept for backward, by formula: ``stored`` after the forward pass
    and ``peak`` during backward (one recomputed span alive next to the span inputs not yet used).
    The model's ``stats`` after ``forward_backward`` count the same arrays; the tests check they agree."""
    L, k = config.n_layer, int(checkpoint_every)
    per_block = sum(block_activation_bytes(config, batch, seq, dtype).values())
    x_in = backend.resolve_dtype(dtype).itemsize * batch * seq * config.n_embd
    if k == 0:
        return {"stored": L * per_block, "peak": L * per_block}
    starts = list(range(0, L, k))
    # backward visits the spans last to first; span j's input (and the earlier ones) are still alive
    peak = max((j + 1) * x_in + (min(s + k, L) - s) * per_block for j, s in enumerate(starts))
    return {"stored": len(starts) * x_in, "peak": peak}



def training_flops(config: GPTConfig, batch: int, seq: int, checkpoint_every: int = 0) -> dict:
    """FLOPs this implementation executes for one forward + backward pass (GEMMs only).

    Forward per token: 24·C² per block (qkv, projection, MLP up and down) + 4·T·C per block for the
    two attention products (the math path computes full T × T products, masked afterwards) + 2·C·V
    for the LM head; backward twice the forward. Checkpointing adds the forward of every block again,
    minus the last MLP projection of each span (its output is not needed to run the span's backward).
    """
    N, C, L, T = batch * seq, config.n_embd, config.n_layer, seq
    block = 24.0 * N * C * C + 4.0 * N * T * C
    head = 2.0 * N * C * config.padded_vocab_size
    fwd = L * block + head
    k = int(checkpoint_every)
    rec = 0.0 if k == 0 else L * block - len(range(0, L, k)) * 8.0 * N * C * C
    return {"forward": fwd, "backward": 2.0 * fwd, "recompute": rec, "total": 3.0 * fwd + rec,
            "recompute_fraction": rec / (3.0 * fwd)}



def checkpointing_sweep(config: GPTConfig, *, batch: int, seq: int, ks=(0, 1, 2, 4), dtype="bf16", xp=None,
                        reps: int = 5, warmup: int = 1, seed: int = 0) -> list[dict]:
    """Memory and time of one forward + backward pass for each ``checkpoint_every`` in ``ks``.

    Per row: ``k``, ``ms`` (median time of forward + backward, CUDA events on the GPU), the activation
    bytes the model kept (``activation_stored_bytes`` after the forward, ``activation_peak_bytes``
    during the backward; counted, both backends), and on the GPU ``peak_bytes``: what the CuPy memory
    pool held at its high-water mark (the pool is emptied of cached blocks before each k, and a pool
    never gives memory back by itself, so its total after the run is the peak), with
    ``static_bytes``: what it held before the pass (weights, gradients, optimizer state, the batch).
    """
    from .timing import time_fn

    xp = xp or backend.default_xp()
    model = GPT(config, dtype=dtype, xp=xp, seed=seed)
    rng = np.random.default_rng(seed)
    idx = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)
    tgt = backend.to_device(rng.integers(0, config.vocab_size, (batch, seq)).astype(np.int32), xp)
    rows = []
    for k in ks:
        model.checkpoint_every = k
        row = {"k": int(k), "label": "off" if k == 0 else f"every {k}",
               "extra_flops": training_flops(config, batch, seq, k)["recompute_fraction"]}
        pool = None
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
            pool = xp.get_default_memory_pool()
            pool.free_all_blocks()
            row["static_bytes"] = int(pool.total_bytes())

        def step():
            model.forward_backward(idx, tgt)

        t = time_fn(step, xp=xp, warmup=warmup, reps=reps)
        row["ms"] = t.median_ms
        row["activation_stored_bytes"] = model.stats["activation_bytes_stored"]
        row["activation_peak_bytes"] = model.stats["activation_bytes_peak"]
        if pool is not None:
            row["peak_bytes"] = int(pool.total_bytes())
        rows.append(row)
    model.zero_grad()
    base = rows[0]
    for r in rows:
        r["time_vs_off"] = r["ms"] / base["ms"]
        key = "peak_bytes" if "peak_bytes" in r else "activation_peak_bytes"
        r["memory_vs_off"] = r[key] / base[key]
    return rows
