"""The ``llmgpu`` command: ``train``, ``sample``, ``info`` and ``bench``.

``llmgpu train`` with no arguments trains on the embedded corpus (the Python standard library's
sources, byte-level): on a CPU the ``tiny`` preset for about three minutes, on a GPU GPT-2 small
(124M) in bf16 for five. Bad flags and bad data give one ``llmgpu: error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__, backend

EXIT_USAGE = 2


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage + exiting, so every error is one line."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _positive_int(name):
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return conv


def _nonneg_int(name):
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {v}")
        return v

    return conv


def _pos_float(name):
    def conv(s):
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {s!r}") from None
        if not v > 0 or v != v or v == float("inf"):
            raise argparse.ArgumentTypeError(f"{name} must be a positive number, got {s!r}")
        return v

    return conv


def build_parser() -> argparse.ArgumentParser:
    from .model import PRESETS

    p = _Parser(prog="llmgpu", description="GPT-2 training on GPUs with CuPy + CUDA C (NumPy on a CPU).")
    p.add_argument("--version", action="version", version=f"llmgpu {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,sample,info,bench}", parser_class=_Parser)

    t = sub.add_parser("train", help="train a GPT-2 (default: the embedded corpus, time-bounded)",
                       description="Train a GPT-2. With no arguments: the embedded corpus (Python standard "
                       "library sources, byte tokens); on a CPU the 'tiny' preset for ~3 minutes, on a GPU "
                       "GPT-2 small in bf16 for ~5 minutes.")
    g = t.add_argument_group("model")
    g.add_argument("--preset", choices=list(PRESETS), help="model size (default: tiny on CPU, gpt2 on GPU)")
    g.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute precision (default: bf16 on "
                   "GPU, fp32 on CPU); master weights are always fp32")
    g.add_argument("--checkpoint-every", type=_nonneg_int("--checkpoint-every"), default=0, metavar="K",
                   help="activation checkpointing: keep every K-th block input, recompute the rest (0 = off)")
    g.add_argument("--vocab-size", type=_positive_int("--vocab-size"), help="model vocabulary (default: the data's)")
    g.add_argument("--pad-vocab", type=_nonneg_int("--pad-vocab"), metavar="M",
                   help="pad the vocabulary to a multiple of M (default 64 on GPU, off on CPU)")
    g = t.add_argument_group("data")
    g.add_argument("--data", help="'stdlib' (embedded corpus, default), a text file, an llm.c .bin shard, "
                   "a directory or a glob of shards")
    g.add_argument("--val-data", help="validation data (default: *val* shards, else the last --val-fraction)")
    g.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction (default 0.05)")
    g.add_argument("--batch", type=_positive_int("--batch"), help="sequences per micro-batch")
    g.add_argument("--seq", type=_positive_int("--seq"), help="tokens per sequence")
    g.add_argument("--grad-accum", type=_positive_int("--grad-accum"), default=1, metavar="N",
                   help="micro-batches per optimizer step")
    g = t.add_argument_group("optimization")
    g.add_argument("--steps", type=_positive_int("--steps"), help="optimizer steps (default: fit --max-time)")
    g.add_argument("--max-time", type=_pos_float("--max-time"), metavar="SECONDS",
                   help="training time limit (default 180 on CPU, 300 on GPU when --steps is not given)")
    g.add_argument("--lr", type=_pos_float("--lr"), help="peak learning rate (default 3e-3 on CPU, 6e-4 on GPU)")
    g.add_argument("--warmup", type=_nonneg_int("--warmup"), help="linear warm-up steps")
    g.add_argument("--schedule", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping (0 = off)")
    g.add_argument("--seed", type=int, default=1337)
    g = t.add_argument_group("run")
    g.add_argument("--out", help="output directory (default runs/<timestamp>)")
    g.add_argument("--resume", metavar="DIR", help="continue the run in DIR (its checkpoint/)")
    g.add_argument("--eval-every", type=_nonneg_int("--eval-every"), metavar="N", help="validation every N steps")
    g.add_argument("--eval-batches", type=_positive_int("--eval-batches"), default=8)
    g.add_argument("--log-every", type=_positive_int("--log-every"), default=10,
                   help="steps between host synchronizations / log lines")
    g.add_argument("--save-every", type=_nonneg_int("--save-every"), default=0, metavar="N",
                   help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    g.add_argument("--sync-copy", action="store_true", help="copy batches synchronously (for comparison)")
    g.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None,
                   help="the chapter 8 model: cuBLASLt GEMMs with fused epilogues, fused residual+LayerNorm, "
                        "flash attention (default: on when the GPU, bf16/fp16 and the 'fast' extra allow it)")
    g.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each step as one CUDA graph (default: with --fast)")
    g.add_argument("--cpu-threads", type=_nonneg_int("--cpu-threads"), metavar="N",
                   help="BLAS threads on the CPU backend (default 1: small GEMMs; 0: the BLAS default)")
    g.add_argument("--sample-tokens", type=_nonneg_int("--sample-tokens"), default=200)
    g.add_argument("--prompt", help="prompt of the sample printed at the end")
    g.add_argument("--quiet", action="store_true", help="no progress output")
    g.add_argument("--no-plot", action="store_true", help="skip loss.png")

    s = sub.add_parser("sample", help="generate text from a trained checkpoint")
    s.add_argument("--from", dest="src", required=True, metavar="DIR", help="run directory or checkpoint")
    s.add_argument("--prompt", help="text prompt (GPT-2 models without tiktoken: 'ids:50256,464')")
    s.add_argument("--tokens", type=_nonneg_int("--tokens"), default=200, help="new tokens (default 200)")
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=_positive_int("--top-k"), default=40)
    s.add_argument("--num-samples", type=_positive_int("--num-samples"), default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute precision (default: the run's "
                   "on GPU, fp32 on CPU)")

    i = sub.add_parser("info", help="device facts: GPU, memory, CuPy/CUDA versions, peak FLOP/s")
    i.add_argument("--json", action="store_true", help="print JSON")

    b = sub.add_parser("bench", help="train steps of llmgpu and PyTorch (eager, torch.compile) side by side")
    from . import bench

    bench.add_arguments(b)
    return p


# --------------------------------------------------------------------------- commands


def cmd_train(a) -> int:
    from .train import TrainConfig, default_out_dir, train

    out = a.out
    if out is None and not a.resume:
        out = default_out_dir()
    cfg = TrainConfig(
        preset=a.preset, data=a.data, val_data=a.val_data, val_fraction=a.val_fraction, steps=a.steps,
        max_time=a.max_time, batch=a.batch, seq=a.seq, grad_accum=a.grad_accum, dtype=a.dtype,
        checkpoint_every=a.checkpoint_every, lr=a.lr, warmup=a.warmup, schedule=a.schedule,
        weight_decay=a.weight_decay, grad_clip=a.grad_clip, eval_every=a.eval_every, eval_batches=a.eval_batches,
        log_every=a.log_every, save_every=a.save_every, out=out, resume=a.resume, seed=a.seed,
        vocab_size=a.vocab_size, pad_vocab=a.pad_vocab, device=a.device, async_copy=not a.sync_copy,
        sample_tokens=a.sample_tokens, prompt=a.prompt, progress=not a.quiet, plot=not a.no_plot,
        cpu_threads=a.cpu_threads, fast=a.fast, graph=a.graph,
    )
    summary = train(cfg)
    if "sample" in summary and not a.quiet:
        print("--- sample ---")
        print(summary["sample"])
    return 0


def cmd_sample(a) -> int:
    import numpy as np

    from .checkpoint_io import load_checkpoint
    from .data import get_tokenizer
    from .model import GPT, GPTConfig
    from .train import prompt_ids, select_xp

    if a.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {a.temperature}")
    xp = select_xp(a.device)
    weights, meta, _ = load_checkpoint(a.src, with_optim=False)
    cfg = GPTConfig.from_dict(meta["model_config"])
    dtype = a.dtype or ("fp32" if xp is np else meta.get("dtype", "bf16"))
    model = GPT(cfg, dtype=dtype, xp=xp, init=False)
    model.load_state_dict(weights)
    tok = get_tokenizer(meta.get("tokenizer", "bytes"))
    ids = prompt_ids(tok, a.prompt)
    if max(ids) >= cfg.vocab_size:
        raise UsageError(f"the prompt has token id {max(ids)} >= the model's vocabulary {cfg.vocab_size}")
    rng = np.random.default_rng(a.seed)
    for k in range(a.num_samples):
        out = model.generate(ids, a.tokens, temperature=a.temperature, top_k=a.top_k, rng=rng)
        if a.num_samples > 1:
            print(f"--- sample {k + 1} ---")
        print(tok.decode(out))
    return 0


def cmd_info(a) -> int:
    import numpy as np

    facts = {"llmgpu": __version__, "numpy": np.__version__}
    reason = backend.gpu_unavailable_reason()
    xp = backend.default_xp() if reason is None else np
    info = backend.device_info(xp)
    facts["device"] = info.as_dict()
    facts["gpu_available"] = reason is None
    if reason is not None:
        facts["gpu_unavailable_reason"] = reason
    facts["requested_device"] = backend.requested_device()
    if xp is not np:
        free, total = xp.cuda.runtime.memGetInfo()
        facts["memory_free_bytes"], facts["memory_total_bytes"] = int(free), int(total)
        from .train import _PEAK_TFLOPS

        for key, tc, f32 in _PEAK_TFLOPS:
            if key in info.name:
                facts["peak_tflops_datasheet"] = {"bf16/fp16": tc, "fp32": f32, "model": key}
                break
    facts["train_defaults"] = "tiny preset, fp32, NumPy" if xp is np else "gpt2 preset (124M), bf16, CuPy"
    from .train import fast_path_available

    fast_ok, fast_why = fast_path_available(xp, "bf16")
    facts["fast_step"] = fast_ok
    if not fast_ok:
        facts["fast_step_unavailable_reason"] = fast_why
    if a.json:
        print(json.dumps(facts, indent=1))
        return 0
    print(f"llmgpu {__version__} (NumPy {np.__version__})")
    print(f"device: {info.summary()}")
    if reason is not None:
        print(f"GPU: not used ({reason})")
    if "memory_free_bytes" in facts:
        free, total = facts["memory_free_bytes"] / 2**30, facts["memory_total_bytes"] / 2**30
        print(f"memory: {free:.1f} GiB free of {total:.1f} GiB")
    if "peak_tflops_datasheet" in facts:
        pk = facts["peak_tflops_datasheet"]
        print(f"peak (datasheet, dense): {pk['bf16/fp16']:.0f} TFLOP/s bf16/fp16, {pk['fp32']:.0f} TFLOP/s fp32")
    print(f"llmgpu train defaults here: {facts['train_defaults']}")
    print("chapter 8 fast step (--fast, --graph): " + ("available, used by default" if facts["fast_step"] else
                                                        f"not used here ({facts['fast_step_unavailable_reason']})"))
    return 0


def cmd_bench(a) -> int:
    from . import bench

    try:
        return bench.bench_main(a)
    except ValueError as e:  # unknown mode, bad sizes
        raise UsageError(str(e)) from None


def main(argv=None) -> int:
    """Entry point of the ``llmgpu`` command; returns the exit code."""
    from .checkpoint_io import CheckpointError
    from .data import DataError

    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        if a.command is None:
            parser.print_help()
            return EXIT_USAGE
        return {"train": cmd_train, "sample": cmd_sample, "info": cmd_info, "bench": cmd_bench}[a.command](a)
    except (UsageError, DataError, CheckpointError) as e:
        print(f"llmgpu: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except backend.GPUUnavailableError as e:
        print(f"llmgpu: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except MemoryError as e:
        print(f"llmgpu: error: out of host memory ({e}); lower --batch/--seq or use a smaller --preset",
              file=sys.stderr)
        return 1
    except OSError as e:  # an output directory that cannot be written, a disk that is full, ...
        print(f"llmgpu: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError
            print(f"llmgpu: error: out of GPU memory ({e}); lower --batch, use --checkpoint-every 1 or a smaller "
                  "--preset", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        print("llmgpu: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
