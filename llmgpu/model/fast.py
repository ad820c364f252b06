"""The chapter 8 GPT: the same model as ``llmgpu.model.GPT``, with the step rebuilt for speed.

``FastGPT`` is ``GPT``'s sibling on ``GPTBase`` (``model/base.py``: configuration, parameters in one
``FlatParams``, state dict names, initialization, sampling, the loss) with its own forward and backward passes.
What changes, and why (chapter 8 measures each item):

* **Every GEMM through cuBLASLt** (``llmgpu.gemm.cublaslt.lt_gemm``): CuPy refuses its own cuBLAS calls while a
  stream is capturing, cuBLASLt called directly does not, so the whole step can become one CUDA graph
  (``TrainStep(graph=True)``). Weight gradients go straight into the fp32 gradient buffer (``beta=1``); a token
  count N not a multiple of 64 is split into two GEMMs (``ksplit.wgrad_gemm``: the trap at N = 2ⁿ + 1, issue 13).
* **Epilogue fusions**: the bias add rides in the GEMM's store (BIAS), the MLP's ``GELU(x W₁ᵀ + b₁)`` is one GEMM
  that also keeps the pre-activation (GELU_AUX_BIAS; GELU_BIAS in ``forward``), and the backward's
  ``(dm W₂) ⊙ GELU'(f)`` is one GEMM (DGELU): each removes a read and a write of an activation.
* **Residual add + LayerNorm in one kernel** (``add_layernorm_forward``): ``x ← x + a`` then ``LN(x)`` reads
  ``x`` and ``a`` once instead of three times; the backward adds the residual gradient inside the LayerNorm
  backward kernel (``dresidual=``) and accumulates dγ, dβ straight into the fp32 gradients.
* **Flash attention** (``llmgpu.ops.flash_attention``: our kernel of chapter 2b or cuDNN's,
  ``FastOptions.attention_kernel``; "auto", the default, takes whichever is faster on the machine, chosen once per
  shape and kept in the model's ``kernel_choices``, which a training run saves in its checkpoint) on strided views
  of the QKV buffer: no ``[B, H, T, T]`` probabilities, and no transposing copies around attention. With fp32
  working precision on the GPU (both take fp16/bf16) the chapter 2 kernels run instead.

Every choice of this step is a field of one frozen ``FastOptions`` (``options=``), fixed for the model's life.
This module is long because it is the whole step in reading order, as nanoGPT's ``model.py`` is (the block's
forward and backward, checkpointing, the chunked head, the FP8 layers' wiring); splitting it would scatter the step.

**The LM head in chunks of rows** (``lm_head_rows``): in ``forward_backward`` the logits are made, turned
into their gradient (cross-entropy backward, in place) and consumed by the head's dgrad and weight gradient
``lm_head_rows`` rows at a time, so the ``[N, Vp]`` logits — 6.6 GB at GPT-2's B = 64, T = 1024, more than
any other activation — never exist whole. The loss is the chunks' sums over the batch's target count.
With ``fused_cross_entropy`` (default) a chunk's cross-entropy forward and backward are one kernel
(``cross_entropy_forward_backward``): it reads each row of logits once, writes the row's gradient over it
(divided by the batch's target count, a device scalar) and adds the chunk's loss sum into one device scalar.
With ``embedding_grad_into_fp32`` (default) the embedding backward adds its fp32 row sums straight into the fp32
gradients of ``wte`` (the batch's token rows only) and ``wpe``, instead of a bf16 ``[Vp, C]`` array cast and added.

**Vocabulary padding.** An unpadded vocabulary (50257) gives the LM head's GEMMs row strides that are not
multiples of 16 bytes, where cuBLASLt falls back to much slower kernels (205 ms per GPT-2 step at B = 64 on the
H200), so ``FastGPT`` pads the vocabulary to a multiple of ``VOCAB_ALIGN`` when the configuration does not:
padded logits are masked to -1e4, their gradients are zero, ``state_dict(unpadded=True)`` gives the original shapes.
The gradients agree with ``GPT``'s to rounding (the fusions round at different points; in fp32 on NumPy ~1e-6).

**Activation checkpointing** (``checkpoint_every=k``, 0 = off), as chapter 6 does it for ``GPT``, except where
a span starts: the fused residual add + LayerNorm crosses block boundaries (block i's ``ln_1`` runs in block
i-1's last kernel), so the span input kept for every k-th block is the residual stream ``x`` entering it *and*
``ln_1(x)`` with its mean and rstd (``2·B·T·C`` values instead of ``B·T·C``). The backward walks the spans from
the last to the first, reruns a span's blocks from that state (the same kernels on the same inputs, the span's
last residual add + LayerNorm skipped) and runs their backward: the gradients are bitwise those without
checkpointing, and the step still captures as one CUDA graph.

**FP8** (``FastOptions(fp8="current" | "delayed")``, chapter 5b): each block's QKV, MLP-in and MLP-out layers run
their three GEMMs in FP8 through ``model/fp8_linear.py`` (``_layer_forward`` / ``_layer_backward``); their
caches then hold the inputs' one-byte transposed casts instead of the inputs. With ``fp8_fused_casts`` the MLP's
GELU and its derivative run inside the FP8 casts around them instead of cuBLASLt's epilogues, and the casts of
the layers' output gradients also sum their bias gradients. With ``fp8_layernorm_casts`` and delayed scaling the
residual add + LayerNorm before QKV and MLP-in writes its output as the layer's FP8 bytes
(``Fp8Linears.add_layernorm``): the state and caches then hold those bytes (a span input's ``ln_1(x)`` too).

Every op sits in an ``instrument.region`` (a no-op unless a timer is active), so ``OpTimer`` can produce
the per-op table of chapter 8 and ``nsys`` timelines read like the model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import backend
from ..gemm.cublaslt import lt_gemm
from ..gemm.ksplit import wgrad_gemm
from ..instrument import region
from ..ops.attention import attention_backward, attention_forward
from ..ops.cross_entropy import (
    IGNORE_INDEX,
    cross_entropy_backward,
    cross_entropy_forward,
    cross_entropy_forward_backward,
)
from ..ops.embedding import embedding_backward, embedding_forward
from ..ops.flash_attention import (
    KernelChoices,
    flash_attention_backward,
    flash_attention_forward,
    heads_view,
    split_qkv,
)
from ..ops.layernorm import add_layernorm_forward, layernorm_backward, layernorm_forward
from ..ops.linear import bias_grad
from ..optim.params import ALIGN
from .base import PAD_LOGIT, GPTBase, accumulate_grad, nbytes_of
from .config import LNF_B, LNF_W, WPE, WTE, GPTConfig, block_param_names
from .fp8_linear import Fp8Linears, Fp8Saved
from .options import FP8_ONLY_GPT2, FastOptions

VOCAB_ALIGN = 64  # pad the vocabulary to a multiple of this (unless the config pads already)


class FastGPT(GPTBase):
    """GPT-2 with the chapter 8 step: cuBLASLt GEMMs with fused epilogues, fused residual + LayerNorm,
    flash attention. Same constructor as ``GPT``; ``checkpoint_every``: 0 (off) or k ≥ 1 (keep every k-th
    block's input state, recompute the rest in backward; module docstring); ``options``: a ``FastOptions``
    (None: the defaults). ``kernel_choices``: what ``attention_kernel="auto"`` resolved to per attention call
    shape (a ``KernelChoices``: a training run saves it in its checkpoint and pins it on resume)."""

    keeps_ln_1 = True  # a checkpointed span input holds ln_1's output and statistics too (module docstring)
    runs_fp8 = True  # FastOptions.fp8 is implemented by this class's blocks (model/fp8_linear.py)

    def __init__(self, config: GPTConfig, *, dtype="bf16", checkpoint_every: int = 0, xp=None, seed: int = 0,
                 init: bool = True, param_multiple: int = ALIGN, options: FastOptions | None = None):
        if options is not None and not isinstance(options, FastOptions):
            raise TypeError(f"options must be a FastOptions, got {type(options).__name__}")
        self._options = FastOptions() if options is None else options
        self.kernel_choices = KernelChoices()
        self.checkpoint_every = checkpoint_every
        if config.pad_vocab_to <= 1 and config.vocab_size % VOCAB_ALIGN:
            config = replace(config, pad_vocab_to=VOCAB_ALIGN)  # aligned LM-head GEMMs (module docstring)
        super().__init__(config, dtype=dtype, xp=xp, seed=seed, init=init, param_multiple=param_multiple)
        opts = self._options
        # flash attention (ours or cuDNN's) takes fp16/bf16; the NumPy reference runs any float type
        half = self.dtype in (backend.float16, backend.bfloat16)
        self.flash = opts.attention_kernel != "math" and (self.xp is np or half)
        self.attention = "flash" if self.flash else "math-copy"
        if opts.fp8 != "off" and not self.runs_fp8:
            raise ValueError(f"FastOptions.fp8={opts.fp8!r}: {FP8_ONLY_GPT2}, not {type(self).__name__}")
        # the QKV and MLP linear layers in FP8 (model/fp8_linear.py), or None: every GEMM in the model's dtype
        self.fp8 = (Fp8Linears(opts.fp8, opts.fp8_history, self.xp, fused_epilogues=opts.fp8_fused_epilogues,
                               fused_casts=opts.fp8_fused_casts, delayed_weights=opts.fp8_delayed_weights)
                    if opts.fp8 != "off" else None)
        self.fused_casts = self.fp8 is not None and opts.fp8_fused_casts  # GELU and bias gradients in the FP8 casts

    def capture_blocker(self) -> str | None:
        """None in bf16/fp16 on the GPU (cuBLASLt and cuDNN calls, all capturable). In fp32, or with
        attention_kernel='math', attention is chapter 2's, whose batched GEMMs are CuPy's cuBLAS: capture is refused."""
        if self.xp is np or self.flash:
            return super().capture_blocker() if self.xp is np else None
        why = ("attention_kernel='math'" if self.options.attention_kernel == "math"
               else f"{backend.dtype_name(self.dtype)} (flash attention takes bf16/fp16)")
        return (f"{type(self).__name__} with {why} runs chapter 2's attention, whose GEMMs are CuPy's cuBLAS calls, "
                "which refuse stream capture; use a flash attention kernel in bf16 or fp16 for a graph step, "
                "or graph=False")

    @property
    def options(self) -> FastOptions:
        """The step's choices (fixed for the model's life: a captured graph holds them)."""
        return self._options

    # ------------------------------------------------------------------ pieces

    def _matrix(self, w_name, *, grad: bool = False):
        """The weight ``w_name`` (with ``grad``: its fp32 gradient); a tuple of names is their stacked matrix
        (``FlatParams.stacked``: one GEMM for several projections of one input, chapter 10)."""
        if isinstance(w_name, tuple):
            return self.params.stacked(w_name, grad=grad)
        return self.params.grad_of(w_name) if grad else self.weight(w_name)

    def _linear(self, x, w_name, b_name=None, *, name, epilogue=None, aux=None):
        """``x Wᵀ (+ b)`` through cuBLASLt, the bias in the epilogue (``w_name``: a name or a stacked tuple)."""
        w = self._matrix(w_name)
        n, k = x.shape
        m = w.shape[0]
        nbytes = (n * k + k * m + n * m * (2 if aux is not None else 1)) * x.dtype.itemsize
        with region(name, flops=2.0 * n * k * m, bytes=nbytes):
            if b_name is None:
                return lt_gemm(x, w, trans_b=True)
            return lt_gemm(x, w, trans_b=True, bias=self.weight(b_name), epilogue=epilogue or "bias", aux=aux)

    def _linear_grads(self, dy, x, w_name, b_name, *, name):
        """dW += dyᵀ x (fp32, in the GEMM) and db += Σ dy (deterministic reduction; summed by the GEMM's BGRADB
        epilogue instead, the captured GPT-2 step was 1.5–3 ms slower: chapter 8)."""
        n, cout = dy.shape
        cin = x.shape[1]
        with region(name + " wgrad", flops=2.0 * n * cout * cin, bytes=(n * cout + n * cin) * dy.dtype.itemsize
                    + 8 * cout * cin):
            dw = self._matrix(w_name, grad=True)
            wgrad_gemm(dy, x, out=dw, beta=1.0, gemm=lt_gemm)  # N % 64 != 0: split (issue 13)
        if b_name is not None:
            with region(name + " bgrad", bytes=dy.nbytes + 8 * cout, flops=float(dy.size)):
                bias_grad(dy, out=self.params.grad_of(b_name), accumulate=True)

    def _dgrad(self, dy, w_name, *, name, epilogue="none", aux=None, out=None, beta=0.0):
        """``dy W`` (``+ beta · out``: a second branch's input gradient added by the GEMM)."""
        w = self._matrix(w_name)
        n = dy.shape[0]
        m, k = w.shape
        nbytes = (n * m + m * k + n * k * (2 if aux is not None or beta else 1)) * dy.dtype.itemsize
        with region(name + " dgrad", flops=2.0 * n * m * k, bytes=nbytes):
            return lt_gemm(dy, w, epilogue=epilogue, aux=aux, out=out, beta=beta)

    def _layer_forward(self, x, i: int, layer: str, *, name, epilogue=None, aux=None, train: bool = True, act=None):
        """Block i's linear layer ``layer`` (one of ``fp8_linear.FP8_LAYERS``) on x: ``(y, what its backward
        needs)``: x itself, or with ``FastOptions.fp8`` the FP8 GEMM's output and x's and W's FP8 casts
        (``Fp8Saved``; None with ``train=False``). ``act="gelu"`` (FP8 only): the input is GELU(x + MLP-in's bias)
        (``FastOptions.fp8_fused_casts``)."""
        w_name, b_name = f"transformer.h.{i}.{layer}.weight", f"transformer.h.{i}.{layer}.bias"
        if self.fp8 is None:
            return self._linear(x, w_name, b_name, name=name, epilogue=epilogue, aux=aux), x
        return self.fp8.forward(x, self.weight(w_name), self.weight(b_name), f"h.{i}.{layer}", name=name,
                                epilogue=epilogue or "bias", aux=aux, train=train, act=act,
                                act_bias=self._fc_bias(i) if act else None)

    def _layer_backward(self, dy, saved, i: int, layer: str, *, name, dgrad_name=None, epilogue="none", aux=None,
                        act=None):
        """The backward of ``_layer_forward``: dW and db accumulated (fp32), the input gradient returned.
        ``act="dgelu"`` (FP8 only): the output gradient is dy · GELU'(aux + MLP-in's bias)."""
        w_name, b_name = f"transformer.h.{i}.{layer}.weight", f"transformer.h.{i}.{layer}.bias"
        if isinstance(saved, Fp8Saved):
            G = self.params.grad_of
            return self.fp8.backward(dy, saved, f"h.{i}.{layer}", G(w_name), G(b_name), name=name,
                                     dgrad_name=dgrad_name or name, epilogue=epilogue, aux=aux, act=act,
                                     act_bias=self._fc_bias(i) if act else None)
        self._linear_grads(dy, saved, w_name, b_name, name=name)
        return self._dgrad(dy, w_name, name=dgrad_name or name, epilogue=epilogue, aux=aux)

    def _fc_bias(self, i: int):
        return self.weight(f"transformer.h.{i}.mlp.c_fc.bias")

    def _add_ln(self, x, a, ln, *, name, fp8_layer=None, train: bool = True):
        """(x + a written over a, LN(x + a), mean, rstd). ``fp8_layer``: the FP8 layer that reads LN's output, which
        ``FastOptions.fp8_layernorm_casts`` then writes as that layer's FP8 input where the scale allows
        (``Fp8Linears.add_layernorm``; ``train``: with the transposed bytes and the amax)."""
        if fp8_layer is not None and self.options.fp8_layernorm_casts and self.fp8 is not None:
            fused = self.fp8.add_layernorm(x, a, self.weight(ln + ".weight"), self.weight(ln + ".bias"), fp8_layer,
                                           name=name, train=train)
            if fused is not None:
                return fused
        it = x.dtype.itemsize
        with region(name, bytes=4 * x.nbytes + 8 * x.shape[0] + 2 * it * x.shape[1], flops=10.0 * x.size):
            return add_layernorm_forward(x, a, self.weight(ln + ".weight"), self.weight(ln + ".bias"), residual_out=a)

    def _ln_backward(self, dh, x, ln, mean, rstd, dres, *, name):
        """d(LN input) + the residual gradient ``dres`` (None: none), written over ``dres``; dγ, dβ accumulated
        in fp32 into the gradient buffer."""
        G = self.params.grad_of
        with region(name, bytes=(3 if dres is None else 4) * x.nbytes + 8 * x.shape[0], flops=12.0 * x.size):
            dx, _, _ = layernorm_backward(dh, x, self.weight(ln + ".weight"), mean, rstd, dresidual=dres, dx_out=dres,
                                          dgamma_out=G(ln + ".weight"), dbeta_out=G(ln + ".bias"),
                                          accumulate_params=True, method=self.options.layernorm_backward_method)
        return dx

    def _attention_forward(self, qkv, B, T):
        """Causal attention on the ``[N, 3C]`` QKV buffer: ``(y [N, C], state for the backward)``."""
        cfg = self.config
        H, C, D = cfg.n_head, cfg.n_embd, cfg.n_embd // cfg.n_head
        it = qkv.dtype.itemsize
        with region("attn.core fwd", flops=2.0 * B * H * T * T * D, bytes=4 * B * T * C * it):
            return self._attention_core(*split_qkv(qkv.reshape(B, T, 3 * C), H), B, T)

    def _attention_backward(self, dy, state, B, T):
        """``dqkv [N, 3C]`` from ``dy [N, C]``."""
        cfg, xp = self.config, self.xp
        H, C, D = cfg.n_head, cfg.n_embd, cfg.n_embd // cfg.n_head
        it = dy.dtype.itemsize
        with region("attn.core bwd", flops=5.0 * B * H * T * T * D, bytes=8 * B * T * C * it):
            dqkv = xp.empty((B, T, 3 * C), dtype=dy.dtype)
            self._attention_core_backward(dy, state, *split_qkv(dqkv, H), B, T)
            return dqkv.reshape(B * T, 3 * C)

    def _attention_core(self, q, k, v, B, T):
        """Causal attention on ``[B, H, T, D]`` views q and ``[B, H_kv, T, D]`` views k, v (strided views of the
        GEMMs' rows): ``(y [N, C], state for the backward)``. Flash attention reads the views and writes y's rows;
        chapter 2's kernels take contiguous copies."""
        xp, H, C = self.xp, self.config.n_head, self.config.n_embd
        if self.flash:
            y = xp.empty((B, T, C), dtype=q.dtype)
            o, stats = flash_attention_forward(q, k, v, causal=True, out=heads_view(y, H),
                                               kernel=self.options.attention_kernel, choices=self.kernel_choices)
            return y.reshape(B * T, C), (q, k, v, o, stats)
        qc, kc, vc = (xp.ascontiguousarray(t) for t in (q, k, v))
        o, stats = attention_forward(qc, kc, vc, causal=True)
        y = xp.ascontiguousarray(o.transpose(0, 2, 1, 3)).reshape(B * T, C)
        return y, (qc, kc, vc, o, stats)

    def _attention_core_backward(self, dy, state, dq, dk, dv, B, T, rope=None):
        """The gradients of ``_attention_core`` from ``dy [N, C]`` into the ``[B, n, T, D]`` views dq, dk, dv (dk, dv
        summed over each K/V head's group). ``rope``: Llama's (cos, sin), applied by flash attention (returns True)."""
        xp, H = self.xp, self.config.n_head
        q, k, v, o, stats = state
        if self.flash:
            flash_attention_backward(heads_view(dy.reshape(B, T, -1), H), q, k, v, o, stats, causal=True,
                                     dq=dq, dk=dk, dv=dv, kernel=self.options.attention_kernel,
                                     choices=self.kernel_choices, deterministic=self.options.deterministic_attention,
                                     rope=rope)
            return rope is not None
        do = xp.ascontiguousarray(dy.reshape(B, T, H, -1).transpose(0, 2, 1, 3))
        for out, g in zip((dq, dk, dv), attention_backward(do, q, k, v, o, stats, causal=True)):
            out[...] = g
        return False

    # ------------------------------------------------------------------ forward

    def _embed(self, idx):
        """Embeddings and block 0's ln_1: the state ``(x, ln_1(x), mean, rstd)`` entering block 0."""
        cfg = self.config
        B, T = idx.shape
        N, C = B * T, cfg.n_embd
        it = self.dtype.itemsize
        with region("embedding fwd", bytes=2 * N * C * it + T * C * it + 4 * N, flops=float(N * C)):
            x = embedding_forward(idx, self.weight(WTE), self.weight(WPE), vocab_size=cfg.vocab_size).reshape(N, C)
        with region("ln_1 fwd", bytes=2 * x.nbytes + 8 * N, flops=8.0 * x.size):
            h, mean, rstd = layernorm_forward(x, self.weight("transformer.h.0.ln_1.weight"),
                                              self.weight("transformer.h.0.ln_1.bias"))
        return x, h, mean, rstd

    def _block_forward(self, i: int, state, B: int, T: int, need_output: bool = True, keep_pre: bool = True):
        """Block i from its input state ``(x, ln_1(x), mean, rstd)``: ``(cache for the backward, the next state)``,
        block i+1's input (``ln_f``'s after the last block), or None with ``need_output=False`` (a recomputed span's
        last block). ``keep_pre=False`` (inference): no MLP pre-activation (GELU_BIAS), no ``f`` in the cache."""
        x, h, mean, rstd = state
        N, C, L = B * T, self.config.n_embd, self.config.n_layer
        n = block_param_names(i)
        # h1, h2, g: what the weight gradients need (the inputs, or their FP8 casts: _layer_forward)
        qkv, h1 = self._layer_forward(h, i, "attn.c_attn", name="attn.qkv fwd", train=keep_pre)
        y, att = self._attention_forward(qkv, B, T)
        a = self._linear(y, n["attn.c_proj.weight"], n["attn.c_proj.bias"], name="attn.proj fwd")
        x2, h2, mean2, rstd2 = self._add_ln(x, a, f"transformer.h.{i}.ln_2", name="residual+ln_2 fwd",
                                            fp8_layer=f"h.{i}.mlp.c_fc", train=keep_pre)
        act = "gelu" if self.fused_casts else None  # then g = f = h2 W₁ᵀ, GELU(f + b₁) by mlp.c_proj's FP8 cast
        f = self.xp.empty((N, 4 * C), dtype=x2.dtype) if keep_pre and not act else None  # the pre-activation
        g, h2 = self._layer_forward(h2, i, "mlp.c_fc", name="mlp.fc fwd" if act else "mlp.fc+gelu fwd",
                                    epilogue="none" if act else "gelu_bias", aux=f, train=keep_pre)
        f = g if act and keep_pre else f
        cache = {"x": x, "h1": h1, "mean1": mean, "rstd1": rstd, "qkv": qkv, "y": y, "att": att,
                 "x2": x2, "h2": h2, "mean2": mean2, "rstd2": rstd2, "f": f, "g": g}
        if not need_output:  # a recomputed span's last block: mlp.c_proj's backward still needs its FP8 casts
            if self.fp8 is not None and keep_pre:
                cache["g"] = self.fp8.keep(g, self.weight(n["mlp.c_proj.weight"]), f"h.{i}.mlp.c_proj", act=act,
                                           act_bias=self._fc_bias(i) if act else None)
            return cache, None
        m, cache["g"] = self._layer_forward(g, i, "mlp.c_proj", name="mlp.proj fwd", train=keep_pre, act=act)
        if i + 1 < L:
            return cache, self._add_ln(x2, m, f"transformer.h.{i + 1}.ln_1", name="residual+ln_1 fwd",
                                       fp8_layer=f"h.{i + 1}.attn.c_attn", train=keep_pre)
        return cache, self._add_ln(x2, m, "transformer.ln_f", name="residual+ln_f fwd")

    def _forward_trunk(self, idx, store: bool, keep_pre: bool | None = None):
        """Embeddings, the blocks and ln_f: ``(state, caches, inputs)``, the final state ``(x_L, ln_f(x_L),
        statistics...)``; with ``store``, every block's cache (no checkpointing) or every k-th block's input state.
        ``keep_pre`` (default ``store``): the MLP keeps its pre-activation (checkpointing too: the same bits)."""
        keep_pre = store if keep_pre is None else keep_pre
        B, T = idx.shape
        L, k = self.config.n_layer, self.checkpoint_every if store else 0
        caches, inputs = [None] * L, [None] * L
        state = self._embed(idx)
        for i in range(L):
            if store and k and i % k == 0:
                inputs[i] = state  # a span input (module docstring); the rest is thrown away as we go
            c, state = self._block_forward(i, state, B, T, keep_pre=keep_pre)
            if store and not k:
                caches[i] = c
            del c
        return state, caches, inputs

    def _logits(self, hf):
        N = hf.shape[0]
        Vp, V = self.config.padded_vocab_size, self.config.vocab_size
        logits = self._linear(hf, self._head_name, name="lm_head fwd")
        if Vp != V:
            with region("lm_head pad", bytes=N * (Vp - V) * logits.dtype.itemsize, flops=float(N * (Vp - V))):
                logits[:, V:] = PAD_LOGIT
        return logits

    def forward(self, idx, targets=None, *, last_only: bool = False):
        """Inference with the fast kernels; same contract as ``GPT.forward``."""
        idx = self.check_idx(idx)
        B, T = idx.shape
        C = self.config.n_embd
        (_, hf, *_), _, _ = self._forward_trunk(idx, store=False)
        if last_only:
            hf = self.xp.ascontiguousarray(hf.reshape(B, T, C)[:, -1])
        return self.logits_and_loss(self._logits(hf), targets, B, T, last_only)

    def _block_backward(self, i: int, dx, c, B: int, T: int):
        """Block i's backward from its output's gradient ``dx`` (updated in place and returned: its input's). Weight
        gradients accumulate in fp32 in line (on a second stream they gained nothing: the GEMMs fill the GPU)."""
        n = block_param_names(i)
        # MLP: m = g W₂ᵀ + b₂ with g = GELU(f); dm = dx
        act = "dgelu" if self.fused_casts else None  # then GELU'(f + b₁) by mlp.c_fc's FP8 gradient cast
        df = self._layer_backward(dx, c["g"], i, "mlp.c_proj", name="mlp.proj", aux=c["f"],
                                  dgrad_name=None if act else "mlp.proj+dgelu", epilogue="none" if act else "dgelu")
        dh2 = self._layer_backward(df, c["h2"], i, "mlp.c_fc", name="mlp.fc", act=act, aux=c["f"] if act else None)
        del df
        dx = self._ln_backward(dh2, c["x2"], f"transformer.h.{i}.ln_2", c["mean2"], c["rstd2"], dx,
                               name="ln_2+residual bwd")
        del dh2
        # attention: a = y Wpᵀ + bp; da = dx
        self._linear_grads(dx, c["y"], n["attn.c_proj.weight"], n["attn.c_proj.bias"], name="attn.proj")
        dy = self._dgrad(dx, n["attn.c_proj.weight"], name="attn.proj")
        dqkv = self._attention_backward(dy, c["att"], B, T)
        del dy
        dh1 = self._layer_backward(dqkv, c["h1"], i, "attn.c_attn", name="attn.qkv")
        del dqkv
        return self._ln_backward(dh1, c["x"], f"transformer.h.{i}.ln_1", c["mean1"], c["rstd1"], dx,
                                 name="ln_1+residual bwd")

    # ------------------------------------------------------------------ forward + backward

    def _head_forward_backward(self, hf, targets, dloss):
        """LM head, cross-entropy and their backward, ``lm_head_rows`` rows at a time (module docstring): ``(mean
        loss, dhf)``; every row's gradient is divided by the whole batch's target count, counted first."""
        N, C = hf.shape
        Vp = self.config.padded_vocab_size
        it, xp = self.dtype.itemsize, self.xp
        opts = self.options
        R = min(N, opts.lm_head_rows)
        fused = opts.fused_cross_entropy
        if R < N or fused:
            n_total = (targets != IGNORE_INDEX).sum(dtype=np.int32)
        dhf = xp.empty((N, C), dtype=hf.dtype)
        loss = None
        for r0 in range(0, N, R):
            h, t = hf[r0:r0 + R], targets[r0:r0 + R]
            n = h.shape[0]
            logits = self._logits(h)
            if fused:  # one pass: the chunk's loss sum (added into loss) and dlogits in place over the logits
                with region("cross_entropy fwd+bwd", bytes=logits.nbytes * 2 + 8 * n, flops=6.0 * logits.size):
                    loss, dlogits = cross_entropy_forward_backward(logits, t, dloss, n_total, ignore_index=IGNORE_INDEX,
                                                                   out=logits, loss_sum=loss)
                del logits
                self._head_grads(dlogits, h, dhf[r0:r0 + R])
                del dlogits
                continue
            with region("cross_entropy fwd", bytes=logits.nbytes + 8 * n, flops=4.0 * logits.size):
                loss_c, ce = cross_entropy_forward(logits, t, ignore_index=IGNORE_INDEX,
                                                   method=opts.cross_entropy_method)
            del logits
            if R < N:  # the chunk's mean, weighted back to a sum; its gradient scaled by the whole batch
                part = loss_c * ce.n_valid.astype(loss_c.dtype)
                loss = part if loss is None else loss + part
                ce = replace(ce, n_valid=n_total)
            else:
                loss = loss_c
            with region("cross_entropy bwd", bytes=2 * n * Vp * it + 8 * n, flops=4.0 * n * Vp):
                dlogits = cross_entropy_backward(ce, dloss, out=ce.logits)  # in place over the logits
            del ce
            self._head_grads(dlogits, h, dhf[r0:r0 + R])
            del dlogits
        if fused:  # the sum over the chunks, over the batch's count (an all-ignored batch: 0)
            loss = loss / xp.maximum(n_total, 1).astype(loss.dtype)
        elif R < N:
            loss = loss / n_total.astype(loss.dtype)
        return loss, dhf

    def _head_grads(self, dlogits, h, dh):
        """The LM head's backward for one chunk: ``dh = dlogits W`` and ``dW += dlogitsᵀ h`` (fp32)."""
        n, Vp = dlogits.shape
        C, it = h.shape[1], self.dtype.itemsize
        self._dgrad(dlogits, self._head_name, name="lm_head", out=dh)
        with region("lm_head wgrad", flops=2.0 * n * Vp * C, bytes=(n * Vp + n * C) * it + 8 * Vp * C):
            wgrad_gemm(dlogits, h, out=self.params.grad_of(self._head_name), beta=1.0, gemm=lt_gemm)

    def _final_norm_backward(self, dhf, state):
        """ln_f's backward from the final state: (the residual stream's gradient [N, C], the names made final)."""
        x, _, mean, rstd = state
        return self._ln_backward(dhf, x, "transformer.ln_f", mean, rstd, None, name="ln_f bwd"), [LNF_W, LNF_B]

    def _embed_backward(self, dx, idx) -> list[str]:
        """The embeddings' backward from the residual stream's gradient ``dx [N, C]``: their names."""
        cfg, G = self.config, self.params.grad_of
        B, T = idx.shape
        N, C, Vp, it = B * T, cfg.n_embd, cfg.padded_vocab_size, self.dtype.itemsize
        method = self.options.embedding_backward_method if self.xp is not np else "optimized"
        if self.options.embedding_grad_into_fp32:  # fp32 row sums added into the fp32 gradients, touched rows only
            with region("embedding bwd", bytes=N * C * it + 4 * N + (min(N, Vp) + T) * C * 8, flops=float(N * C)):
                embedding_backward(dx.reshape(B, T, C), idx, Vp, cfg.block_size, method=method,
                                   dwte_out=G(WTE), dwpe_out=G(WPE), accumulate=True)
        else:
            with region("embedding bwd", bytes=N * C * it + 4 * N + (Vp + cfg.block_size) * C * (it + 8),
                        flops=float(N * C)):
                dwte, dwpe = embedding_backward(dx.reshape(B, T, C), idx, Vp, cfg.block_size, method=method)
                accumulate_grad(G(WTE), dwte)
                accumulate_grad(G(WPE), dwpe)
        return [WTE, WPE]

    def forward_backward(self, idx, targets, dloss=1.0, *, grads_ready=None):
        """One micro-batch: the loss (0-d device array) and gradients added into ``params.grad``; same
        contract as ``GPT.forward_backward`` (``grads_ready``: ``model/base.py``)."""
        cfg = self.config
        idx, targets = self.check_batch(idx, targets)
        ready = grads_ready or (lambda names: None)
        B, T = idx.shape
        L, k = cfg.n_layer, self.checkpoint_every

        state, caches, inputs = self._forward_trunk(idx, store=True)
        stored = nbytes_of(caches) + nbytes_of(inputs)
        loss, dhf = self._head_forward_backward(state[1], targets.reshape(-1), dloss)
        # the gradient of the residual stream: from here on one [N, C] buffer, updated in place
        dx, names = self._final_norm_backward(dhf, state)
        ready(names)
        del dhf, state

        peak = stored
        if k == 0:
            for i in reversed(range(L)):
                dx = self._block_backward(i, dx, caches[i], B, T)
                caches[i] = None
                ready(self._block_names(i))
        else:
            for s in reversed(range(0, L, k)):  # the spans, last to first
                e = min(s + k, L)
                state, span = inputs[s], []
                for j in range(s, e):  # recompute the span from its input state, storing its activations
                    c, state = self._block_forward(j, state, B, T, need_output=j < e - 1)
                    span.append(c)
                    del c
                peak = max(peak, nbytes_of(inputs) + nbytes_of(span))
                for j in reversed(range(s, e)):
                    dx = self._block_backward(j, dx, span[j - s], B, T)
                    span[j - s] = None
                    ready(self._block_names(j))
                inputs[s] = None

        ready(self._embed_backward(dx, idx))
        if self.fp8 is not None:
            self.fp8.end_step()
        self.stats = {"activation_bytes_stored": stored, "activation_bytes_peak": peak}
        return loss


__all__ = ["FastGPT", "FastOptions"]
