"""Planning a run (chapter 7): what the run will be, decided from the configuration before anything is built.

``Trainer`` (``trainer.py``) plans, then builds. The plan is pure: it reads the configuration, the saved run it
continues (``SavedRun``: its checkpoint's ``meta.json``), the configuration of ``--init``'s weights and two facts
of the data (its vocabulary and tokenizer), and returns a ``RunPlan``: the effective configuration, where the run
writes, the model's configuration and the notes (one line for each thing the run does differently from what was
asked). It writes no file, allocates nothing and needs no GPU, so tests plan runs that could never be built here
(``tests/test_plan.py``). In order:

    resume merge   the checkpoint's configuration, with what this command may change (``config.resume_config``)
    fast path      a run saved with --fast, resumed where the fast step cannot run, continues on the book step
    resolve        the device's defaults filled in, every setting validated (``config.resolve``); a family without a
                   fast step (--arch llama) runs the book step, with a note where GPT-2 would have run the fast one
    model          the checkpoint's model, the pretrained weights' (``--init``), or the --arch family's preset with
                   the data's vocabulary (``plan_model``, once the data is known): a ``GPTConfig`` or ``LlamaConfig``
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..model import GPTConfig, LlamaConfig
from ..model.family import config_from_dict, presets
from .checkpoint import META_FILE, CheckpointError
from .config import (
    FP8,
    ConfigError,
    TrainConfig,
    compute_dtype,
    explicit_fields,
    fast_path_available,
    flag_of,
    model_block_size,
    resolve,
    resume_config,
)
from .rundir import default_out_dir, resume_target

ModelConfig = GPTConfig | LlamaConfig  # a model of any family (model/family.py)


@dataclass(frozen=True)
class SavedRun:
    """What a checkpoint says about the run it belongs to (its ``meta.json``): read before planning a resume."""

    directory: Path  # the checkpoint directory
    meta: dict
    train_config: TrainConfig  # with the model's block size
    model_config: ModelConfig  # of the family its "arch" names (GPT-2 without one)
    world_size: int

    @classmethod
    def from_meta(cls, directory, meta: dict) -> SavedRun:
        """The saved run of ``meta``, or a ``CheckpointError`` naming ``directory``'s meta file."""
        try:
            model = config_from_dict(meta["model_config"])
            # the model's family is the train config's too (a checkpoint from before --arch has none: GPT-2)
            train = replace(TrainConfig.from_dict(meta["train_config"]), block_size=model.block_size, arch=model.arch)
            world = meta.get("world_size", 1)
            if isinstance(world, bool) or not isinstance(world, int) or world < 1:
                raise ValueError(f"world_size {world!r} is not a positive integer")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{Path(directory) / META_FILE}: no usable training configuration "
                                  f"({type(e).__name__}: {e})") from None
        return cls(Path(directory), meta, train, model, world)

    def global_batch(self) -> int:
        """Tokens per optimizer step of the saved run (over all its ranks)."""
        c = self.train_config
        return c.batch * c.seq * c.grad_accum * self.world_size


@dataclass(frozen=True)
class RunPlan:
    """A run, decided: ``cfg`` (every default filled in), where it writes (``out``; ``forked``: a resumed run
    writing to a new directory, ``fork_from`` the run directory it came from), ``model_config`` (None until the
    data is known: ``plan_model``) and ``notes``."""

    cfg: TrainConfig
    out: Path
    resumed: bool
    forked: bool = False
    fork_from: Path | None = None
    model_config: ModelConfig | None = None
    notes: tuple[str, ...] = ()

    @property
    def new_directory(self) -> bool:
        """Whether the run writes into a directory that must not already hold another run."""
        return not self.resumed or self.forked


def plan_config(cfg: TrainConfig, xp, *, explicit=None, saved: SavedRun | None = None) -> RunPlan:
    """The run's configuration on backend ``xp``: resumed from ``saved`` (the fields in ``explicit`` are the ones
    the user set; see ``config.resume_config``), else as given; then resolved and validated (``ConfigError``)."""
    notes = []
    if saved is not None:
        out, forked, fork_from = resume_target(cfg.resume, cfg.out)
        cfg = replace(resume_config(saved.train_config, cfg, explicit), out=str(out))
        fast_ok, why = fast_path_available(xp, compute_dtype(cfg.dtype), cfg.checkpoint_every) if cfg.fast else \
            (True, "")
        if not fast_ok and cfg.dtype == FP8:  # FP8 GEMMs live in the fast step alone: never bf16 in their place
            raise ConfigError(f"the checkpointed run trains with --dtype fp8, which runs in the fast step only, "
                              f"unavailable here: {why}")
        if not fast_ok:
            # the run used the fast step, which this machine cannot run: continue on the book step (same model and
            # state; the losses will differ from an uninterrupted run in the last bits)
            notes.append(f"the checkpointed run used the fast step (--fast), unavailable here: {why}; resuming with "
                         "the book step")
            cfg = replace(cfg, fast=False, graph=False)
    else:
        out, forked, fork_from = Path(cfg.out or default_out_dir()), False, None
        cfg = replace(cfg, out=str(out))
    resolved = resolve(cfg, xp)
    if saved is None:
        notes += unused_flag_notes(resolved, explicit_fields(cfg) if explicit is None else set(explicit))
    return RunPlan(resolved, out, saved is not None, forked, fork_from, notes=tuple(notes))


def unused_flag_notes(cfg: TrainConfig, given: set) -> list[str]:
    """A note for each group of flags the user set (``given``) that the run's other settings leave unused: taken
    without a word, they read as if they had worked."""
    unused = ((("prompt", "temperature", "top_k"), cfg.sample_tokens == 0, "there is no end-of-run sample "
               "(--sample-tokens 0)"),
              (("val_data", "eval_batches"), cfg.eval_every == 0, "no validation runs (--eval-every 0)"),
              (("min_lr_ratio",), cfg.schedule == "constant", "a constant schedule does not decay"),
              (("attention_kernel",), not cfg.fast, "it chooses the fast step's attention, and this run takes the "
               "book step"))
    return [f"{', '.join(flag_of(k) for k in keys if k in given)} unused: {why}" for keys, off, why in unused
            if off and any(k in given for k in keys)]


def plan_model(plan: RunPlan, *, data_vocab: int, data_tokenizer: str, saved: SavedRun | None = None,
               init=None, world_size: int = 1) -> RunPlan:
    """``plan`` with the model's configuration: the checkpoint's (``saved``), the pretrained weights' (``init``,
    a ``pretrained.Pretrained``), or the preset's with the data's vocabulary (``data_vocab`` tokens of
    ``data_tokenizer``) unless ``--vocab-size`` sets it. ``world_size``: the ranks this run trains on."""
    cfg, notes = plan.cfg, list(plan.notes)
    if cfg.zero and world_size == 1:
        notes.append(f"--zero {cfg.zero} on one rank: nothing to shard, the optimizer state stays whole (ZeRO saves "
                     "memory across several ranks)")
    if saved is not None:
        mcfg = saved.model_config
        if saved.world_size != world_size:
            micro, had = cfg.batch * cfg.seq * world_size, saved.global_batch()
            now = micro * cfg.grad_accum
            keep = ("as before" if now == had else f"it had {had}; --grad-accum {had // micro} keeps that"
                    if had % micro == 0 else f"it had {had}, which no --grad-accum gives with --batch {cfg.batch} on "
                    f"{world_size} rank(s)")
            notes.append(f"the run was saved on {saved.world_size} rank(s) and continues on {world_size}: {now} "
                         f"tokens per step ({keep})")
    elif init is not None:
        mcfg = init.run_model_config(data_tokenizer, cfg)
    else:
        base = presets(cfg.arch)[cfg.preset]
        vocab = cfg.vocab_size or data_vocab
        if cfg.vocab_size is None and vocab != base.vocab_size:
            notes.append(f"the {cfg.preset} preset's vocabulary {base.vocab_size} becomes the data's {vocab} "
                         f"({data_tokenizer} tokens; --vocab-size sets it)")
        mcfg = replace(base, vocab_size=vocab, block_size=model_block_size(cfg), pad_vocab_to=cfg.pad_vocab)
    if cfg.seq > mcfg.block_size:
        raise ConfigError(f"--seq {cfg.seq} exceeds the model's block size {mcfg.block_size}")
    return replace(plan, model_config=mcfg, notes=tuple(notes))


def warmup_note(warmup: int, total_steps: int) -> str:
    """The note for a warm-up longer than the run."""
    return (f"--warmup {warmup} is longer than the run ({total_steps} steps): it warms up over all {total_steps}, "
            "never decays")


def fitted_total_steps(cfg, step: int, per_step: float, elapsed: float, *, first: bool) -> int:
    """The schedule's length that ends a ``--max-time`` run on time, from the measured seconds per step after
    ``step`` steps and ``elapsed`` seconds; ``step`` itself means stop now. The ``first`` fit adds the evaluations,
    not yet in the measurement: each reads eval_batches steps' worth of sequences forward only, a third of a step."""
    if first and cfg.eval_every:
        per_step *= 1.0 + cfg.eval_batches / (3.0 * cfg.eval_every)
    remaining = 0.97 * cfg.max_time - elapsed
    return step + max(0, int(remaining / max(per_step, 1e-9)))


__all__ = ["RunPlan", "SavedRun", "fitted_total_steps", "plan_config", "plan_model", "unused_flag_notes",
           "warmup_note"]
