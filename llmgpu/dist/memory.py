"""Bytes of model state per rank under ZeRO (chapter 9): the paper's formulas next to llmgpu's own buffers.

ψ parameters, N ranks. The ZeRO paper (Rajbhandari et al., 2020, sections 3 and 5, figure 1) counts
mixed-precision Adam as 2ψ (fp16 weights) + 2ψ (fp16 gradients) + Kψ of optimizer state, K = 12 (fp32 master weights,
momentum and variance, 4 bytes each), and shards them in stages:

=========  =========================  ====================================================
stage      paper, bytes per rank      llmgpu, bf16 working copy (``dist/zero.py``)
=========  =========================  ====================================================
0 (DDP)    (2 + 2 + K)ψ               2ψ working + 4ψ fp32 gradient + 12ψ master, m, v = 18ψ
1          4ψ + Kψ/N                  2ψ + 4ψ + (12 + 4 + 2)ψ/N: the shards of master, m and v, the
                                      fp32 buffer the reduce-scatter writes rank r's piece into, and
                                      the bf16 piece AdamW writes before the all-gather
2          2ψ + (2 + K)ψ/N            2ψ + 4·(R + 2B) + 18ψ/N: the fp32 gradient keeps only R resident
                                      elements (embeddings, 1-D tensors) and two slots of B elements
                                      (one block's weight matrices)
3          (2 + 2 + K)ψ/N             not in llmgpu (the weights themselves sharded)
=========  =========================  ====================================================

llmgpu keeps its gradients in fp32 (4 bytes, not the paper's 2): the backward pass accumulates
micro-batches into one flat fp32 buffer (chapter 4). In fp32 training (``working='fp32'``) the working copy
is the master itself, so stage 0 is 16ψ, and stage 1 keeps the full fp32 weights (the forward pass reads
them) plus a 4ψ/N copy of this rank's piece for AdamW. Activations, workspaces and the allocator's slack
are not model state and are not counted.
"""

from __future__ import annotations

PAPER_K = 12  # bytes of Adam state per parameter in the ZeRO paper: fp32 master, momentum, variance


def zero2_gradient_split(config) -> tuple[int, int]:
    """``(R, B)`` for ZeRO-2 on a GPT (``GPTConfig``): R gradient elements stay resident (the embeddings and the
    1-D tensors: everything but the blocks' weight matrices), B = 12·C² elements are one block's weight
    matrices, the size of each of the two gradient slots (``dist/zero.py``). Padding is not counted."""
    C, L = config.n_embd, config.n_layer
    return config.num_parameters() - L * 12 * C * C, 12 * C * C


def zero_memory_bytes(params: int, world: int, stage: int, policy: str = "llmgpu", *, working: str = "bf16",
                      grad_split: tuple[int, int] | None = None) -> dict:
    """Model-state bytes per rank: ``{part: bytes}`` with a ``"total"``, for ``params`` parameters (ψ) over
    ``world`` ranks (N) at ZeRO ``stage``. ``policy='paper'``: the paper's formulas (stages 0-3, K = 12);
    ``policy='llmgpu'``: llmgpu's buffers (stages 0-2; ``working`` 'bf16', 'fp16' or 'fp32'), those
    ``DataParallelSync`` and ``ZeroSync`` hold (tests/test_memory.py counts them). Stage 2 needs the split of
    the gradient, ``grad_split=(R, B)`` (``zero2_gradient_split(config)``): its fp32 gradient buffer holds R
    resident elements and two slots of B; the scratch piece it reduce-scatters later micro-batches into
    (one piece of the largest bucket) is not counted."""
    psi, N = float(params), int(world)
    if N < 1 or params < 0:
        raise ValueError(f"need params >= 0 and world >= 1, got {params} and {world}")
    if policy == "paper":
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"the paper's ZeRO stages are 0-3, got {stage}")
        parts = {"fp16 weights": 2 * psi / (N if stage >= 3 else 1),
                 "fp16 gradients": 2 * psi / (N if stage >= 2 else 1),
                 "optimizer state (K = 12)": PAPER_K * psi / (N if stage >= 1 else 1)}
    elif policy == "llmgpu":
        if stage not in (0, 1, 2):
            raise ValueError(f"llmgpu's ZeRO stages are 0-2, got {stage}")
        if working not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"working must be bf16, fp16 or fp32, got {working!r}")
        half = working != "fp32"
        parts = {}
        if half:
            parts["bf16 working copy" if working == "bf16" else "fp16 working copy"] = 2 * psi
        if stage == 0:
            parts["fp32 gradient"] = 4 * psi
            parts["fp32 master weights"] = 4 * psi
            parts["fp32 AdamW m, v"] = 8 * psi
        else:
            if not half:  # the forward pass reads the full fp32 weights; AdamW updates a copy of the shard
                parts["fp32 weights (working)"] = 4 * psi
            if stage == 1:
                parts["fp32 gradient"] = 4 * psi
            else:
                if grad_split is None:
                    raise ValueError("llmgpu's ZeRO-2 needs grad_split=(resident, slot): zero2_gradient_split(config)")
                resident, slot = grad_split
                parts["fp32 gradient (resident + 2 slots)"] = 4 * (resident + 2 * slot)
            parts["fp32 gradient shard"] = 4 * psi / N
            parts["fp32 master shard"] = 4 * psi / N
            parts["fp32 AdamW m, v shards"] = 8 * psi / N
            if half:
                parts[f"{working} working shard"] = 2 * psi / N
    else:
        raise ValueError(f"policy must be 'llmgpu' or 'paper', got {policy!r}")
    parts["total"] = sum(parts.values())
    return parts


__all__ = ["PAPER_K", "zero2_gradient_split", "zero_memory_bytes"]
