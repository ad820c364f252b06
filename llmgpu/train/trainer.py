"""The trainer (chapter 7): a model, THE step, data streams, checkpoints, the log, in one run loop.

``Trainer(cfg)`` builds everything (or restores it from ``cfg.resume``); ``train_step(lr)`` runs one
optimizer step (``train/step.py``) and returns a device array ``[loss, grad_norm, found_inf]`` without
waiting for the GPU; ``evaluate()`` the validation loss (one host sync); ``save()`` a checkpoint;
``run()`` the whole loop: a progress line, a JSON-lines log, validation every ``eval_every`` steps,
checkpoints (weights, optimizer, scaler, step, data position, RNG state: resuming reproduces the
uninterrupted run's losses bit for bit), a loss-curve PNG and samples at the end.
``train(TrainConfig(...))`` is the one-call form. The learning rate comes from the schedule on the host
(a float, no sync); the loss, the gradient norm and the overflow flag are fetched in one copy every
``log_every`` steps.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import backend
from ..model import GPT, FastGPT, GPTConfig
from ..optim import lr_at
from ..optim.params import ALIGN
from ..perf.timing import MFU_DEFINITION, datasheet_peak_tflops, mfu, mfu_ceiling
from ..plotting import plot_losses
from ..version import __version__
from . import checkpoint as ckpt_files
from . import rundir
from .checkpoint import CheckpointError, find_checkpoint, load_checkpoint, non_finite, save_checkpoint
from .config import ConfigError, TrainConfig, fast_path_available, model_block_size, resolve, resume_config, select_xp
from .data import BatchLoader, Corpus, get_tokenizer, load_corpus, validation_loader
from .divergence import check_step
from .pretrained import init_run
from .ranks import agree, check_agreement, connect, gradient_seam, wait_for_ranks
from .report import Progress, read_log
from .rundir import check_target, default_out_dir, open_run_dir, resume_target, with_log_figures, write_config
from .sampling import check_run_sample, prompt_ids
from .step import TrainStep
from .stream import DataStream


class Trainer:
    """Model, optimizer, loss scaler, clipper and data streams for one run.

    ``Trainer(cfg)`` builds everything (or restores it from ``cfg.resume``); ``train_step(lr)`` runs
    one optimizer step and returns a device array ``[loss, grad_norm, found_inf]`` without waiting
    for the GPU; ``evaluate()`` the validation loss (a host float, one sync); ``save()`` a checkpoint;
    ``run()`` the whole loop.
    """

    def __init__(self, cfg: TrainConfig, *, xp=None, corpus: Corpus | None = None, explicit=None):
        """``explicit``: the fields the user set (the CLI passes its explicit flags); on resume every other
        field comes from the checkpoint, and a set field a resume cannot change is a ConfigError."""
        xp = xp if xp is not None else select_xp(cfg.device)
        self.comm = connect(cfg, xp)  # one rank: LocalComm; chapter 9: NCCL or MPI (train/ranks.py)
        self.rank, self.world = self.comm.rank, self.comm.world_size
        self.is_main = self.rank == 0  # the rank that prints and writes files
        self.notes: list[str] = []  # what the run does differently from what was asked (one line each)
        meta = ckpt_model = ckpt_optim = None
        self.forked, self.fork_from = False, None  # resumed into another directory; the run it came from
        self.last_checkpoint = None  # the newest complete checkpoint of this run on disk
        cfg, self.init = init_run(cfg, self._note) if cfg.init else (cfg, None)  # --init's weights (pretrained.py)
        if cfg.resume:
            self.last_checkpoint = find_checkpoint(cfg.resume)
            ckpt_model, meta, ckpt_optim = load_checkpoint(cfg.resume)
            try:
                saved = TrainConfig.from_dict(meta["train_config"])
                saved = replace(saved, block_size=GPTConfig.from_dict(meta["model_config"]).block_size)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.last_checkpoint / ckpt_files.META_FILE}: no usable training "
                                      f"configuration ({type(e).__name__}: {e})") from None
            out, self.forked, self.fork_from = resume_target(cfg.resume, cfg.out)
            cfg = replace(resume_config(saved, cfg, explicit), out=str(out))
            fast_ok, why = fast_path_available(xp, cfg.dtype, cfg.checkpoint_every) if cfg.fast else (True, "")
            if not fast_ok:
                # the run used the fast step, which this machine cannot run: continue on the book step
                # (same model and state; the losses will differ from an uninterrupted run in the last bits)
                self._note(f"the checkpointed run used the fast step (--fast), unavailable here: {why}; resuming "
                           "with the book step")
                cfg = replace(cfg, fast=False, graph=False)
        elif cfg.out is None:
            cfg = replace(cfg, out=default_out_dir())
        cfg = resolve(cfg, xp)
        self.cfg, self.xp = cfg, xp
        if self.is_main:  # a directory no other process writes; a new one never over another run
            check_target(Path(cfg.out), cfg.overwrite, new=not cfg.resume or self.forked)
        backend.use_cpu(xp, cfg.device, cfg.cpu_threads, self._note)  # on NumPy: why, and BLAS threads <= cores

        # data
        self.corpus = corpus or load_corpus(cfg.data, val_data=cfg.val_data, val_fraction=cfg.val_fraction)
        for n in self.corpus.notes:
            self._note(n)
        if meta is not None:
            mcfg = GPTConfig.from_dict(meta["model_config"])
        elif self.init is not None:
            mcfg = self.init.run_model_config(self.corpus.tokenizer, cfg)
        else:
            base = GPTConfig.preset(cfg.preset)
            vocab = cfg.vocab_size or self.corpus.vocab_size
            if cfg.vocab_size is None and vocab != base.vocab_size:
                self._note(f"the {cfg.preset} preset's vocabulary {base.vocab_size} becomes the data's {vocab} "
                           f"({self.corpus.tokenizer} tokens; --vocab-size sets it)")
            mcfg = replace(base, vocab_size=vocab, block_size=model_block_size(cfg), pad_vocab_to=cfg.pad_vocab)
        if cfg.seq > mcfg.block_size:
            raise ConfigError(f"--seq {cfg.seq} exceeds the model's block size {mcfg.block_size}")
        self.corpus.check_vocab(mcfg.vocab_size)
        self.tokenizer = get_tokenizer(self.corpus.tokenizer)
        check_run_sample(cfg, self.tokenizer, mcfg.vocab_size)  # the end-of-run sample's settings, before training
        self.train_loader = BatchLoader(self.corpus.train, cfg.batch, cfg.seq, seed=cfg.seed, name="training",
                                        vocab_size=mcfg.vocab_size, rank=self.rank, world=self.world)
        self.stream = DataStream(self.train_loader, xp, async_copy=cfg.async_copy)
        self.val_loader = validation_loader(self.corpus.val, cfg.batch, cfg.seq, mcfg.vocab_size)
        if cfg.eval_every and self.val_loader is None:
            self._note(f"no validation: the {self.corpus.n_val} validation tokens make no sequence of {cfg.seq}")
        elif cfg.eval_every and self.val_loader.batches_per_epoch() < cfg.eval_batches:
            self._note(f"validation uses {self.val_loader.batches_per_epoch()} batch(es) of "
                       f"{self.val_loader.batch}, all the validation data holds (--eval-batches {cfg.eval_batches})")

        # model, optimizer, precision
        model_cls = FastGPT if cfg.fast else GPT
        self.model = model_cls(mcfg, dtype=cfg.dtype, checkpoint_every=cfg.checkpoint_every, xp=xp, seed=cfg.seed,
                               init=meta is None and self.init is None,
                               param_multiple=ALIGN * (self.world if cfg.zero else 1))
        if self.init is not None:
            self.model.load_state_dict(self.init.weights)
        self.params = self.model.params
        self.step_fn = TrainStep(self.model, cfg)
        self.opt, self.scaler = self.step_fn.opt, self.step_fn.scaler
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.total_steps = cfg.steps
        self.budget_fitted = False
        if meta is not None:
            self._restore(ckpt_model, ckpt_optim, meta)
            if meta.get("world_size", 1) != self.world:
                old = meta["train_config"]
                before = old["batch"] * old["seq"] * old["grad_accum"] * meta.get("world_size", 1)
                self._note(f"the run was saved on {meta.get('world_size', 1)} rank(s) and continues on {self.world}: "
                           f"{self.tokens_per_step} tokens per step (it had {before}; --grad-accum keeps it)")
        check_agreement(self.comm, cfg, mcfg.as_dict(), self.step)
        seam = gradient_seam(self.comm, cfg, self.step_fn)  # after the restore: ZeRO shards the restored state
        if seam is not None:
            self.step_fn.grad_sync = seam
            self.opt = self.step_fn.opt
        if self.total_steps is not None and cfg.warmup > self.total_steps:
            self._note(self._warmup_note())
        self.flops_per_token = mcfg.flops_per_token(cfg.seq)
        self._print_notes()

    def _note(self, text: str):
        """Say what the run adjusts (one line, even with --quiet), kept for config.json and the log. Notes
        of the set-up are printed once it has succeeded, so an error stays the only line."""
        self.notes.append(text)
        if getattr(self, "_bar", None) is not None:
            self._bar.warn(f"llmgpu: note: {text}")

    def _print_notes(self):
        for text in self.notes if self.is_main else ():
            print(f"llmgpu: note: {text}", file=sys.stderr)

    def _warmup_note(self) -> str:
        n = self.total_steps
        return f"--warmup {self.cfg.warmup} is longer than the run ({n} steps): it warms up over all {n}, never decays"

    @property
    def tokens_per_step(self) -> int:
        c = self.cfg
        return c.batch * c.seq * c.grad_accum * self.world

    # ------------------------------------------------------------------ the step

    def train_step(self, lr: float):
        """One optimizer step over ``grad_accum`` micro-batches (``TrainStep``); no host synchronization.

        Returns a device array ``[mean loss, gradient norm (unscaled, before clipping), found_inf]``.
        """
        batches = [self.stream.next() for _ in range(self.cfg.grad_accum)]  # on the device already
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # the run checks for inf/nan itself
            out = self.step_fn(batches, lr)
        self.step += 1
        return out

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
            "llmgpu": __version__,
        }
        path = save_checkpoint(d, model=sd, optim=optim, meta=meta) if self.is_main else d
        if directory is None:
            self.last_checkpoint = path
        return path

    def weights_finite(self) -> bool:
        """Whether every master weight is finite (one reduction, one host sync): a checkpoint must be."""
        return self.step_fn.weights_finite()

    def _restore(self, model_arrays: dict, optim_arrays: dict | None, meta: dict):
        d = self.last_checkpoint
        if optim_arrays is None:
            raise CheckpointError(f"{d / ckpt_files.OPTIM_FILE} is missing: the checkpoint holds no optimizer state, "
                                  "so training cannot resume from it (llmgpu sample can still read it)")
        bad = non_finite(model_arrays)
        if bad:
            raise CheckpointError(f"{ckpt_files.model_file(d)} holds inf/nan weights ({bad}): the run had diverged")
        try:
            self.model.load_state_dict(model_arrays)
            ost = dict(meta["optimizer"])
            ost["m"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("m/")}
            ost["v"] = {k[2:]: v for k, v in optim_arrays.items() if k.startswith("v/")}
            self.opt.load_state_dict(ost)
            self.scaler.load_state_dict(meta["scaler"])
            self.stream.load_state_dict(meta["data"])
            self.rng.bit_generator.state = meta["rng"]
        except (KeyError, TypeError, ValueError) as e:  # arrays or state that do not fit this run
            raise CheckpointError(f"checkpoint {d} does not match its own configuration ({type(e).__name__}: "
                                  f"{e})") from None
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
        out = Path(self.cfg.out)
        with rundir.run_lock(out, self.notes, enabled=self.is_main):
            return rundir.finished_summary(out, self.step, self.total_steps, self.cfg.resume) or self._run(stop_at)

    def _run(self, stop_at):
        c, xp, main = self.cfg, self.xp, self.is_main
        out = Path(c.out)
        log_path = out / "log.jsonl"
        resumed = self.step > 0 or bool(c.resume)  # a checkpoint of step 0 (stopped before its first step) too
        # the records of the steps before this session (a resumed run's); rank 0 alone owns the directory
        kept = open_run_dir(out, c.overwrite, resumed, self.forked, self.fork_from, self.step) if main else []
        logf = open(log_path, "a") if main else None

        def log(rec):
            if logf is not None:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()

        ceiling, ceiling_src = mfu_ceiling(xp, c.dtype)  # MFU's denominator, measured now
        datasheet, gpu_model = datasheet_peak_tflops(xp, c.dtype)
        mc = self.model.config
        bar = self._bar = Progress(self.total_steps or 0, enabled=c.progress and main)
        bar.message(f"llmgpu train: {mc.n_layer} layers, C={mc.n_embd}, {self.model.num_parameters() / 1e6:.2f}M "
                    f"parameters, vocab {mc.vocab_size}, {backend.dtype_name(self.model.dtype)}, batch "
                    f"{c.batch}x{c.seq}x{c.grad_accum}" + (f" on each of {self.world} ranks" if self.world > 1 else "")
                    + (f", ZeRO-{c.zero}" if c.zero else "")
                    + (f", activation checkpointing every {c.checkpoint_every}" if c.checkpoint_every else "")
                    + (", chapter 8 fast step" + (" as a CUDA graph" if c.graph else "") if c.fast else "")
                    + f"; {backend.device_info(xp).summary()}")
        bar.message(f"data: {self.corpus.description}; {self.corpus.n_train:,} training / "
                    f"{self.corpus.n_val:,} validation tokens; output: {out}")
        if resumed:
            bar.message(f"resumed from step {self.step} ({self.last_checkpoint})")
        if main:
            write_config(out, {"config": c.as_dict(), "model": mc.as_dict(), "data": self.corpus.description,
                               "notes": self.notes, "step": self.step, "world_size": self.world,
                               "resumed_from": str(self.last_checkpoint) if resumed else None})
        log({"type": "run", "step": self.step, "config": c.as_dict(), "model": mc.as_dict(), "notes": self.notes,
             "parameters": self.model.num_parameters(), "device": backend.device_info(xp).as_dict(),
             "mfu_ceiling_tflops": ceiling, "mfu_ceiling": ceiling_src, "mfu_definition": MFU_DEFINITION,
             "datasheet_peak_tflops": datasheet, "datasheet_gpu": gpu_model, "data": self.corpus.description})

        first_val = last_val = None
        if not resumed and c.eval_every:
            first_val = last_val = self.evaluate()
            if first_val is not None:
                log({"type": "val", "step": 0, "val_loss": first_val})
                bar.message(f"step 0: val loss {first_val:.4f}")

        pending: list = []  # (step, lr, device record) since the last sync
        state = {"last_loss": None, "streak": 0, "failure": None,
                 "skipped": sum(1 for r in kept if r.get("type") == "train" and r.get("skipped"))}

        def flush(t_from, steps_from):
            """The one host sync of a log interval: fetch the records, write the log lines."""
            records = xp.stack([r for _, _, r in pending])
            wait_for_ranks(self.comm, f"the steps up to {self.step}")  # with a deadline: a dead rank never answers
            host = backend.to_numpy(records)  # waits for the GPU
            now = time.perf_counter()
            tok_s = (self.step - steps_from) * self.tokens_per_step / max(now - t_from, 1e-9)
            util = mfu(self.flops_per_token, tok_s, ceiling)
            for (s_, lr_s, _), (loss, norm, inf) in zip(pending, host):
                entry = {"type": "train", "step": s_, "loss": float(loss), "grad_norm": float(norm), "lr": lr_s,
                         "skipped": bool(inf)}
                if s_ == pending[-1][0]:
                    entry.update(tokens_per_s=tok_s, mfu=util, time_s=now - t0)
                log(entry)
                check_step(state, s_, float(loss), bool(inf), loss_scaled=self.scaler.enabled,
                           max_skipped=self.cfg.max_skipped_steps)
            state["last_loss"] = float(host[-1][0])
            pending.clear()
            return now, tok_s, util

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
                if c.max_time is not None and self.world == 1 and time.perf_counter() - t0 >= c.max_time:
                    stop_reason = "max_time"  # several ranks: rank 0's clock decides at a sync (below)
                    break
                lr = self.lr_at(self.step)
                rec = self.train_step(lr)
                pending.append((self.step, lr, rec))
                due_eval = bool(c.eval_every) and self.step % c.eval_every == 0
                due_save = bool(c.save_every) and self.step % c.save_every == 0
                due_probe = refit and self.step in (1, 1 + c.time_budget_probe)
                last = (self.total_steps is not None and self.step >= self.total_steps) or self.step == stop_at
                if len(pending) >= c.log_every or due_eval or due_save or due_probe or last:
                    now, tok_s, util = flush(t_last, steps_last)
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
                            if c.warmup > self.total_steps:
                                self._note(self._warmup_note())
                    time_up = False
                    if self.world > 1:  # rank 0's clock sets the schedule and the stop, the same on every rank
                        time_up = c.max_time is not None and now - t0 >= c.max_time
                        self.total_steps, time_up = agree(self.comm, self.total_steps, time_up)
                        bar.total = self.total_steps
                        stop_reason = "max_time" if time_up else stop_reason
                    eta = None
                    if self.total_steps and self.step > 1:
                        eta = (now - probe_start) / (self.step - 1) * (self.total_steps - self.step)
                    bar.update(self.step, loss=state["last_loss"], val=last_val, lr=lr, tok_s=tok_s, mfu=util,
                               elapsed=now - t0, eta=eta, skipped=state["skipped"])
                    if state["failure"] or time_up:
                        break
                if due_eval:
                    last_val = self.evaluate()
                    if last_val is not None:
                        log({"type": "val", "step": self.step, "val_loss": last_val})
                    t_last = time.perf_counter()  # evaluation time does not count against tokens/s
                if due_save:
                    if not self._save_if_finite(state):
                        break
                    t_last = time.perf_counter()
        except KeyboardInterrupt:
            stop_reason = "interrupted"
            bar.message(f"interrupted at step {self.step}: saving a checkpoint (continue with --resume {out})")
        if pending:  # stopped between syncs
            flush(t_last, steps_last)
        elapsed = time.perf_counter() - t0
        failed = state["failure"] is not None
        if c.eval_every and not failed and stop_reason != "interrupted" and (last_val is None
                                                                              or self.step % c.eval_every):
            v = self.evaluate()
            if v is not None:
                last_val = v
                log({"type": "val", "step": self.step, "val_loss": v})
        bar.close()
        if not failed:
            self._save_if_finite(state)
            failed = state["failure"] is not None
        ckpt = self.last_checkpoint  # a failed run keeps the last good one: nothing bad is written over it
        if failed:
            stop_reason = state["failure"][0]
        summary = with_log_figures(kept, {"steps": self.step, "stop_reason": stop_reason, "train_time_s": elapsed,
                   "first_val_loss": first_val, "val_loss": last_val, "train_loss": state["last_loss"],
                   "skipped_steps": state["skipped"], "tokens": self.step * self.tokens_per_step,
                   "checkpoint": str(ckpt) if ckpt else None, "out": str(out), "notes": self.notes})
        if failed:
            summary["error"] = state["failure"][1] + (f"; the last good checkpoint is {ckpt}" if ckpt else
                                                      "; no checkpoint was saved (--save-every N keeps some)")
        final = stop_reason not in ("stop_at", "interrupted")
        if c.plot and final and main:
            try:
                summary["plot"] = str(plot_losses(read_log(log_path), out / "loss.png"))
            except Exception as e:  # a plot must never lose a finished run
                bar.message(f"(no loss plot: {type(e).__name__}: {e})")
        if c.sample_tokens and final and not failed and main:
            text = self.sample()
            (out / "samples.txt").write_text(text + "\n")
            summary["sample"] = text
        log({"type": "end", **{k: v for k, v in summary.items() if k != "sample"}})
        if main:
            logf.close()
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if failed:
            bar.message(f"stopped at step {self.step}: {summary['error']}")
            return summary
        bar.message(f"done: {self.step} steps in {elapsed:.0f} s; "
                    + (f"val loss {first_val:.3f} -> {last_val:.3f}; " if first_val is not None and last_val
                       is not None else (f"val loss {last_val:.3f}; " if last_val is not None else ""))
                    + (f"{state['skipped']} steps skipped (inf/nan gradients); " if state["skipped"] else "")
                    + f"checkpoint {ckpt}")
        return summary

    def _save_if_finite(self, state: dict) -> bool:
        """Checkpoint unless a weight is inf/nan (then record the failure: the last good checkpoint stays)."""
        if not self.weights_finite():
            state["failure"] = ("diverged", f"the weights hold inf/nan after step {self.step}: the run diverged")
            return False
        self.save()
        return True

    def _fit_budget(self, per_step: float, elapsed: float):
        """Set total_steps from the measured seconds per step so the schedule ends when max_time runs out."""
        c = self.cfg
        if not self.budget_fitted and c.eval_every:  # first fit: evaluations not yet in the measurement
            per_step *= 1.0 + c.eval_batches / (3.0 * c.eval_every * c.grad_accum)
        remaining = 0.97 * c.max_time - elapsed
        self.total_steps = self.step + max(0, int(remaining / max(per_step, 1e-9)))  # == step: stop now
        self.budget_fitted = True


# --------------------------------------------------------------------------- entry points


def train(cfg: TrainConfig | None = None, *, explicit=None, **kwargs) -> dict:
    """Run a training job; returns the summary (see ``Trainer.run``). ``explicit``: see ``Trainer``."""
    cfg = replace(cfg or TrainConfig(), **kwargs)
    if explicit is not None:
        explicit = set(explicit) | set(kwargs)
    return Trainer(cfg, explicit=explicit).run()


__all__ = ["Trainer", "default_out_dir", "prompt_ids", "train"]
