"""The Llama configuration (chapter 10) and the facts derived from it: presets, parameter names and shapes, FLOPs.

What changed from GPT-2 (``config.py``), one line each: no position embedding (RoPE rotates q and k instead);
RMSNorm instead of LayerNorm (no mean, no bias); a SwiGLU MLP of width ``ffn_dim`` (three matrices: gate, up,
down) instead of GELU over 4C (two); grouped-query attention (``n_kv_head`` key/value heads, each serving
``n_head / n_kv_head`` query heads); no biases anywhere; the LM head tied to the embedding or not
(``tie_embeddings``: SmolLM ties it, Llama 3 8B does not).

Parameter names are Hugging Face's ``LlamaForCausalLM`` names and layouts (``nn.Linear`` weights ``[out, in]``), so a
checkpoint directory maps onto the model one to one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from .. import backend
from ..checks import fields_of_dict

EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
BUFFERS = (".rotary_emb.inv_freq",)  # RoPE's frequencies, saved by older transformers: recomputed, not weights

_INT_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "vocab_size", "block_size", "pad_vocab_to")


@dataclass(frozen=True)
class LlamaConfig:
    """Llama hyperparameters. ``LlamaConfig.preset('smollm-135m')`` etc. give the standard sizes."""

    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    n_embd: int = 576
    ffn_dim: int = 1536  # Hugging Face's intermediate_size
    vocab_size: int = 49152
    block_size: int = 2048  # the longest sequence (RoPE has no table to outgrow; the rotation tables are this long)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    pad_vocab_to: int = 0  # 0 or 1: no padding; e.g. 64 pads the vocabulary to a multiple (as GPTConfig)

    arch = "llama"  # a class attribute, not a field: what `llmgpu train --arch` names

    def __post_init__(self):
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"LlamaConfig.{name} must be an int, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise TypeError(f"LlamaConfig.{name} must be a number, got {type(v).__name__} {v!r}")
            if not (np.isfinite(v) and v > 0):
                raise ValueError(f"LlamaConfig.{name} must be a positive finite number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not isinstance(self.tie_embeddings, (bool, np.bool_)):
            raise TypeError(f"LlamaConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        object.__setattr__(self, "tie_embeddings", bool(self.tie_embeddings))
        for name in _INT_FIELDS[:-1]:
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.pad_vocab_to < 0:
            raise ValueError(f"pad_vocab_to must be >= 0, got {self.pad_vocab_to}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): each "
                             "key/value head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"RoPE rotates pairs of dimensions: the head dimension n_embd / n_head = {self.head_dim} "
                             "must be even")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_dim(self) -> int:
        """Columns of k (and of v): n_kv_head · head_dim."""
        return self.n_kv_head * self.head_dim

    @property
    def padded_vocab_size(self) -> int:
        p = self.pad_vocab_to
        return self.vocab_size if p <= 1 else -(-self.vocab_size // p) * p

    def as_dict(self) -> dict:
        return {"arch": self.arch, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        if isinstance(d, dict) and d.get("arch", "llama") != "llama":
            raise ValueError(f"not a Llama configuration (arch {d.get('arch')!r})")
        return cls(**fields_of_dict(cls, d, also=("arch",)))

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        try:
            base = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown Llama preset {name!r}; choose one of {', '.join(PRESETS)}") from None
        return replace(base, **overrides) if overrides else base

    def num_parameters(self) -> int:
        """Parameters counted once (a tied LM head is the embedding), padded vocabulary rows included."""
        C, L, F = self.n_embd, self.n_layer, self.ffn_dim
        block = C * C + 2 * C * self.kv_dim + C * C + 3 * C * F + 2 * C  # q, k+v, o, gate+up+down, two norms
        head = 0 if self.tie_embeddings else self.padded_vocab_size * C
        return self.padded_vocab_size * C + L * block + C + head

    def flop_parameters(self) -> int:
        """N of the FLOP formula: every matrix a token multiplies, the LM head once (its padded rows included:
        they are computed); the embedding lookup costs none, so an untied model leaves its embedding out."""
        lookup = 0 if self.tie_embeddings else self.padded_vocab_size * self.n_embd
        return self.num_parameters() - lookup - (2 * self.n_layer + 1) * self.n_embd  # norms: no GEMM

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, ``6·N + 12·L·C·T`` as for GPT-2 (``GPTConfig.flops_per_token``): grouped K/V
        heads save parameters and memory, not score work (every query head still meets T keys)."""
        return 6.0 * self.flop_parameters() + 12.0 * self.n_layer * self.n_embd * seq


PRESETS: dict[str, LlamaConfig] = {
    # byte-level, for CPUs and tests: 2 query heads per K/V head, untied head (both code paths of the tie)
    "llama-tiny": LlamaConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=128, ffn_dim=352, vocab_size=256,
                              block_size=128, tie_embeddings=False),
    # SmolLM's shapes (Hugging Face, 2024: HuggingFaceTB/SmolLM-135M and -360M config.json)
    "smollm-135m": LlamaConfig(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, ffn_dim=1536),
    "smollm-360m": LlamaConfig(n_layer=32, n_head=15, n_kv_head=5, n_embd=960, ffn_dim=2560),
}


def block_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The nine tensors of one block, by their name inside the block (Hugging Face's)."""
    C, F, K = cfg.n_embd, cfg.ffn_dim, cfg.kv_dim
    return {
        "input_layernorm.weight": (C,),
        "self_attn.q_proj.weight": (C, C), "self_attn.k_proj.weight": (K, C), "self_attn.v_proj.weight": (K, C),
        "self_attn.o_proj.weight": (C, C),
        "post_attention_layernorm.weight": (C,),
        "mlp.gate_proj.weight": (F, C), "mlp.up_proj.weight": (F, C), "mlp.down_proj.weight": (C, F),
    }  # fmt: skip


def block_names(i: int) -> dict[str, str]:
    """Short name (``"mlp.up_proj.weight"``) → full name (``"model.layers.3.mlp.up_proj.weight"``) of block i."""
    return {k: f"model.layers.{i}.{k}" for k in block_shapes(PRESETS["llama-tiny"])}


def llama_param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes (padded vocabulary rows included); ``lm_head.weight`` only when untied."""
    shapes: dict[str, tuple[int, ...]] = {EMBED: (cfg.padded_vocab_size, cfg.n_embd)}
    for i in range(cfg.n_layer):
        shapes.update({block_names(i)[k]: s for k, s in block_shapes(cfg).items()})
    shapes[NORM] = (cfg.n_embd,)
    if not cfg.tie_embeddings:
        shapes[LM_HEAD] = (cfg.padded_vocab_size, cfg.n_embd)
    return shapes


def llama_block_activation_bytes(cfg: LlamaConfig, batch: int, seq: int, dtype="bf16", attention="math") -> dict:
    """Bytes one Llama block keeps for its backward pass, by array (q and k after RoPE, k and v with the n_kv_head
    heads of grouped-query attention; RMSNorm's inverse RMS in fp32, as LayerNorm's statistics). ``attention``:
    ``"math"`` (the book step's chapter 2 attention: its ``B·H·T·T`` probabilities, and o in heads order besides
    its ``[N, C]`` copy y) or ``"flash"`` (``FastLlama``: o written as y, one fp32 log-sum-exp per row)."""
    dt = backend.resolve_dtype(dtype)
    it, N, C, F = dt.itemsize, batch * seq, cfg.n_embd, cfg.ffn_dim
    stat = 8 if dt == backend.float64 else 4
    if attention == "flash":
        core = {"attention output y": it * N * C, "attention log-sum-exp": stat * batch * cfg.n_head * seq}
    else:
        core = {"attention probabilities P": it * batch * cfg.n_head * seq * seq, "attention output o": it * N * C,
                "o as [N, C] (y)": it * N * C}
    return {
        "x (block input)": it * N * C, "input_norm output": it * N * C, "q": it * N * C,
        "k, v": 2 * it * N * cfg.kv_dim, **core, "x + attention": it * N * C,
        "post_norm output": it * N * C, "gate, up": 2 * it * N * F, "SwiGLU output": it * N * F,
        "RMSNorm inverse rms": 2 * stat * N,
    }  # fmt: skip


__all__ = ["EMBED", "LM_HEAD", "NORM", "PRESETS", "LlamaConfig", "block_names", "block_shapes",
           "llama_block_activation_bytes", "llama_param_shapes"]
