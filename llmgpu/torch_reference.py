"""The PyTorch GPT-2 and Llama that ``llmgpu bench`` and the tests compare llmgpu with (chapters 8 and 10).

A GPT-2 of identical architecture (nanoGPT-style: learned position embeddings, pre-LayerNorm blocks,
tanh-GELU MLP of width 4C, biases everywhere, LM head tied to the token embedding,
``F.scaled_dot_product_attention(is_causal=True)``, i.e. flash attention on the GPU), with nanoGPT's
parameter names so ``llmgpu.model.GPT.state_dict()`` loads as is, trained with bf16 autocast, fused
AdamW and the same clipping as ``llmgpu train`` (``TrainConfig``'s settings). PyTorch is imported on
first use; without it the functions raise ImportError saying so.

The Llama (``build_torch_llama``; its modules in ``torch_llama``) is written from the formulas of
``llmgpu.model.Llama`` with Hugging Face's names. Both families share ``TorchLM`` (the padded vocabulary, span
checkpointing, the loss), the state-dict loading and the initialisation rule (``build_torch_model``).

``llmgpu bench`` runs it at its best: the SDPA backend that is fastest on this GPU for the model's
attention shape (``pick_sdpa_backend``: flash and cuDNN timed once, forward + backward), any
``torch.compile`` mode (``COMPILE_MODES``), and per-span activation checkpointing
(``torch.utils.checkpoint``) when a large model needs it, as llmgpu's ``checkpoint_every``.

PyTorch's FP8 training (``run_torch(..., fp8=True)``, chapter 5b) is torchao's float8 training, its "tensorwise"
recipe (dynamic per-tensor scaling: the current scaling of ``FastOptions(fp8="current")``), on the linear layers
llmgpu runs in FP8 (``model.options.FP8_LINEARS``: QKV, MLP in, MLP out; not the attention out-projection, not the
LM head), under the same bf16 autocast; ``float8_unavailable_reason`` says why it cannot run (one line).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from functools import partial

import numpy as np

from . import backend
from .model.base import PAD_LOGIT
from .model.family import model_class
from .model.llama_config import EMBED, LM_HEAD
from .model.options import FP8_LINEARS, fp8_hardware_reason, fp8_setting_reason
from .perf.timing import time_torch
from .torch_llama import sdpa_takes_gqa, torch_llama_class
from .train.config import CPU_DEFAULTS, GPU_DEFAULTS, TrainConfig


def import_torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"PyTorch is not installed ({e}); install torch to run the PyTorch reference") from None
    return torch


_TORCH_CLASSES: dict | None = None
def _torch_classes() -> dict:
    """arch -> the PyTorch model class (defined on first use: torch is imported lazily)."""
    global _TORCH_CLASSES
    if _TORCH_CLASSES is not None:
        return _TORCH_CLASSES
    torch = import_torch()
    nn = torch.nn
    F = torch.nn.functional

    class TorchLM(nn.Module):
        """What both references share: the padded vocabulary's mask, span checkpointing, head logits → loss."""

        def __init__(self, config, mask_padded):
            super().__init__()
            V = config.padded_vocab_size
            self.config = config
            pad = torch.zeros(V)
            pad[config.vocab_size:] = PAD_LOGIT
            self.register_buffer("pad_logits", pad, persistent=False)
            self.mask_padded = bool(mask_padded) and V != config.vocab_size
            self.checkpoint_every = 0  # > 0: recompute spans of that many blocks in backward

        def _span(self, s, e, x, *extra):
            for blk in self.blocks[s:e]:
                x = blk(x, *extra)
            return x

        def run_blocks(self, x, *extra):
            """Every block on x (``extra``: what each block takes besides x), spans recomputed if checkpointing."""
            L, k = len(self.blocks), self.checkpoint_every
            if k and self.training and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                for s in range(0, L, k):
                    x = checkpoint(partial(self._span, s, min(s + k, L)), x, *extra, use_reentrant=False)
                return x
            return self._span(0, L, x, *extra)

        def logits_or_loss(self, logits, targets):
            if self.mask_padded:
                logits = logits + self.pad_logits
            if targets is None:
                return logits
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    # ------------------------------------------------------------------ GPT-2

    class SelfAttention(nn.Module):
        def __init__(self, C, H):
            super().__init__()
            self.n_head = H
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)

        def forward(self, x):
            B, T, C = x.shape
            H = self.n_head
            q, k, v = self.c_attn(x).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    class MLP(nn.Module):
        def __init__(self, C):
            super().__init__()
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self, C, H):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C, eps=1e-5)
            self.attn = SelfAttention(C, H)
            self.ln_2 = nn.LayerNorm(C, eps=1e-5)
            self.mlp = MLP(C)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class TorchGPT(TorchLM):
        """GPT-2 with nanoGPT's parameter names (so ``llmgpu.model.GPT.state_dict()`` loads as is)."""

        def __init__(self, config, mask_padded=False):
            super().__init__(config, mask_padded)
            C, V = config.n_embd, config.padded_vocab_size
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(V, C), "wpe": nn.Embedding(config.block_size, C),
                "h": nn.ModuleList([Block(C, config.n_head) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(C, eps=1e-5)})
            self.lm_head = nn.Linear(C, V, bias=False)
            self.transformer.wte.weight = self.lm_head.weight  # tied

        @property
        def blocks(self):
            return self.transformer.h

        def forward(self, idx, targets=None):
            T = idx.shape[1]
            pos = torch.arange(T, device=idx.device)
            x = self.run_blocks(self.transformer.wte(idx) + self.transformer.wpe(pos))
            return self.logits_or_loss(self.lm_head(self.transformer.ln_f(x)), targets)

    _TORCH_CLASSES = {"gpt2": TorchGPT, "llama": torch_llama_class(torch, TorchLM)}
    return _TORCH_CLASSES


def _as_torch_fp32(torch, v):
    """A NumPy, CuPy or torch array as an fp32 torch tensor on the CPU."""
    if hasattr(v, "detach"):
        return v.detach().float().cpu()
    return torch.from_numpy(np.ascontiguousarray(backend.to_numpy(v), dtype=np.float32))


# arch -> (state-dict entries to leave out, (the embedding, the LM head): the vocabulary rows, tied or not)
_NAMES = {"gpt2": ((".attn.bias", ".attn.masked_bias"), ("transformer.wte.weight", "lm_head.weight")),
          "llama": ((), (EMBED, LM_HEAD))}


def build_torch_model(config, *, state_dict=None, device=None, seed: int = 0, mask_padded: bool = False):
    """The PyTorch reference (fp32 parameters) of ``config``'s family (``config.arch``: GPT-2 or Llama) on
    ``device`` (default: cuda if available).

    ``state_dict``: llmgpu's names (``GPT(...).state_dict()``: nanoGPT's; ``Llama(...).state_dict()``: Hugging
    Face's), NumPy, CuPy or torch arrays, an unpadded vocabulary padded with zero rows; otherwise llmgpu's
    initialisation rule (``GPTBase.init_weights``: matrices N(0, 0.02), the model class's
    ``residual_projections`` N(0, 0.02/√(2L)), biases 0, norm gains 1), from torch's generator.
    ``mask_padded``: set the padded vocabulary logits to ``PAD_LOGIT`` as llmgpu does (default off, as
    nanoGPT's 50304-vocabulary runs; the FLOPs are the same either way).
    """
    torch = import_torch()
    arch = config.arch
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    model = _torch_classes()[arch](config, mask_padded=mask_padded)
    if state_dict is not None:
        skip, (emb_name, head_name) = _NAMES[arch]
        sd = {k: _as_torch_fp32(torch, v) for k, v in state_dict.items() if not (skip and k.endswith(skip))}
        for name in (emb_name, head_name):
            w = sd.get(name)
            if w is not None and w.shape[0] < config.padded_vocab_size:  # an unpadded vocabulary: zero rows
                sd[name] = torch.cat([w, torch.zeros(config.padded_vocab_size - w.shape[0], w.shape[1])])
        if getattr(config, "tie_embeddings", True):
            emb = sd.get(emb_name, sd.get(head_name))
            if emb is not None:
                sd[emb_name] = sd[head_name] = emb  # tied: both names, one tensor
        model.load_state_dict(sd, strict=True)
    else:
        std_res = 0.02 / math.sqrt(2 * config.n_layer)
        residual = model_class(config).residual_projections
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(residual):
                    p.normal_(0.0, std_res)
                elif p.dim() >= 2:
                    p.normal_(0.0, 0.02)
                elif name.endswith("bias"):
                    p.zero_()
    return model.to(device)


def build_torch_gpt(config, *, state_dict=None, device=None, seed: int = 0, mask_padded: bool = False):
    """A PyTorch GPT-2 of ``config`` (a ``GPTConfig``): ``build_torch_model``, nanoGPT's names."""
    if config.arch != "gpt2":
        raise TypeError(f"build_torch_gpt takes a GPTConfig, got a {type(config).__name__}")
    return build_torch_model(config, state_dict=state_dict, device=device, seed=seed, mask_padded=mask_padded)


def build_torch_llama(config, *, state_dict=None, device=None, seed: int = 0, mask_padded: bool = False):
    """A PyTorch Llama of ``config`` (a ``LlamaConfig``): ``build_torch_model``, Hugging Face's names."""
    if config.arch != "llama":
        raise TypeError(f"build_torch_llama takes a LlamaConfig, got a {type(config).__name__}")
    return build_torch_model(config, state_dict=state_dict, device=device, seed=seed, mask_padded=mask_padded)


def _torch_optimizer(torch, model, fused, opt: TrainConfig):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, fused=fused)


def torch_train_step(torch, run, x, y, params, opt, grad_clip: float, device_type: str, amp):
    """One PyTorch training step as a closure: forward + loss under autocast (``amp``: a torch dtype, or None
    for none), backward, global-norm clip, the optimizer step, ``zero_grad(set_to_none=True)``."""

    def step():
        ctx = torch.autocast(device_type=device_type, dtype=amp) if amp is not None else contextlib.nullcontext()
        with ctx:
            loss = run(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "none")
_SDPA_CHOICE: dict = {}  # (device, shape, dtype) -> the pick_sdpa_backend result: measured once per process


def _sdpa_enum(torch, name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


def sdpa_context(torch, name: str | None):
    """``torch.nn.attention.sdpa_kernel`` restricted to the backend ``name`` (None: PyTorch's own choice)."""
    if name is None:
        return contextlib.nullcontext()
    if name not in SDPA_BACKENDS:
        raise ValueError(f"SDPA backend must be one of {', '.join(SDPA_BACKENDS)}, got {name!r}")
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([_sdpa_enum(torch, name)])


def pick_sdpa_backend(config, batch: int, seq: int, *, dtype: str = "bf16", device=None, reps: int = 10,
                      candidates=("flash", "cudnn")) -> dict:
    """The fastest SDPA backend for this model's attention on this GPU, timed once per process.

    Each candidate runs causal ``scaled_dot_product_attention`` forward + backward on ``[B, H, T, D]``
    inputs of the model's shape (``perf.timing.time_torch``: CUDA events, median of ``reps``). Returns
    ``{"backend": name or None, "ms": {name: ms or None}, "errors": {name: why}}``; ``backend`` is None on a
    CPU or when no candidate runs (PyTorch then picks as usual)."""
    torch = import_torch()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    B, H, D = batch, config.n_head, config.n_embd // config.n_head
    Hk = getattr(config, "n_kv_head", H)  # a Llama's grouped K/V heads: timed as the model calls SDPA
    key = (str(device), B, H, Hk, seq, D, dtype, tuple(candidates))
    if key in _SDPA_CHOICE:
        return _SDPA_CHOICE[key]
    if device.type != "cuda":
        res = {"backend": None, "ms": {}, "errors": {"all": "no CUDA device: PyTorch's default SDPA backend"}}
        _SDPA_CHOICE[key] = res
        return res
    F = torch.nn.functional
    tdt = torch.bfloat16 if backend.dtype_name(dtype) == "bf16" else torch.float16
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, h, seq, D, device=device, dtype=tdt, generator=g, requires_grad=True)
               for h in (H, Hk, Hk))
    gqa = {"enable_gqa": True} if Hk != H and sdpa_takes_gqa(torch) else {}
    if Hk != H and not gqa:
        k, v = (t.detach().repeat_interleave(H // Hk, dim=1).requires_grad_() for t in (k, v))
    do = torch.randn(B, H, seq, D, device=device, dtype=tdt, generator=g)
    ms, errors = {}, {}
    for name in candidates:
        try:
            with sdpa_context(torch, name):
                def run():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
                    o.backward(do)
                ms[name] = time_torch(torch, run, reps)
        except Exception as e:  # this backend does not take the shape/dtype here
            ms[name] = None
            errors[name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    ok = {n: t for n, t in ms.items() if t is not None}
    res = {"backend": min(ok, key=ok.get) if ok else None, "ms": ms, "errors": errors}
    _SDPA_CHOICE[key] = res
    torch.cuda.empty_cache()
    return res


TORCHAO_RECIPE = "tensorwise"  # torchao's Float8LinearRecipeName: per-tensor dynamic scaling, its fastest recipe


def float8_unavailable_reason(torch, device=None, *, dtype: str = "bf16", arch: str = "gpt2") -> str | None:
    """Why torchao's float8 training cannot run here (one line), or None: the GPT-2 family (the layers llmgpu runs in
    FP8), bf16 autocast around it, a CUDA GPU with FP8 tensor cores, torchao importable."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    cap = "{}.{}".format(*torch.cuda.get_device_capability(device)) if cuda else None
    # the hardware first: where it cannot run FP8, no setting would help
    if why := (fp8_hardware_reason(cap, torch.cuda.get_device_name(device) if cuda else "this GPU")
               or fp8_setting_reason(arch, backend.dtype_name(dtype))):
        return why
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # not installed, or built for another PyTorch
        line = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return f"torchao's float8 training is not importable ({type(e).__name__}: {line}); pip install torchao"
    return None


def is_fp8_linear(fqn: str) -> bool:
    """Whether the reference's linear layer ``fqn`` (``transformer.h.0.mlp.c_fc``) is one llmgpu runs in FP8."""
    return fqn.startswith("transformer.h.") and fqn.endswith(tuple("." + n for n in FP8_LINEARS))


def convert_to_float8(torch, model) -> int:
    """Swap ``model``'s FP8 linear layers (``is_fp8_linear``) for torchao's ``Float8Linear`` with the tensorwise recipe,
    in place; returns how many were swapped (3 per block, checked: a renamed layer must not go unnoticed)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_fp8_linear(n)]
    want = len(FP8_LINEARS) * len(model.blocks)
    if len(chosen) != want:
        raise RuntimeError(f"the FP8 layer filter chose {len(chosen)} linear layers of the reference, not {want}: "
                           f"{chosen[:6]}")
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(TORCHAO_RECIPE),
                               module_filter_fn=lambda m, fqn: is_fp8_linear(fqn))
    return len(chosen)


def run_torch(config, batch: int, seq: int, steps: int = 20, mode: str = "eager", *, warmup: int | None = None,
              dtype: str = "bf16", device=None, state_dict=None, seed: int = 0, mask_padded: bool = False,
              settings: TrainConfig | None = None, compile_mode: str = "default", sdpa: str | None = None,
              checkpoint_every: int = 0, fp8: bool = False) -> dict:
    """Train the PyTorch reference of ``config``'s family for ``warmup + steps`` steps on synthetic tokens;
    returns the metrics.

    ``mode``: ``"eager"`` or ``"compile"`` (``torch.compile`` of the model; the optimizer stays eager).
    ``dtype``: autocast dtype (``"bf16"``, ``"fp16"`` without a scaler is refused, ``"fp32"`` = no autocast).
    Each step: forward + loss under autocast, backward, global-norm clip at 1.0, fused AdamW
    (``fused=True`` on CUDA), ``zero_grad(set_to_none=True)``. Times: CUDA events per step, median.
    ``compile_mode``: ``torch.compile``'s ``mode`` with ``mode="compile"`` (one of ``COMPILE_MODES`` but
    "none"; "default" is ``mode=None``). ``sdpa``: restrict attention to that SDPA backend (``SDPA_BACKENDS``;
    None: PyTorch's choice). ``checkpoint_every``: recompute spans of k blocks in backward (0 = off). ``fp8``:
    torchao's float8 training on llmgpu's FP8 layers (``convert_to_float8``) before ``torch.compile``; where it cannot
    run (``float8_unavailable_reason``), a ValueError saying why.
    """
    torch = import_torch()
    if mode not in ("eager", "compile"):
        raise ValueError(f"mode must be 'eager' or 'compile', got {mode!r}")
    if compile_mode not in COMPILE_MODES or compile_mode == "none":
        raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES[:-1])}, got {compile_mode!r}")
    amp = {"bf16": torch.bfloat16, "fp32": None}.get(backend.dtype_name(dtype), "bad")
    if amp == "bad":
        raise ValueError(f"dtype must be bf16 or fp32 for the benchmark, got {dtype!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if fp8 and (why := float8_unavailable_reason(torch, device, dtype=dtype, arch=config.arch)):
        raise ValueError(why)
    if warmup is None:
        warmup = 5 if mode == "compile" else 3
    model = build_torch_model(config, state_dict=state_dict, device=device, seed=seed, mask_padded=mask_padded)
    fp8_layers = convert_to_float8(torch, model) if fp8 else 0
    model.train()
    model.checkpoint_every = int(checkpoint_every)
    settings = settings or TrainConfig(lr=GPU_DEFAULTS["lr"] if cuda else CPU_DEFAULTS["lr"])
    opt = _torch_optimizer(torch, model, fused=cuda, opt=settings)
    cuda_graphs = mode == "compile" and compile_mode in ("reduce-overhead", "max-autotune")
    run = torch.compile(model, mode=None if compile_mode == "default" else compile_mode) if mode == "compile" \
        else model
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    y = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    params = list(model.parameters())

    inner = torch_train_step(torch, run, x, y, params, opt, settings.grad_clip, device.type, amp)

    def step():
        if cuda_graphs:  # torch.compile's CUDA graphs: a new step begins (the previous outputs may be overwritten)
            torch.compiler.cudagraph_mark_step_begin()
        with sdpa_context(torch, sdpa):
            return inner()

    t0 = time.perf_counter()
    for _ in range(warmup):
        loss = step()
    if cuda:
        torch.cuda.synchronize(device)
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    t_begin = time.time()  # the timed steps' wall-clock window (to match the clock readings: perf.clocks)
    if cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        for a, b in evs:
            a.record()
            loss = step()
            b.record()
        torch.cuda.synchronize(device)
        times = [a.elapsed_time(b) for a, b in evs]
    else:
        for _ in range(steps):
            t = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - t) * 1e3)
    t_end = time.time()
    ms = statistics.median(times)
    res = {"framework": "pytorch", "arch": config.arch, "mode": f"torch-{mode}", "batch": batch, "seq": seq,
           "dtype": backend.dtype_name(dtype), "steps": steps, "warmup": warmup, "warmup_s": warmup_s,
           "ms_per_step": ms, "ms_min": min(times), "tokens_per_s": batch * seq / (ms * 1e-3),
           "final_loss": float(loss.detach().float().cpu()), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu",
           "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if cuda else None,
           "vocab": config.padded_vocab_size, "sdpa_backend": sdpa, "checkpoint_every": int(checkpoint_every),
           "timed_window": [t_begin, t_end]}
    if mode == "compile":
        res["compile_mode"] = compile_mode
    if fp8:
        res.update(fp8_recipe=f"torchao {TORCHAO_RECIPE}", fp8_layers=fp8_layers)
    return res


__all__ = ["COMPILE_MODES", "SDPA_BACKENDS", "TORCHAO_RECIPE", "build_torch_gpt", "build_torch_llama",
           "build_torch_model", "convert_to_float8", "float8_unavailable_reason", "is_fp8_linear", "pick_sdpa_backend",
           "run_torch", "sdpa_context", "sdpa_takes_gqa", "torch_train_step"]
