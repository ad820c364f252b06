"""Chapter 6 benchmark: activation checkpointing, peak memory against step time.

For ``checkpoint_every`` k ∈ {off, 1, 2, 4}: the median time of one forward + backward pass and the
peak device memory (the CuPy memory pool's high-water mark) on GPT-2 124M (bf16, B=16, T=1024,
vocabulary padded to 50304) on a GPU, next to the FLOPs the recomputation adds. If PyTorch with CUDA
is importable, the same sweep runs on a nanoGPT-style PyTorch GPT-2 (bf16 autocast, flash attention,
``torch.utils.checkpoint`` over spans of k blocks) for comparison.

The article's claim to check: "about half the memory for 30–40 % more compute".

    python benchmarks/bench_ch6_checkpointing.py            # GPU: writes benchmarks/results/ch6/ch6_checkpointing.json
    python benchmarks/bench_ch6_checkpointing.py --quick    # small sizes (the default on a CPU; nothing written)

On a CPU (NumPy backend) it runs the tiny model, reports counted activation bytes instead of pool
memory, and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import os
import sys

import _common
import numpy as np

from llmgpu.model import GPTConfig
from llmgpu.perf.sweeps import checkpointing_sweep

RESULTS = _common.RESULTS_DIR / "ch6" / "ch6_checkpointing.json"
KS = (0, 1, 2, 4)


def torch_sweep(cfg: GPTConfig, batch: int, seq: int, ks, reps: int = 5):
    """The same measurement on a nanoGPT-style PyTorch GPT-2 (None when PyTorch/CUDA is missing)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.utils.checkpoint import checkpoint
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    nn = torch.nn
    C, H = cfg.n_embd, cfg.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
            self.c_fc, self.m_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

        def forward(self, x):
            B, T, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.c_proj(y)
            return x + self.m_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(cfg.padded_vocab_size, C)
            self.wpe = nn.Embedding(cfg.block_size, C)
            self.h = nn.ModuleList([Block() for _ in range(cfg.n_layer)])
            self.ln_f = nn.LayerNorm(C)
            self.k = 0

        def span(self, s, e):
            def run(x):
                for b in self.h[s:e]:
                    x = b(x)
                return x
            return run

        def forward(self, idx, tgt):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            L = len(self.h)
            if self.k == 0:
                x = self.span(0, L)(x)
            else:
                for s in range(0, L, self.k):
                    x = checkpoint(self.span(s, min(s + self.k, L)), x, use_reentrant=False)
            logits = F.linear(self.ln_f(x), self.wte.weight)
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), tgt.view(-1))

    net = Net().cuda()
    idx = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    tgt = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    rows = []
    for k in ks:
        net.k = k

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = net(idx, tgt)
            loss.backward()

        net.zero_grad(set_to_none=False)
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        rows.append({"k": k, "ms": float(np.median(times)), "peak_bytes": int(torch.cuda.max_memory_allocated())})
    for r in rows:
        r["time_vs_off"] = r["ms"] / rows[0]["ms"]
        r["memory_vs_off"] = r["peak_bytes"] / rows[0]["peak_bytes"]
    return {"torch": torch.__version__, "rows": rows}


def main(argv=None):
    ap = _common.parser(__doc__, reps=None)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--preset")
    ap.add_argument("--dtype")
    a = ap.parse_args(argv)
    xp, on_gpu, quick = _common.setup(a)
    if on_gpu and not quick:
        preset, batch, seq, dtype, reps = "gpt2", 16, 1024, "bf16", 5
    elif on_gpu:
        preset, batch, seq, dtype, reps = "d6", 4, 256, "bf16", 3
    else:
        preset, batch, seq, dtype, reps = "tiny", 4, 64, "fp32", 2
        from llmgpu.backend import blas_threads

        blas_threads(1)
    preset, batch, seq = a.preset or preset, a.batch or batch, a.seq or seq
    dtype, reps = a.dtype or dtype, a.reps or reps
    base = GPTConfig.preset(preset)
    cfg = GPTConfig.preset(preset, pad_vocab_to=64 if on_gpu else 0, block_size=max(seq, base.block_size))
    print(f"model: {preset} ({cfg.num_parameters() / 1e6:.1f}M parameters), {dtype}, batch {batch} x {seq}")
    rows = checkpointing_sweep(cfg, batch=batch, seq=seq, ks=KS, dtype=dtype, xp=xp, reps=reps)
    mem_key = "peak_bytes" if on_gpu else "activation_peak_bytes"
    print(f"\n{'checkpointing':>14} {'fwd+bwd ms':>11} {'time x':>7} {'extra FLOPs':>12} "
          f"{'peak MiB' if on_gpu else 'act. MiB':>10} {'memory x':>9}")
    for r in rows:
        print(f"{r['label']:>14} {r['ms']:11.2f} {r['time_vs_off']:7.2f} {100 * r['extra_flops']:11.0f}% "
              f"{r[mem_key] / 2**20:10.1f} {r['memory_vs_off']:9.2f}")
    payload = {"benchmark": "ch6_checkpointing", "preset": preset, "batch": batch, "seq": seq, "dtype": dtype,
               "memory_metric": "CuPy memory pool high-water mark" if on_gpu else "counted activation bytes",
               "rows": rows}
    if on_gpu and not a.no_torch:
        t = torch_sweep(cfg, batch, seq, KS, reps)
        if t is not None:
            payload["pytorch"] = t
            print(f"\nPyTorch {t['torch']} (bf16 autocast, flash SDPA, torch.utils.checkpoint):")
            for r, o in zip(t["rows"], rows):
                print(f"{('off' if r['k'] == 0 else 'every ' + str(r['k'])):>14} {r['ms']:11.2f} "
                      f"{r['time_vs_off']:7.2f} {'':>12} {r['peak_bytes'] / 2**20:10.1f} {r['memory_vs_off']:9.2f}"
                      f"   (llmgpu / PyTorch time {o['ms'] / r['ms']:.2f})")
    one = next(r for r in rows if r["k"] == 1)
    print(f"\ncheckpointing every block: {100 * (1 - one['memory_vs_off']):.0f}% less memory for "
          f"{100 * (one['time_vs_off'] - 1):.0f}% more time (the article: about half the memory for 30-40% "
          "more compute)")
    out = a.out or (RESULTS if on_gpu and not quick else None)
    _common.save(out and os.path.relpath(out), payload, xp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
