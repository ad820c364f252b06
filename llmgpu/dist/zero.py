"""ZeRO (chapter 9): shard the optimizer state over the ranks instead of copying it to every one.

Data parallelism keeps on every rank what AdamW needs for *every* parameter: the fp32 master weight and two
fp32 moments, 12 bytes per parameter, the largest part of training memory. ZeRO stage 1 (Rajbhandari et al.,
"ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", 2020) gives rank r only a 1/N piece
of each gradient bucket to update:

    reduce-scatter each bucket   (rank r receives the sum of piece r: half the traffic of an all-reduce)
    ‖g‖: each rank's sum of squares over its pieces, all-reduced (one 2-element all-reduce, with the inf flag)
    AdamW over rank r's pieces only  (the same fused kernel, on a FlatParams over the shard buffers)
    all-gather each bucket's updated working-precision weights   (the other half of an all-reduce)

So the traffic equals one all-reduce, and the master weights and moments shrink to 12ψ/N bytes per rank.
A rank's shard is the concatenation of its pieces in bucket order; every bucket ends on a multiple of
N·ALIGN (the model is built with ``param_multiple=N·ALIGN``), so each piece is aligned, and one bucket
boundary is the decay split, so the shard's decay split is a single point too: one AdamW launch.

Checkpoints are written whole (``full_state`` gathers the shards), so a run saved on N ranks resumes on M.
"""

from __future__ import annotations

import numpy as np

from .. import backend
from ..instrument import region
from ..optim import AdamW
from ..optim.clip import grad_norm_fused
from ..optim.params import ALIGN, FlatParams
from .ddp import BUCKET_BYTES, BucketedReduction


class ZeroSync(BucketedReduction):
    """ZeRO stage 1 on the training step's seam: buckets reduce-scattered into this rank's shard, a
    sharded update (``apply_update``), and the working weights all-gathered.

    ``step``: the ``TrainStep`` whose optimizer, scaler and clipper this replaces; its AdamW state (restored
    or fresh) becomes the shards, and the full-size moments (and, below fp32, the master weights) are freed.
    """

    zero_stage = 1

    def __init__(self, comm, step, *, stage: int = 1, bucket_bytes: int = BUCKET_BYTES):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}")
        self.zero_stage = stage
        P = step.params
        W = comm.world_size
        super().__init__(comm, P, bucket_bytes, multiple=W * ALIGN)
        xp = self.xp
        self.scaler, self.grad_clip, self.clipper = step.scaler, step.grad_clip, step.clipper
        # rank r's piece of bucket k: P[lo + r·len : lo + (r+1)·len], at shard offset off
        self.pieces = []
        off = 0
        for lo, hi in self.buckets:
            n = (hi - lo) // W
            self.pieces.append((lo + comm.rank * n, n, off))
            off += n
        self.shard_size = off
        decay_end = sum(n for (lo, hi), (_, n, _) in zip(self.buckets, self.pieces) if hi <= P.decay_end)

        def gather_own(full):
            return xp.concatenate([full[src:src + n] for src, n, _ in self.pieces])

        data = gather_own(P.data)
        working = data if P.working is P.data else gather_own(P.working)
        self.shard = FlatParams.over(data=data, grad=xp.zeros(self.shard_size, np.float32), m=gather_own(P.m),
                                     v=gather_own(P.v), working=working, decay_end=decay_end)
        old = step.opt
        self.opt = AdamW(self.shard, lr=old.lr, betas=(old.beta1, old.beta2), eps=old.eps,
                         weight_decay=old.weight_decay)
        self.opt.step_count[...] = old.step_count
        self._stats = xp.zeros(2, np.float32)  # [Σ g² of this shard, inf/nan flag], all-reduced
        f32 = backend.float32
        self._local = type(self.clipper.result)(xp.empty((), f32), xp.empty((), f32), xp.empty((), f32))
        # the full-size optimizer state is the shards' now
        P.m = P.v = None
        if P.working is not P.data:
            P.data = None
        step.opt = self.opt

    # ------------------------------------------------------------------ the reduction

    def launch(self, k, lo, hi):
        src, n, off = self.pieces[k]
        g, out = self.params.grad[lo:hi], self.shard.grad[off:off + n]
        self.comm.reduce_scatter(g, out, stream=self.stream if self._gpu else None)

    # ------------------------------------------------------------------ the update

    def apply_update(self, lr):
        """Global-norm clip over the shards, AdamW on this rank's shard, all-gather of the working weights,
        loss-scaler update. Returns the ``GradNorm`` (norm, scale, found_inf) like ``train.step.apply_update``."""
        xp, sh, P, sc = self.xp, self.shard, self.params, self.scaler
        res = self.clipper.result
        with region("clip (grad norm, sharded)", bytes=sh.grad.nbytes, flops=2.0 * sh.numel):
            local = grad_norm_fused(sh.grad, 0.0, prescale=sc.inv_scale if sc.enabled else None, out=self._local)
            self._stats[0:1] = local.norm * local.norm
            self._stats[1:2] = local.found_inf
            self.comm.all_reduce(self._stats)
            res.norm[...] = xp.sqrt(self._stats[0])
            res.found_inf[...] = xp.minimum(self._stats[1], np.float32(1.0))
            coef = xp.float32(1.0)
            if self.grad_clip > 0:
                with np.errstate(invalid="ignore", divide="ignore"):
                    coef = xp.minimum(np.float32(1.0), np.float32(self.grad_clip) / (res.norm + np.float32(1e-6)))
                coef = xp.where(xp.isnan(coef), np.float32(1.0), coef)
            res.scale[...] = coef * sc.inv_scale if sc.enabled else coef
        with region("adamw (shard)", bytes=sh.numel * (4 * 4 + 4 * 4 + sh.working.dtype.itemsize),
                    flops=15.0 * sh.numel):
            self.opt.step(lr=lr, grad_scale=res.scale, found_inf=res.found_inf, zero_grad=True)
        P.grad.fill(0)  # the full buffer the backward pass accumulates into
        with region("all-gather weights", bytes=P.working.nbytes):
            for (lo, hi), (_, n, off) in zip(self.buckets, self.pieces):
                self.comm.all_gather(sh.working[off:off + n], P.working[lo:hi])
        sc.update(res.found_inf)
        return res

    # ------------------------------------------------------------------ whole state (checkpoints)

    def _full(self, shard_buf):
        """One whole flat fp32 buffer from every rank's shard of it (an all-gather per bucket), on the host."""
        full = self.xp.empty(self.params.numel, np.float32)
        for (lo, hi), (_, n, off) in zip(self.buckets, self.pieces):
            self.comm.all_gather(shard_buf[off:off + n], full[lo:hi])
        return backend.to_numpy(full)

    def master_weights(self) -> dict:
        """name → fp32 master weight (gathered): what ``FlatParams.to_dict`` gives without ZeRO."""
        return _split(self.params, self._full(self.shard.data))

    def optimizer_state(self) -> dict:
        """AdamW's ``state_dict`` as if unsharded: m and v gathered per name, the step count, hyperparameters."""
        st = {k: v for k, v in self.opt.state_dict().items() if k not in ("m", "v")}
        st["m"] = _split(self.params, self._full(self.shard.m))
        st["v"] = _split(self.params, self._full(self.shard.v))
        return st

    def weights_finite(self) -> bool:
        flag = self.xp.asarray([0.0 if bool(self.xp.isfinite(self.shard.data).all()) else 1.0], dtype=np.float32)
        self.comm.all_reduce(flag)
        return float(backend.to_numpy(flag)[0]) == 0.0


def _split(P: FlatParams, flat: np.ndarray) -> dict:
    return {n: flat[P.offsets[n]:P.offsets[n] + P.sizes[n]].reshape(P.shapes[n]).copy() for n in P.names}


__all__ = ["ZeroSync"]
