"""The training loop (chapter 7): every piece of the book in one step.

One optimizer step, in the order the GPU sees it::

    for each micro-batch (gradient accumulation):
        x, y ← the batch copied host → device on a side stream during the previous step
        forward: embeddings, n_layer blocks, ln_f, LM head, fused cross-entropy
        backward with the loss gradient seeded by  loss_scale / micro_batches
                 (weight gradients accumulate in fp32 into the flat gradient buffer)
    one launch:  ‖g‖ of the unscaled gradient, clip factor, inf/nan flag       (optim.clip)
    one launch:  AdamW with grad_scale = clip / loss_scale, skipped on inf,
                 writes the bf16/fp16 working copy ("cast back"), zeroes the gradient  (optim.adamw)
    one launch:  loss-scaler update (fp16 only)                                 (amp)

Nothing in the step reads a value on the host: the loss, the gradient norm and the overflow flag
stay on the device and are fetched in one copy every ``log_every`` steps. The learning rate comes
from the schedule on the host (a float, no sync).

``Trainer`` holds the model, optimizer, scaler and data; ``train(TrainConfig(...))`` runs it with a
progress bar, a JSON-lines log, validation every ``eval_every`` steps, checkpoints (weights,
optimizer, scaler, step, data position, RNG state: resuming reproduces the uninterrupted run's losses
bit for bit), a loss-curve PNG and samples at the end.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from . import backend
from .amp import Policy
from .checkpoint_io import load_checkpoint, save_checkpoint
from .data import BatchLoader, Corpus, DataError, DataStream, get_tokenizer, load_corpus
from .model import GPT, GPTConfig
from .optim import AdamW, GradClipper, lr_at
from .profile import region

# --------------------------------------------------------------------------- configuration


@dataclass
class TrainConfig:
    """Everything a run needs. ``None`` fields get device-dependent defaults (``resolve``)."""

    preset: str | None = None  # None: 'tiny' on the CPU, 'gpt2' (124M) on a GPU
    data: str | None = None  # None: the embedded corpus (Python standard library sources)
    val_data: str | None = None
    val_fraction: float = 0.05
    steps: int | None = None  # None: as many as fit in max_time
    max_time: float | None = None  # seconds of training; None: 180 on CPU / 300 on GPU when steps is None
    batch: int | None = None
    seq: int | None = None
    grad_accum: int = 1
    dtype: str | None = None  # None: bf16 on GPU, fp32 on CPU
    checkpoint_every: int = 0  # activation checkpointing: keep every k-th block input (0 = off)
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    schedule: str = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int | None = None
    eval_batches: int = 8
    log_every: int = 10
    save_every: int = 0  # 0: a checkpoint at the end only
    out: str | None = None  # None: runs/<timestamp>
    resume: str | None = None
    seed: int = 1337
    vocab_size: int | None = None  # None: the data's (256 for bytes, 50257 for GPT-2 shards)
    pad_vocab: int | None = None  # None: 64 on GPU, off on CPU
    device: str = "auto"  # auto | cpu | gpu
    async_copy: bool = True
    sample_tokens: int = 200
    prompt: str | None = None
    temperature: float = 0.8
    top_k: int | None = 40
    progress: bool = True
    plot: bool = True
    time_budget_probe: int = 5  # steps timed to fit the schedule to max_time
    cpu_threads: int | None = None  # BLAS threads on the NumPy backend (None: 1, 0: leave as is; blas_threads)
    fast: bool | None = None  # the chapter 8 model (FastGPT); None: on the GPU when its extras are installed
    graph: bool | None = None  # replay the step as one CUDA graph; None: whenever the fast model runs

    def as_dict(self) -> dict:
        return asdict(self)


# keys a resumed run takes from the command line rather than from the checkpoint
RESUME_OVERRIDES = ("steps", "max_time", "out", "eval_every", "log_every", "save_every", "progress", "plot",
                    "sample_tokens", "prompt", "temperature", "top_k", "device", "async_copy", "resume", "cpu_threads",
                    "fast", "graph")

CPU_DEFAULTS = dict(preset="tiny", batch=8, seq=128, dtype="fp32", lr=3e-3, warmup=20, eval_every=25,
                    max_time=180.0, pad_vocab=0)
GPU_DEFAULTS = dict(preset="gpt2", batch=16, seq=1024, dtype="bf16", lr=6e-4, warmup=50, eval_every=100,
                    max_time=300.0, pad_vocab=64)


def select_xp(device: str = "auto"):
    """NumPy or CuPy for ``--device``."""
    device = (device or "auto").lower()
    if device == "cpu":
        return np
    if device == "gpu":
        try:
            return backend.require_gpu()
        except backend.GPUUnavailableError as e:
            raise DataError(f"--device gpu: {e}") from None
    if device != "auto":
        raise DataError(f"--device must be auto, cpu or gpu, not {device!r}")
    import warnings

    with warnings.catch_warnings():  # "CuPy present but no GPU" is expected here: `llmgpu info` says why
        warnings.simplefilter("ignore")
        return backend.default_xp()


def resolve(cfg: TrainConfig, xp) -> TrainConfig:
    """Fill the ``None`` fields with the defaults of the device, and validate."""
    d = CPU_DEFAULTS if xp is np else GPU_DEFAULTS
    upd = {}
    for k, v in d.items():
        if getattr(cfg, k) is None:
            if k == "max_time" and cfg.steps is not None:
                continue
            upd[k] = v
    cfg = replace(cfg, **upd)
    _validate(cfg)
    fast, why = fast_path_available(xp, cfg.dtype, cfg.checkpoint_every)
    if cfg.fast and not fast:
        raise DataError(f"--fast: {why}")
    if cfg.fast is None:
        cfg = replace(cfg, fast=fast)
    if cfg.graph and not cfg.fast:
        raise DataError("--graph needs the fast model (--fast): CuPy's cuBLAS calls of the book model cannot be "
                        "captured into a CUDA graph")
    if cfg.graph is None:
        cfg = replace(cfg, graph=bool(cfg.fast))
    return cfg


def fast_path_available(xp, dtype, checkpoint_every: int = 0) -> tuple[bool, str]:
    """(whether ``FastGPT`` can train here, why not): a GPU, bf16/fp16, no checkpointing, the ``fast`` extra."""
    if xp is np:
        return False, "the fast model is a GPU path (cuBLASLt, cuDNN); on the CPU the book model runs"
    if checkpoint_every:
        return False, "the fast model does not implement activation checkpointing (--checkpoint-every 0)"
    if backend.resolve_dtype(dtype) not in (backend.bfloat16, backend.float16):
        return False, "the fast model's flash attention takes bf16 or fp16 (--dtype)"
    from . import gemm_lt
    from .ops import flash_attention

    for mod in (gemm_lt, flash_attention):
        why = mod.unavailable_reason()
        if why:
            return False, why
    return True, ""


def _validate(cfg: TrainConfig):
    def need(cond, msg):
        if not cond:
            raise DataError(msg)

    from .model import PRESETS

    need(cfg.preset in PRESETS, f"unknown preset {cfg.preset!r}; choose one of {', '.join(PRESETS)}")
    need(cfg.steps is None or cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}")
    need(cfg.max_time is None or cfg.max_time > 0, f"--max-time must be > 0, got {cfg.max_time}")
    need(cfg.batch >= 1, f"--batch must be >= 1, got {cfg.batch}")
    need(cfg.seq >= 1, f"--seq must be >= 1, got {cfg.seq}")
    need(cfg.grad_accum >= 1, f"--grad-accum must be >= 1, got {cfg.grad_accum}")
    need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
    need(cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr must be a positive number, got {cfg.lr}")
    need(cfg.warmup >= 0, f"--warmup must be >= 0, got {cfg.warmup}")
    need(cfg.eval_every >= 0, f"--eval-every must be >= 0, got {cfg.eval_every}")
    need(cfg.log_every >= 1, f"--log-every must be >= 1, got {cfg.log_every}")
    need(cfg.grad_clip >= 0, f"--grad-clip must be >= 0, got {cfg.grad_clip}")
    need(cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    need(cfg.eval_batches >= 1, f"--eval-batches must be >= 1, got {cfg.eval_batches}")
    need(cfg.vocab_size is None or cfg.vocab_size >= 2, f"--vocab-size must be >= 2, got {cfg.vocab_size}")
    need(cfg.pad_vocab >= 0, f"--pad-vocab must be >= 0, got {cfg.pad_vocab}")
    need(cfg.temperature >= 0, f"--temperature must be >= 0, got {cfg.temperature}")
    need(cfg.top_k is None or cfg.top_k >= 1, f"--top-k must be >= 1, got {cfg.top_k}")
    try:
        Policy(cfg.dtype)
    except ValueError:
        raise DataError(f"--dtype must be bf16, fp16 or fp32, got {cfg.dtype!r}") from None


def blas_threads(n: int | None) -> int | None:
    """Set the thread count of the OpenBLAS that NumPy uses; returns the previous count (None: unknown).

    The tiny model's GEMMs are small (128-wide) and many (batched attention products loop over B·H
    matrices): OpenBLAS threads spend more time handing work around than computing, and on a loaded
    machine a spinning BLAS thread that lost its core slows a step down tenfold. One thread is the
    robust default for the CPU backend. Uses threadpoolctl when installed, else OpenBLAS' own
    ``*_set_num_threads`` entry point found among the loaded libraries (Linux); otherwise nothing.
    """
    if n is None:
        return None
    try:
        import threadpoolctl

        before = [i.get("num_threads") for i in threadpoolctl.threadpool_info() if i.get("internal_api") == "openblas"]
        threadpoolctl.threadpool_limits(int(n), user_api="blas")
        return before[0] if before else None
    except ImportError:
        pass
    import ctypes
    import re

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    prev = None
    for path in sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", maps))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                setf = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if setf is not None:
                    if get is not None:
                        prev = int(get())
                    setf(ctypes.c_int(int(n)))
    return prev


# --------------------------------------------------------------------------- throughput facts

# Dense peak TFLOP/s per GPU from the vendors' datasheets: (16-bit tensor cores, fp32 without TF32).
# MFU (Chowdhery et al., PaLM, appendix B) divides the model FLOPs actually achieved by this.
_PEAK_TFLOPS = (
    ("H200", 989.4, 66.9), ("H100 PCIe", 756.0, 51.2), ("H100", 989.4, 66.9), ("GH200", 989.4, 66.9),
    ("A100", 312.0, 19.5), ("L40S", 362.0, 91.6), ("L4", 121.0, 30.3), ("A10G", 125.0, 31.2), ("A10", 125.0, 31.2),
    ("RTX 4090", 165.2, 82.6), ("RTX 3090", 71.0, 35.6), ("V100", 125.0, 15.7),
)


def peak_flops(xp, dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from) for MFU on this device and precision."""
    dt = backend.resolve_dtype(dtype)
    if xp is np:
        from .timing import gemm_ceiling

        return gemm_ceiling(384, "fp32", xp=np, reps=3) * 1e12, "measured NumPy fp32 GEMM"
    name = backend.device_info(xp).name
    for key, tc, f32 in _PEAK_TFLOPS:
        if key in name:
            return (f32 if dt == backend.float32 else tc) * 1e12, f"{key} datasheet"
    from .timing import gemm_ceiling

    return gemm_ceiling(4096, backend.dtype_name(dt), xp=xp, reps=5) * 1e12, "measured cuBLAS GEMM"


# --------------------------------------------------------------------------- progress output


class Progress:
    """One status line (redrawn in place on a terminal, printed per log interval otherwise)."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._len = 0

    def update(self, step: int, *, loss=None, val=None, lr=None, tok_s=None, mfu=None, elapsed=None, eta=None):
        if not self.enabled:
            return
        frac = min(step / self.total, 1.0) if self.total else 0.0
        width = 20
        fill = int(round(frac * width))
        parts = [f"[{'#' * fill}{'.' * (width - fill)}] {step}/{self.total or '?'}"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if val is not None:
            parts.append(f"val {val:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if tok_s is not None:
            parts.append(f"{_si(tok_s)} tok/s")
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        if elapsed is not None:
            parts.append(f"{_hms(elapsed)}" + (f"<{_hms(eta)}" if eta is not None else ""))
        line = " | ".join(parts)
        if self.tty:
            pad = max(0, self._len - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str):
        if not self.enabled:
            return
        if self.tty and self._len:
            self.stream.write("\n")
            self._len = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self):
        if self.enabled and self.tty and self._len:
            self.stream.write("\n")
            self.stream.flush()
            self._len = 0


def _si(x: float) -> str:
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _hms(s: float) -> str:
    s = int(max(s, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# --------------------------------------------------------------------------- the trainer


def apply_update(P, opt, scaler, clipper, grad_clip: float, lr):
    """After the backward pass: unscale + global-norm clip (one fused launch), AdamW with the working-copy
    cast and the gradient zeroed (one launch), loss-scaler update. Returns the ``GradNorm`` result."""
    with region("clip (grad norm)", bytes=P.grad.nbytes, flops=2.0 * P.numel):
        if scaler.enabled:
            res = scaler.check_and_clip(P.grad, grad_clip, out=clipper.result)
        else:
            res = clipper(P.grad)
    with region("adamw", bytes=P.numel * (4 * 4 + 4 * 4 + P.working.dtype.itemsize), flops=15.0 * P.numel):
        opt.step(lr=lr, grad_scale=res.scale, found_inf=res.found_inf, zero_grad=True)
    scaler.update(res.found_inf)
    return res


class Trainer:
    """Model, optimizer, loss scaler, clipper and data streams for one run.

    ``Trainer(cfg)`` builds everything (or restores it from ``cfg.resume``); ``train_step(lr)`` runs
    one optimizer step and returns a device array ``[loss, grad_norm, found_inf]`` without waiting
    for the GPU; ``evaluate()`` the validation loss (a host float, one sync); ``save()`` a checkpoint;
    ``run()`` the whole loop.
    """

    def __init__(self, cfg: TrainConfig, *, xp=None, corpus: Corpus | None = None):
        xp = xp if xp is not None else select_xp(cfg.device)
        meta = ckpt_model = ckpt_optim = None
        if cfg.resume:
            ckpt_model, meta, ckpt_optim = load_checkpoint(cfg.resume)
            saved = TrainConfig(**{k: v for k, v in meta["train_config"].items()
                                   if k in {f.name for f in fields(TrainConfig)}})
            # what the command line sets explicitly wins; everything else comes from the checkpoint
            over = {k: getattr(cfg, k) for k in RESUME_OVERRIDES if getattr(cfg, k) is not None}
            cfg = replace(saved, **over)
            fast_ok, why = fast_path_available(xp, cfg.dtype, cfg.checkpoint_every) if cfg.fast else (True, "")
            if not fast_ok:
                # the run used the fast step, which this machine cannot run: continue on the book step
                # (same model and state; the losses will differ from an uninterrupted run in the last bits)
                print(f"llmgpu: the checkpointed run used the fast step (--fast), unavailable here: {why}; "
                      "resuming with the book step", file=sys.stderr)
                cfg = replace(cfg, fast=False, graph=False)
        cfg = resolve(cfg, xp)
        self.cfg, self.xp = cfg, xp
        self.policy = Policy(cfg.dtype)
        if xp is np and cfg.cpu_threads != 0:
            blas_threads(cfg.cpu_threads or 1)

        # data
        self.corpus = corpus or load_corpus(cfg.data, val_data=cfg.val_data, val_fraction=cfg.val_fraction)
        if meta is not None:
            mcfg = GPTConfig.from_dict(meta["model_config"])
        else:
            base = GPTConfig.preset(cfg.preset)
            mcfg = replace(base, vocab_size=cfg.vocab_size or self.corpus.vocab_size,
                           block_size=max(base.block_size, cfg.seq), pad_vocab_to=cfg.pad_vocab)
        if cfg.seq > mcfg.block_size:
            raise DataError(f"--seq {cfg.seq} exceeds the model's block size {mcfg.block_size}")
        self.corpus.check_vocab(mcfg.vocab_size)
        self.tokenizer = get_tokenizer(self.corpus.tokenizer)
        self.train_loader = BatchLoader(self.corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, name="training",
                                        vocab_size=mcfg.vocab_size)
        self.stream = DataStream(self.train_loader, xp, async_copy=cfg.async_copy)
        self.val_loader = _val_loader(self.corpus.val, cfg.batch, cfg.seq, mcfg.vocab_size)

        # model, optimizer, precision
        if cfg.fast:
            from .fast_model import FastGPT as model_cls
        else:
            model_cls = GPT
        self.model = model_cls(mcfg, dtype=cfg.dtype, checkpoint_every=cfg.checkpoint_every, xp=xp, seed=cfg.seed,
                         init=meta is None)
        self.params = self.model.params
        self.opt = AdamW(self.params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
        self.scaler = self.policy.make_scaler(xp)
        self.clipper = GradClipper(cfg.grad_clip, xp=xp)
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.total_steps = cfg.steps
        self.budget_fitted = False
        if meta is not None:
            self._restore(ckpt_model, ckpt_optim, meta)
        self.flops_per_step = mcfg.flops_per_token(cfg.seq) * self.tokens_per_step
        self._graph = None  # the captured step (cfg.graph): static inputs, lr on the device
        self._graph_inputs = self._graph_lr = None
        self._graph_warm = False

    @property
    def tokens_per_step(self) -> int:
        c = self.cfg
        return c.batch * c.seq * c.grad_accum

    # ------------------------------------------------------------------ the step

    def train_step(self, lr: float):
        """One optimizer step over ``grad_accum`` micro-batches; no host synchronization.

        Returns a device array ``[mean loss, gradient norm (unscaled, before clipping), found_inf]``.
        With ``cfg.graph`` the first step runs eagerly (it compiles kernels, builds cuBLASLt plans and
        cuDNN graphs), the second is captured into a CUDA graph, and every step from then on copies its
        batches and learning rate into the graph's static inputs and replays it: one launch per step.
        """
        batches = [self.stream.next() for _ in range(self.cfg.grad_accum)]  # on the device already
        if not self.cfg.graph:
            out = self._step_body(batches, lr)
        else:
            out = self._graph_step(batches, lr)
        self.step += 1
        return out

    def _step_body(self, batches, lr):
        """Forward + backward over the micro-batches, unscale + clip, AdamW (+ cast), scaler update."""
        xp, model, P = self.xp, self.model, self.params
        n = len(batches)
        if self.scaler.enabled:
            dloss = self.scaler.scale * np.float32(1.0 / n)  # 0-d device array
        else:
            dloss = 1.0 / n
        loss_sum = None
        for x, y in batches:
            loss = model.forward_backward(x, y, dloss=dloss)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        res = apply_update(P, self.opt, self.scaler, self.clipper, self.cfg.grad_clip, lr)
        mean = loss_sum if n == 1 else loss_sum * np.float32(1.0 / n)
        return xp.stack([mean.astype(np.float32).reshape(()), res.norm, res.found_inf])

    def _graph_step(self, batches, lr):
        xp = self.xp
        if self._graph_inputs is None:  # first step: static buffers, one eager step (the warm-up)
            self._graph_inputs = xp.empty((len(batches), 2) + tuple(batches[0][0].shape), dtype=np.int32)
            self._graph_lr = xp.empty((), dtype=np.float32)
        gin, glr = self._graph_inputs, self._graph_lr
        for j, (x, y) in enumerate(batches):
            gin[j, 0] = x
            gin[j, 1] = y
        glr.fill(lr)
        static = [(gin[j, 0], gin[j, 1]) for j in range(len(batches))]
        if not self._graph_warm:
            self._graph_warm = True
            return self._step_body(static, glr)
        if self._graph is None:
            from .graphs import capture

            xp.get_default_memory_pool().free_all_blocks()  # the eager step's cached blocks: the graph has its own
            self._graph = capture(lambda: self._step_body(static, glr), warmup=0)
        self._graph.replay()
        return self._graph.outputs.copy()  # the graph rewrites its output buffer at every replay

    def lr_at(self, step: int) -> float:
        c = self.cfg
        total = self.total_steps or 10**9
        warm = min(c.warmup, total)
        return lr_at(step, max_lr=c.lr, min_lr=c.lr * c.min_lr_ratio, warmup_steps=warm,
                     total_steps=max(total, warm), kind=c.schedule)

    def evaluate(self, n_batches: int | None = None) -> float | None:
        """Mean validation loss over the first ``eval_batches`` validation batches (the same ones every
        time, so successive values are comparable); one host sync. None without validation data."""
        vl = self.val_loader
        if vl is None:
            return None
        n = min(n_batches or self.cfg.eval_batches, vl.batches_per_epoch())
        vl.reset()
        total = None
        for _ in range(n):
            b = backend.to_device(vl.next_host(), self.xp)
            loss = self.model.loss(b[0], b[1])
            total = loss if total is None else total + loss
        return float(backend.to_numpy(total)) / n

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory=None) -> Path:
        """Checkpoint: weights, AdamW moments and step count, scaler, step, data position, RNG state."""
        d = Path(directory) if directory else Path(self.cfg.out) / "checkpoint"
        sd = self.params.to_dict()
        ost = self.opt.state_dict()
        optim = {**{f"m/{k}": v for k, v in ost["m"].items()}, **{f"v/{k}": v for k, v in ost["v"].items()}}
        meta = {
            "step": self.step,
            "total_steps": self.total_steps,
            "budget_fitted": self.budget_fitted,
            "model_config": self.model.config.as_dict(),
            "dtype": backend.dtype_name(self.model.dtype),
            "tokenizer": self.corpus.tokenizer,
            "train_config": self.cfg.as_dict(),
            "optimizer": {k: v for k, v in ost.items() if k not in ("m", "v")},
            "scaler": self.scaler.state_dict(),
            "data": self.stream.state_dict(),
            "rng": self.rng.bit_generator.state,
            "llmgpu": _version(),
        }
        return save_checkpoint(d, model=sd, optim=optim, meta=meta)

    def _restore(self, model_arrays: dict, optim_arrays: dict | None, meta: dict):
        self.model.load_state_dict(model_arrays)
        if optim_arrays is None:
            raise DataError("the checkpoint holds no optimizer state (optim.npz): cannot resume training from it")
        ost = dict(meta["optimizer"])
        ost["m"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("m/")}
        ost["v"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("v/")}
        self.opt.load_state_dict(ost)
        self.scaler.load_state_dict(meta["scaler"])
        self.stream.load_state_dict(meta["data"])
        self.rng.bit_generator.state = meta["rng"]
        self.step = int(meta["step"])
        # the schedule's length: an explicit --steps, else the one the interrupted run used
        if self.cfg.steps is not None and self.cfg.steps != meta.get("total_steps"):
            self.total_steps, self.budget_fitted = self.cfg.steps, False
        else:
            self.total_steps = meta.get("total_steps")
            self.budget_fitted = bool(meta.get("budget_fitted"))

    # ------------------------------------------------------------------ sampling

    def sample(self, prompt: str | None = None, n_tokens: int | None = None) -> str:
        c = self.cfg
        ids = prompt_ids(self.tokenizer, prompt if prompt is not None else c.prompt)
        out = self.model.generate(ids, c.sample_tokens if n_tokens is None else n_tokens,
                                  temperature=c.temperature, top_k=c.top_k, rng=self.rng)
        return self.tokenizer.decode(out)

    # ------------------------------------------------------------------ the loop

    def run(self, stop_at: int | None = None) -> dict:
        """Train until ``steps`` / ``max_time`` (or ``stop_at``: stop there as if interrupted, keeping the
        schedule of the full run); returns a summary dict (also written to summary.json).

        Ctrl-C stops cleanly too: the steps done so far are logged and checkpointed (``--resume``).
        """
        c, xp = self.cfg, self.xp
        out = Path(c.out)
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "log.jsonl"
        resumed = self.step > 0
        if not resumed and log_path.exists():
            log_path.unlink()
        logf = open(log_path, "a")

        def log(rec):
            logf.write(json.dumps(rec) + "\n")
            logf.flush()

        peak, peak_src = peak_flops(xp, c.dtype)
        mc = self.model.config
        bar = Progress(self.total_steps or 0, enabled=c.progress)
        bar.message(f"llmgpu train: {mc.n_layer} layers, C={mc.n_embd}, {self.model.num_parameters() / 1e6:.2f}M "
                    f"parameters, vocab {mc.vocab_size}, {backend.dtype_name(self.model.dtype)}, batch "
                    f"{c.batch}x{c.seq}x{c.grad_accum}"
                    + (f", activation checkpointing every {c.checkpoint_every}" if c.checkpoint_every else "")
                    + (", chapter 8 fast step" + (" as a CUDA graph" if c.graph else "") if c.fast else "")
                    + f"; {backend.device_info(xp).summary()}")
        bar.message(f"data: {self.corpus.description}; {self.corpus.n_train:,} training / "
                    f"{self.corpus.n_val:,} validation tokens; output: {out}")
        if resumed:
            bar.message(f"resumed from step {self.step}")
        log({"type": "run", "step": self.step, "config": c.as_dict(), "model": mc.as_dict(),
             "parameters": self.model.num_parameters(), "device": backend.device_info(xp).as_dict(),
             "peak_flops": peak, "peak_flops_source": peak_src, "data": self.corpus.description})

        first_val = last_val = None
        if not resumed and c.eval_every:
            first_val = last_val = self.evaluate()
            if first_val is not None:
                log({"type": "val", "step": 0, "val_loss": first_val})
                bar.message(f"step 0: val loss {first_val:.4f}")

        pending: list = []  # (step, lr, device record) since the last sync
        state = {"last_loss": None}

        def flush(t_from, steps_from):
            """The one host sync of a log interval: fetch the records, write the log lines."""
            host = backend.to_numpy(xp.stack([r for _, _, r in pending]))  # waits for the GPU
            now = time.perf_counter()
            tok_s = (self.step - steps_from) * self.tokens_per_step / max(now - t_from, 1e-9)
            mfu = tok_s * self.flops_per_step / self.tokens_per_step / peak
            for (s_, lr_s, _), (loss, norm, inf) in zip(pending, host):
                entry = {"type": "train", "step": s_, "loss": float(loss), "grad_norm": float(norm), "lr": lr_s,
                         "skipped": bool(inf)}
                if s_ == pending[-1][0]:
                    entry.update(tokens_per_s=tok_s, mfu=mfu, time_s=now - t0)
                log(entry)
            state["last_loss"] = float(host[-1][0])
            pending.clear()
            return now, tok_s, mfu

        t0 = time.perf_counter()
        t_last, steps_last = t0, self.step
        probe_start = t0
        # a time-bounded run fits its schedule to the clock; a resumed one keeps the saved schedule
        refit = c.steps is None and c.max_time is not None and not resumed
        stop_reason = "steps"
        try:
            while True:
                if self.total_steps is not None and self.step >= self.total_steps:
                    break
                if stop_at is not None and self.step >= stop_at:
                    stop_reason = "stop_at"
                    break
                if c.max_time is not None and time.perf_counter() - t0 >= c.max_time:
                    stop_reason = "max_time"
                    break
                lr = self.lr_at(self.step)
                rec = self.train_step(lr)
                pending.append((self.step, lr, rec))
                due_eval = bool(c.eval_every) and self.step % c.eval_every == 0
                due_save = bool(c.save_every) and self.step % c.save_every == 0
                due_probe = refit and self.step in (1, 1 + c.time_budget_probe)
                last = (self.total_steps is not None and self.step >= self.total_steps) or self.step == stop_at
                if len(pending) >= c.log_every or due_eval or due_save or due_probe or last:
                    now, tok_s, mfu = flush(t_last, steps_last)
                    t_last, steps_last = now, self.step
                    if due_probe and self.step == 1:  # step 1 includes compilation and warm-up: time from here
                        probe_start = now
                    elif refit and self.step > 1:
                        # seconds per step so far (evaluations included) -> the schedule length that ends
                        # when max_time runs out; refitted at every sync, so a machine that slows down or
                        # speeds up still gets a complete schedule
                        announce = not self.budget_fitted
                        self._fit_budget((now - probe_start) / (self.step - 1), now - t0)
                        bar.total = self.total_steps
                        if announce:
                            bar.message(f"time budget {c.max_time:.0f} s: about {self.total_steps} steps")
                    eta = None
                    if self.total_steps and self.step > 1:
                        eta = (now - probe_start) / (self.step - 1) * (self.total_steps - self.step)
                    bar.update(self.step, loss=state["last_loss"], val=last_val, lr=lr, tok_s=tok_s, mfu=mfu,
                               elapsed=now - t0, eta=eta)
                    if not math.isfinite(state["last_loss"]) and not self.scaler.enabled:
                        bar.message(f"step {self.step}: the loss is {state['last_loss']}; stopping")
                        stop_reason = "diverged"
                        break
                if due_eval:
                    last_val = self.evaluate()
                    if last_val is not None:
                        log({"type": "val", "step": self.step, "val_loss": last_val})
                    t_last = time.perf_counter()  # evaluation time does not count against tokens/s
                if due_save:
                    self.save()
                    t_last = time.perf_counter()
        except KeyboardInterrupt:
            stop_reason = "interrupted"
            bar.message(f"interrupted at step {self.step}: saving a checkpoint (continue with --resume {out})")
        if pending:  # stopped between syncs
            flush(t_last, steps_last)
        elapsed = time.perf_counter() - t0
        if c.eval_every and stop_reason != "interrupted" and (last_val is None or self.step % c.eval_every):
            v = self.evaluate()
            if v is not None:
                last_val = v
                log({"type": "val", "step": self.step, "val_loss": v})
        bar.close()
        ckpt = self.save()
        summary = {"steps": self.step, "stop_reason": stop_reason, "train_time_s": elapsed,
                   "first_val_loss": first_val, "val_loss": last_val, "train_loss": state["last_loss"],
                   "tokens": self.step * self.tokens_per_step, "checkpoint": str(ckpt), "out": str(out)}
        final = stop_reason not in ("stop_at", "interrupted")
        if c.plot and final:
            try:
                summary["plot"] = str(plot_losses(log_path, out / "loss.png"))
            except Exception as e:  # a plot must never lose a finished run
                bar.message(f"(no loss plot: {type(e).__name__}: {e})")
        if c.sample_tokens and final:
            text = self.sample()
            (out / "samples.txt").write_text(text + "\n")
            summary["sample"] = text
        log({"type": "end", **{k: v for k, v in summary.items() if k != "sample"}})
        logf.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        bar.message(f"done: {self.step} steps in {elapsed:.0f} s; "
                    + (f"val loss {first_val:.3f} -> {last_val:.3f}; " if first_val is not None and last_val
                       is not None else (f"val loss {last_val:.3f}; " if last_val is not None else ""))
                    + f"checkpoint {ckpt}")
        return summary

    def _fit_budget(self, per_step: float, elapsed: float):
        """Set total_steps from the measured seconds per step so the schedule ends when max_time runs out."""
        c = self.cfg
        if not self.budget_fitted and c.eval_every:  # first fit: evaluations not yet in the measurement
            per_step *= 1.0 + c.eval_batches / (3.0 * c.eval_every * c.grad_accum)
        remaining = 0.97 * c.max_time - elapsed
        self.total_steps = self.step + max(0, int(remaining / max(per_step, 1e-9)))  # == step: stop now
        self.budget_fitted = True


def _val_loader(val_arrays, batch, seq, vocab_size):
    if not val_arrays:
        return None
    n = sum(max(0, (a.size - 1) // seq) for a in val_arrays if a.size > seq)
    if n == 0:
        return None
    return BatchLoader(val_arrays, min(batch, n), seq, shuffle=False, name="validation", vocab_size=vocab_size)


def prompt_ids(tokenizer, prompt: str | None) -> list[int]:
    """Token ids of a prompt. ``None``: a default ('def ' for bytes, <|endoftext|> for GPT-2).
    A GPT-2 prompt may also be given as comma-separated ids ('ids:50256,464')."""
    if prompt is None:
        return tokenizer.encode("def ") if tokenizer.name == "bytes" else [50256]
    if prompt.startswith("ids:"):
        try:
            return [int(t) for t in prompt[4:].split(",") if t.strip()]
        except ValueError:
            raise DataError(f"--prompt ids:... must be comma-separated integers, got {prompt!r}") from None
    ids = tokenizer.encode(prompt)
    if not ids:
        raise DataError("the prompt is empty")
    return ids


def _version() -> str:
    try:
        from . import __version__

        return __version__
    except ImportError:  # pragma: no cover
        return "?"


# --------------------------------------------------------------------------- entry points


def default_out_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def train(cfg: TrainConfig | None = None, **kwargs) -> dict:
    """Run a training job; returns the summary (see ``Trainer.run``)."""
    cfg = replace(cfg or TrainConfig(), **kwargs)
    if cfg.out is None and not cfg.resume:
        cfg = replace(cfg, out=default_out_dir())
    return Trainer(cfg).run()


def read_log(path) -> list[dict]:
    """The records of a JSON-lines training log."""
    p = Path(path)
    if p.is_dir():
        p = p / "log.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot_losses(log_path, png_path=None, ax=None):
    """Training loss per step (and a moving average) with the validation points; saves a PNG."""
    recs = read_log(log_path)
    tr = [(r["step"], r["loss"]) for r in recs if r.get("type") == "train"]
    va = [(r["step"], r["val_loss"]) for r in recs if r.get("type") == "val"]
    import matplotlib

    if png_path is not None and ax is None:
        matplotlib.use("Agg", force=False) if "matplotlib.pyplot" not in sys.modules else None
    import matplotlib.pyplot as plt

    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        s, l_ = np.array(tr, dtype=float).T
        ax.plot(s, l_, color="#4c72b0", alpha=0.35, lw=1, label="train loss (per step)")
        w = max(1, len(l_) // 50)
        if w > 1:
            sm = np.convolve(l_, np.ones(w) / w, mode="valid")
            ax.plot(s[w - 1:], sm, color="#4c72b0", lw=2, label=f"train loss ({w}-step mean)")
    if va:
        s, v = np.array(va, dtype=float).T
        ax.plot(s, v, "o-", color="#c44e52", lw=2, ms=4, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    run = next((r for r in recs if r.get("type") == "run"), None)
    title = "training run"
    if run is not None and "config" in run:
        c = run["config"]
        title = (f"{run.get('parameters', 0) / 1e6:.1f}M parameters, {c.get('dtype')}, batch "
                 f"{c.get('batch')}x{c.get('seq')}x{c.get('grad_accum')}")
        if va:
            title += f": validation loss {va[0][1]:.2f} -> {va[-1][1]:.2f}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    if png_path is not None:
        ax.figure.tight_layout()
        ax.figure.savefig(png_path, dpi=120)
        if own:
            plt.close(ax.figure)
        return Path(png_path)
    return ax
