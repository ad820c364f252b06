"""What the two GPT-2 paths share: configuration, flat parameters, initialization, the state dict,
input checks, the loss, sampling, and the activation-memory accounting.

``GPT`` (``model/gpt.py``, chapters 1–6: the book's step with activation checkpointing) and ``FastGPT``
(``model/fast.py``, chapter 8: the fused step) are siblings on ``GPTBase``. Each implements
``forward(idx, targets=None, *, last_only=False)`` and ``forward_backward(idx, targets, dloss, *,
grads_ready=None)``; everything else lives here once.

Parameters live in one ``FlatParams`` (chapter 4): fp32 master weights, their gradients and AdamW's
moments in one buffer each; the passes read the working copy (``weight(name)``: bf16, fp16 or fp32,
chapter 5). ``dtype="fp64"`` (NumPy only) makes every buffer float64: the reference for
finite-difference checks of the whole model.

Vocabulary padding (``pad_vocab_to=64/128``): the embedding/LM-head matrix gets
``padded_vocab_size`` rows (llm.c pads 50257 → 50304) so the largest GEMM has friendly sizes. The
padded rows start at zero; their logits are set to ``PAD_LOGIT`` before the cross-entropy, so their
softmax probability is exactly 0 and their gradient too: the padded model computes the same function.

``grads_ready`` (the seam of data-parallel training, chapter 9): a callable that ``forward_backward``
calls with a list of parameter names as soon as those gradients are final for this micro-batch (the
LayerNorm ``ln_f`` first, then each block from the last to the first, then the embeddings), so their
reduction can start while the rest of the backward pass runs.
"""

from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import check_token_ids, is_integer
from ..ops.cross_entropy import cross_entropy_forward
from ..ops.embedding import check_ids_numpy
from ..optim.params import ALIGN, FlatParams
from .config import BUFFERS, WTE, GPTConfig, activation_bytes, block_param_names, param_shapes
from .llama_config import LM_HEAD

PAD_LOGIT = -1.0e4  # logit of padded vocabulary columns: exp(-1e4 - max) == 0 in fp32


class GPTBase:
    """GPT-2 parameters and everything around the passes (see the module docstring).

    ``dtype``: working precision of the forward/backward pass ('fp32', 'bf16', 'fp16'; the master
    weights are always fp32; 'fp64' on NumPy: the finite-difference reference). ``xp``: NumPy or CuPy
    (default: the active backend). ``seed``: the initialization's seed. ``init=False`` leaves the
    weights at zero (for loading). ``param_multiple``: see ``FlatParams`` (ZeRO's ranks × ALIGN, chapter 9).
    """

    attention = "math"  # which activation-memory formula applies (model/config.block_activation_bytes)
    config_type = GPTConfig  # the configuration this family takes (Llama: model/llama_config.LlamaConfig)
    embedding_name = WTE  # the token embedding (its padded rows; the LM head when tied)
    buffers = BUFFERS  # names of saved non-weights that load_state_dict skips
    norm_gains = ("ln_1.weight", "ln_2.weight", "ln_f.weight")  # initialized to 1 (init_weights)
    residual_projections = ("c_proj.weight",)  # the block's two writes into the residual stream (init_weights)
    keeps_ln_1 = False  # a checkpointed span input is x alone (FastGPT: x and ln_1(x); model/config.activation_bytes)
    _ckpt = 0  # checkpoint_every's value until a subclass sets it

    def __init__(self, config: GPTConfig, *, dtype="fp32", xp=None, seed: int = 0, init: bool = True,
                 param_multiple: int = ALIGN):
        if not isinstance(config, self.config_type):
            raise TypeError(f"config must be a {self.config_type.__name__}, got {type(config).__name__}")
        self.config = config
        self.xp = xp or backend.default_xp()
        self.dtype = backend.resolve_dtype(dtype)
        shapes = self.param_shapes()
        if self.dtype == backend.float64:
            self.params = _float64_params(shapes, self.xp, param_multiple)
        else:
            self.params = FlatParams(shapes, xp=self.xp, working_dtype=self.dtype, multiple=param_multiple)
        self.stats: dict = {}  # activation-memory accounting of the last forward_backward
        if init:
            self.init_weights(seed)

    # ------------------------------------------------------------------ parameters

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the parameters, in their order in the flat buffers."""
        return param_shapes(self.config)

    def _block_names(self, i: int) -> list[str]:
        """The parameter names of block i (whose gradients are final once its backward has run)."""
        return list(block_param_names(i).values())

    @property
    def tied(self) -> bool:
        """Whether the LM head is the token embedding (GPT-2: always)."""
        return getattr(self.config, "tie_embeddings", True)

    @property
    def _head_name(self) -> str:
        """The LM head's weight: the token embedding when tied, else its own matrix."""
        return self.embedding_name if self.tied else LM_HEAD

    def num_parameters(self) -> int:
        return self.params.num_parameters

    def weight(self, name: str):
        """The working-precision weight ``name`` (a view into the flat working copy)."""
        return self.params.weight(name)

    def init_weights(self, seed: int = 0):
        """GPT-2's initialization: matrices N(0, 0.02), the two residual projections per block
        (``residual_projections``) N(0, 0.02/√(2L)) so that the residual stream's variance does not grow with depth,
        biases 0, norm gains (``norm_gains``) 1; padded vocabulary rows 0. Deterministic for a given seed."""
        cfg, P = self.config, self.params
        rng = np.random.default_rng(seed)
        std_resid = 0.02 / math.sqrt(2 * cfg.n_layer)
        d = {}
        for name in P.names:
            shape = P.shapes[name]
            if name.endswith(self.norm_gains):
                d[name] = np.ones(shape, np.float32)
            elif len(shape) == 1:
                d[name] = np.zeros(shape, np.float32)
            else:
                std = std_resid if name.endswith(self.residual_projections) else 0.02
                d[name] = (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
        for name in {self.embedding_name, LM_HEAD} & set(d):
            d[name][cfg.vocab_size:] = 0.0
        P.load_dict(d)

    def capture_blocker(self) -> str | None:
        """Why this model's training step cannot be captured into a CUDA graph, or None when it can.
        The book model (``GPT``) cannot: its GEMMs are CuPy/cuBLAS calls, which refuse stream capture."""
        if self.xp is np:
            return "CUDA graphs need the GPU (CuPy) backend; this model runs on NumPy"
        return (f"{type(self).__name__} runs its GEMMs through CuPy's cuBLAS, which refuses stream capture; "
                "use the fast step (FastGPT, FastLlama) in bf16/fp16 for a graph step, or graph=False")

    def check_capturable(self):
        """Raise ValueError saying why, unless the training step can be captured as a CUDA graph."""
        why = self.capture_blocker()
        if why:
            raise ValueError(f"cannot capture the training step as a CUDA graph: {why}")

    def state_dict(self, unpadded: bool = False) -> dict:
        """nanoGPT names and PyTorch layouts (``nn.Linear`` weights ``[out, in]``), fp32 copies on the backend.

        ``lm_head.weight`` is the same array as ``transformer.wte.weight`` (tied, as in PyTorch's
        state_dict). ``unpadded=True`` drops the padded vocabulary rows.
        """
        xp, P, E = self.xp, self.params, self.embedding_name
        out = {n: P.param(n).copy() for n in P.names}
        if unpadded:
            for n in (E, "lm_head.weight"):
                if n in out:
                    out[n] = out[n][: self.config.vocab_size].copy()
        if self.tied:
            out["lm_head.weight"] = out[E]
        return {n: backend.to_device(a, xp) for n, a in out.items()}

    def load_state_dict(self, sd: dict, strict: bool = True, *, allow_nonfinite: bool = False):
        """Load nanoGPT-named weights (NumPy, CuPy or PyTorch tensors; any float dtype).

        ``lm_head.weight`` is optional (tied; given, it must equal the embedding up to 16-bit rounding); an
        unpadded token embedding (at least ``vocab_size`` rows) is zero-padded, one with fewer rows a ValueError.
        Keys ending in ``buffers`` (GPT-2's causal masks, Llama's RoPE frequencies) are ignored. A tensor that is
        not floating point (integer or bool weights: a wrong file, or a buffer under a weight's name) is a TypeError
        naming its key; a NaN or inf weight a ValueError naming the key and the count (``allow_nonfinite=True``
        loads it anyway, e.g. to inspect a run that diverged).
        """
        cfg, P, E, tied = self.config, self.params, self.embedding_name, self.tied
        d = {}
        for k, v in sd.items():
            if (tied and k == "lm_head.weight") or k.endswith(self.buffers):
                continue
            d[k] = _checked_host(k, v, allow_nonfinite)
        if tied and "lm_head.weight" in sd and E not in sd:
            d[E] = _checked_host("lm_head.weight", sd["lm_head.weight"], allow_nonfinite)
        elif tied and "lm_head.weight" in sd:  # both: an untied model's head would be dropped without a word
            head, emb, V = _checked_host("lm_head.weight", sd["lm_head.weight"], True), d[E], cfg.vocab_size
            a, b = (w[:V].astype(np.float32) for w in (head, emb))  # one may have been rounded to bf16 or fp16
            if a.shape == b.shape and not np.allclose(a, b, rtol=2.0**-7, atol=1e-6, equal_nan=True):
                raise ValueError(f"lm_head.weight differs from {E}, which this model ties it to: weights of an "
                                 "untied model (load them into one with tie_embeddings=False)")
        for n in (E, "lm_head.weight"):  # vocabulary rows: an unpadded matrix is zero-padded
            if n in d and d[n].shape[0] != cfg.padded_vocab_size and d[n].shape[1:] == (cfg.n_embd,):
                if not cfg.vocab_size <= d[n].shape[0] <= cfg.padded_vocab_size:  # fewer: real tokens would get zeros
                    raise ValueError(f"{n} has {d[n].shape[0]} rows, the model's vocabulary is {cfg.vocab_size} "
                                     f"tokens" + (f" ({cfg.padded_vocab_size} rows padded)"
                                                  if cfg.padded_vocab_size != cfg.vocab_size else ""))
                pad = np.zeros((cfg.padded_vocab_size, cfg.n_embd), np.float32)
                pad[: d[n].shape[0]] = d[n]
                d[n] = pad
        P.load_dict(d, strict=strict)

    def grads(self) -> dict:
        """name → fp32 gradient view (nanoGPT names), as accumulated by the last backward passes."""
        return {n: self.params.grad_of(n) for n in self.params.names}

    def zero_grad(self):
        self.params.zero_grad()

    # ------------------------------------------------------------------ inputs, logits, loss

    def check_idx(self, idx, name="idx", *, token_ids: bool = True):
        """``idx`` as a contiguous int32 ``[B, T]`` array on the model's device, not empty, T ≤ block_size. Ids of a
        wider type must fit int32 (narrowed, they would wrap to other ids); ``token_ids`` on NumPy: each in
        ``[0, vocab_size)``. Not on a GPU, where it would cost a host synchronisation: there the embedding kernel writes
        NaN rows for such ids (the padding rows' ids included), and the loss turns NaN."""
        xp = self.xp
        if backend.get_array_module(idx) is not xp:
            raise TypeError(f"{name} must live on the model's device ({'cupy' if xp is not np else 'numpy'})")
        if idx.ndim != 2:
            raise ValueError(f"{name} must be [B, T], got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.block_size:
            raise ValueError(f"{name} has T={idx.shape[1]} > block_size={self.config.block_size}")
        if idx.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integer token ids, got {idx.dtype}")
        if idx.size == 0:
            raise ValueError(f"{name} is empty (shape {tuple(idx.shape)})")
        if idx.dtype != np.int32:
            if idx.dtype.itemsize >= 4 and not -2**31 <= int(idx.min()) <= int(idx.max()) < 2**31:
                raise ValueError(f"{name} holds ids from {int(idx.min())} to {int(idx.max())}, beyond int32's range")
            idx = idx.astype(np.int32)
        if token_ids and xp is np:
            check_ids_numpy(idx, self.config.vocab_size, name)
        return xp.ascontiguousarray(idx)

    def check_batch(self, idx, targets):
        """``check_idx`` of both, and the same shape."""
        idx = self.check_idx(idx)
        targets = self.check_idx(targets, "targets", token_ids=False)  # cross_entropy checks them (ignore_index)
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have idx's shape {tuple(idx.shape)}, got {tuple(targets.shape)}")
        return idx, targets

    def logits_and_loss(self, logits, targets, B: int, T: int, last_only: bool):
        """``forward``'s result from the ``[B·T', Vp]`` head output (T' = 1 with ``last_only``): the loss
        against ``targets`` if given, and the logits reshaped to ``[B, T, vocab]`` (``[B, vocab]``)."""
        loss = None
        if targets is not None:
            targets = self.check_idx(targets, "targets", token_ids=False)
            loss, _ = cross_entropy_forward(logits, targets.reshape(-1))
        Tl = 1 if last_only else T
        logits = logits.reshape(B, Tl, -1)[:, :, : self.config.vocab_size]
        if last_only:
            logits = logits[:, 0]
        return logits, loss

    def forward(self, idx, targets=None, *, last_only: bool = False):  # pragma: no cover - the subclasses'
        raise NotImplementedError

    def loss(self, idx, targets):
        """Mean cross-entropy loss (0-d device array) without storing activations: validation."""
        return self.forward(idx, targets)[1]

    # ------------------------------------------------------------------ activation memory

    @property
    def checkpoint_every(self) -> int:
        """Activation checkpointing: keep every k-th block's input and recompute the others in the backward (0: off;
        the steps of ``GPT`` and ``FastGPT``, chapter 6)."""
        return self._ckpt

    @checkpoint_every.setter
    def checkpoint_every(self, k: int):
        if not is_integer(k) or k < 0:  # 1.5 was taken as 1
            raise (ValueError if is_integer(k) else TypeError)(f"checkpoint_every must be 0 (off) or an integer >= 1, "
                                                               f"got {k!r}")
        self._ckpt = int(k)

    def activation_bytes(self, batch: int, seq: int, checkpoint_every: int | None = None) -> dict:
        """``model.config.activation_bytes`` for this model's dtype, attention and (default) checkpointing."""
        k = self.checkpoint_every if checkpoint_every is None else checkpoint_every
        return activation_bytes(self.config, batch, seq, k, self.dtype, attention=self.attention,
                                keeps_ln_1=self.keeps_ln_1)

    # ------------------------------------------------------------------ sampling

    def generate(self, prompt, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
                 seed: int | None = None, rng: np.random.Generator | None = None) -> list[int]:
        """Autoregressive sampling: the prompt's token ids plus ``max_new_tokens`` new ones.

        Each step runs the model on the last ``block_size`` tokens and samples from
        ``softmax(logits / temperature)`` restricted to the ``top_k`` largest (temperature 0: argmax).
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        rng = rng or np.random.default_rng(seed)
        ids = check_token_ids(prompt, self.config.vocab_size, "the prompt")  # integers in [0, V), at least one
        for _ in range(max_new_tokens):
            ctx = np.asarray(ids[-self.config.block_size:], dtype=np.int32)[None, :]
            logits, _ = self.forward(backend.to_device(ctx, self.xp), last_only=True)
            ids.append(sample_token(backend.to_numpy(logits[0]).astype(np.float64), temperature, top_k, rng))
        return ids


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """One token from ``softmax(logits / temperature)`` over the ``top_k`` largest logits (host NumPy)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


# --------------------------------------------------------------------------- helpers of both passes


def accumulate_grad(dst, src):
    """dst (fp32 gradient view) += src (any float dtype)."""
    if src.dtype != dst.dtype:
        src = src.astype(dst.dtype)
    dst += src


def nbytes_of(objs) -> int:
    """Bytes held by the arrays in caches (dicts, tuples, lists; None skipped). Views of one buffer
    (q, k, v of the QKV buffer) are counted once; other objects (the attention stats) by their ``nbytes``."""
    seen: set = set()

    def walk(o) -> int:
        if o is None:
            return 0
        if isinstance(o, dict):
            return sum(walk(v) for v in o.values())
        if isinstance(o, (list, tuple)):
            return sum(walk(v) for v in o)
        if not hasattr(o, "base"):
            return int(getattr(o, "nbytes", 0))
        base = o
        while getattr(base, "base", None) is not None:
            base = base.base
        if id(base) in seen:
            return 0
        seen.add(id(base))
        return int(base.nbytes)

    return walk(objs)


def _float64_params(shapes, xp, multiple: int = ALIGN) -> FlatParams:
    """A FlatParams whose buffers are float64 (NumPy only): the finite-difference reference model; the layout
    of any other dtype's (``multiple``)."""
    if xp is not np:
        raise TypeError("dtype fp64 is a NumPy-only reference (finite-difference checks); use fp32/bf16/fp16 on GPU")
    P = FlatParams(shapes, xp=np, working_dtype="fp32", multiple=multiple)
    for name in ("data", "grad", "m", "v"):
        setattr(P, name, np.zeros(P.numel, dtype=np.float64))
    P.working = P.data
    P.working_dtype = backend.float64
    return P


def _checked_host(key, v, allow_nonfinite=False) -> np.ndarray:
    """``_to_host`` of a float tensor; TypeError for other dtypes, ValueError for NaN/inf (unless allowed)."""
    dt = getattr(v, "dtype", None)
    is_float = getattr(dt, "is_floating_point", None)  # torch.dtype
    if is_float is None:
        is_float = dt is not None and np.dtype(dt).kind == "f"  # NumPy/CuPy (bf16 from ml_dtypes is kind 'V')
        is_float = is_float or (dt is not None and np.dtype(dt) == backend.bfloat16)
    if not is_float:
        raise TypeError(f"load_state_dict: {key!r} must hold floating-point weights, got "
                        f"{dt if dt is not None else type(v).__name__}")
    a = _to_host(v)
    if not allow_nonfinite:
        bad = int(a.size - np.count_nonzero(np.isfinite(a)))
        if bad:
            raise ValueError(f"load_state_dict: {key!r} has {bad} non-finite (NaN or inf) value(s) of {a.size}; "
                             "pass allow_nonfinite=True to load them anyway")
    return a


def _to_host(v) -> np.ndarray:
    """NumPy float32 copy of a NumPy/CuPy array or a PyTorch tensor."""
    if hasattr(v, "detach") and hasattr(v, "cpu"):  # torch.Tensor, without importing torch
        v = v.detach().float().cpu().numpy()
    return np.asarray(backend.to_numpy(v), dtype=np.float32)


__all__ = ["PAD_LOGIT", "GPTBase", "accumulate_grad", "nbytes_of", "sample_token"]
