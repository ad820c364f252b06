"""The trainer (chapter 7): a model, THE step, data streams, checkpoints, the log, in one run loop.

``Trainer(cfg)`` plans the run (``plan.py``: the effective configuration, the model's, the notes), then builds
it: the data streams, the model with its starting weights (fresh, ``--init``'s or the checkpoint's), the gradient
seam (one process, data parallel or ZeRO: ``ranks.gradient_seam``), the step (``step.py``) and, on resume, the
optimizer, loss-scaler, data and RNG state. ``train_step(lr)`` runs one optimizer step and returns a device array
``[loss, grad_norm, found_inf]`` without waiting for the GPU; ``evaluate()`` the validation loss (one host sync);
``save()`` a checkpoint; ``run()`` the whole loop: a progress line, a JSON-lines log, validation every
``eval_every`` steps, checkpoints (resuming reproduces the uninterrupted run's losses bit for bit), a loss-curve PNG
and samples at the end. ``train(TrainConfig(...))`` is the one-call form. The learning rate comes from the schedule
on the host (a float, no sync); the loss, the gradient norm and the overflow flag are fetched in one copy every
``log_every`` steps.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import backend
from ..model import fast_model_class, model_class
from ..optim import lr_at
from ..optim.params import ALIGN
from ..perf.timing import MFU_DEFINITION, datasheet_peak_tflops, mfu, mfu_ceiling
from ..plotting import plot_losses
from ..version import __version__
from . import checkpoint as ckpt_files
from . import rundir
from .checkpoint import CheckpointError, find_checkpoint, load_checkpoint, non_finite, save_checkpoint
from .config import TrainConfig, compute_dtype, fast_options, select_xp
from .data import BatchLoader, Corpus, ValidationSplit, get_tokenizer, load_corpus, validation_loader
from .divergence import RunHealth
from .plan import RunPlan, SavedRun, fitted_total_steps, plan_config, plan_model, warmup_note
from .pretrained import init_run
from .ranks import agree, check_agreement, connect, gradient_seam, wait_for_ranks
from .report import Progress, done_line, read_log, run_banner
from .rundir import check_target, default_out_dir, open_run_dir, write_config
from .sampling import check_run_sample, prompt_ids
from .session import Log, Session, strict_json
from .step import TrainStep
from .stop import StoppedAtOnce, StopRequests
from .stream import DataStream


class Trainer:
    """Model, optimizer, loss scaler, clipper and data streams for one run (see the module docstring).

    ``xp``: the backend (default: ``cfg.device``'s). ``corpus``: the data, already loaded (default: ``cfg.data``).
    ``explicit``: the fields the user set (the CLI passes its explicit flags); on resume every other field comes
    from the checkpoint, and a set field a resume cannot change is a ``ConfigError``.
    """

    def __init__(self, cfg: TrainConfig, *, xp=None, corpus: Corpus | None = None, explicit=None):
        xp = xp if xp is not None else select_xp(cfg.device)
        self.xp = xp
        self.comm = connect(cfg, xp)  # one rank: LocalComm; chapter 9: NCCL or MPI (train/ranks.py)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.is_main = self.rank == 0  # the rank that prints and writes files
        self.notes: list[str] = []  # what the run does differently from what was asked (one line each)
        self._bar = None
        self._in_step = False  # between a step's first state change and its end (then no checkpoint may be written)

        # plan: the configuration, where the run writes, the model (pure, plan.py) around the reads it needs
        cfg, self.init = init_run(cfg, self._note, explicit) if cfg.init else (cfg, None)  # --init's weights
        saved = ckpt = None
        if cfg.resume:
            rundir.refuse_if_in_use(Path(cfg.resume))  # a run being written holds no checkpoint before its first save
            ckpt = load_checkpoint(cfg.resume)  # (weights, meta, optimizer arrays)
            saved = SavedRun.from_meta(find_checkpoint(cfg.resume), ckpt[1])
        plan = plan_config(cfg, xp, explicit=explicit, saved=saved)
        self.notes += plan.notes
        if self.is_main:  # a directory no other process writes; a new one never over another run
            check_target(plan.out, plan.cfg.overwrite, new=plan.new_directory)
        backend.use_cpu(xp, plan.cfg.device, plan.cfg.cpu_threads, self._note)  # NumPy: why; BLAS threads <= cores
        self.corpus = corpus or load_corpus(plan.cfg.data, val_data=plan.cfg.val_data,
                                            val_fraction=plan.cfg.val_fraction)
        known = len(plan.notes)
        plan = plan_model(plan, data_vocab=self.corpus.vocab_size, data_tokenizer=self.corpus.tokenizer, saved=saved,
                          init=self.init, world_size=self.world)
        self.notes += plan.notes[known:]
        self.plan, self.cfg = plan, plan.cfg
        self.forked, self.fork_from = plan.forked, plan.fork_from
        self.last_checkpoint = saved.directory if saved else None  # the newest complete checkpoint on disk

        # build
        self._build_data(plan)
        self._build_model(plan, ckpt)
        self.flops_per_token = plan.model_config.flops_per_token(self.cfg.seq)
        for text in self.notes if self.is_main else ():  # printed once the set-up succeeded: an error stays alone
            print(f"llmgpu: note: {text}", file=sys.stderr)

    # ------------------------------------------------------------------ building

    def _build_data(self, plan: RunPlan):
        cfg, mcfg = plan.cfg, plan.model_config
        for n in self.corpus.notes:
            self._note(n)
        self.corpus.check_vocab(mcfg.vocab_size)
        self.tokenizer = get_tokenizer(self.corpus.tokenizer)
        check_run_sample(cfg, self.tokenizer, mcfg.vocab_size)  # the end-of-run sample's settings, before training
        self.train_loader = BatchLoader(self.corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, name="training",
                                        vocab_size=mcfg.vocab_size, rank=self.rank, world=self.world)
        self.stream = DataStream(self.train_loader, self.xp, async_copy=cfg.async_copy)
        loader = validation_loader(self.corpus.val, cfg.batch, cfg.seq, mcfg.vocab_size)
        self.validation = None
        if cfg.eval_every and loader is None:
            self._note(f"no validation: the {self.corpus.n_val} validation tokens make no sequence of {cfg.seq}")
        elif loader is not None:
            # one evaluation reads eval_batches optimizer steps' worth of sequences, however the ranks split them
            asked = cfg.eval_batches * cfg.batch * cfg.grad_accum * self.world
            self.validation = ValidationSplit(loader, asked, rank=self.rank, world=self.world)
            if cfg.eval_every and self.validation.count < asked:
                self._note(f"validation reads {self.validation.count} sequences of {cfg.seq}, all the validation "
                           f"data holds (--eval-batches {cfg.eval_batches} asks for {asked})")

    def _build_model(self, plan: RunPlan, ckpt):
        """The model with its starting weights, the gradient seam, the step, and a checkpoint's state."""
        cfg, mcfg = plan.cfg, plan.model_config
        fast = (fast_model_class(mcfg), {"options": fast_options(cfg)})  # chapters 8 and 10 (and 5b: --dtype fp8)
        model_cls, opts = fast if cfg.fast else (model_class(mcfg), {})
        self.model = model_cls(mcfg, dtype=compute_dtype(cfg.dtype), checkpoint_every=cfg.checkpoint_every, xp=self.xp,
                               seed=cfg.seed, init=ckpt is None and self.init is None,
                               param_multiple=ALIGN * (self.world if cfg.zero else 1), **opts)
        self.params = self.model.params
        self.rng = np.random.default_rng(cfg.seed)
        self.step, self.total_steps, self.budget_fitted = 0, cfg.steps, False
        if self.init is not None:
            self.model.load_state_dict(self.init.weights)
        elif ckpt is not None:
            self._load_weights(ckpt[0])
            self.step = int(ckpt[1]["step"])
        # every rank: the same configuration and starting step, before the first collective of the step
        check_agreement(self.comm, cfg, mcfg.as_dict(), self.step, self.corpus)
        seam = gradient_seam(self.comm, cfg, self.params)  # after the weights: ZeRO keeps its shard of them
        self.step_fn = TrainStep(self.model, cfg, grad_sync=seam)
        self.opt, self.scaler = self.step_fn.opt, self.step_fn.scaler
        if ckpt is not None:
            self._restore(ckpt[1], ckpt[2])
        if self.total_steps is not None and cfg.warmup > self.total_steps:
            self._note(warmup_note(cfg.warmup, self.total_steps))

    def _load_weights(self, model_arrays: dict):
        d = self.last_checkpoint
        bad = non_finite(model_arrays)
        if bad:
            raise CheckpointError(f"{ckpt_files.model_file(d)} holds inf/nan weights ({bad}): the file is damaged, "
                                  "or the run that wrote it had diverged")
        try:
            self.model.load_state_dict(model_arrays)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {d} does not match its own configuration ({type(e).__name__}: "
                                  f"{e})") from None

    def _restore(self, meta: dict, optim_arrays: dict | None):
        """The optimizer, loss-scaler, data and RNG state of a checkpoint, and its schedule's length."""
        d = self.last_checkpoint
        if optim_arrays is None:
            raise CheckpointError(f"{d / ckpt_files.OPTIM_FILE} is missing: the checkpoint holds no optimizer state, "
                                  "so training cannot resume from it (llmgpu sample can still read it)")
        try:
            ost = dict(meta["optimizer"])
            ost["m"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("m/")}
            ost["v"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("v/")}
            self.step_fn.load_optimizer_state(ost)
            self.scaler.load_state_dict(meta["scaler"])
            self.stream.load_state_dict(meta["data"])
            self.rng.bit_generator.state = meta["rng"]
            ckpt_files.restore_model_state(self.model, meta, note=self._note)
        except (KeyError, TypeError, ValueError) as e:  # arrays or state that do not fit this run
            raise CheckpointError(f"checkpoint {d} does not match its own configuration ({type(e).__name__}: "
                                  f"{e})") from None
        # the schedule's length: an explicit --steps, else the one the interrupted run used
        if self.cfg.steps is not None and self.cfg.steps != meta.get("total_steps"):
            self.total_steps, self.budget_fitted = self.cfg.steps, False
        else:
            self.total_steps = meta.get("total_steps")
            self.budget_fitted = bool(meta.get("budget_fitted"))

    def _note(self, text: str):
        """Say what the run adjusts (one line, even with --quiet), kept for config.json and the log. Notes
        of the set-up are printed once it has succeeded, so an error stays the only line."""
        self.notes.append(text)
        if self._bar is not None:
            self._bar.warn(f"llmgpu: note: {text}")

    @property
    def tokens_per_step(self) -> int:
        c = self.cfg
        return c.batch * c.seq * c.grad_accum * self.world

    # ------------------------------------------------------------------ the step

    def train_step(self, lr: float):
        """One optimizer step over ``grad_accum`` micro-batches (``TrainStep``); no host synchronization.

        Returns a device array ``[mean loss, gradient norm (unscaled, before clipping), found_inf]``.
        """
        self._in_step = True
        batches = [self.stream.next() for _ in range(self.cfg.grad_accum)]  # on the device already
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the run checks for inf/nan itself
            out = self.step_fn(batches, lr)
        self.step += 1
        self._in_step = False
        return out

    def lr_at(self, step: int) -> float:
        c = self.cfg
        total = self.total_steps or 10**9
        warm = min(c.warmup, total)
        return lr_at(step, max_lr=c.lr, min_lr=c.lr * c.min_lr_ratio, warmup_steps=warm,
                     total_steps=max(total, warm), kind=c.schedule)

    def evaluate(self) -> float | None:
        """Mean validation loss per sequence over the same sequences every time (``data.ValidationSplit``: the
        same number on any number of ranks); one host sync. None without validation data."""
        if self.validation is None:
            return None
        total = self.validation.loss_sums(self.model)
        if self.world > 1:
            self.comm.all_reduce(total)
            wait_for_ranks(self.comm, "the other ranks' validation")
        host = backend.to_numpy(total)
        return float(host[0]) / float(host[1])

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory=None) -> Path:
        """Checkpoint: weights, AdamW moments and step count, scaler, step, data position, RNG state."""
        if self._in_step:  # a KeyboardInterrupt stopped a step halfway
            raise RuntimeError(f"step {self.step + 1} was stopped halfway: no checkpoint may hold its state")
        d = Path(directory) if directory else Path(self.cfg.out) / "checkpoint"
        sd = self.step_fn.master_weights()  # whole, also under ZeRO (every rank takes part in gathering it)
        ost = self.step_fn.optimizer_state()
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
            "world_size": self.world,
            **ckpt_files.model_state_of(self.model),  # the attention kernels, the FP8 scaling state
            "llmgpu": __version__,
        }
        path = save_checkpoint(d, model=sd, optim=optim, meta=meta) if self.is_main else d
        if directory is None:
            self.last_checkpoint = path
        return path

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
        schedule of the full run); returns a summary dict (also written to summary.json). Ctrl-C: ``stop.py``."""
        out = Path(self.cfg.out)
        with rundir.run_lock(out, self.notes, enabled=self.is_main):  # one process writes a run directory
            return rundir.finished_summary(out, self.step, self.total_steps, self.cfg.resume) or self._run(stop_at)

    def _run(self, stop_at: int | None) -> dict:
        s = self._open_session()
        with StopRequests() as s.stop:  # a signal stops the run after a whole step (stop.py)
            return self._loop(s, stop_at)

    def _loop(self, s: Session, stop_at: int | None) -> dict:
        try:
            while (reason := self._stop_reason(s, stop_at)) is None:
                lr = self.lr_at(self.step)
                record = self.train_step(lr)
                s.pending.append((self.step, lr, record))
                due_eval = bool(self.cfg.eval_every) and self.step % self.cfg.eval_every == 0
                due_save = bool(self.cfg.save_every) and self.step % self.cfg.save_every == 0
                if self._sync_due(s, stop_at, due_eval or due_save) and self._sync(s, lr):
                    break  # a failure, or (several ranks) rank 0's time is up
                if due_eval:
                    self._validate(s)
                if due_save and not self._save_if_finite(s.health):
                    break
            else:  # the loop ended before a step, not by a break
                s.stop_reason = reason
                if reason == "interrupted":
                    self._interrupted(s, s.stop.signum)
        except KeyboardInterrupt:  # a second signal (stop.py), or one raised by code other than the handler
            if self.world > 1:  # the other ranks wait in this step's collectives: end the run now (cli: MPI_Abort)
                raise StoppedAtOnce(s.stop.signum or signal.SIGINT, self.rank, self.step, self._in_step) from None
            self._interrupted(s, s.stop.signum or signal.SIGINT)
        s.stop.defer = self.world > 1  # one process: from here on (final save, sample) a signal stops at once
        return self._close_session(s)

    def _interrupted(self, s: Session, signum: int):
        s.stop_reason, s.signal = "interrupted", signum
        s.bar.message(f"{signal.Signals(signum).name} at step {self.step}: " + (
            f"step {self.step + 1} was stopped halfway, so nothing is saved" if self._in_step else
            f"saving a checkpoint (continue with --resume {s.out})"))

    def _open_session(self) -> Session:
        """The run directory (a resumed run's log cut back to its checkpoint), the log, the progress line, the
        first validation."""
        c, mc = self.cfg, self.model.config
        out = Path(c.out)
        resumed = self.step > 0 or bool(c.resume)  # a checkpoint of step 0 (stopped before its first step) too
        kept = open_run_dir(out, c.overwrite, resumed, self.forked, self.fork_from, self.step) if self.is_main else []
        s = Session(out=out, log=Log(out / "log.jsonl" if self.is_main else None),
                    bar=Progress(self.total_steps or 0, enabled=c.progress and self.is_main),
                    health=RunHealth(skipped=sum(1 for r in kept if r.get("type") == "train" and r.get("skipped"))),
                    refit=c.steps is None and c.max_time is not None and not resumed, kept=kept)
        self._bar = s.bar
        s.ceiling, ceiling_src = mfu_ceiling(self.xp, compute_dtype(c.dtype))  # MFU's denominator (fp8: bf16's)
        datasheet, gpu_model = datasheet_peak_tflops(self.xp, compute_dtype(c.dtype))
        s.bar.message(run_banner(c, mc, self.model.num_parameters(), backend.dtype_name(self.model.dtype),
                                 self.world, backend.device_info(self.xp).summary()))
        s.bar.message(f"data: {self.corpus.description}; {self.corpus.n_train:,} training / "
                      f"{self.corpus.n_val:,} validation tokens; output: {out}")
        if resumed:
            s.bar.message(f"resumed from step {self.step} ({self.last_checkpoint})")
        if self.is_main:
            write_config(out, {"config": c.as_dict(), "model": mc.as_dict(), "data": self.corpus.description,
                               "notes": self.notes, "step": self.step, "world_size": self.world,
                               "resumed_from": str(self.last_checkpoint) if resumed else None})
        s.log({"type": "run", "step": self.step, "config": c.as_dict(), "model": mc.as_dict(), "notes": self.notes,
               "parameters": self.model.num_parameters(), "device": backend.device_info(self.xp).as_dict(),
               "mfu_ceiling_tflops": s.ceiling, "mfu_ceiling": ceiling_src, "mfu_definition": MFU_DEFINITION,
               "datasheet_peak_tflops": datasheet, "datasheet_gpu": gpu_model, "data": self.corpus.description})
        if not resumed and c.eval_every:
            s.first_val = s.last_val = self.evaluate()
            s.last_val_step = 0
            if s.first_val is not None:
                s.log({"type": "val", "step": 0, "val_loss": s.first_val})
                s.bar.message(f"step 0: val loss {s.first_val:.4f}")
        s.t0 = s.t_last = s.probe_start = time.perf_counter()
        s.steps_last = self.step
        return s

    def _stop_reason(self, s: Session, stop_at: int | None) -> str | None:
        """Why the loop stops before the next step, or None to go on."""
        if self.total_steps is not None and self.step >= self.total_steps:
            return "steps"
        if stop_at is not None and self.step >= stop_at:
            return "stop_at"
        if self.world == 1 and s.stop.requested:  # several ranks: they agree on it at a sync (_sync)
            return "interrupted"
        if self.cfg.max_time is not None and self.world == 1 and time.perf_counter() - s.t0 >= self.cfg.max_time:
            return "max_time"  # several ranks: rank 0's clock decides at a sync (_sync)
        return None

    def _sync_due(self, s: Session, stop_at: int | None, due: bool) -> bool:
        """Whether this step ends a log interval: every log_every steps, before an evaluation or a checkpoint,
        at the steps the time budget is measured over, and at the last step."""
        last = (self.total_steps is not None and self.step >= self.total_steps) or self.step == stop_at
        probe = s.refit and self.step in (1, 1 + self.cfg.time_budget_probe)
        return len(s.pending) >= self.cfg.log_every or due or probe or last

    def _sync(self, s: Session, lr: float) -> bool:
        """The end of a log interval: the log lines, the time budget's schedule, the ranks' agreement, the
        progress line. True when the run must stop (a failure, or rank 0's time is up)."""
        now, tok_s, util = self._flush(s)
        if s.refit and self.step == 1:  # step 1 includes compilation and warm-up: time from here
            s.probe_start = now
        elif s.refit and self.step > 1:
            # seconds per step so far (evaluations included) -> the schedule length that ends when max_time runs
            # out; refitted at every sync, so a machine that slows down or speeds up still gets a whole schedule
            announce = not self.budget_fitted
            self.total_steps = fitted_total_steps(self.cfg, self.step, (now - s.probe_start) / (self.step - 1),
                                                  now - s.t0, first=not self.budget_fitted)
            self.budget_fitted = True
            s.bar.total = self.total_steps
            if announce:
                s.bar.message(f"time budget {self.cfg.max_time:.0f} s: about {self.total_steps} steps")
                if self.cfg.warmup > self.total_steps:
                    self._note(warmup_note(self.cfg.warmup, self.total_steps))
        time_up = False
        if self.world > 1:  # rank 0's clock sets the schedule and the stop, the same on every rank
            time_up = self.cfg.max_time is not None and now - s.t0 >= self.cfg.max_time
            self.total_steps, time_up, sig = agree(self.comm, self.total_steps, time_up, s.stop.signum)
            s.bar.total = self.total_steps
            s.stop_reason = "max_time" if time_up else s.stop_reason
            if sig is not None:  # a rank was asked to stop: every rank stops after this step, saving together
                self._interrupted(s, sig)
                time_up = True
        eta = None
        if self.total_steps and self.step > 1:
            eta = (now - s.probe_start) / (self.step - 1) * (self.total_steps - self.step)
        s.bar.update(self.step, loss=s.last_loss, val=s.last_val, lr=lr, tok_s=tok_s, mfu=util, elapsed=now - s.t0,
                     eta=eta, skipped=s.health.skipped)
        return bool(s.health.failure) or time_up

    def _flush(self, s: Session):
        """The one host sync of a log interval: fetch the steps' records, write their log lines."""
        records = self.xp.stack([r for _, _, r in s.pending])
        wait_for_ranks(self.comm, f"the steps up to {self.step}")  # with a deadline: a dead rank never answers
        host = backend.to_numpy(records)  # waits for the GPU
        now = time.perf_counter()
        tok_s = (self.step - s.steps_last) * self.tokens_per_step / max(now - s.t_last, 1e-9)
        util = mfu(self.flops_per_token, tok_s, s.ceiling)
        for (step, lr, _), (loss, norm, inf) in zip(s.pending, host):
            entry = {"type": "train", "step": step, "loss": float(loss), "grad_norm": float(norm), "lr": lr,
                     "skipped": bool(inf)}
            if step == s.pending[-1][0]:
                entry.update(tokens_per_s=tok_s, mfu=util, time_s=now - s.t0)
            s.log(entry)
            s.health.check(step, float(loss), bool(inf), loss_scaled=self.scaler.enabled,
                           max_skipped=self.cfg.max_skipped_steps, synced=self.step)
        s.last_loss = float(host[-1][0])
        s.pending.clear()
        s.t_last, s.steps_last = now, self.step
        return now, tok_s, util

    def _validate(self, s: Session):
        s.last_val, s.last_val_step = self.evaluate(), self.step
        if s.last_val is not None:
            s.log({"type": "val", "step": self.step, "val_loss": s.last_val})
        s.t_last = time.perf_counter()  # evaluation time does not count against tokens/s

    def _close_session(self, s: Session) -> dict:
        """After the loop: the last records, a final validation, the checkpoint, the summary, plot and sample."""
        c = self.cfg
        if s.pending:  # stopped between syncs
            self._flush(s)
        elapsed = time.perf_counter() - s.t0
        failed = s.health.failure is not None
        if c.eval_every and not failed and s.stop_reason != "interrupted" and (s.last_val is None
                                                                                or self.step % c.eval_every):
            self._validate(s)
        s.bar.close()
        if not failed and not self._in_step:  # a step stopped halfway: the last checkpoint on disk stays
            self._save_if_finite(s.health)
            failed = s.health.failure is not None
        ckpt = self.last_checkpoint  # a failed run keeps the last good one: nothing bad is written over it
        if failed:
            s.stop_reason = s.health.failure[0]
        summary = rundir.with_log_figures(s.kept, {
            "steps": self.step, "stop_reason": s.stop_reason, "train_time_s": elapsed, "first_val_loss": s.first_val,
            "val_loss": s.last_val, "val_loss_step": s.last_val_step, "train_loss": s.last_loss,
            "skipped_steps": s.health.skipped, "tokens": self.step * self.tokens_per_step,
            "checkpoint": str(ckpt) if ckpt else None, "out": str(s.out), "notes": self.notes})
        if s.stop_reason == "interrupted":
            summary["signal"] = signal.Signals(s.signal).name
            if self._in_step:
                summary["unfinished_step"] = self.step + 1
        if failed:
            summary["error"] = s.health.failure[1] + (f"; the last good checkpoint is {ckpt}" if ckpt else
                                                      "; no checkpoint was saved (--save-every N keeps some)")
        final = s.stop_reason not in ("stop_at", "interrupted")
        if c.plot and final and self.is_main:
            try:
                summary["plot"] = str(plot_losses(read_log(s.out / "log.jsonl"), s.out / "loss.png"))
            except Exception as e:  # a plot must never lose a finished run
                s.bar.message(f"(no loss plot: {type(e).__name__}: {e})")
        if c.sample_tokens and final and not failed and self.is_main:
            text = self.sample()
            (s.out / "samples.txt").write_text(text + "\n")
            summary["sample"] = text
        s.log({"type": "end", **{k: v for k, v in summary.items() if k != "sample"}})
        s.log.close()
        if self.is_main:
            (s.out / "summary.json").write_text(json.dumps(strict_json(summary), indent=1, allow_nan=False) + "\n")
        s.bar.message(f"stopped at step {self.step}: {summary['error']}" if failed else done_line(summary))
        return summary

    def _save_if_finite(self, health: RunHealth) -> bool:
        """Checkpoint unless a weight is inf/nan (then record the failure: the last good checkpoint stays)."""
        if not self.step_fn.weights_finite():  # one reduction, one host sync
            health.failure = ("diverged", f"the weights hold inf/nan after step {self.step}: the run diverged")
            return False
        self.save()
        return True

# --------------------------------------------------------------------------- entry points


def train(cfg: TrainConfig | None = None, *, explicit=None, **kwargs) -> dict:
    """Run a training job; returns the summary (see ``Trainer.run``). ``explicit``: see ``Trainer``."""
    cfg = replace(cfg or TrainConfig(), **kwargs)
    if explicit is not None:
        explicit = set(explicit) | set(kwargs)
    return Trainer(cfg, explicit=explicit).run()


__all__ = ["Trainer", "default_out_dir", "prompt_ids", "train"]
