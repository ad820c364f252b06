"""The GPT-2 configuration and every fact derived from it: presets, parameter names and shapes, FLOPs,
the training state per parameter and the activation memory of the two model paths (chapters 4, 6 and 8). One
source for the model, the trainer, ``llmgpu bench``, the README's memory table and the chapters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from .. import backend
from ..checks import fields_of_dict

# nanoGPT's names (and PyTorch layouts: ``nn.Linear`` weights are ``[out, in]``)
WTE, WPE = "transformer.wte.weight", "transformer.wpe.weight"
BUFFERS = (".attn.bias", ".attn.masked_bias")  # nanoGPT's and transformers' causal masks: not weights
LNF_W, LNF_B = "transformer.ln_f.weight", "transformer.ln_f.bias"


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyperparameters. ``GPTConfig.preset('gpt2')`` etc. give the standard sizes."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024  # maximum sequence length (rows of the position embedding)
    pad_vocab_to: int = 0  # 0 or 1: no padding; e.g. 64 or 128 pads the vocabulary to a multiple

    arch = "gpt2"  # a class attribute, not a field: what `llmgpu train --arch` names (as_dict leaves it out, as
    # checkpoints written before the Llama family did; a dict without "arch" is GPT-2's)

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size", "pad_vocab_to"):
            v = getattr(self, name)
            # an int, not a bool (an int subclass), a float ("2.5" heads) or a string ("2" from a file)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"GPTConfig.{name} must be an int, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, int(v))  # NumPy ints become ints (as_dict goes to JSON)
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
        # a Llama's dict holds GPT-2's field names too: never read it as one
        if isinstance(d, dict) and d.get("arch", "gpt2") != "gpt2":
            raise ValueError(f"not a GPT-2 configuration (arch {d.get('arch')!r})")
        return cls(**fields_of_dict(cls, d, also=("arch",)))

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return replace(base, **overrides) if overrides else base

    def num_parameters(self) -> int:
        """Parameters counted once (the tied LM head is the token embedding), padded vocabulary rows included."""
        C, L = self.n_embd, self.n_layer
        return self.padded_vocab_size * C + self.block_size * C + L * (12 * C * C + 13 * C) + 2 * C

    def flop_parameters(self) -> int:
        """N of the FLOP formula: every parameter except the position embedding (a lookup costs no FLOPs);
        the tied LM head once, its padded rows included (they are computed)."""
        return self.num_parameters() - self.block_size * self.n_embd

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, forward + backward, no recomputation: ``6·N + 12·L·C·T``
        (Chowdhery et al., PaLM, appendix B). 6N: forward (2N) and backward (4N) of every weight matrix;
        12·L·C·T: the attention score and value products, which no parameter counts."""
        return 6.0 * self.flop_parameters() + 12.0 * self.n_layer * self.n_embd * seq


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


# --------------------------------------------------------------------------- parameter names and shapes


def _block_shapes(C: int) -> dict[str, tuple[int, ...]]:
    """The twelve tensors of one block, by their name inside the block."""
    return {
        "ln_1.weight": (C,), "ln_1.bias": (C,),
        "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,), "ln_2.bias": (C,),
        "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (C, 4 * C), "mlp.c_proj.bias": (C,),
    }  # fmt: skip


def block_param_names(i: int) -> dict[str, str]:
    """Short name (``"attn.c_attn.weight"``) → full name (``"transformer.h.3.attn.c_attn.weight"``) of block i."""
    return {k: f"transformer.h.{i}.{k}" for k in _block_shapes(1)}


def gpt2_param_shapes(n_layer: int = 12, n_embd: int = 768, vocab: int = 50257, block_size: int = 1024,
                      bias: bool = True) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of GPT-2 in nanoGPT's naming and (PyTorch ``nn.Linear``) layout.

    ``lm_head.weight`` is tied to ``transformer.wte.weight`` and therefore not listed. With the
    defaults this is GPT-2 small: 124,439,808 parameters in 148 tensors.
    """
    C = n_embd
    shapes: dict[str, tuple[int, ...]] = {WTE: (vocab, C), WPE: (block_size, C)}
    for i in range(n_layer):
        full = block_param_names(i)
        for n, s in _block_shapes(C).items():
            if bias or not n.endswith(".bias"):
                shapes[full[n]] = s
    shapes[LNF_W] = (C,)
    if bias:
        shapes[LNF_B] = (C,)
    return shapes


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """``gpt2_param_shapes`` of a configuration (the padded vocabulary rows included)."""
    return gpt2_param_shapes(config.n_layer, config.n_embd, config.padded_vocab_size, config.block_size)


# --------------------------------------------------------------------------- training state (chapters 4, 5)


def state_bytes_per_parameter(working="bf16") -> dict[str, int]:
    """Bytes of training state per parameter, by part, as ``FlatParams`` and ``AdamW`` hold it: fp32 master
    weights, the fp32 gradient, AdamW's fp32 moments m and v and, in 16-bit training, the working copy the
    forward and backward passes read (in fp32 training the master weights are the working copy). The sum is
    18 bytes in bf16 or fp16, 16 in fp32."""
    w = backend.resolve_dtype(working)
    f32 = backend.float32.itemsize
    parts = {"fp32 master weights": f32, "fp32 gradient": f32, "fp32 AdamW m, v": 2 * f32}
    if w != backend.float32:
        parts[f"{backend.dtype_name(w)} working copy"] = w.itemsize
    return parts


# --------------------------------------------------------------------------- activation memory (chapters 6, 8)


def block_activation_bytes(config: GPTConfig, batch: int, seq: int, dtype="bf16", *, attention: str = "math") -> dict:
    """Bytes one block keeps for its backward pass, by array.

    ``attention``: ``"math"`` (chapter 2, ``GPT``): q, k, v in one buffer and the ``B·H·T·T``
    probabilities; ``"flash"`` (``FastGPT`` in bf16/fp16): no probabilities, the fp32 row log-sum-exp
    ``[B, H, T]`` instead; ``"math-copy"`` (``FastGPT`` in fp32 on the GPU): the chapter 2 kernels on
    contiguous copies of q, k, v next to the QKV buffer.
    """
    if attention not in ("math", "flash", "math-copy"):
        raise ValueError(f"attention must be 'math', 'flash' or 'math-copy', got {attention!r}")
    dt = backend.resolve_dtype(dtype)
    N, C, H = batch * seq, config.n_embd, config.n_head
    it = dt.itemsize
    stat = 8 if dt == backend.float64 else 4  # LayerNorm mean/rstd and the log-sum-exp: fp32 (fp64 reference)
    out = {
        "x (block input)": it * N * C, "ln_1 output": it * N * C, "q, k, v": 3 * it * N * C,
        "attention output o": it * N * C, "o as [N, C] (y)": it * N * C, "x + attention": it * N * C,
        "ln_2 output": it * N * C, "MLP pre-activation f": 4 * it * N * C, "GELU output g": 4 * it * N * C,
        "LayerNorm mean, rstd": 4 * stat * N,
    }
    if attention == "flash":
        del out["attention output o"]  # o is a view of y: the kernel writes the [N, C] layout directly
        out["attention log-sum-exp"] = stat * batch * H * seq
    else:
        out["attention probabilities P"] = it * batch * H * seq * seq
    if attention == "math-copy":
        out["contiguous q, k, v"] = 3 * it * N * C
    return out


def activation_bytes(config: GPTConfig, batch: int, seq: int, checkpoint_every: int = 0, dtype="bf16", *,
                     attention: str = "math", keeps_ln_1: bool = False) -> dict:
    """Bytes of block activations kept for backward, by formula: ``stored`` after the forward pass
    and ``peak`` during backward (one recomputed span alive next to the span inputs not yet used).
    ``keeps_ln_1`` (``FastGPT``): a span input is the block input x *and* ln_1(x) with its mean and rstd
    (the fused residual add + LayerNorm crosses the block boundary; ``model/fast.py``).
    The models' ``stats`` after ``forward_backward`` count the same arrays; the tests check they agree."""
    blk = block_activation_bytes(config, batch, seq, dtype, attention=attention)
    x_in = blk["x (block input)"]
    if keeps_ln_1:
        x_in += blk["ln_1 output"] + blk["LayerNorm mean, rstd"] // 2
    return span_activation_bytes(config.n_layer, checkpoint_every, sum(blk.values()), x_in)


def span_activation_bytes(n_layer: int, checkpoint_every: int, per_block: int, span_input: int) -> dict:
    """``stored`` and ``peak`` bytes of ``n_layer`` blocks that each keep ``per_block`` bytes, checkpointed every
    ``checkpoint_every`` blocks (0: off) with ``span_input`` bytes kept per span (any architecture)."""
    L, k = n_layer, int(checkpoint_every)
    if k == 0:
        return {"stored": L * per_block, "peak": L * per_block}
    starts = list(range(0, L, k))
    # backward visits the spans last to first; span j's input (and the earlier ones) are still alive
    peak = max((j + 1) * span_input + (min(s + k, L) - s) * per_block for j, s in enumerate(starts))
    return {"stored": len(starts) * span_input, "peak": peak}


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


__all__ = ["LNF_B", "LNF_W", "PRESETS", "WPE", "WTE", "GPTConfig", "activation_bytes", "block_activation_bytes",
           "block_param_names", "gpt2_param_shapes", "param_shapes", "span_activation_bytes",
           "state_bytes_per_parameter", "training_flops"]
