"""``TrainConfig``: every setting of a training run, its default, its check, and its command-line flag.

This is the only place training defaults are written. ``llmgpu train``'s flags are generated from the
fields (``metadata``: help text, group, flag name), and ``llmgpu bench`` and the chapters take their
optimizer settings from here too. ``None`` fields get a default that depends on the device
(``CPU_DEFAULTS`` / ``GPU_DEFAULTS``; a run that starts from trained weights, ``--init``, takes
``FINETUNE_DEFAULTS`` first); ``resolve(cfg, xp)`` fills them in and validates everything, raising
``ConfigError`` with one line naming the flag.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from .. import backend
from ..amp import Policy
from ..checks import check_field_types
from ..gemm import cublaslt
from ..model.family import ALL_PRESETS, ARCHS, arch_of_preset, presets
from ..model.options import FLASH_KERNELS, FastOptions, fp8_hardware_reason, fp8_setting_reason
from ..ops import cudnn_attention, flash_attention
from ..ops.fp8 import RECIPES as FP8_RECIPES

FP8 = "fp8"  # --dtype fp8: bf16 storage and compute, FP8 GEMMs where FastOptions.fp8 puts them (FP8_STORAGE)
FP8_STORAGE = "bf16"


class ConfigError(ValueError):
    """A setting that cannot work (printed by the CLI as one line, exit code 2)."""


def _opt(default, help: str, group: str, **cli):  # noqa: A002 - argparse's word
    """A field with its command-line description: ``cli`` may hold ``flag`` (default: --field-name),
    ``metavar``, ``choices``, ``cli=False`` (not a flag), ``negative`` (an extra --no-... style flag)."""
    return field(default=default, metadata={"help": help, "group": group, **cli})


# a run that starts from trained weights (--init): a tenth of the GPU peak learning rate, a short warm-up
# (nanoGPT fine-tunes GPT-2 at 3e-5, Hugging Face's examples at 5e-5; 1e-4 suits short runs on small data)
FINETUNE_DEFAULTS = dict(lr=1e-4, warmup=10)


@dataclass
class TrainConfig:
    """Everything a run needs. ``None`` fields get device-dependent defaults (``resolve``)."""

    # model
    arch: str = _opt("gpt2", "model family: gpt2, or llama (RMSNorm, RoPE, SwiGLU, grouped-query attention; book "
                     "and fast step, as gpt2)", "model", choices=list(ARCHS))
    preset: str | None = _opt(None, "model size of the --arch family (default: tiny on CPU, gpt2 on GPU; with --arch "
                              "llama: llama-tiny on CPU, smollm-135m on GPU)", "model", choices=list(ALL_PRESETS))
    dtype: str | None = _opt(None, "compute precision (default: bf16 on GPU, fp32 on CPU); master weights are "
                             "always fp32; fp8: bf16 with the QKV and MLP GEMMs in FP8 (GPT-2's fast step on a GPU "
                             "with FP8 tensor cores)", "model", choices=["bf16", "fp16", "fp32", FP8])
    fp8_recipe: str | None = _opt(None, "scaling of --dtype fp8's GEMMs: current (each tensor's own amax, this "
                                  "step) or delayed (the amax history of the last steps; one read per cast, the "
                                  "faster: chapter 5b) (default current)", "model",
                                  choices=list(FP8_RECIPES))
    fp8_history: int | None = _opt(None, "steps of amax the delayed recipe keeps per tensor (default "
                                   f"{FastOptions.fp8_history})", "model", metavar="N")
    checkpoint_every: int = _opt(0, "activation checkpointing: keep every K-th block input, recompute the rest "
                                 "(0 = off)", "model", metavar="K")
    vocab_size: int | None = _opt(None, "model vocabulary (default: the data's: 256 for bytes, 50257 for GPT-2 "
                                  "shards)", "model")
    pad_vocab: int | None = _opt(None, "pad the vocabulary to a multiple of M (default 64 on GPU, off on CPU)",
                                 "model", metavar="M")
    fast: bool | None = _opt(None, "the chapter 8 model: cuBLASLt GEMMs with fused epilogues, fused "
                             "residual+LayerNorm, flash attention (default: on when the GPU, bf16/fp16 and the "
                             "'fast' extra allow it)", "model")
    graph: bool | None = _opt(None, "replay each step as one CUDA graph (default: with --fast)", "model")
    attention_kernel: str = _opt("auto", "flash attention of the fast model: ours (chapter 2b), cudnn, or auto: "
                                 "whichever is faster here, timed once per shape and kept in the checkpoint, so a "
                                 "resumed run runs the same kernels", "model", choices=list(FLASH_KERNELS))
    block_size: int | None = _opt(None, "context length, the rows of the position embedding (default: the "
                                  "preset's; --seq may not exceed it)", "model")
    init: str | None = _opt(None, "start a new run from trained weights: a Hugging Face GPT-2 directory (config.json "
                            "+ model.safetensors) or an llmgpu run; the model's shape, vocabulary and block size are "
                            "the weights', with fine-tuning defaults", "model", metavar="PATH")
    # data
    data: str | None = _opt(None, "'stdlib' (embedded corpus, default), a text file, an llm.c .bin shard, a "
                            "directory or a glob of shards", "data")
    val_data: str | None = _opt(None, "validation data (default: *val* shards, else the last --val-fraction)", "data")
    val_fraction: float = _opt(0.05, "held-out fraction of the training data when there is no --val-data", "data")
    batch: int | None = _opt(None, "sequences per micro-batch (default 16 on GPU, 8 on CPU)", "data")
    seq: int | None = _opt(None, "tokens per sequence (default 1024 on GPU, 128 on CPU, at most the block size)",
                           "data")
    grad_accum: int = _opt(1, "micro-batches per optimizer step", "data", metavar="N")
    async_copy: bool = _opt(True, "copy the next batch to the GPU on a side stream during the step", "data")
    # optimization
    steps: int | None = _opt(None, "optimizer steps (default: as many as fit in --max-time)", "optimization")
    max_time: float | None = _opt(None, "training time limit (default 180 on CPU, 300 on GPU when --steps is not "
                                  "given; several ranks read it at the log syncs, --log-every)", "optimization",
                                  metavar="SECONDS")
    lr: float | None = _opt(None, "peak learning rate (default 3e-3 on CPU, 6e-4 on GPU, "
                            f"{FINETUNE_DEFAULTS['lr']:.0e} with --init)".replace("e-0", "e-"), "optimization")
    min_lr_ratio: float = _opt(0.1, "final learning rate as a fraction of the peak", "optimization")
    warmup: int | None = _opt(None, "linear warm-up steps (default 20 on CPU, 50 on GPU, "
                              f"{FINETUNE_DEFAULTS['warmup']} with --init)", "optimization")
    schedule: str = _opt("cosine", "learning-rate schedule after the warm-up", "optimization",
                         choices=["cosine", "linear", "constant"])
    weight_decay: float = _opt(0.1, "AdamW weight decay (matrices only; biases and LayerNorm get none)",
                               "optimization")
    beta1: float = _opt(0.9, "AdamW beta1", "optimization")
    beta2: float = _opt(0.95, "AdamW beta2", "optimization")
    eps: float = _opt(1e-8, "AdamW epsilon", "optimization")
    grad_clip: float = _opt(1.0, "global-norm clipping (0 = off)", "optimization")
    seed: int = _opt(1337, "seed of the initialization, the data order and the samples", "optimization")
    # distributed (chapter 9)
    nproc: int = _opt(1, "start N local ranks (one per GPU, or N CPU ranks through mpiexec) and wait for them; "
                      "under torchrun, mpiexec or srun leave it at 1", "distributed", metavar="N")
    zero: int = _opt(0, "ZeRO stage: 0 = every rank keeps the whole optimizer state, 1 = AdamW moments and master "
                     "weights sharded over the ranks, 2 = the reduced gradients too", "distributed", choices=[0, 1, 2])
    dist_backend: str = _opt("auto", "collectives: auto (NCCL on GPUs, MPI on CPUs, none for one rank); nccl or mpi "
                             "use that engine even for one rank", "distributed", choices=["auto", "nccl", "mpi"])
    dist_timeout: float = _opt(300.0, "seconds a rank waits for the others before stopping with an error",
                               "distributed", metavar="SECONDS")
    # run
    out: str | None = _opt(None, "output directory (default runs/<timestamp>; with --resume: the resumed run's)",
                           "run")
    overwrite: bool = _opt(False, "replace the run already in --out (default: refuse)", "run")
    resume: str | None = _opt(None, "continue the run in DIR (its checkpoint/), writing to DIR", "run", metavar="DIR")
    eval_every: int | None = _opt(None, "validation every N steps (default 25 on CPU, 100 on GPU; 0 = off)", "run",
                                  metavar="N")
    eval_batches: int = _opt(8, "validation batches per evaluation", "run")
    log_every: int = _opt(10, "steps between host synchronizations / log lines", "run")
    save_every: int = _opt(0, "checkpoint every N steps (0: only at the end)", "run", metavar="N")
    max_skipped_steps: int = _opt(25, "stop when N steps in a row are skipped for inf/nan gradients (0 = never)",
                                  "run", metavar="N")
    device: str = _opt("auto", "where to train", "run", choices=["auto", "cpu", "gpu"])
    cpu_threads: int | None = _opt(None, "BLAS threads on the CPU backend (default 1: small GEMMs; 0: the BLAS "
                                   "default)", "run", metavar="N")
    sample_tokens: int = _opt(200, "tokens of the sample printed at the end (0 = none)", "run")
    prompt: str | None = _opt(None, "prompt of the sample printed at the end", "run")
    temperature: float = _opt(0.8, "sampling temperature of that sample", "run")
    top_k: int | None = _opt(40, "sample from the K most likely tokens", "run", metavar="K")
    progress: bool = _opt(True, "progress output", "run")
    plot: bool = _opt(True, "write loss.png at the end", "run")
    time_budget_probe: int = _opt(5, "steps timed to fit the schedule to --max-time", "run", cli=False)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """A config from a saved dict (a checkpoint's), ignoring keys this version does not know."""
        names = {f.name for f in fields(cls)}
        return check_field_types(cls(**{k: v for k, v in d.items() if k in names}), flag_of)  # TypeError: damaged


# what a resumed run may take from the command line: its length and schedule, its cadences, the machine's
# settings (ranks, ZeRO stage, and --grad-accum, so that a run moved to another number of ranks can keep its
# global batch; the step's kernels: --fast, --graph, --attention-kernel, whose change costs bit-exactness) and the
# presentation; everything else (model, data, optimizer, seed) is the checkpoint's
RESUME_OVERRIDES = ("steps", "max_time", "lr", "min_lr_ratio", "warmup", "schedule", "eval_every", "eval_batches",
                    "log_every", "save_every", "max_skipped_steps", "out", "overwrite", "progress", "plot",
                    "sample_tokens", "prompt", "temperature", "top_k", "device", "cpu_threads", "async_copy", "fast",
                    "graph", "attention_kernel", "resume", "nproc", "zero", "dist_backend", "dist_timeout",
                    "grad_accum")
# taken from the command line on resume even when not given: this invocation's, never the saved run's
_RESUME_ALWAYS = ("resume", "overwrite", "device", "async_copy", "nproc", "dist_backend", "dist_timeout")


def flag_of(name: str) -> str:
    """The command-line flag of a TrainConfig field."""
    f = {f.name: f for f in fields(TrainConfig)}[name]
    return f.metadata.get("flag", "--" + name.replace("_", "-"))


def explicit_fields(cfg: TrainConfig) -> set[str]:
    """The fields of ``cfg`` that differ from TrainConfig's defaults (what a caller of the API set)."""
    default = TrainConfig()
    return {f.name for f in fields(TrainConfig) if getattr(cfg, f.name) != getattr(default, f.name)}


def resume_config(saved: TrainConfig, given: TrainConfig, explicit=None) -> TrainConfig:
    """The configuration of a resumed run: the checkpoint's (``saved``), with what ``given`` sets of
    ``RESUME_OVERRIDES``. ``explicit``: the fields the user set (the CLI knows); None: those of ``given``
    that differ from the defaults. Any other field set to a value the run does not have is a ConfigError."""
    explicit = explicit_fields(given) if explicit is None else set(explicit)
    bad = [k for k in sorted(explicit) if k not in RESUME_OVERRIDES and getattr(given, k) != getattr(saved, k)]
    if bad:
        what = ", ".join(f"{flag_of(k)} {getattr(given, k)} (the run has "
                         f"{'the default' if getattr(saved, k) is None else getattr(saved, k)})" for k in bad)
        accepted = ", ".join(flag_of(k) for k in RESUME_OVERRIDES if k != "resume")
        raise ConfigError(f"a resumed run keeps its settings: {what} cannot change; --resume accepts {accepted}")
    over = {k: getattr(given, k) for k in RESUME_OVERRIDES if k in explicit or k in _RESUME_ALWAYS}
    return replace(saved, **over)


CPU_DEFAULTS = dict(preset="tiny", batch=8, seq=128, dtype="fp32", lr=3e-3, warmup=20, eval_every=25,
                    max_time=180.0, pad_vocab=0)
GPU_DEFAULTS = dict(preset="gpt2", batch=16, seq=1024, dtype="bf16", lr=6e-4, warmup=50, eval_every=100,
                    max_time=300.0, pad_vocab=64)
# the default preset of each family other than GPT-2 (whose is the defaults' above), (CPU, GPU): a size like
# GPT-2's for the same device; either takes the data's vocabulary (plan.plan_model), as GPT-2's presets do
ARCH_DEFAULT_PRESETS = {"llama": ("llama-tiny", "smollm-135m")}


def compute_dtype(dtype: str) -> str:
    """The dtype the model is built in for ``--dtype``: bf16 for fp8 (its FP8 GEMMs are FastOptions'), else itself."""
    return FP8_STORAGE if dtype == FP8 else dtype


def fast_options(cfg: TrainConfig) -> FastOptions:
    """The fast step's options of a resolved run: its attention kernel, and ``--dtype fp8``'s recipe."""
    history = {"fp8_history": cfg.fp8_history} if cfg.fp8_history is not None else {}
    return FastOptions(cfg.attention_kernel, fp8=cfg.fp8_recipe if cfg.dtype == FP8 else "off", **history)


def fp8_unavailable_reason(xp) -> str | None:
    """Why this device has no FP8 GEMMs (one line), or None: a GPU with FP8 tensor cores."""
    info = None if xp is np else backend.device_info(xp)
    return fp8_hardware_reason(info and info.compute_capability, info.name if info else "this GPU")


def select_xp(device: str = "auto"):
    """NumPy or CuPy for ``--device`` (``backend.select_xp``), a bad choice as a ``ConfigError``."""
    try:
        return backend.select_xp(device)
    except backend.DeviceSettingError:
        raise  # about LLMGPU_DEVICE, not --device: it says so itself
    except backend.GPUUnavailableError as e:  # --device gpu, or LLMGPU_DEVICE=gpu (which its text names)
        raise ConfigError(f"--device gpu: {e}" if device == "gpu" else str(e)) from None
    except ValueError as e:
        raise ConfigError(f"--device: {e}") from None


def resolve(cfg: TrainConfig, xp) -> TrainConfig:
    """Fill the ``None`` fields with the defaults of the device, and validate."""
    d = CPU_DEFAULTS if xp is np else GPU_DEFAULTS
    if cfg.arch in ARCH_DEFAULT_PRESETS:
        d = {**d, "preset": ARCH_DEFAULT_PRESETS[cfg.arch][xp is not np]}
    if cfg.init:  # fine-tuning: the model is the weights' (no preset), the schedule gentler
        d = {**{k: v for k, v in d.items() if k != "preset"}, **FINETUNE_DEFAULTS}
    upd = {}
    for k, v in d.items():
        if getattr(cfg, k) is None:
            if k == "max_time" and cfg.steps is not None:
                continue
            preset = cfg.preset or d.get("preset")
            if k == "seq" and (preset in presets_of(cfg.arch) or cfg.block_size):  # a default never outgrows the model
                v = min(v, model_block_size(replace(cfg, preset=preset)))
            upd[k] = v
    if cfg.dtype == FP8 and cfg.fp8_recipe is None:
        upd["fp8_recipe"] = FP8_RECIPES[0]
    cfg = replace(cfg, **upd)
    validate(cfg)
    fast, why = fast_path_available(xp, compute_dtype(cfg.dtype), cfg.checkpoint_every)
    if cfg.dtype == FP8:
        check_fp8(cfg, xp, fast, why)
    if cfg.fast and not fast:
        raise ConfigError(f"--fast: {why}")
    if cfg.fast is None:
        cfg = replace(cfg, fast=fast)
    if cfg.graph and not cfg.fast:
        raise ConfigError("--graph needs the fast model (--fast): CuPy's cuBLAS calls of the book model cannot be "
                          "captured into a CUDA graph")
    if cfg.graph is None:
        cfg = replace(cfg, graph=bool(cfg.fast))
    if cfg.fast and cfg.attention_kernel == "cudnn" and (why := cudnn_attention.unavailable_reason()):
        raise ConfigError(f"--attention-kernel cudnn: {why}")
    return cfg


def check_fp8(cfg: TrainConfig, xp, fast: bool, why: str):
    """``--dtype fp8`` runs in the fast step on a GPU with FP8 tensor cores, or is refused: never bf16 instead."""
    if cfg.fast is False:
        raise ConfigError("--dtype fp8 runs in the fast step only: drop --no-fast")
    if not fast:
        raise ConfigError(f"--dtype fp8 runs in the fast step only, unavailable here: {why}")
    if reason := fp8_unavailable_reason(xp):
        raise ConfigError(f"--dtype fp8: {reason}")


def model_block_size(cfg: TrainConfig) -> int:
    """The context length of the model ``cfg`` describes: ``--block-size``, else the preset's."""
    return cfg.block_size or presets_of(cfg.arch)[cfg.preset].block_size


def presets_of(arch: str) -> dict:
    """The presets of ``--arch`` (none for an unknown family: ``validate`` names it)."""
    return presets(arch) if arch in ARCHS else {}


def fast_path_available(xp, dtype, checkpoint_every: int = 0) -> tuple[bool, str]:
    """(whether the fast step, ``FastGPT`` or ``FastLlama``, can train here, why not): a GPU, bf16/fp16, the
    ``fast`` extra. ``checkpoint_every`` is accepted for the callers' sake: the fast model checkpoints too."""
    if xp is np:
        return False, "the fast model is a GPU path (cuBLASLt, cuDNN); on the CPU the book model runs"
    if backend.resolve_dtype(dtype) not in (backend.bfloat16, backend.float16):
        return False, "the fast model's flash attention takes bf16 or fp16 (--dtype)"
    for mod in (cublaslt, flash_attention):
        why = mod.unavailable_reason()
        if why:
            return False, why
    return True, ""


def validate(cfg: TrainConfig):
    """Every setting in range, or a ``ConfigError`` naming its flag (defaults already resolved)."""
    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)

    def finite(x):
        return isinstance(x, (int, float)) and math.isfinite(x)

    check_field_types(cfg, flag_of, ConfigError)  # --steps 2.5 is refused, not rounded
    need(cfg.arch in ARCHS, f"--arch must be one of {', '.join(ARCHS)}, got {cfg.arch!r}")
    if cfg.init:  # the model is the weights' (pretrained.init_config sets the block size)
        need(cfg.preset is None, f"--init takes the model's shape from its weights: drop --preset {cfg.preset}")
        need(cfg.block_size is not None, "--init: the block size comes from the weights (pretrained.init_config)")
    else:
        valid = ", ".join(presets_of(cfg.arch))
        other = arch_of_preset(cfg.preset) if isinstance(cfg.preset, str) else None
        need(other is None or other == cfg.arch, f"--preset {cfg.preset} is a {other} preset, not a {cfg.arch} "
             f"one: give --arch {other}, or one of the {cfg.arch} presets: {valid}")
        need(cfg.preset in presets_of(cfg.arch), f"unknown preset {cfg.preset!r}; choose one of {valid}")
    need(cfg.steps is None or cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}")
    need(cfg.max_time is None or (finite(cfg.max_time) and cfg.max_time > 0),
         f"--max-time must be a positive number, got {cfg.max_time}")
    need(cfg.batch >= 1, f"--batch must be >= 1, got {cfg.batch}")
    need(cfg.seq >= 1, f"--seq must be >= 1, got {cfg.seq}")
    need(cfg.block_size is None or cfg.block_size >= 1, f"--block-size must be >= 1, got {cfg.block_size}")
    block = model_block_size(cfg)
    need(cfg.seq <= block, f"--seq {cfg.seq} exceeds the model's block size {block} "
         + ("(--block-size)" if cfg.block_size else f"(the {cfg.preset} preset's)")
         + f": give --block-size {cfg.seq} for a model with a longer context, or a smaller --seq")
    need(cfg.grad_accum >= 1, f"--grad-accum must be >= 1, got {cfg.grad_accum}")
    need(cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
    need(finite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive number, got {cfg.lr}")
    need(cfg.warmup >= 0, f"--warmup must be >= 0, got {cfg.warmup}")
    need(cfg.eval_every >= 0, f"--eval-every must be >= 0, got {cfg.eval_every}")
    need(cfg.log_every >= 1, f"--log-every must be >= 1, got {cfg.log_every}")
    need(cfg.save_every >= 0, f"--save-every must be >= 0, got {cfg.save_every}")
    need(cfg.max_skipped_steps >= 0, f"--max-skipped-steps must be >= 0, got {cfg.max_skipped_steps}")
    need(finite(cfg.grad_clip) and cfg.grad_clip >= 0, f"--grad-clip must be >= 0, got {cfg.grad_clip}")
    need(finite(cfg.weight_decay) and cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    need(finite(cfg.beta1) and 0 <= cfg.beta1 < 1, f"--beta1 must be in [0, 1), got {cfg.beta1}")
    need(finite(cfg.beta2) and 0 <= cfg.beta2 < 1, f"--beta2 must be in [0, 1), got {cfg.beta2}")
    need(finite(cfg.eps) and cfg.eps > 0, f"--eps must be a positive number, got {cfg.eps}")
    need(finite(cfg.min_lr_ratio) and 0 <= cfg.min_lr_ratio <= 1,
         f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    need(finite(cfg.val_fraction) and 0 <= cfg.val_fraction < 1,
         f"--val-fraction must be in [0, 1), got {cfg.val_fraction}")
    need(cfg.eval_batches >= 1, f"--eval-batches must be >= 1, got {cfg.eval_batches}")
    need(cfg.vocab_size is None or cfg.vocab_size >= 2, f"--vocab-size must be >= 2, got {cfg.vocab_size}")
    need(cfg.pad_vocab >= 0, f"--pad-vocab must be >= 0, got {cfg.pad_vocab}")
    need(cfg.cpu_threads is None or cfg.cpu_threads >= 0, f"--cpu-threads must be >= 0, got {cfg.cpu_threads}")
    need(cfg.sample_tokens >= 0, f"--sample-tokens must be >= 0, got {cfg.sample_tokens}")
    need(finite(cfg.temperature) and cfg.temperature >= 0, f"--temperature must be >= 0, got {cfg.temperature}")
    need(cfg.top_k is None or cfg.top_k >= 1, f"--top-k must be >= 1, got {cfg.top_k}")
    need(cfg.seed >= 0, f"--seed must be >= 0, got {cfg.seed}")
    need(cfg.time_budget_probe >= 1, f"time_budget_probe must be >= 1, got {cfg.time_budget_probe}")
    need(cfg.nproc >= 1, f"--nproc must be >= 1, got {cfg.nproc}")
    need(cfg.zero in (0, 1, 2), f"--zero must be 0, 1 or 2, got {cfg.zero}")
    need(cfg.dist_backend in ("auto", "nccl", "mpi"), f"--dist-backend must be auto, nccl or mpi, got "
         f"{cfg.dist_backend!r}")
    need(finite(cfg.dist_timeout) and cfg.dist_timeout > 0, f"--dist-timeout must be positive, got {cfg.dist_timeout}")
    need(cfg.attention_kernel in FLASH_KERNELS, f"--attention-kernel must be one of "
         f"{', '.join(FLASH_KERNELS)}, got {cfg.attention_kernel!r}")
    need(cfg.schedule in ("cosine", "linear", "constant"),
         f"--schedule must be cosine, linear or constant, got {cfg.schedule!r}")
    try:
        Policy(compute_dtype(cfg.dtype))
    except ValueError:
        raise ConfigError(f"--dtype must be bf16, fp16, fp32 or fp8, got {cfg.dtype!r}") from None
    if cfg.dtype == FP8 and (why := fp8_setting_reason(cfg.arch, FP8_STORAGE)):  # the GPT-2 family's fast step
        raise ConfigError(f"--dtype fp8: {why}")
    need(cfg.fp8_recipe is None or cfg.fp8_recipe in FP8_RECIPES,
         f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {cfg.fp8_recipe!r}")
    need(cfg.fp8_recipe is None or cfg.dtype == FP8, f"--fp8-recipe {cfg.fp8_recipe} sets the scaling of --dtype "
         f"fp8's GEMMs; this run's --dtype is {cfg.dtype}")
    if cfg.fp8_history is not None:
        need(cfg.fp8_history >= 1, f"--fp8-history must be >= 1, got {cfg.fp8_history}")
        need(cfg.fp8_recipe == "delayed", "--fp8-history sets the amax history of --dtype fp8 --fp8-recipe delayed; "
             f"this run's is {'--fp8-recipe ' + cfg.fp8_recipe if cfg.fp8_recipe else '--dtype ' + str(cfg.dtype)}")


__all__ = ["ARCH_DEFAULT_PRESETS", "CPU_DEFAULTS", "FP8", "FP8_RECIPES", "FP8_STORAGE", "GPU_DEFAULTS",
           "RESUME_OVERRIDES", "ConfigError", "TrainConfig", "check_fp8", "compute_dtype", "explicit_fields",
           "fast_options", "fast_path_available", "flag_of", "fp8_unavailable_reason", "model_block_size",
           "presets_of", "resolve", "resume_config", "select_xp", "validate", "FINETUNE_DEFAULTS"]
