"""Chapter 9 benchmark, the comparison users would pick instead: PyTorch DDP on the same model and batch.

The model is ``llmgpu bench``'s PyTorch reference (``llmgpu.torch_reference``: nanoGPT's GPT-2 with SDPA,
vocabulary padded like FastGPT's), wrapped in ``DistributedDataParallel`` (NCCL, its default 25 MiB
buckets, gradients reduced during the backward pass), compiled with ``torch.compile`` (default mode), bf16
autocast, fused AdamW, global-norm clip 1.0. Each rank trains on its own synthetic batch; rank 0 prints
the median step time and the tokens/s of all ranks together, and writes JSON with ``--out``.

    torchrun --nproc-per-node 8 benchmarks/bench_ch9_torch_ddp.py --out benchmarks/results/ch9/ch9_ddp_8gpu.json
    python benchmarks/bench_ch9_torch_ddp.py --mode eager --steps 5      # one GPU, world size 1 (a check)

The llmgpu side of the same comparison is ``benchmarks/bench_ch9_step.py`` under the same launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from llmgpu.model import GPTConfig
from llmgpu.torch_reference import _torch_optimizer, build_torch_gpt, import_torch, torch_train_step
from llmgpu.train.config import TrainConfig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--batch", type=int, default=64, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mode", choices=["compile", "eager"], default="compile")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch = import_torch()
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if "RANK" not in os.environ:  # one GPU without a launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    cfg = GPTConfig(**{**GPTConfig.preset(a.preset).as_dict(), "pad_vocab_to": 64})
    model = build_torch_gpt(cfg, device=dev, seed=0, mask_padded=True)
    model.train()
    ddp = DDP(model, device_ids=[local])
    run = torch.compile(ddp) if a.mode == "compile" else ddp
    settings = TrainConfig(lr=6e-4)
    opt = _torch_optimizer(torch, model, fused=True, opt=settings)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen).to(dev)
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=gen).to(dev)
    step = torch_train_step(torch, run, x, y, list(model.parameters()), opt, settings.grad_clip, "cuda", torch.bfloat16)

    t0 = time.perf_counter()
    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats(dev)
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.steps)]
    for s, e in evs:
        s.record()
        loss = step()
        e.record()
    torch.cuda.synchronize()
    ms = statistics.median(s.elapsed_time(e) for s, e in evs)
    res = {"framework": "pytorch-ddp", "mode": a.mode, "world_size": world, "batch_per_gpu": a.batch, "seq": a.seq,
           "preset": a.preset, "ms_per_step": ms, "tokens_per_s": world * a.batch * a.seq / (ms * 1e-3),
           "warmup_s": warm, "final_loss": float(loss.detach().float().cpu()), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "device": torch.cuda.get_device_name(dev),
           "peak_memory_bytes_rank0": int(torch.cuda.max_memory_allocated(dev)),
           "sdpa_backend": "PyTorch's default choice (flash or cuDNN)"}
    if rank == 0:
        print(json.dumps(res))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
