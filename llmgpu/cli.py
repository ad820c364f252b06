"""The ``llmgpu`` command: ``train``, ``sample``, ``eval``, ``prepare``, ``export``, ``info`` and ``bench``.

``llmgpu train`` with no arguments trains on the embedded corpus (the Python standard library's
sources, byte-level): on a CPU the ``tiny`` preset for about three minutes, on a GPU GPT-2 small
(124M) in bf16 for five. Bad flags and bad data give one ``llmgpu: error: ...`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import traceback
from dataclasses import fields
from pathlib import Path

from .version import __version__

EXIT_USAGE = 2  # every error the command reports (bad flags, data, checkpoints, a diverged run, I/O)
EXIT_INTERRUPTED = 130  # Ctrl-C (after saving a checkpoint)


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage + exiting, so every error is one line."""

    def error(self, message):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _int_at_least(name, low):
    def conv(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {v}")
        return v

    return conv


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_GROUPS = ("model", "data", "optimization", "distributed", "run")
# older spellings kept as aliases: (flag, field, value stored)
_ALIASES = (("--sync-copy", "async_copy", False, "copy batches synchronously (= --no-async-copy)"),
            ("--quiet", "progress", False, "no progress output (= --no-progress)"))


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``llmgpu train``'s flags, one per ``TrainConfig`` field (its default, type, help and group).

    Generated, so the command line cannot drift from the configuration: ``TrainConfig(**vars(args))``
    (less the ``command`` key) is the configuration the flags describe. The parsed namespace holds only
    the flags given (argparse.SUPPRESS defaults; TrainConfig supplies the rest), so a resumed run knows
    which settings were asked for explicitly."""
    from .train.config import TrainConfig

    groups = {g: parser.add_argument_group(g) for g in _GROUPS}
    for f in fields(TrainConfig):
        meta = f.metadata
        if meta.get("cli", True) is False:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kind = _TYPES[str(f.type).split("|")[0].strip()]
        g = groups[meta["group"]]
        helptext = meta["help"]
        if f.default is not None:
            helptext += f" (default {'on' if f.default is True else 'off' if f.default is False else f.default})"
        if kind is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=helptext)
            continue
        g.add_argument(flag, dest=f.name, type=_typed(kind, flag), default=argparse.SUPPRESS, help=helptext,
                       metavar=meta.get("metavar"), choices=meta.get("choices"))
    for flag, dest, value, helptext in _ALIASES:
        groups["run"].add_argument(flag, dest=dest, action="store_const", const=value, default=argparse.SUPPRESS,
                                   help=helptext)
    return parser


def _typed(kind, flag):
    """argparse type: one clear line for a value of the wrong type."""
    def conv(s):
        try:
            return kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {'an integer' if kind is int else 'a number'}, "
                                             f"got {s!r}") from None

    return conv if kind in (int, float) else kind


def add_interop_commands(sub):
    """``llmgpu eval``, ``prepare`` and ``export``: other people's models and data in, ours out."""
    from .train.config import CPU_DEFAULTS as CPU
    from .train.config import GPU_DEFAULTS as GPU
    from .train.evaluate import EMBEDDED_EVAL_BATCHES
    from .train.prepare import SHARD_TOKENS, VAL_FRACTION

    e = sub.add_parser("eval", help="mean loss and perplexity of a model on held-out data (JSON)",
                       description="Mean next-token loss and perplexity of an llmgpu run or a Hugging Face GPT-2 "
                       "directory on token shards or text (tokenized with the model's tokenizer).")
    e.add_argument("--from", dest="src", required=True, metavar="DIR", help="run, checkpoint or Hugging Face dir")
    e.add_argument("--data", required=True, help="'stdlib' (the embedded corpus train uses by default: its "
                   f"validation split, at most {EMBEDDED_EVAL_BATCHES} batches unless --max-batches), a text file, "
                   ".bin shard, directory or glob (a directory with *val* shards: those)")
    e.add_argument("--batch", type=_int_at_least("--batch", 1), help=f"sequences per batch (default {GPU['batch']} on "
                   f"GPU, {CPU['batch']} on CPU)")
    e.add_argument("--seq", type=_int_at_least("--seq", 1), help=f"tokens per sequence (default {GPU['seq']} on "
                   f"GPU, {CPU['seq']} on CPU, at most the model's block size)")
    e.add_argument("--max-batches", type=_int_at_least("--max-batches", 1), help="at most N batches (default: all; "
                   f"{EMBEDDED_EVAL_BATCHES} for stdlib)")
    e.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    e.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="fp32", help="compute precision (default "
                   "fp32)")
    e.add_argument("--json", metavar="FILE", help="also write the result to FILE")
    e.add_argument("--quiet", action="store_true", help="no progress output")

    p = sub.add_parser("prepare", help="tokenize text files into llm.c token shards (train + val)",
                       description="Tokenize text files (one document each) into llm.c-format shards in parallel "
                       "over files, streaming: DIR/train_*.bin, DIR/val_*.bin and DIR/prepare.json.")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files, directories or globs")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--tokenizer", choices=["gpt2", "bytes"], default="gpt2", help="GPT-2 BPE (tiktoken, the 'bpe' "
                   "extra) or UTF-8 bytes (default gpt2)")
    p.add_argument("--val-fraction", type=float, default=None, help="held-out share of the tokens, the end of the "
                   f"stream (default {VAL_FRACTION})")
    p.add_argument("--shard-tokens", type=_int_at_least("--shard-tokens", 1), default=None,
                   help=f"tokens per shard (default {SHARD_TOKENS:,})")
    p.add_argument("--workers", type=_int_at_least("--workers", 1), help="tokenizer processes (default: one per "
                   "CPU, at most one per file)")
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress output")

    x = sub.add_parser("export", help="write a run as a Hugging Face GPT-2 or Llama directory (transformers loads it)",
                       description="Write config.json + model.safetensors that transformers' from_pretrained loads: "
                       "a GPT-2 run for GPT2LMHeadModel (Hugging Face names, Conv1D layout, plus nanogpt.safetensors "
                       "in nanoGPT's names and layout), a Llama run for LlamaForCausalLM; and llmgpu.json.")
    x.add_argument("--from", dest="src", required=True, metavar="RUN", help="run or checkpoint directory")
    x.add_argument("--to", dest="dst", required=True, metavar="DIR", help="new or empty output directory")
    x.add_argument("--overwrite", action="store_true",
                   help="write into a directory that holds files: the model there goes (its config.json and weight "
                   "files), other files stay")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="llmgpu", description="GPT-2 training on GPUs with CuPy + CUDA C (NumPy on a CPU).")
    p.add_argument("--version", action="version", version=f"llmgpu {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{train,sample,eval,prepare,export,info,bench}",
                           parser_class=_Parser)

    t = sub.add_parser("train", help="train a GPT-2 or (--arch llama) a Llama (default: the embedded corpus, "
                       "time-bounded)",
                       description="Train a GPT-2 (--arch llama: a Llama, on the book step). With no arguments: the "
                       "embedded corpus (Python standard library sources, byte tokens); on a CPU the 'tiny' preset for "
                       "~3 minutes, on a GPU GPT-2 small in bf16 for ~5 minutes.")
    add_train_arguments(t)

    s = sub.add_parser("sample", help="generate text from a trained checkpoint")
    s.add_argument("--from", dest="src", required=True, metavar="DIR", help="run directory or checkpoint")
    s.add_argument("--prompt", help="text prompt (GPT-2 models without tiktoken: 'ids:50256,464')")
    s.add_argument("--tokens", type=_int_at_least("--tokens", 0), default=200, help="new tokens (default 200)")
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=_int_at_least("--top-k", 1), default=40)
    s.add_argument("--num-samples", type=_int_at_least("--num-samples", 1), default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto")
    s.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="compute precision (default: the run's "
                   "on GPU, fp32 on CPU)")

    add_interop_commands(sub)

    i = sub.add_parser("info", help="device facts: GPU, memory, CuPy/CUDA versions, peak FLOP/s")
    i.add_argument("--json", action="store_true", help="print JSON")

    b = sub.add_parser("bench", help="train steps of llmgpu and PyTorch (eager, torch.compile) side by side")
    from . import bench

    bench.add_arguments(b)
    return p


# --------------------------------------------------------------------------- commands


def cmd_train(a) -> int:
    from .dist import from_environ
    from .train import TrainConfig, train
    from .train.stop import exit_code

    given = {f.name: getattr(a, f.name) for f in fields(TrainConfig) if hasattr(a, f.name)}  # the explicit flags
    if given.get("nproc", 1) > 1:
        return _launch_ranks(a, given)
    summary = train(TrainConfig(**given), explicit=set(given))
    if "error" in summary:  # diverged: stopped, the last good checkpoint kept
        raise UsageError(summary["error"])
    if summary["stop_reason"] == "interrupted":
        ckpt, out, unfinished = summary["checkpoint"], summary["out"], summary.get("unfinished_step")
        if from_environ().is_main and unfinished:  # a second signal stopped a step halfway (train/stop.py)
            print(f"llmgpu: interrupted in the middle of step {unfinished} ({summary['signal']}): nothing saved; "
                  + (f"the last checkpoint is {ckpt} (continue with: llmgpu train --resume {out})" if ckpt else
                     "no checkpoint was saved before it"), file=sys.stderr)
        elif from_environ().is_main:
            print(f"llmgpu: interrupted at step {summary['steps']} ({summary['signal']}); checkpoint saved in "
                  f"{ckpt} (continue with: llmgpu train --resume {out})", file=sys.stderr)
        return exit_code(getattr(signal, summary["signal"]))
    if "sample" in summary and given.get("progress", True):
        print("--- sample ---")
        print(summary["sample"])
    return 0


def _launch_ranks(a, given) -> int:
    """``--nproc N`` (chapter 9): the same command as N ranks, one per GPU (or N CPU ranks through mpiexec)."""
    import numpy as np

    from . import backend
    from .dist import from_environ
    from .dist.launch import launch, strip_nproc
    from .train import select_xp
    from .train.ranks import refuse_nested_launch

    refuse_nested_launch(given["nproc"], from_environ())
    gpu = select_xp(given.get("device", "auto")) is not np
    if gpu:
        cp = backend.require_gpu()
        n = cp.cuda.runtime.getDeviceCount()
        if given["nproc"] > n:
            from .dist import ranks_may_share_gpus

            why = ranks_may_share_gpus()  # None where NCCL 2.30 lets ranks share a GPU (chapter 9, one GPU)
            if why:
                raise UsageError(f"--nproc {given['nproc']} but {n} GPU(s) are visible: one rank per GPU ({why}; "
                                 "--device cpu trains CPU ranks)")
    return launch(given["nproc"], strip_nproc(a.argv), gpu=gpu)  # a.argv starts with "train"


def cmd_sample(a) -> int:
    import numpy as np

    from .train import select_xp
    from .train.sampling import load_for_sampling, prompt_ids, sampling_settings

    sampling_settings(a.temperature, a.top_k, a.seed)
    xp = select_xp(a.device)
    model, tok, _ = load_for_sampling(a.src, xp, a.dtype)
    ids = prompt_ids(tok, a.prompt, model.config.vocab_size)
    rng = np.random.default_rng(a.seed)
    for k in range(a.num_samples):
        out = model.generate(ids, a.tokens, temperature=a.temperature, top_k=a.top_k, rng=rng)
        if a.num_samples > 1:
            print(f"--- sample {k + 1} ---")
        print(tok.decode(out))
    return 0


def cmd_eval(a) -> int:
    from .train.evaluate import run_eval

    if a.json:
        _check_output_file(a.json, "--json", replaces=(EVAL_KEYS,))
    result = run_eval(a.src, a.data, batch=a.batch, seq=a.seq, max_batches=a.max_batches, device=a.device,
                      dtype=a.dtype, progress=not a.quiet)
    for note in result["notes"]:  # what the evaluation chose (also in the JSON), as train says it: even with --quiet
        print(f"llmgpu: note: {note}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)  # first: should writing --json fail after all, the result is not lost
    if a.json:
        from .interop.hf_files import publish

        publish(Path(a.json).expanduser(), lambda tmp: tmp.write_text(text + "\n"))  # whole, or not at all
    return 0


def _check_output_file(path, flag: str, *, makes_folders: bool = False, replaces: tuple = ()):
    """A UsageError unless the file ``path`` can be written, checked before the work whose result it is: not a
    directory, in a folder that exists (``makes_folders``: that can be made) and is writable, and, where it exists,
    empty or an earlier result of the command (a JSON object with every key of one of the tuples ``replaces``): a
    model's config.json or weights, or the data, given by mistake, are not written over."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{flag} {p} is a directory: give a file name, e.g. {p / 'result.json'}")
    if p.is_file() and p.stat().st_size and not _holds_keys(p, replaces):
        raise UsageError(f"{flag} {p} exists and is not an earlier result of this command (a model's or the data's "
                         "file?): it is not written over; give another path or remove it")
    folder = p.parent
    while makes_folders and not folder.exists() and folder != folder.parent:  # the nearest folder that exists
        folder = folder.parent
    if not folder.exists():
        raise UsageError(f"{flag} {p}: the directory {folder} does not exist; create it or give another path")
    if not folder.is_dir():
        raise UsageError(f"{flag} {p}: {folder} is not a directory; give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {p}: the directory {folder} is not writable; give another path")


EVAL_KEYS = ("loss", "perplexity", "model", "data")  # in every eval result: an --json file eval may replace
BENCH_KEYS = (("benchmark",), ("presets",))  # a bench result, or a scale table (which merges into its file)


def _holds_keys(path: Path, key_sets: tuple) -> bool:
    """Whether ``path`` is a JSON object with every key of one of ``key_sets``."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)  # a model's weights are not read whole to find they are no JSON
            obj = json.loads(head + f.read(1 << 26)) if head.lstrip().startswith(b"{") else None
    except (OSError, ValueError):  # unreadable, binary, too long to be a result, or not JSON
        return False
    return isinstance(obj, dict) and any(all(k in obj for k in keys) for keys in key_sets)


def cmd_prepare(a) -> int:
    from .train import prepare

    kw = {k: v for k, v in (("val_fraction", a.val_fraction), ("shard_tokens", a.shard_tokens)) if v is not None}
    prepare.prepare(a.inputs, a.out, tokenizer=a.tokenizer, workers=a.workers, overwrite=a.overwrite,
                    progress=not a.quiet, **kw)
    return 0


def cmd_export(a) -> int:
    from .train.pretrained import export

    print(json.dumps(export(a.src, a.dst, overwrite=a.overwrite), indent=1))
    return 0


def cmd_info(a) -> int:
    import numpy as np

    from . import backend

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
        from .perf.timing import datasheet_peak_tflops

        tc, key = datasheet_peak_tflops(xp, "bf16")
        if key is not None:
            facts["peak_tflops_datasheet"] = {"bf16/fp16": tc, "fp32": datasheet_peak_tflops(xp, "fp32")[0],
                                              "model": key}
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
    from . import backend, bench

    if a.json:
        # timing.save_results makes missing folders
        _check_output_file(a.json, "--json", makes_folders=True, replaces=BENCH_KEYS)
    try:
        if bench.wants_scale_table(a):
            from .bench_scale import scale_main

            return scale_main(a, backend.select_xp(a.device))
        return bench.bench_main(a)
    except ValueError as e:  # unknown mode, bad sizes
        raise UsageError(str(e)) from None


def main(argv=None) -> int:
    """Entry point of the ``llmgpu`` command; returns the exit code."""
    try:
        with _ctrl_c_held():  # the imports (a second or more): NumPy, the backend, every command's modules
            errors, parser = _user_errors(), build_parser()
        return _run(parser, errors, argv)
    except KeyboardInterrupt as e:  # outside the training loop (which saves and returns), or a rank's second signal
        print(f"llmgpu: interrupted{': ' if str(e) else ''}{e}", file=sys.stderr)
        _abort_run(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def _ctrl_c_held():
    """A Ctrl-C inside the block is held until the block ends, then raised: inside an import, NumPy's C code turns a
    KeyboardInterrupt into an ImportError (or worse) with a traceback. Left alone where SIGINT is not Python's
    default (ignored, another handler) or this is not the main thread."""
    held, previous = [], None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        try:
            previous = signal.signal(signal.SIGINT, lambda *_: held.append(True))
        except ValueError:  # not the main thread: not ours to hold
            pass
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def _user_errors() -> tuple:
    """The exceptions a command reports as one ``llmgpu: error:`` line (exit code 2)."""
    from . import backend
    from .dist import DistError
    from .interop import InteropError
    from .train.checkpoint import CheckpointError
    from .train.config import ConfigError
    from .train.data import DataError

    return (DistError, UsageError, ConfigError, DataError, CheckpointError, InteropError, backend.GPUUnavailableError,
            backend.DeviceSettingError)


def _run(parser, errors: tuple, argv) -> int:
    from .dist.launch import ERROR_MARK

    try:
        a = parser.parse_args(argv)
        a.argv = list(sys.argv[1:] if argv is None else argv)
        if a.command is None:
            parser.print_help()
            return EXIT_USAGE
        return {"train": cmd_train, "sample": cmd_sample, "eval": cmd_eval, "prepare": cmd_prepare,
                "export": cmd_export, "info": cmd_info, "bench": cmd_bench}[a.command](a)
    except errors as e:
        return _fail(f"{ERROR_MARK}{e}")
    except MemoryError as e:
        return _fail(f"{ERROR_MARK}out of host memory ({e}); lower --batch/--seq or use a smaller --preset")
    except OSError as e:  # an output directory that cannot be written, a disk that is full, ...
        where = f": {e.filename}" if e.filename else ""
        return _fail(f"{ERROR_MARK}{e.strerror or e}{where}")
    except Exception as e:
        if type(e).__name__ == "OutOfMemoryError":  # cupy.cuda.memory.OutOfMemoryError
            return _fail(f"{ERROR_MARK}out of GPU memory ({e}); lower --batch, use --checkpoint-every 1 or a smaller "
                         "--preset")
        if not _several_ranks():
            raise
        traceback.print_exc()  # this rank's traceback, then the end of the run: the others must not wait for it
        _abort_run(1)
        return 1


def _several_ranks() -> bool:
    from .dist.env import from_environ

    return from_environ().world_size > 1


def _abort_run(code: int):
    if _several_ranks():
        from .dist.comm import abort_run

        abort_run(code)


def _fail(line: str) -> int:
    """The one line of an error, and in a run of several ranks the end of every rank (``dist.abort_run``): a
    refusal on one rank must not leave the others waiting in a collective for --dist-timeout."""
    from .dist.launch import report_rank_error

    print(line, file=sys.stderr)
    report_rank_error(line)  # the --nproc launcher shows it even if mpiexec drops the line above
    _abort_run(EXIT_USAGE)
    return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
