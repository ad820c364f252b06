"""GPU memory per preset, from ``llmgpu.model.config`` alone (no GPU needed); the README's table.

    python tools/maintenance/memory_table.py [--batch 16] [--seq 1024]

State per parameter (``llmgpu.model.config.state_bytes_per_parameter``, what ``FlatParams`` and ``AdamW`` hold):
fp32 master weights (4 B), fp32 gradients (4 B), fp32 AdamW moments m and v (8 B) and the bf16 working copy
(2 B) = 18 B (fp32 training: 16 B, the working copy is the master). Activations: the bytes the blocks keep for the
backward pass at --batch x --seq in bf16 (``activation_bytes``): the book step (``math`` attention,
B*H*T*T probabilities) and the chapter 8 step (``flash``), without and with checkpointing every block.
Not counted: the logits (B*T*V), cuBLAS/cuDNN workspaces, CuPy's memory pool slack.
"""

import argparse

from llmgpu.model.config import PRESETS, activation_bytes, state_bytes_per_parameter

GIB = 2**30
STATE_BYTES = {dtype: sum(state_bytes_per_parameter(dtype).values()) for dtype in ("bf16", "fp32")}


def rows(batch: int, seq: int):
    for name, cfg in PRESETS.items():
        t = min(seq, cfg.block_size)
        n = cfg.num_parameters()
        act = {(att, k): activation_bytes(cfg, batch, t, k, "bf16", attention=att, keeps_ln_1=att == "flash")["peak"]
               for att in ("math", "flash") for k in (0, 1)}
        yield name, cfg, t, n, act


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    a = p.parse_args(argv)
    print(f"| preset | layers / heads / width, vocab | parameters | weights + grads + AdamW, bf16 (fp32) "
          f"| activations, B={a.batch}, bf16: book step / checkpointed | fast step (flash) / checkpointed |")
    print("|---|---|---|---|---|---|")
    for name, cfg, t, n, act in rows(a.batch, a.seq):
        state = f"{n * STATE_BYTES['bf16'] / GIB:.2f} GiB ({n * STATE_BYTES['fp32'] / GIB:.2f})"
        book = f"{act['math', 0] / GIB:.2f} / {act['math', 1] / GIB:.2f} GiB"
        fast = f"{act['flash', 0] / GIB:.2f} / {act['flash', 1] / GIB:.2f} GiB"
        print(f"| `{name}` | {cfg.n_layer} / {cfg.n_head} / {cfg.n_embd}, {cfg.vocab_size} (T={t}) "
              f"| {n / 1e6:.1f} M | {state} | {book} | {fast} |")


if __name__ == "__main__":
    main()
