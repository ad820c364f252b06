"""THE training step (train/step.py) and its seams: the data-parallel hooks, one step for trainer and bench,
the CLI generated from TrainConfig, and the activation accounting of both model paths."""

from __future__ import annotations

import argparse
from dataclasses import fields

import numpy as np
import pytest

from llmgpu import bench
from llmgpu.cli import add_train_arguments
from llmgpu.model import GPT, FastGPT, GPTConfig
from llmgpu.model.config import block_param_names
from llmgpu.train import LocalGradSync, TrainConfig, Trainer, TrainStep

pytestmark = pytest.mark.ch7

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=37, block_size=8, pad_vocab_to=8)


def _batch(rng, cfg, B=2, T=8):
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    return x, np.roll(x, -1, axis=1)


@pytest.mark.parametrize("model_cls", [GPT, FastGPT])
@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_grads_ready_names_every_gradient_once_when_it_is_final(rng, model_cls, checkpoint_every):
    m = model_cls(CFG, dtype="fp32", xp=np, seed=1, checkpoint_every=checkpoint_every)
    x, y = _batch(rng, CFG)
    seen, snapshot = [], {}

    def ready(names):
        for n in names:
            seen.append(n)
            snapshot[n] = m.params.grad_of(n).copy()  # what the gradient is at the moment it is "final"

    m.forward_backward(x, y, grads_ready=ready)
    assert sorted(seen) == sorted(m.params.names) and len(seen) == len(set(seen))
    for n in m.params.names:  # nothing wrote to a gradient after it was announced
        assert np.array_equal(snapshot[n], m.params.grad_of(n)), n
    # backward order: ln_f first, then blocks from the last to the first, the embeddings last
    first_block = [seen.index(block_param_names(i)["ln_1.weight"]) for i in range(CFG.n_layer)]
    assert seen[:2] == ["transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert first_block == sorted(first_block, reverse=True)
    assert seen[-2:] == ["transformer.wte.weight", "transformer.wpe.weight"]


class _Recorder(LocalGradSync):
    def __init__(self, params, zero_in_finish=False):
        super().__init__(params)
        self.ready, self.finished, self.zero = [], 0, zero_in_finish

    def grads_ready(self, names):
        self.ready.extend(names)

    def finish(self):
        self.finished += 1
        if self.zero:
            self.params.grad[...] = 0.0


def test_step_calls_the_sync_on_the_last_micro_batch_and_before_the_clip(rng):
    m = GPT(CFG, dtype="fp32", xp=np, seed=1)
    sync = _Recorder(m.params)
    step = TrainStep(m, TrainConfig(lr=1e-3), grad_sync=sync)
    assert step.opt is sync.opt  # the seam owns the optimizer the step built through it
    batches = [_batch(rng, CFG) for _ in range(3)]
    rec = step(batches, 1e-3)
    assert sync.finished == 1 and sorted(sync.ready) == sorted(m.params.names)  # once: the last micro-batch only
    assert rec.shape == (3,) and rec[1] > 0  # a real gradient norm
    # finish() runs before the norm kernel: a sync that zeroes the gradient gives norm 0 and no update
    m2 = GPT(CFG, dtype="fp32", xp=np, seed=1)
    before = m2.params.data.copy()
    step2 = TrainStep(m2, TrainConfig(lr=1e-3, weight_decay=0.0), grad_sync=_Recorder(m2.params, zero_in_finish=True))
    rec2 = step2(batches, 1e-3)
    assert rec2[1] == 0.0 and np.array_equal(m2.params.data, before)


def test_one_step_for_trainer_and_bench(rng, tmp_path):
    """The trainer's step and the bench's step are the same object doing the same arithmetic."""
    t = Trainer(TrainConfig(preset="tiny", device="cpu", batch=2, seq=16, steps=1, progress=False, sample_tokens=0,
                            plot=False, eval_every=0, out=str(tmp_path)))
    assert isinstance(t.step_fn, TrainStep)
    step, model = bench.make_train_step(GPTConfig.preset("tiny"), 2, 16, dtype="fp32", xp=np)
    assert isinstance(step.train_step, TrainStep)
    rec = step()
    assert rec.shape == (3,) and np.isfinite(rec).all()
    # the bench trains with llmgpu train's optimizer settings on this device
    s = bench.optimizer_settings(np)
    opt = step.train_step.opt
    assert (opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay) == (s.lr, s.beta1, s.beta2, s.eps, s.weight_decay)
    assert s.lr == 3e-3  # CPU_DEFAULTS' learning rate: the bench reads it, it does not write it again


def test_graph_mode_needs_the_gpu():
    with pytest.raises(ValueError, match="GPU"):
        TrainStep(GPT(CFG, xp=np), graph=True)


def test_train_flags_are_generated_from_the_config():
    p = add_train_arguments(argparse.ArgumentParser())
    a = p.parse_args([])
    cfg = TrainConfig(**vars(a))
    assert cfg == TrainConfig(), "a flag's default differs from TrainConfig's"
    dests = {act.dest for act in p._actions}
    for f in fields(TrainConfig):
        if f.metadata.get("cli", True):
            assert f.name in dests, f"TrainConfig.{f.name} has no flag"
    # every flag reaches its field
    a = p.parse_args(["--batch", "3", "--no-fast", "--lr", "0.01", "--quiet", "--sync-copy", "--no-plot",
                      "--checkpoint-every", "2", "--schedule", "linear"])
    cfg = TrainConfig(**vars(a))
    assert (cfg.batch, cfg.fast, cfg.lr, cfg.progress, cfg.async_copy, cfg.plot, cfg.checkpoint_every,
            cfg.schedule) == (3, False, 0.01, False, False, False, 2, "linear")


def test_activation_bytes_match_what_each_model_keeps(rng):
    x, y = _batch(rng, CFG, B=3)
    for m in (GPT(CFG, dtype="fp32", xp=np), FastGPT(CFG, dtype="fp32", xp=np), GPT(CFG, dtype="fp64", xp=np),
              FastGPT(CFG, dtype="fp64", xp=np)):
        m.forward_backward(x, y)
        est = m.activation_bytes(3, 8)
        assert est["stored"] == m.stats["activation_bytes_stored"], (type(m).__name__, m.dtype)
    flash, math_ = FastGPT(CFG, xp=np).activation_bytes(3, 8), GPT(CFG, xp=np).activation_bytes(3, 8)
    assert flash["stored"] < math_["stored"]  # no B·H·T·T probabilities on the flash path
