"""AdamW: NumPy path vs an independent float64 AdamW, fused kernel vs reference, per-tensor vs fused,
skipped steps, state round trip, torch.optim.AdamW, the LR schedule, bad inputs (chapter 4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmgpu import backend
from llmgpu.optim import AdamW, adamw_update, lr_at
from llmgpu.optim.params import FlatParams

pytestmark = pytest.mark.ch4

SHAPES = {"w1": (33, 7), "b1": (33,), "ln.weight": (7,), "w2": (1, 1000), "emb": (50, 8), "one": (1,)}


def ref_adamw64(p, m, v, grads, *, lr, beta1, beta2, eps, wd, scales, lrs=None):
    """Textbook AdamW in float64 over several steps (t = 1, 2, ...); wd may be a per-element array."""
    p, m, v = (np.asarray(a, np.float64).copy() for a in (p, m, v))
    for t, (g, s) in enumerate(zip(grads, scales), start=1):
        lr_t = lr if lrs is None else lrs[t - 1]
        g = np.asarray(g, np.float64) * s
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        p = p - lr_t * wd * p - lr_t * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


def _rel(a, b, scale=None):
    """‖a − b‖ over ‖b‖, or over ``scale`` where b is a difference of terms that can cancel."""
    a, b = (backend.to_numpy(x).astype(np.float64) for x in (a, b))
    return np.linalg.norm(a - b) / max(np.linalg.norm(b) if scale is None else scale, 1e-30)


def _init(P, rng):
    for n in P.names:
        P.param(n)[...] = backend.to_device((rng.standard_normal(P.shapes[n]) * 0.5).astype(np.float32), P.xp)
    P.sync_working()


def _grads(P, rng, steps):
    out = []
    for _ in range(steps):
        g = np.zeros(P.numel, np.float32)
        for n in P.names:
            o, s = P.offsets[n], P.sizes[n]
            g[o: o + s] = rng.standard_normal(s).astype(np.float32) * 3.0
        out.append(g)
    return out


# --------------------------------------------------------------------------- NumPy path


def test_adamw_update_numpy_vs_float64(rng):
    shape = (13, 5)
    p = rng.standard_normal(shape).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(6)]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)
    p0 = p.copy()
    for t, g in enumerate(grads, start=1):
        adamw_update(p, g, m, v, step=t, weight_decay=0.1, grad_scale=0.5, **kw)
    rp, rm, rv = ref_adamw64(p0, np.zeros(shape), np.zeros(shape), grads, wd=0.1, scales=[0.5] * 6, **kw)
    assert _rel(p, rp) < 1e-6 and _rel(m, rm) < 1e-6 and _rel(v, rv) < 1e-6


def test_bias_correction_first_step(rng):
    # with zero moments, step 1 moves every weight by lr * sign(g) (|g| >> eps): bias correction at work
    p = rng.standard_normal(100).astype(np.float32)
    g = rng.standard_normal(100).astype(np.float32)
    p0 = p.copy()
    adamw_update(p, g, np.zeros_like(p), np.zeros_like(p), step=1, lr=1e-3)
    np.testing.assert_allclose(p0 - p, 1e-3 * np.sign(g), rtol=1e-4)


def test_flat_optimizer_numpy_vs_float64_with_decay_mask(rng):
    P = FlatParams(SHAPES, xp=np, working_dtype="bf16")
    _init(P, rng)
    p0 = P.data.copy()
    steps = 5
    grads = _grads(P, rng, steps)
    scales = [1.0, 0.25, 2.0, 1.0, 0.5]
    lrs = [lr_at(s, max_lr=1e-2, warmup_steps=2, total_steps=5) for s in range(steps)]
    opt = AdamW(P, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for k in range(steps):
        P.grad[...] = grads[k]
        opt.step(lr=lrs[k], grad_scale=scales[k])
    wd = 0.1 * P.decay_mask().astype(np.float64)
    rp, rm, rv = ref_adamw64(p0, 0 * p0, 0 * p0, grads, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, wd=wd,
                             scales=scales, lrs=lrs)
    assert _rel(P.data, rp) < 1e-6 and _rel(P.m, rm) < 1e-6 and _rel(P.v, rv) < 1e-6
    assert opt.steps_taken() == steps
    np.testing.assert_array_equal(P.working, P.data.astype(P.working.dtype))
    # the no-decay tensors really were not decayed: compare against a run with wd only on them flipped
    assert P.decay["w1"] and not P.decay["b1"] and not P.decay["ln.weight"]


def test_per_tensor_equals_fused_numpy(rng):
    Ps = [FlatParams(SHAPES, xp=np) for _ in range(2)]
    for P in Ps:
        _init(P, np.random.default_rng(1))
    opts = [AdamW(Ps[0]), AdamW(Ps[1], per_tensor=True)]
    for g in _grads(Ps[0], rng, 3):
        for P, o in zip(Ps, opts):
            P.grad[...] = g
            o.step(lr=3e-3, zero_grad=True)
    for a in ("data", "m", "v", "grad"):
        np.testing.assert_array_equal(getattr(Ps[0], a), getattr(Ps[1], a))


def test_skipped_step_numpy(rng):
    P = FlatParams(SHAPES, xp=np, working_dtype="fp16")
    _init(P, rng)
    opt = AdamW(P)
    P.grad[...] = _grads(P, rng, 1)[0]
    opt.step()
    before = {a: getattr(P, a).copy() for a in ("data", "m", "v", "working")}
    P.grad[...] = _grads(P, rng, 1)[0]
    opt.step(found_inf=np.array(1.0, np.float32), zero_grad=True)
    for a, b in before.items():
        np.testing.assert_array_equal(getattr(P, a), b)
    assert opt.steps_taken() == 1 and not P.grad.any()


def test_state_dict_resume(rng):
    grads = None
    runs = []
    for split in (False, True):
        P = FlatParams(SHAPES, xp=np)
        _init(P, np.random.default_rng(7))
        grads = grads or _grads(P, rng, 4)
        opt = AdamW(P, lr=1e-2)
        for k, g in enumerate(grads):
            if split and k == 2:  # checkpoint, rebuild everything, resume
                sd, pd = opt.state_dict(), P.to_dict()
                P = FlatParams(SHAPES, xp=np)
                P.load_dict(pd)
                opt = AdamW(P, lr=0.5)
                opt.load_state_dict(sd)
                assert opt.lr == 1e-2 and opt.steps_taken() == 2
            P.grad[...] = g
            opt.step()
        runs.append(P.data.copy())
    np.testing.assert_array_equal(runs[0], runs[1])


def test_bad_inputs_numpy():
    p = np.zeros((4, 3), np.float32)
    g, m, v = np.ones_like(p), np.zeros_like(p), np.zeros_like(p)
    with pytest.raises(ValueError, match="grad"):
        adamw_update(p, np.ones((3, 4), np.float32), m, v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="m"):
        adamw_update(p, g, m.astype(np.float64), v, step=1, lr=1e-3)
    with pytest.raises(TypeError, match="param"):
        adamw_update(p.astype(np.float16), g, m, v, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="v"):
        adamw_update(p, g, m, np.zeros((3, 4), np.float32).T, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step"):
        adamw_update(p, g, m, v, step=0, lr=1e-3)
    with pytest.raises(TypeError, match="grad_scale"):
        adamw_update(p, g, m, v, step=1, lr=1e-3, grad_scale=np.array(1.0, np.float64))
    with pytest.raises(ValueError, match="betas"):
        adamw_update(p, g, m, v, step=1, lr=1e-3, beta2=1.0)
    with pytest.raises(TypeError, match="FlatParams"):
        AdamW({"w": p})
    P = FlatParams({"w": (3, 3)}, xp=np)
    with pytest.raises(TypeError, match="found_inf"):
        AdamW(P).step(found_inf=np.array(1, np.int32))


# --------------------------------------------------------------------------- schedule


def test_lr_schedule():
    kw = dict(max_lr=6e-4, warmup_steps=10, total_steps=110, min_lr=6e-5)
    assert lr_at(0, **kw) == pytest.approx(6e-5)
    assert lr_at(9, **kw) == pytest.approx(6e-4)
    assert lr_at(10, **kw) == pytest.approx(6e-4)
    assert lr_at(60, **kw) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert lr_at(110, **kw) == pytest.approx(6e-5) and lr_at(500, **kw) == pytest.approx(6e-5)
    assert lr_at(35, **kw) == pytest.approx(6e-5 + 0.5 * (1 + math.cos(math.pi * 0.25)) * (6e-4 - 6e-5))
    assert lr_at(60, kind="linear", **kw) == pytest.approx((6e-4 + 6e-5) / 2)
    assert lr_at(1000, kind="constant", **kw) == 6e-4
    vals = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    with pytest.raises(ValueError, match="kind"):
        lr_at(0, kind="step", **kw)
    with pytest.raises(ValueError, match="step"):
        lr_at(-1, **kw)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 33, 1000, 50257])
@pytest.mark.parametrize("gdt", ["fp32", "bf16", "fp16"])
def test_adamw_update_gpu_vs_reference(cp, rng, n, gdt):
    gdt = backend.resolve_dtype(gdt)
    p = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.1).astype(np.float32)
    v = (rng.random(n) * 0.1).astype(np.float32)
    g = rng.standard_normal(n).astype(gdt)
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    adamw_update(rp, g.astype(np.float32), rm, rv, **kw)  # float64 math, fp32 storage
    dp, dm, dv, dg = (cp.asarray(a) for a in (p, m, v, g))
    w = cp.full(n, cp.nan, dtype=cp.dtype(backend.bfloat16))  # poisoned working copy
    adamw_update(dp, dg, dm, dv, working=w, **kw)
    # m = β1·m + (1 − β1)·s·g can cancel to a tiny value (seen with n=1 on the H200): measure its
    # error against the size of the two terms, which is what fp32 rounding is proportional to.
    m_terms = np.linalg.norm(0.9 * np.abs(m) + 0.1 * 0.5 * np.abs(g.astype(np.float64)))
    assert _rel(dp, rp) < 1e-6 and _rel(dm, rm, scale=m_terms) < 1e-6 and _rel(dv, rv) < 1e-6
    np.testing.assert_array_equal(backend.to_numpy(w).view(np.uint16),
                                  backend.to_numpy(dp).astype(backend.bfloat16).view(np.uint16))


@pytest.mark.gpu
def test_adamw_update_gpu_unaligned_and_device_scalars(cp, rng):
    # views starting one element in: the kernel must take the scalar path
    n = 1001
    base = [cp.asarray(rng.standard_normal(n + 1).astype(np.float32)) for _ in range(4)]
    base[3] = cp.abs(base[3])  # v >= 0
    p, g, m, v = (b[1:] for b in base)
    ref = [backend.to_numpy(a).copy() for a in (p, g, m, v)]
    heads = [float(b[0]) for b in base]
    lr_d, gs_d, step_d = cp.asarray(np.float32(2e-3)), cp.asarray(np.float32(0.7)), cp.asarray(np.int32(5))
    adamw_update(p, g, m, v, step=step_d, lr=lr_d, grad_scale=gs_d, weight_decay=0.05)
    adamw_update(ref[0], ref[1], ref[2], ref[3], step=5, lr=2e-3, grad_scale=0.7, weight_decay=0.05)
    assert _rel(p, ref[0]) < 1e-6 and _rel(m, ref[2]) < 1e-6 and _rel(v, ref[3]) < 1e-6
    assert int(step_d) == 5  # adamw_update never changes a step it was given
    assert [float(b[0]) for b in base] == heads  # nothing written before the views


def _pair(rng, working="bf16"):
    seed = int(rng.integers(1 << 30))
    Pn = FlatParams(SHAPES, xp=np, working_dtype=working)
    _init(Pn, np.random.default_rng(seed))
    cp = backend.require_gpu()
    Pg = FlatParams(SHAPES, xp=cp, working_dtype=working)
    Pg.load_dict(Pn.to_dict())
    return Pn, Pg


@pytest.mark.gpu
@pytest.mark.parametrize("working", ["fp32", "bf16", "fp16"])
def test_fused_gpu_vs_numpy(cp, rng, working):
    Pn, Pg = _pair(rng, working)
    on, og = AdamW(Pn, lr=1e-2), AdamW(Pg, lr=1e-2)
    for k, g in enumerate(_grads(Pn, rng, 5)):
        Pn.grad[...] = g
        Pg.grad[...] = cp.asarray(g)
        gs = 0.5 + 0.1 * k
        lr = lr_at(k, max_lr=1e-2, warmup_steps=2, total_steps=5)
        on.step(lr=lr, grad_scale=gs)
        og.step(lr=cp.asarray(np.float32(lr)) if k % 2 else lr, grad_scale=cp.asarray(np.float32(gs)),
                zero_grad=True)
    assert _rel(Pg.data, Pn.data) < 1e-6 and _rel(Pg.m, Pn.m) < 1e-6 and _rel(Pg.v, Pn.v) < 1e-6
    assert og.steps_taken() == 5
    assert not cp.any(Pg.grad)
    if working != "fp32":
        np.testing.assert_array_equal(backend.to_numpy(Pg.working).view(np.uint16),
                                      backend.to_numpy(Pg.data).astype(Pg.working.dtype).view(np.uint16))


@pytest.mark.gpu
def test_per_tensor_equals_fused_gpu(cp, rng):
    _, Pa = _pair(rng)
    Pb = FlatParams(SHAPES, xp=cp, working_dtype="bf16")
    Pb.load_dict(Pa.to_dict())
    oa, ob = AdamW(Pa), AdamW(Pb, per_tensor=True)
    for g in _grads(Pa, rng, 3):
        for P, o in ((Pa, oa), (Pb, ob)):
            P.grad[...] = cp.asarray(g)
            o.step(lr=3e-3, grad_scale=0.9)
    for a in ("data", "m", "v", "working"):
        assert cp.array_equal(getattr(Pa, a).view(cp.uint8), getattr(Pb, a).view(cp.uint8)), a
    assert oa.steps_taken() == ob.steps_taken() == 3


@pytest.mark.gpu
@pytest.mark.parametrize("per_tensor", [False, True])
def test_injected_inf_skips_step_gpu(cp, rng, per_tensor):
    from llmgpu.amp import LossScaler

    _, P = _pair(rng, "fp16")
    opt = AdamW(P, per_tensor=per_tensor)
    scaler = LossScaler("dynamic", init_scale=1024.0, xp=cp)
    g = _grads(P, rng, 2)
    P.grad[...] = cp.asarray(g[0])
    res = scaler.check_and_clip(P.grad, max_norm=1.0)
    opt.step(grad_scale=res.scale, found_inf=res.found_inf)
    scaler.update(res.found_inf)
    before = {a: getattr(P, a).copy() for a in ("data", "m", "v", "working")}
    step_before = opt.step_count.copy()
    bad = g[1].copy()
    bad[P.offsets["w2"] + 17] = np.inf
    P.grad[...] = cp.asarray(bad)
    res = scaler.check_and_clip(P.grad, max_norm=1.0)
    opt.step(grad_scale=res.scale, found_inf=res.found_inf, zero_grad=True)
    scaler.update(res.found_inf)
    for a, b in before.items():
        assert cp.array_equal(getattr(P, a).view(cp.uint8), b.view(cp.uint8)), a
    assert cp.array_equal(opt.step_count, step_before) and opt.steps_taken() == 1
    assert not cp.any(P.grad)
    assert scaler.scale_value() == 512.0
    # and the next clean step goes through again
    P.grad[...] = cp.asarray(g[1])
    res = scaler.check_and_clip(P.grad, max_norm=1.0)
    opt.step(grad_scale=res.scale, found_inf=res.found_inf)
    assert opt.steps_taken() == 2 and not cp.array_equal(P.data, before["data"])


@pytest.mark.gpu
def test_vs_torch_adamw(cp, rng):
    torch = pytest.importorskip("torch", reason="PyTorch not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    Pn, Pg = _pair(rng, "fp32")
    ours = AdamW(Pg, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tparams = {n: torch.tensor(Pn.param(n), device="cuda", requires_grad=True) for n in Pn.names}
    groups = [{"params": [tparams[n] for n in Pn.names if Pn.decay[n]], "weight_decay": 0.1},
              {"params": [tparams[n] for n in Pn.names if not Pn.decay[n]], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for g in _grads(Pn, rng, 5):
        Pg.grad[...] = cp.asarray(g)
        ours.step()
        for n in Pn.names:
            o, s = Pn.offsets[n], Pn.sizes[n]
            tparams[n].grad = torch.tensor(g[o: o + s].reshape(Pn.shapes[n]), device="cuda")
        topt.step()
    for n in Pn.names:
        assert _rel(Pg.param(n), tparams[n].detach().cpu().numpy()) < 1e-5, n


@pytest.mark.gpu
def test_bad_inputs_gpu(cp):
    p = cp.zeros((4, 3), cp.float32)
    with pytest.raises(TypeError, match="grad"):
        adamw_update(p, np.ones((4, 3), np.float32), cp.zeros_like(p), cp.zeros_like(p), step=1, lr=1e-3)
    with pytest.raises(TypeError, match="lr"):
        adamw_update(p, cp.ones_like(p), cp.zeros_like(p), cp.zeros_like(p), step=1, lr=np.array(1e-3, np.float32))
    with pytest.raises(ValueError, match="param"):
        adamw_update(p.T, cp.ones_like(p.T), cp.zeros_like(p.T), cp.zeros_like(p.T), step=1, lr=1e-3)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", ["lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale"])
def test_non_finite_hyperparameters_refused(name, bad):
    """A NaN/inf float argument would turn every weight into NaN without a word: a ValueError naming it."""
    p = np.ones((4, 3), np.float32)
    g, m, v = np.ones_like(p), np.zeros_like(p), np.zeros_like(p)
    kw = {"lr": 1e-3, name: bad}
    with pytest.raises(ValueError, match=name):
        adamw_update(p, g, m, v, step=1, **kw)
    assert np.all(p == 1.0) and np.all(m == 0.0)  # nothing was touched
    P = FlatParams({"w": (3, 3)}, xp=np)
    ctor = {"beta1": {"betas": (bad, 0.95)}, "beta2": {"betas": (0.9, bad)}}.get(name, {name: bad})
    if name == "grad_scale":
        with pytest.raises(ValueError, match=name):
            AdamW(P).step(grad_scale=bad)
    else:
        with pytest.raises(ValueError, match=name):
            AdamW(P, **ctor)
        if name == "lr":
            with pytest.raises(ValueError, match="lr"):
                AdamW(P).step(lr=bad)


@pytest.mark.parametrize("name, value", [("lr", -1e-3), ("eps", 0.0), ("weight_decay", -0.1), ("grad_scale", -1.0),
                                         ("beta1", 1.0), ("beta2", -0.1)])
def test_out_of_range_hyperparameters_refused(name, value):
    p = np.ones((4, 3), np.float32)
    g, m, v = np.ones_like(p), np.zeros_like(p), np.zeros_like(p)
    with pytest.raises(ValueError, match=name):
        adamw_update(p, g, m, v, step=1, **{"lr": 1e-3, name: value})


def test_hyperparameter_types_refused():
    p = np.ones((4, 3), np.float32)
    g, m, v = np.ones_like(p), np.zeros_like(p), np.zeros_like(p)
    with pytest.raises(TypeError, match="lr"):
        adamw_update(p, g, m, v, step=1, lr="1e-3")
    with pytest.raises(TypeError, match="eps"):
        adamw_update(p, g, m, v, step=1, lr=1e-3, eps=True)


def test_load_state_dict_refuses_nan_hyperparameters():
    P = FlatParams({"w": (3, 3)}, xp=np)
    opt = AdamW(P)
    sd = opt.state_dict()
    sd["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        AdamW(P).load_state_dict(sd)
