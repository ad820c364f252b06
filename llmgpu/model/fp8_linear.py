"""The FP8 linear layers of the fast step (issue 37, chapter 5b): ``FastOptions(fp8="current" | "delayed")``.

**Which GEMMs.** The attention's QKV projection, the MLP's input (with its GELU) and output projections run
their forward GEMM and both backward GEMMs in FP8; the attention's output projection, the LM head, attention
itself, the norms and the optimizer stay in the model's dtype (``dev/cuda/fp8_plan.md`` argues each choice).

**One layer.** Weights and activations are E4M3, the incoming gradient E5M2 (more range, less precision:
Micikevicius et al. 2022). cuBLASLt's FP8 GEMMs take only operands contiguous along the reduction
(``llmgpu.gemm.fp8``), so every cast also writes the transposed bytes the backward needs, in the same pass::

    forward    x → x8, x8ᵀ        W → W8, W8ᵀ        y  = x8 · W8ᵀ   (+ bias, GELU: cuBLASLt's epilogue)
    backward   dy → dy8, dy8ᵀ                        dW += dy8ᵀ · (x8ᵀ)ᵀ   (fp32, beta = 1)
                                                     dx = dy8 · (W8ᵀ)ᵀ     (× GELU'(f): the DGELU epilogue)
                                                     db += Σ dy             (the bf16 bias-gradient kernel)

The forward keeps x8ᵀ (one byte per element) for the weight gradient instead of the bf16 input: the FP8 step
stores less than the bf16 one.

**Scaling** (``llmgpu.ops.fp8``). Every tensor follows the recipe: ``"current"`` measures each tensor before casting
it (the scale always fits; a second read of the tensor, and for each a scale update), ``"delayed"`` casts with the
scale from the last ``fp8_history`` steps' amaxes and records this step's amax in the same pass; ``end_step()``
(called at the end of ``forward_backward``) turns the recorded amaxes into the next scales. The first step of a
delayed run has no history yet, so it scales like ``"current"``; so does a state that a resumed checkpoint did not
hold, in the resumed run's first step. ``delayed_weights=False`` (``FastOptions.fp8_delayed_weights``) keeps the
weights on current scaling under the delayed recipe (the step before, for A/B benchmarks). Delaying them is safe: a
weight moves by about the learning rate in a step, so its amax rarely passes its history's max, and then by that
much (the cast saturates that weight, never inf). Within one ``forward_backward`` no scale changes between a
tensor's forward cast and its recomputation (activation checkpointing), so a checkpointed step has the same bits as
one without.

**One update launch.** The delayed states are made on first use, in the first step; that step's ``end_step`` moves
them into the flat device buffers of one ``AmaxHistories`` (the states' arrays become views of its rows), and every
``end_step`` from then on updates all of them and zeroes their amaxes in one launch instead of two per state. A
CUDA graph is captured only after eager steps (``TrainStep``'s warm-up), so it sees the grouped arrays; a state
once grouped never moves (one first used later would join a group of its own), so a graph's pointers stay valid.

**Epilogues.** cuBLASLt has FP8 kernels with the BIAS, GELU_AUX_BIAS and DGELU epilogues, but on an H100 some
ran slower than the same FP8 GEMM without an epilogue followed by a separate pass (the fused DGELU 2.4x slower;
chapter 5b's profiles). ``FastOptions.fp8_fused_epilogues`` names the ones fused (default: GELU_AUX_BIAS and BIAS);
the others run as the plain product followed by ``add_bias`` / ``gelu_forward`` / ``gelu_backward``. A machine whose
cuBLASLt has no FP8 kernel for a fused one fails the plan on the first call (always outside a CUDA graph
capture), and the layer runs it unfused from then on; ``unfused`` lists the epilogues for which that happened.

**Fused casts** (``FastOptions.fp8_fused_casts``). A layer's output gradient is read by its cast and by a bias
gradient pass; the cast now sums the columns itself (``column_sums=``, deterministic). And the MLP's GELU output
is read only by the cast that feeds MLP-out's FP8 GEMM, the pre-activation's gradient only by MLP-in's gradient
cast and its bias gradient. So MLP-in's GEMM writes just x·Wᵀ (no epilogue), MLP-out's forward casts
GELU(x·Wᵀ + b) from it (``act="gelu"``), and MLP-in's backward casts dg · GELU'(x·Wᵀ + b) from MLP-out's input
gradient dg (``act="dgelu"``): neither GELU's output, the biased pre-activation nor its gradient is ever written in
bf16 (``ops/fp8.py``). Per element of the [N, 4C] tensors, the passes between MLP-in's GEMM and MLP-out's, and
between MLP-out's dgrad and MLP-in's backward GEMMs, move 18 bytes instead of 24 under current scaling and 12
instead of 20 under delayed scaling::

    forward    f = x8 · W8ᵀ                         (MLP-in, no epilogue; kept for the backward)
               g8, g8ᵀ = cast(GELU(f + b))          (MLP-out's input cast)
    backward   dg = dy8 · (W8ᵀ)ᵀ                    (MLP-out's dgrad, no epilogue)
               d8, d8ᵀ = cast(dg · GELU'(f + b)),  db += Σ dg · GELU'(f + b)     (MLP-in's output gradient)

**LayerNorm casts** (``FastOptions.fp8_layernorm_casts``, delayed scaling only). The QKV and MLP-in inputs are
LayerNorm outputs that nothing but those layers reads, and under delayed scaling their scale is known before the
LayerNorm runs. So ``add_layernorm`` runs the block's residual add + LayerNorm writing the layer's E4M3 bytes and
amax, then a byte transpose (``ops/fp8_layernorm.py``), and ``forward`` / ``keep`` take that ``Fp8Tensor`` instead of
casting: per element 3 bytes moved instead of 6, and no bf16 LayerNorm output at all. Current scaling, and the first
step of a delayed run, keep the bf16 LayerNorm and the cast (the scale needs this tensor's amax first).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import backend
from ..gemm.fp8 import fp8_gemm
from ..instrument import region
from ..ops.fp8 import AmaxHistories, AmaxHistory, Fp8Tensor, fp8_cast, quantize
from ..ops.fp8_layernorm import fp8_add_layernorm
from ..ops.gelu import gelu_backward, gelu_forward
from ..ops.linear import add_bias, bias_grad
from .options import FP8_LINEARS as FP8_LAYERS  # per block, the linear layers that run in FP8

FORMATS = {"x": "e4m3", "w": "e4m3", "dy": "e5m2"}  # the format of each of a layer's three tensors


class Fp8Saved(NamedTuple):
    """What a layer's forward keeps for its backward: x8ᵀ [Cin, N] and W8ᵀ [Cin, Cout] with their scale_inv."""

    x_t: object
    x_scale_inv: object
    w_t: object
    w_scale_inv: object


class Fp8Linears:
    """The FP8 linear layers of one model: the scaling state of every (layer, tensor) and the three GEMMs of a
    layer. ``recipe``: "current" or "delayed" (module docstring); ``history``: steps of amax the delayed recipe
    keeps per tensor; ``delayed_weights``: the delayed recipe scales the weights from their history too (else
    current scaling, always, for them)."""

    def __init__(self, recipe: str, history: int, xp, *, fused_epilogues: tuple = (), fused_casts: bool = False,
                 delayed_weights: bool = False):
        self.recipe, self.history, self.xp = recipe, int(history), xp
        # the roles whose states keep an amax history (delayed recipe): the tensors cast with the scale it gives
        self.delayed_roles = (("x", "dy", "w") if delayed_weights else ("x", "dy")) if recipe == "delayed" else ()
        self.fused_epilogues = frozenset(fused_epilogues)
        self.fused_casts = bool(fused_casts)  # the output gradients' casts also sum the bias gradients
        self.states: dict = {}  # (layer, "x" | "w" | "dy") -> AmaxHistory, made on first use
        self.groups: list = []  # AmaxHistories of the delayed states: end_step's launches (one after the first step)
        self._ungrouped: list = []  # delayed states made since the last end_step
        self.primed = False  # delayed: False until the first step has filled the histories
        self._resumed = None  # after load_state_dict, until its step ends: the states it restored (the others scale
        # like current scaling in that step, as in a first step: a checkpoint from before weights were delayed)
        self.unfused: set = set()  # epilogues cuBLASLt had no FP8 kernel for (module docstring)

    # ------------------------------------------------------------------ scaling

    def state(self, layer: str, role: str) -> AmaxHistory:
        key = (layer, role)
        st = self.states.get(key)
        if st is None:
            delayed = role in self.delayed_roles
            st = self.states[key] = AmaxHistory(FORMATS[role], self.history if delayed else 1, xp=self.xp)
            if delayed:
                self._ungrouped.append(st)
        return st

    def _delayed(self, layer: str, role: str) -> bool:
        """Whether the (layer, role) state casts with its history's scale now (else it measures the tensor first)."""
        return role in self.delayed_roles and self.primed and (self._resumed is None or (layer, role) in self._resumed)

    def cast(self, x, layer: str, role: str, *, rowwise: bool = True, transpose: bool = True, record: bool = True,
             act=None, pre=None, bias=None, column_sums=None):
        """``x`` as FP8 bytes (``Fp8Tensor``) with the (layer, role) state's scaling; ``record=False`` (inference)
        leaves a delayed state's amax alone. ``act``, ``pre``, ``bias``, ``column_sums``: ``fp8_cast``'s GELU on the
        fly (the module docstring)."""
        st = self.state(layer, role)
        delayed = self._delayed(layer, role)
        reads = (1 if delayed else 2) * (2 if pre is not None else 1)
        kw = dict(rowwise=rowwise, transpose=transpose, scale_inv=st.scale_inv, act=act, pre=pre, bias=bias,
                  column_sums=column_sums)
        with region(f"fp8 cast {role}" + (f" ({act})" if act else ""),
                    bytes=x.size * (x.dtype.itemsize * reads + rowwise + transpose), flops=2.0 * x.size):
            if delayed:
                return fp8_cast(x, st.scale, st.fmt, amax=st.amax if record else None, accumulate_amax=record, **kw)
            return quantize(x, st, recipe="current", **kw)

    def end_step(self):
        """After a step's backward: a delayed recipe's recorded amaxes become its next scales and are zeroed for the
        next step's casts (which raise them again: accumulate_amax); one launch for all states, no host
        synchronisation. States made since the last ``end_step`` join a new group first (module docstring). Nothing
        to do for current scaling."""
        if self.recipe != "delayed":
            return
        if self._ungrouped:
            self.groups.append(AmaxHistories(self._ungrouped))
            self._ungrouped = []
        for group in self.groups:
            if self.primed:
                group.update_and_clear()
            else:  # the first step scaled like current scaling, which already recorded its amaxes
                group.clear_amax()
        self.primed = True
        self._resumed = None

    def state_dict(self) -> dict:
        """The delayed recipe's scaling state in JSON form ({} under current scaling, which keeps none between
        steps): per activation and gradient its amax ring, the ring's position and the scale it gives, and whether
        the first step has run. A checkpoint keeps it, so a resumed run casts with the scales an uninterrupted run
        would (bit for bit), not like a first step. Read between steps (the recorded amaxes are then 0)."""
        if self.recipe != "delayed":
            return {}
        host = lambda a: [float(v) for v in np.asarray(backend.to_numpy(a), dtype=np.float32)]  # noqa: E731
        return {"history": self.history, "primed": self.primed,
                "states": {f"{layer}|{role}": {"history": host(st.history), "pos": int(backend.to_numpy(st.pos)[0]),
                                               "scale": host(st.scale)[0], "scale_inv": host(st.scale_inv)[0]}
                           for (layer, role), st in sorted(self.states.items()) if role in self.delayed_roles}}

    def load_state_dict(self, state: dict):
        """Put ``state_dict()``'s state back (into the device arrays, made here if the model has not run yet); an
        empty one (current scaling, or a checkpoint made before it was kept) changes nothing. One that does not fit
        this recipe or history length is a ValueError."""
        if not state:
            return
        if self.recipe != "delayed" or state.get("history") != self.history:
            raise ValueError(f"FP8 scaling state of the delayed recipe with history {state.get('history')!r}, but this "
                             f"model runs {self.recipe!r}" + (f" with history {self.history}" if self.recipe ==
                                                             "delayed" else ""))
        for key, s in state["states"].items():
            layer, _, role = key.rpartition("|")
            if role not in self.delayed_roles:
                why = " (FastOptions.fp8_delayed_weights is off)" if role == "w" else ""
                raise ValueError(f"FP8 scaling state {key!r}: this model keeps histories for "
                                 f"{'/'.join(self.delayed_roles)} only{why}")
            if len(s["history"]) != self.history or not 0 <= s["pos"] < self.history:
                raise ValueError(f"FP8 scaling state {key!r} does not fit a history of {self.history} steps")
            st = self.state(layer, role)
            for name, value in (("history", s["history"]), ("pos", [s["pos"]]), ("scale", [s["scale"]]),
                                ("scale_inv", [s["scale_inv"]])):
                arr = getattr(st, name)
                arr[...] = backend.to_device(np.asarray(value, dtype=arr.dtype), self.xp)
            st.amax.fill(0)
        self.primed = bool(state["primed"])
        self._resumed = {tuple(key.rpartition("|")[::2]) for key in state["states"]}

    # ------------------------------------------------------------------ the three GEMMs

    def add_layernorm(self, x, a, gamma, beta, layer: str, *, name: str, train: bool = True):
        """The residual add + LayerNorm whose output is FP8 layer ``layer``'s input, written as that input's bytes
        (``ops.fp8_layernorm``; with ``train`` also the transposed bytes and the recorded amax): ``(x + a written
        over a, Fp8Tensor, mean, rstd)``, which ``forward`` and ``keep`` take in place of x. None where the scale is
        not known before the LayerNorm runs (current scaling, or the first step of a delayed run): the caller runs
        the bf16 LayerNorm and ``forward`` casts its output."""
        if not self._delayed(layer, "x"):
            return None
        st = self.state(layer, "x")
        with region(name + " (fp8)", bytes=3 * x.nbytes + x.size * (3 if train else 1) + 8 * x.shape[0],
                    flops=10.0 * x.size):
            return fp8_add_layernorm(x, a, gamma, beta, st.scale, residual_out=a, transpose=train,
                                     amax=st.amax if train else None, accumulate_amax=train, scale_inv=st.scale_inv)

    def _input(self, x, layer: str, *, rowwise: bool = True, transpose: bool = True, record: bool = True, act=None,
               act_bias=None) -> Fp8Tensor:
        """A layer's input as FP8: x cast, or x itself when ``add_layernorm`` already wrote it as FP8."""
        if isinstance(x, Fp8Tensor):
            return x
        return self.cast(x, layer, "x", rowwise=rowwise, transpose=transpose, record=record, act=act, bias=act_bias)

    def forward(self, x, w, bias, layer: str, *, name: str, epilogue: str = "none", aux=None, train: bool = True,
                act=None, act_bias=None):
        """``y = x Wᵀ`` (+ bias; ``epilogue`` "bias" or "gelu_bias", the latter writing the pre-activation into
        ``aux``, a temporary when None) in W's dtype: ``(y, Fp8Saved or None)`` (None with ``train=False``). x: the
        input, or its ``Fp8Tensor`` from ``add_layernorm``. ``act="gelu"``: the layer's input is GELU(x +
        act_bias), applied by its cast. ``name``: the profiler region's, as the bf16 step's."""
        x8 = self._input(x, layer, transpose=train, record=train, act=act, act_bias=act_bias)
        w8 = self.cast(w, layer, "w", transpose=train, record=train)
        (n, k), m = x8.data.shape, w.shape[0]
        y = self.xp.empty((n, m), dtype=w.dtype)
        if epilogue == "gelu_bias" and aux is None:  # inference: the pre-activation is written, then dropped
            aux = self.xp.empty((n, m), dtype=w.dtype)
        with region(name, flops=2.0 * n * k * m, bytes=n * k + k * m + n * m * w.dtype.itemsize):
            self._gemm(x8.data, w8.data, x8.scale_inv, w8.scale_inv, "e4m3", y, epilogue, bias, aux)
        return y, (Fp8Saved(x8.data_t, x8.scale_inv, w8.data_t, w8.scale_inv) if train else None)

    def keep(self, x, w, layer: str, *, act=None, act_bias=None) -> Fp8Saved:
        """The casts ``forward`` would keep, without its GEMM (a recomputed span's last layer: its output is not
        needed, its backward is)."""
        x8 = self._input(x, layer, rowwise=False, act=act, act_bias=act_bias)
        w8 = self.cast(w, layer, "w", rowwise=False)
        return Fp8Saved(x8.data_t, x8.scale_inv, w8.data_t, w8.scale_inv)

    def backward(self, dy, saved: Fp8Saved, layer: str, dw, db, *, name: str, dgrad_name: str, epilogue: str = "none",
                 aux=None, act=None, act_bias=None):
        """``dW += dyᵀ x`` (fp32 ``dw``), ``db += Σ dy`` (``db`` None: no bias) and the input gradient ``dy W``
        (``epilogue="dgelu"``: times GELU'(``aux``)), returned in dy's dtype. ``act="dgelu"``: the layer's output
        gradient is dy · GELU'(aux + act_bias), applied by its cast. With ``fused_casts`` the cast adds db. ``name``,
        ``dgrad_name``: the profiler regions' names, as the bf16 step's."""
        n, cout = dy.shape
        cin = saved.x_t.shape[0]
        if n % 16:
            raise ValueError(f"the FP8 weight gradient reduces over the batch's B·T = {n} tokens, which cuBLASLt's FP8 "
                             "GEMMs need to be a multiple of 16")
        fused_db = self.fused_casts and db is not None
        g8 = self.cast(dy, layer, "dy", act=act, pre=aux if act else None, bias=act_bias,
                       column_sums=db if fused_db else None)
        with region(name + " wgrad", flops=2.0 * n * cout * cin, bytes=n * (cout + cin) + 8 * cout * cin):
            fp8_gemm(g8.data_t, saved.x_t, g8.scale_inv, saved.x_scale_inv, a_format="e5m2", out=dw, beta=1.0,
                     out_dtype=dw.dtype)
        if db is not None and not fused_db:
            with region(name + " bgrad", bytes=dy.nbytes + 8 * cout, flops=float(dy.size)):
                bias_grad(dy, out=db, accumulate=True)
        dx = self.xp.empty((n, cin), dtype=dy.dtype)
        with region(dgrad_name + " dgrad", flops=2.0 * n * cout * cin, bytes=n * cout + cout * cin + n * cin * 2):
            self._gemm(g8.data, saved.w_t, g8.scale_inv, saved.w_scale_inv, "e5m2", dx, epilogue, None, aux)
        return dx

    def _gemm(self, a, b, sa, sb, a_format, out, epilogue, bias, aux):
        """``out = a · bᵀ`` with ``epilogue`` fused by cuBLASLt, or unfused where it has no FP8 kernel for it."""
        if epilogue in self.fused_epilogues and epilogue not in self.unfused:
            try:
                return fp8_gemm(a, b, sa, sb, a_format=a_format, out=out, out_dtype=out.dtype, epilogue=epilogue,
                                bias=bias, aux=aux)
            except RuntimeError as e:
                if "cuBLASLt" not in str(e) and "cublasLt" not in str(e):
                    raise
                self.unfused.add(epilogue)  # from now on the unfused form (the module docstring)
        if epilogue == "gelu_bias":  # the product into the pre-activation's buffer, then two passes
            fp8_gemm(a, b, sa, sb, a_format=a_format, out=aux, out_dtype=aux.dtype)
            gelu_forward(add_bias(aux, bias), out=out)
            return out
        fp8_gemm(a, b, sa, sb, a_format=a_format, out=out, out_dtype=out.dtype)
        if epilogue == "bias":
            add_bias(out, bias)
        elif epilogue == "dgelu":
            gelu_backward(out, aux, out=out)
        return out


__all__ = ["FP8_LAYERS", "FORMATS", "Fp8Linears", "Fp8Saved"]
