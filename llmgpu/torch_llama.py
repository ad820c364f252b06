"""The PyTorch Llama of ``llmgpu bench`` and the tests (chapter 10): ``torch_reference``'s second family.

Written from the formulas of ``llmgpu.model.Llama`` with Hugging Face's ``LlamaForCausalLM`` names: RMSNorm in fp32,
RoPE in the rotate_half layout with llmgpu's own tables (``ops.rope.rope_tables``), grouped-query attention
through ``F.scaled_dot_product_attention`` (``enable_gqa=True`` where this torch takes it, else K/V repeated per
group), a SwiGLU MLP, no biases, the LM head tied to the embedding or not. The padded vocabulary, span
checkpointing and the loss are ``torch_reference.TorchLM``'s, the class this one extends; torch is imported by the
caller (lazily), so this module imports none.
"""

from __future__ import annotations

import numpy as np

from .ops.rope import rope_tables

_SDPA_GQA: bool | None = None  # whether this torch's SDPA takes enable_gqa (probed once; tests set it False)


def sdpa_takes_gqa(torch) -> bool:
    """Whether ``F.scaled_dot_product_attention`` accepts ``enable_gqa=True`` (PyTorch >= 2.5), probed once."""
    global _SDPA_GQA
    if _SDPA_GQA is None:
        q, kv = torch.zeros(1, 2, 1, 2), torch.zeros(1, 1, 1, 2)
        try:
            torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            _SDPA_GQA = True
        except TypeError:  # an older torch: no such keyword
            _SDPA_GQA = False
    return _SDPA_GQA


def torch_llama_class(torch, TorchLM):
    """The ``TorchLlama`` class on ``torch`` and the shared base ``TorchLM`` (``torch_reference._torch_classes``)."""
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, C, eps):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):  # in fp32 whatever x's dtype (as llmgpu's rmsnorm and transformers' LlamaRMSNorm)
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * self.weight.float()).to(x.dtype)

    def rope(x, cos, sin):  # rotate_half: element j pairs with j + D/2 (ops/rope.py)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

    def grouped_attention(q, k, v, enable_gqa: bool):
        """Causal SDPA where k, v have fewer heads than q: K/V head j serves query heads j·G … j·G+G−1."""
        if k.shape[1] == q.shape[1]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if enable_gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1),
                                              is_causal=True)

    class LlamaAttention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            C, K = cfg.n_embd, cfg.kv_dim
            self.shape = (cfg.n_head, cfg.n_kv_head, cfg.head_dim)
            self.enable_gqa = sdpa_takes_gqa(torch)  # probed here, eagerly, not inside torch.compile's trace
            self.q_proj = nn.Linear(C, C, bias=False)
            self.k_proj = nn.Linear(C, K, bias=False)
            self.v_proj = nn.Linear(C, K, bias=False)
            self.o_proj = nn.Linear(C, C, bias=False)

        def forward(self, x, cos, sin):
            B, T, C = x.shape
            H, Hk, D = self.shape
            q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)
            k = self.k_proj(x).view(B, T, Hk, D).transpose(1, 2)
            v = self.v_proj(x).view(B, T, Hk, D).transpose(1, 2)
            y = grouped_attention(rope(q, cos, sin), rope(k, cos, sin), v, self.enable_gqa)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    class SwiGLU(nn.Module):
        def __init__(self, C, F_):
            super().__init__()
            self.gate_proj = nn.Linear(C, F_, bias=False)
            self.up_proj = nn.Linear(C, F_, bias=False)
            self.down_proj = nn.Linear(F_, C, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class LlamaBlock(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
            self.self_attn = LlamaAttention(cfg)
            self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
            self.mlp = SwiGLU(cfg.n_embd, cfg.ffn_dim)

        def forward(self, x, cos, sin):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))

    class TorchLlama(TorchLM):
        """A Llama with Hugging Face's ``LlamaForCausalLM`` names (so ``llmgpu.model.Llama.state_dict()`` loads)."""

        def __init__(self, config, mask_padded=False):
            super().__init__(config, mask_padded)
            C, V = config.n_embd, config.padded_vocab_size
            self.model = nn.ModuleDict({
                "embed_tokens": nn.Embedding(V, C),
                "layers": nn.ModuleList([LlamaBlock(config) for _ in range(config.n_layer)]),
                "norm": RMSNorm(C, config.norm_eps)})
            self.lm_head = nn.Linear(C, V, bias=False)
            if config.tie_embeddings:
                self.model.embed_tokens.weight = self.lm_head.weight
            cos, sin = rope_tables(config.block_size, config.head_dim, config.rope_theta, xp=np)
            # [S, D]: each half-table twice, so that x * cos + rotate_half(x) * sin rotates pair (j, j + D/2)
            self.register_buffer("rope_cos", torch.from_numpy(np.concatenate([cos, cos], -1)), persistent=False)
            self.register_buffer("rope_sin", torch.from_numpy(np.concatenate([sin, sin], -1)), persistent=False)

        @property
        def blocks(self):
            return self.model.layers

        def forward(self, idx, targets=None):
            T = idx.shape[1]
            x = self.run_blocks(self.model.embed_tokens(idx), self.rope_cos[:T], self.rope_sin[:T])
            return self.logits_or_loss(self.lm_head(self.model.norm(x)), targets)

    return TorchLlama


__all__ = ["sdpa_takes_gqa", "torch_llama_class"]
