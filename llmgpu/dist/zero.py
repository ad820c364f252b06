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

**Stage 2** shards the gradient too: a rank needs only its reduced piece, so no rank should hold the whole
fp32 gradient. llmgpu's backward pass writes each block's weight gradients between the announcement of the
block after it (or of ``ln_f``) and its own (``model/base.py``), so those gradients live in one of **two
slots**, each the size of one block's weight matrices: block i writes slot i mod 2 while the reduce-scatter
of block i+1 reads the other; before block i-1 starts, the compute stream waits for that reduce-scatter
and zeroes the slot. With gradient accumulation each micro-batch's block gradients are reduce-scattered
and added into the shard. The tensors written at both ends of the backward pass (the tied embedding: by
the LM head first, the lookup last), ``wpe`` and the small 1-D tensors stay resident and are reduced on
the last micro-batch as in stage 1. Gradient memory: resident + 2 slots + ψ/N, instead of ψ.

Checkpoints are written whole (``master_weights``/``optimizer_state`` gather the shards), so a run saved
on N ranks resumes on M.
"""

from __future__ import annotations

import re

import numpy as np

from .. import backend
from ..instrument import region
from ..optim.clip import GradNorm, clip_scale, grad_norm_fused
from ..optim.params import ALIGN, FlatParams
from .ddp import BUCKET_BYTES, BucketedReduction, plan_buckets


class ZeroSync(BucketedReduction):
    """ZeRO stages 1 and 2 on the training step's seam (``dist/seam.py``): buckets reduce-scattered into this
    rank's shard, AdamW over the shard only (``bind_optimizer``), and the working weights all-gathered.

    ``params``: the model's ``FlatParams`` (built with ``param_multiple = world · ALIGN``), holding the weights
    to start from: when the optimizer is bound, this rank keeps its shard of the fp32 master weights and, below
    fp32, frees the whole master buffer (the working copy stays whole: the model reads it).
    """

    def __init__(self, comm, params: FlatParams, *, stage: int = 1, bucket_bytes: int = BUCKET_BYTES):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage}")
        P, W = params, comm.world_size
        blocks = _block_ranges(P, W * ALIGN) if stage == 2 else None
        buckets = _stage2_buckets(P, blocks, bucket_bytes, W * ALIGN) if stage == 2 else None
        super().__init__(comm, P, bucket_bytes, multiple=W * ALIGN, buckets=buckets)
        self.zero_stage = stage
        # rank r's piece of bucket k: P[lo + r·len : lo + (r+1)·len], at shard offset off
        self.pieces = []
        off = 0
        for lo, hi in self.buckets:
            n = (hi - lo) // W
            self.pieces.append((lo + comm.rank * n, n, off))
            off += n
        self.shard_size = off
        self.shard = None  # this rank's FlatParams, made with the optimizer (bind_optimizer)
        xp = self.xp
        self._stats = xp.zeros(2, np.float32)  # [Σ g² of this shard, inf/nan flag], all-reduced
        self._local = GradNorm(*(xp.empty((), np.float32) for _ in range(3)))  # this shard's norm and inf flag
        self.every_micro_batch = stage == 2  # TrainStep then announces the gradients of every micro-batch
        self._block_of: dict[int, int] = {}  # stage 2: bucket → the block whose weight gradients it holds
        self._micro, self._last_micro = 0, True
        if stage == 2:
            self._repack_gradients(blocks)

    def _own(self, full):
        """This rank's pieces of a whole flat buffer, concatenated in bucket order (its shard of it)."""
        return self.xp.concatenate([full[src:src + n] for src, n, _ in self.pieces])

    def bind_optimizer(self, make_optimizer):
        """The shard (this rank's master weights, a gradient and moments of ``shard_size``) and the optimizer
        over it; the whole master buffer is freed below fp32 (the shard holds this rank's part of it)."""
        if self.opt is not None:
            raise ValueError(f"{self!r} already has an optimizer: a seam serves one TrainStep")
        P, xp = self.params, self.xp
        decay_end = sum(n for (lo, hi), (_, n, _) in zip(self.buckets, self.pieces) if hi <= P.decay_end)
        data = self._own(P.data)
        working = data if P.working is P.data else self._own(P.working)
        self.shard = FlatParams.over(data=data, grad=xp.zeros(self.shard_size, np.float32),
                                     m=xp.zeros(self.shard_size, np.float32), v=xp.zeros(self.shard_size, np.float32),
                                     working=working, decay_end=decay_end)
        if P.working is not P.data:
            P.data = None
        self.opt = make_optimizer(self.shard)
        return self.opt

    # ------------------------------------------------------------------ stage 2: the gradient slots

    def _repack_gradients(self, blocks):
        """Replace the flat fp32 gradient by [resident buckets][slot 0][slot 1] and point every tensor's
        gradient view (``FlatParams.grad_offsets``) at its new home."""
        P, xp = self.params, self.xp
        starts = {lo: i for i, (lo, hi) in blocks.items()}
        self._base, pos = {}, 0
        for k, (lo, hi) in enumerate(self.buckets):
            if lo in starts:
                self._block_of[k] = starts[lo]  # in slot block % 2
            else:
                self._base[k] = pos
                pos += hi - lo
        slot_len = max(hi - lo for lo, hi in blocks.values())
        self._slot_base = (pos, pos + slot_len)
        self._slot_len = slot_len
        offsets = {}
        for k, names in enumerate(self.tensors):
            for nm in names:
                offsets[nm] = self._base_of(k) + P.offsets[nm] - self.buckets[k][0]
        P.grad = xp.zeros(pos + 2 * slot_len, np.float32)
        P.grad_offsets = offsets
        self._tmp = xp.zeros(max(n for _, n, _ in self.pieces), np.float32)  # a piece of a later micro-batch
        if self._gpu:
            cp = xp
            self._slot_free = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(2)]
        # whether a slot's event was recorded in this step: before that, stream order (finish joined the
        # streams) protects the slot, and waiting on an event of an earlier step would break graph capture
        self._slot_used = [False, False]
        self._n_layer = len(blocks)

    def _base_of(self, k: int) -> int:
        """Stage 2: where bucket k starts in the repacked gradient (its block's slot, or its resident range)."""
        return self._slot_base[self._block_of[k] % 2] if k in self._block_of else self._base[k]

    def _source(self, k, lo, hi):
        """Where bucket k's gradient lives now (a slot, a resident range, or the flat buffer below stage 2)."""
        if self.zero_stage == 1:
            return self.params.grad[lo:hi]
        base = self._base_of(k)
        return self.params.grad[base:base + hi - lo]

    def start_micro_batch(self, j: int, n: int):
        """Stage 2: micro-batch j of n begins (the block buckets are reduced in every one)."""
        if not self.every_micro_batch:
            return
        if j > 0:  # a model that announced nothing: reduce the previous micro-batch's blocks now
            for k in self._block_of:
                self._start(k)
        self._micro, self._last_micro = j, j == n - 1
        for k in self._block_of:
            self._launched[k] = False
            self._waiting[k] = len(self.tensors[k])
        self._prepare_block(self._n_layer - 1)

    def _prepare_block(self, i: int):
        """Before block i's backward writes its slot: the slot's last reduce-scatter is done; zero it."""
        if not 0 <= i < self._n_layer:
            return
        s = i % 2
        if self._gpu and self._slot_used[s]:
            self.xp.cuda.get_current_stream().wait_event(self._slot_free[s])
        base = self._slot_base[s]
        self.params.grad[base:base + self._slot_len].fill(0)

    def grads_ready(self, names):
        if not self.every_micro_batch:
            return super().grads_ready(names)
        nxt = None
        for nm in names:
            for k in self._of.get(nm, ()):
                if k not in self._block_of and not self._last_micro:
                    continue  # resident: reduced once, on the last micro-batch
                self._waiting[k] -= 1
                if self._waiting[k] == 0:
                    self._start(k)
                if k in self._block_of:
                    nxt = self._block_of[k] - 1
        if nxt is not None:
            self._prepare_block(nxt)

    # ------------------------------------------------------------------ the reduction

    def launch(self, k, lo, hi):
        _, n, off = self.pieces[k]
        g, out = self._source(k, lo, hi), self.shard.grad[off:off + n]
        stream = self.stream if self._gpu else None
        if k not in self._block_of or self._micro == 0:
            self.comm.reduce_scatter(g, out, stream=stream)
        else:  # a later micro-batch of a stage-2 block: add its piece to the shard's
            tmp = self._tmp[:n]
            self.comm.reduce_scatter(g, tmp, stream=stream)
            if self._gpu:
                with self.stream:
                    out += tmp
            else:
                out += tmp
        if k in self._block_of and self._gpu:
            s = self._block_of[k] % 2
            self._slot_free[s].record(self.stream)
            self._slot_used[s] = True

    def finish(self):
        super().finish()
        if self.zero_stage == 2 and self._gpu:
            self._slot_used = [False, False]

    # ------------------------------------------------------------------ the update

    def apply_update(self, lr, scaler, clipper):
        """Global-norm clip over the shards, AdamW on this rank's shard, all-gather of the working weights,
        loss-scaler update. Returns the ``GradNorm`` (norm, scale, found_inf) like ``GradSync.apply_update``."""
        xp, sh, P, sc = self.xp, self.shard, self.params, scaler
        res = clipper.result
        with region("clip (grad norm, sharded)", bytes=sh.grad.nbytes, flops=2.0 * sh.numel):
            local = grad_norm_fused(sh.grad, 0.0, prescale=sc.inv_scale if sc.enabled else None, out=self._local)
            self._stats[0:1] = local.norm * local.norm
            self._stats[1:2] = local.found_inf
            self.comm.all_reduce(self._stats)
            res.norm[...] = xp.sqrt(self._stats[0])
            res.found_inf[...] = xp.minimum(self._stats[1], np.float32(1.0))
            coef = clip_scale(res.norm, clipper.max_norm) if clipper.max_norm > 0 else xp.float32(1.0)
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
        st = self.opt.scalars_state()
        st["m"] = _split(self.params, self._full(self.shard.m))
        st["v"] = _split(self.params, self._full(self.shard.v))
        return st

    def load_optimizer_state(self, state: dict):
        """A whole ``state_dict`` (written on any number of ranks): this rank keeps its pieces of m and v."""
        for key, buf in (("m", self.shard.m), ("v", self.shard.v)):
            full = self.params.flatten(state[key], what=f"optimizer state {key}")
            buf[...] = backend.to_device(np.concatenate([full[src:src + n] for src, n, _ in self.pieces]), self.xp)
        self.opt.load_scalars_state(state)

    def weights_finite(self) -> bool:
        flag = self.xp.asarray([0.0 if bool(self.xp.isfinite(self.shard.data).all()) else 1.0], dtype=np.float32)
        self.comm.all_reduce(flag)
        return float(backend.to_numpy(flag)[0]) == 0.0


# a block's tensors are named <prefix>.<i>.<name>: GPT-2's transformer.h.<i>.*, Llama's model.layers.<i>.*
_BLOCK_INDEX = re.compile(r"\.(\d+)\.")


def _block_ranges(P: FlatParams, multiple: int) -> dict:
    """Block i → (lo, hi): the contiguous range of its weight matrices (the decayed tensors) in the buffer."""
    by_block: dict[int, list[str]] = {}
    for n in P.names:
        if (m := _BLOCK_INDEX.search(n)) and P.decay[n]:
            by_block.setdefault(int(m.group(1)), []).append(n)
    if not by_block or sorted(by_block) != list(range(len(by_block))):
        raise ValueError("ZeRO-2 needs a model of numbered blocks (<prefix>.<i>.<name>: GPT-2's transformer.h.<i>.*, "
                         f"Llama's model.layers.<i>.*), found blocks {sorted(by_block)}")
    out = {}
    for i, names in sorted(by_block.items()):
        held = {n: -(-P.sizes[n] // multiple) * multiple for n in names}  # each tensor's size, padding included
        lo = min(P.offsets[n] for n in names)
        hi = max(P.offsets[n] + held[n] for n in names)
        if hi - lo != sum(held.values()):
            raise ValueError(f"block {i}'s weight matrices are not contiguous in the flat buffer: ZeRO-2 needs them so")
        out[i] = (lo, hi)
    return out


def _stage2_buckets(P: FlatParams, blocks: dict, bucket_bytes: int, multiple: int) -> list:
    """Stage 2's buckets: one per block (its weight matrices), and the rest (embeddings, the 1-D tensors) cut
    like stage 1's."""
    edges = {0, P.decay_end, P.numel}
    for lo, hi in blocks.values():
        edges |= {lo, hi}
    others, _ = plan_buckets(P, bucket_bytes, multiple)
    inside = lambda c: any(lo < c < hi for lo, hi in blocks.values())  # noqa: E731
    edges |= {c for a, b in others for c in (a, b) if not inside(c)}
    e = sorted(edges)
    return [(a, b) for a, b in zip(e[:-1], e[1:]) if b > a]


def _split(P: FlatParams, flat: np.ndarray) -> dict:
    return {n: flat[P.offsets[n]:P.offsets[n] + P.sizes[n]].reshape(P.shapes[n]).copy() for n in P.names}


__all__ = ["ZeroSync"]
