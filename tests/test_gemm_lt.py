"""The optional fast path of chapter 8 (``pip install 'llmgpu[fast]'``): cuBLASLt GEMMs with fused
epilogues (``llmgpu.gemm.cublaslt``) and cuDNN flash attention (``llmgpu.ops.flash_attention``).

CPU: the NumPy references against float64 formulas and finite differences, argument checks, the error
raised without the optional packages. GPU (skipped with the reason when nvmath-python / the cuDNN
frontend is missing): every epilogue against ``llmgpu.gemm.gemm`` + the separate ops, fp32 / bf16 /
fp16, awkward shapes, poisoned outputs; capture into a CUDA graph with replay bit-identical to eager;
cuDNN attention against ``llmgpu.ops.attention``, including strided q/k/v views of one qkv buffer.
"""

import math

import numpy as np
import pytest
from repo_tools import load_tool

from llmgpu import backend
from llmgpu.gemm import cublaslt as gemm_lt
from llmgpu.gemm.cublaslt import gelu_grad_reference, gelu_reference, lt_gemm
from llmgpu.ops import cudnn_attention
from llmgpu.ops import flash_attention as fa
from llmgpu.ops.attention import AttentionStats, attention_backward, attention_forward
from llmgpu.ops.gelu import gelu_backward_reference, gelu_forward_reference
from llmgpu.testing import assert_close, check_gradient, poisoned, random_array, rel_error

pytestmark = pytest.mark.ch8


def _gelu64(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_grad64(x):
    t = np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * math.sqrt(2.0 / math.pi) * (1.0 + 3 * 0.044715 * x * x)


def _op64(a, trans):
    a = np.asarray(a, dtype=np.float64)
    return np.swapaxes(a, -1, -2) if trans else a


# =========================================================================== cuBLASLt: NumPy reference


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_reference_plain_and_bias_match_float64(rng, trans_a, trans_b):
    M, K, N = 7, 13, 5
    a = random_array(rng, (K, M) if trans_a else (M, K))
    b = random_array(rng, (N, K) if trans_b else (K, N))
    bias = random_array(rng, (N,))
    ref = _op64(a, trans_a) @ _op64(b, trans_b)
    assert_close(lt_gemm(a, b, trans_a=trans_a, trans_b=trans_b), ref, "fp32")
    out = lt_gemm(a, b, trans_a=trans_a, trans_b=trans_b, out=poisoned((M, N), "fp32", np), bias=bias,
                  epilogue="bias")
    assert_close(out, ref + bias.astype(np.float64), "fp32")
    acc = random_array(rng, (M, N))
    want = 0.5 * ref + 2.0 * acc.astype(np.float64)
    assert_close(lt_gemm(a, b, trans_a=trans_a, trans_b=trans_b, out=acc, alpha=0.5, beta=2.0), want, "fp32")


def test_reference_gelu_bias_writes_aux_and_gelu(rng):
    x, w, b = random_array(rng, (9, 6)), random_array(rng, (16, 6)), random_array(rng, (16,))
    aux = poisoned((9, 16), "fp32", np)
    h = lt_gemm(x, w, trans_b=True, bias=b, epilogue="gelu_bias", aux=aux)
    pre = x.astype(np.float64) @ w.astype(np.float64).T + b
    assert_close(aux, pre, "fp32")
    assert_close(h, _gelu64(pre), "fp32")


def test_reference_gelu_bias_without_aux_keeps_no_pre_activation(rng):
    """Without aux (inference): the same GELU output, nothing else written."""
    x, w, b = random_array(rng, (9, 6)), random_array(rng, (16, 6)), random_array(rng, (16,))
    h = lt_gemm(x, w, trans_b=True, bias=b, epilogue="gelu_bias", out=poisoned((9, 16), "fp32", np))
    np.testing.assert_array_equal(h, lt_gemm(x, w, trans_b=True, bias=b, epilogue="gelu_bias",
                                             aux=np.empty((9, 16), np.float32)))


def test_reference_dgelu_and_bgradb(rng):
    M, K, N = 11, 5, 8
    dy, w2, pre = random_array(rng, (M, K)), random_array(rng, (K, N)), random_array(rng, (M, N), scale=2.0)
    out = lt_gemm(dy, w2, epilogue="dgelu", aux=pre)
    assert_close(out, (dy.astype(np.float64) @ w2) * _gelu_grad64(pre.astype(np.float64)), "fp32")
    # wgrad: dW[N, K] = dpreᵀ x, db[N] = Σ_rows dpre  (a = dpre with trans_a: op(a) = dpreᵀ)
    dpre, x = random_array(rng, (M, N)), random_array(rng, (M, K))
    db = poisoned((N,), "fp32", np)
    dw = lt_gemm(dpre, x, trans_a=True, epilogue="bgradb", dbias=db)
    assert_close(dw, dpre.astype(np.float64).T @ x, "fp32")
    assert_close(db, dpre.astype(np.float64).sum(0), "fp32")


def test_reference_batched_and_broadcast(rng):
    a, b = random_array(rng, (3, 4, 5)), random_array(rng, (3, 5, 6))
    assert_close(lt_gemm(a, b), np.matmul(a.astype(np.float64), b), "fp32")
    b2 = random_array(rng, (6, 5))
    assert_close(lt_gemm(a, b2, trans_b=True), np.matmul(a.astype(np.float64), b2.T.astype(np.float64)), "fp32")


def test_reference_bf16_and_fp64(rng):
    x = random_array(rng, (6, 8), "bf16")
    w = random_array(rng, (8, 8), "bf16")
    b = random_array(rng, (8,), "bf16")
    aux = np.empty((6, 8), backend.bfloat16)
    h = lt_gemm(x, w, trans_b=True, bias=b, epilogue="gelu_bias", aux=aux)
    assert h.dtype == backend.bfloat16 and aux.dtype == backend.bfloat16
    pre = x.astype(np.float64) @ w.astype(np.float64).T + b.astype(np.float64)
    assert_close(h, _gelu64(pre), "bf16")
    x64, w64 = rng.standard_normal((4, 3)), rng.standard_normal((3, 2))
    np.testing.assert_allclose(lt_gemm(x64, w64), x64 @ w64, rtol=1e-13)


def test_gelu_references_agree_with_ops_gelu(rng):
    x = (rng.standard_normal(1000) * 4).astype(np.float32)
    np.testing.assert_allclose(gelu_reference(x), gelu_forward_reference(x), rtol=1e-6, atol=1e-7)
    ones = np.ones_like(x)
    np.testing.assert_allclose(gelu_grad_reference(x), gelu_backward_reference(ones, x), rtol=1e-6, atol=1e-7)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(gelu_reference(x64), _gelu64(x64), rtol=1e-14)
    check_gradient(lambda: float(gelu_reference(x64[:20]).sum()), x64[:20], gelu_grad_reference(x64[:20]),
                   name="gelu'")


def test_bad_arguments(rng):
    a, b = random_array(rng, (4, 8)), random_array(rng, (8, 16))
    bias, aux = random_array(rng, (16,)), random_array(rng, (4, 16))
    with pytest.raises(ValueError, match="epilogue must be"):
        lt_gemm(a, b, epilogue="relu")
    with pytest.raises(ValueError, match="needs bias"):
        lt_gemm(a, b, epilogue="bias")
    with pytest.raises(ValueError, match="needs bias"):
        lt_gemm(a, b, epilogue="gelu_bias", aux=aux)
    with pytest.raises(ValueError, match="needs dbias"):
        lt_gemm(a, b, epilogue="bgradb")
    with pytest.raises(ValueError, match="aux= was given"):
        lt_gemm(a, b, aux=aux)
    with pytest.raises(ValueError, match="bias must have shape"):
        lt_gemm(a, b, bias=random_array(rng, (4,)), epilogue="bias")
    with pytest.raises(TypeError, match="aux must be"):
        lt_gemm(a, b, epilogue="dgelu", aux=aux.astype(np.float16))
    with pytest.raises(ValueError, match="dbias must have shape"):
        lt_gemm(a, b, epilogue="bgradb", dbias=random_array(rng, (16,)))
    with pytest.raises(ValueError, match="alpha == 1"):
        lt_gemm(a, b, bias=bias, epilogue="gelu_bias", aux=aux, alpha=2.0)
    with pytest.raises(ValueError, match="beta == 0"):
        lt_gemm(a, b, epilogue="dgelu", aux=aux, out=aux.copy(), beta=1.0)
    with pytest.raises(ValueError, match="batched"):
        lt_gemm(random_array(rng, (2, 4, 8)), b, bias=bias, epilogue="bias")
    with pytest.raises(ValueError, match="inner dimensions"):
        lt_gemm(a, b, trans_b=True)
    with pytest.raises(TypeError, match="share a dtype"):
        lt_gemm(a, b.astype(np.float16))
    with pytest.raises(ValueError, match="out must have shape"):
        lt_gemm(a, b, out=np.empty((4, 15), np.float32))
    with pytest.raises(ValueError, match="out must be given"):
        lt_gemm(a, b, beta=1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        lt_gemm(a, b.T.copy().T)
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        lt_gemm([[1.0]], b)


def test_missing_nvmath_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gemm_lt, "_import_lt", lambda: (None, "nvmath-python is not installed; " +
                                                        gemm_lt.INSTALL_HINT))
    with pytest.raises(gemm_lt.LtUnavailableError, match=r"llmgpu\[fast\]"):
        gemm_lt.lt_module()
    assert issubclass(gemm_lt.LtUnavailableError, backend.GPUUnavailableError)


# =========================================================================== cuBLASLt: GPU


@pytest.fixture
def lt(cp):
    reason = gemm_lt.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuBLASLt path not available: {reason}")
    return gemm_lt


def _dev(cp, rng, shape, dtype, scale=1.0):
    return cp.asarray(random_array(rng, shape, dtype, scale=scale))


SHAPES_ANY = [(1, 1, 1), (7, 13, 5), (33, 100, 77), (1, 768, 3072), (1000, 768, 2304)]
SHAPES_AUX = [(1, 8, 8), (7, 13, 8), (33, 100, 72), (1000, 768, 3072)]  # N % 8 == 0 (GELU aux ld)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES_ANY)
@pytest.mark.parametrize("trans", [(False, False), (False, True), (True, False), (True, True)])
def test_gpu_plain_and_bias_match_gemm(cp, lt, rng, dtype, shape, trans):
    from llmgpu.gemm import gemm

    M, K, N = shape
    ta, tb = trans
    a = _dev(cp, rng, (K, M) if ta else (M, K), dtype)
    b = _dev(cp, rng, (N, K) if tb else (K, N), dtype)
    bias = _dev(cp, rng, (N,), dtype)
    ref = gemm(a, b, trans_a=ta, trans_b=tb)
    out = lt_gemm(a, b, trans_a=ta, trans_b=tb, out=poisoned((M, N), dtype, cp))
    assert_close(out, ref, dtype, name="none")
    out = lt_gemm(a, b, trans_a=ta, trans_b=tb, out=poisoned((M, N), dtype, cp), bias=bias, epilogue="bias")
    # Reference in fp32 (one rounding, like the epilogue) and error against the size of the two terms:
    # a·b + bias can cancel (seen for 1x1x1 bf16 on the H200, where a double-rounded reference was off).
    ab = gemm(a, b, trans_a=ta, trans_b=tb, out_dtype="fp32")
    bias32 = bias.astype(np.float32)
    assert_close(out, ab + bias32, dtype, name="bias", scale=float(cp.linalg.norm(cp.abs(ab) + cp.abs(bias32))))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES_AUX)
def test_gpu_gelu_bias_matches_separate_ops(cp, lt, rng, dtype, shape):
    from llmgpu.gemm import gemm
    from llmgpu.ops.gelu import gelu_forward
    from llmgpu.ops.linear import add_bias

    M, K, N = shape
    x, w, b = _dev(cp, rng, (M, K), dtype), _dev(cp, rng, (N, K), dtype, K**-0.5), _dev(cp, rng, (N,), dtype)
    pre_ref = add_bias(gemm(x, w, trans_b=True), b)
    aux = poisoned((M, N), dtype, cp)
    h = lt_gemm(x, w, trans_b=True, out=poisoned((M, N), dtype, cp), bias=b, epilogue="gelu_bias", aux=aux)
    assert_close(aux, pre_ref, dtype, name="aux (pre-activation)")
    assert_close(h, gelu_forward(pre_ref), dtype, name="gelu(pre)")
    # without aux: cuBLASLt's GELU_BIAS (its own plan), the same function
    n_plans = lt.plan_count()
    h2 = lt_gemm(x, w, trans_b=True, out=poisoned((M, N), dtype, cp), bias=b, epilogue="gelu_bias")
    assert lt.plan_count() == n_plans + 1
    assert_close(h2, gelu_forward(pre_ref), dtype, name="gelu(pre), no aux")
    assert_close(h2, h, dtype, name="no aux vs aux")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES_AUX)
def test_gpu_dgelu_matches_separate_ops(cp, lt, rng, dtype, shape):
    from llmgpu.gemm import gemm
    from llmgpu.ops.gelu import gelu_backward

    M, K, N = shape
    dout, w2 = _dev(cp, rng, (M, K), dtype), _dev(cp, rng, (K, N), dtype, K**-0.5)
    pre = _dev(cp, rng, (M, N), dtype, 2.0)
    ref = gelu_backward(gemm(dout, w2), pre)
    out = lt_gemm(dout, w2, out=poisoned((M, N), dtype, cp), epilogue="dgelu", aux=pre)
    # cuBLASLt evaluates the GELU derivative its own way (tanh/exp approximations it does not document):
    # a few fp32 ulps from ours (1.01e-5 seen on the H200 for one input), so fp32 gets 3e-5, not 1e-5
    assert_close(out, ref, dtype, name="dpre", rtol=3e-5 if dtype == "fp32" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 5, 8), (7, 13, 5), (33, 100, 77), (1000, 768, 3072)])
@pytest.mark.parametrize("db_dtype", ["fp32", "same"])
def test_gpu_bgradb_matches_separate_ops(cp, lt, rng, dtype, shape, db_dtype):
    from llmgpu.gemm import gemm
    from llmgpu.ops.linear import bias_grad

    T, Cin, Cout = shape
    dy, x = _dev(cp, rng, (T, Cout), dtype), _dev(cp, rng, (T, Cin), dtype)
    dbt = "fp32" if db_dtype == "fp32" else dtype
    db = poisoned((Cout,), dbt, cp)
    if dbt != dtype:  # an fp32 bias gradient needs an fp32 out (cuBLASLt has no algorithm otherwise)
        with pytest.raises(TypeError, match="dbias must have out's dtype"):
            lt_gemm(dy, x, trans_a=True, out=poisoned((Cout, Cin), dtype, cp), epilogue="bgradb", dbias=db)
        dw = lt_gemm(dy, x, trans_a=True, out=poisoned((Cout, Cin), "fp32", cp), epilogue="bgradb", dbias=db)
        assert_close(dw, gemm(dy, x, trans_a=True, out_dtype="fp32"), dtype, name="dW")
    else:
        dw = lt_gemm(dy, x, trans_a=True, out=poisoned((Cout, Cin), dtype, cp), epilogue="bgradb", dbias=db)
        assert_close(dw, gemm(dy, x, trans_a=True), dtype, name="dW")
    assert_close(db, bias_grad(dy, out=cp.empty((Cout,), np.float32)), dtype, name="db")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(64, 16, 24), (4096, 768, 3072), (65536, 768, 2304)])
def test_gpu_bgradb_accumulates_into_an_fp32_weight_gradient(cp, lt, rng, dtype, shape):
    """The weight gradient accumulated into fp32 (dW += dyᵀ x, beta = 1) with the bias sum overwritten into an
    fp32 vector; at the GPT-2 step's 65536 tokens too, where the heuristic may split K; bitwise repeatable."""
    from llmgpu.gemm import gemm
    from llmgpu.ops.linear import bias_grad

    T, Cin, Cout = shape
    dy, x = _dev(cp, rng, (T, Cout), dtype), _dev(cp, rng, (T, Cin), dtype)
    dw0 = _dev(cp, rng, (Cout, Cin), "fp32")
    db = poisoned((Cout,), "fp32", cp)
    dw = lt_gemm(dy, x, trans_a=True, out=dw0.copy(), beta=1.0, epilogue="bgradb", dbias=db)
    assert_close(dw, dw0 + gemm(dy, x, trans_a=True, out_dtype="fp32"), dtype, name="dW")
    assert_close(db, bias_grad(dy, out=cp.empty((Cout,), np.float32)), dtype, name="db")
    again = poisoned((Cout,), "fp32", cp)
    lt_gemm(dy, x, trans_a=True, out=dw0.copy(), beta=1.0, epilogue="bgradb", dbias=again)
    assert bool(cp.all(again == db))  # bitwise repeatable


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", ["none", "bgradb"])
def test_gpu_fp32_gradient_accumulation(cp, lt, rng, epilogue):
    """The model's wgrad: bf16 inputs, fp32 weight gradient accumulated with beta = 1."""
    from llmgpu.gemm import gemm

    T, Cin, Cout = 257, 96, 40
    dy, x = _dev(cp, rng, (T, Cout), "bf16"), _dev(cp, rng, (T, Cin), "bf16")
    acc = _dev(cp, rng, (Cout, Cin), "fp32")
    want = acc + gemm(dy, x, trans_a=True, out_dtype="fp32")
    kw = {"epilogue": "bgradb", "dbias": cp.empty((Cout,), np.float32)} if epilogue == "bgradb" else {}
    lt_gemm(dy, x, trans_a=True, out=acc, beta=1.0, **kw)
    assert_close(acc, want, "fp32", rtol=1e-5)
    if kw:
        assert_close(kw["dbias"], dy.astype(np.float32).sum(0), "fp32", rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_batched_and_shared_b(cp, lt, rng, dtype):
    from llmgpu.gemm import gemm

    a, b = _dev(cp, rng, (2, 3, 33, 17), dtype), _dev(cp, rng, (2, 3, 17, 9), dtype)
    assert_close(lt_gemm(a.reshape(6, 33, 17), b.reshape(6, 17, 9), out=poisoned((6, 33, 9), dtype, cp)),
                 gemm(a.reshape(6, 33, 17), b.reshape(6, 17, 9)), dtype)
    b2 = _dev(cp, rng, (9, 17), dtype)
    assert_close(lt_gemm(a, b2, trans_b=True), gemm(a, b2, trans_b=True), dtype)  # folded into one 2-D GEMM
    at = _dev(cp, rng, (6, 17, 33), dtype)  # shared b with trans_a: a strided batch with b's stride 0
    assert_close(lt_gemm(at, b2, trans_a=True, trans_b=True, out=poisoned((6, 33, 9), dtype, cp)),
                 gemm(at, b2, trans_a=True, trans_b=True), dtype)
    q, k = _dev(cp, rng, (24, 65, 64), dtype), _dev(cp, rng, (24, 65, 64), dtype)  # attention's S = q kᵀ
    assert_close(lt_gemm(q, k, trans_b=True, out_dtype="fp32"), gemm(q, k, trans_b=True, out_dtype="fp32"), dtype)


@pytest.mark.gpu
def test_gpu_less_aligned_views(cp, lt, rng):
    """Views into a flat buffer (as FlatParams hands out) start 32 bytes apart, not 256: the plan asks the
    heuristic for that alignment instead of assuming cuBLASLt's default."""
    from llmgpu.gemm import gemm

    flat = _dev(cp, rng, (16 + 64 * 48 + 16 + 64,), "bf16")  # weight [64, 48], then a bias of 64
    w = flat[16:16 + 64 * 48].reshape(64, 48)
    b = flat[16 + 64 * 48 + 16:]
    assert w.data.ptr % 256 != 0
    x = _dev(cp, rng, (100, 48), "bf16")
    out = lt_gemm(x, w, trans_b=True, bias=b, epilogue="bias")
    from llmgpu.ops.linear import add_bias

    assert_close(out, add_bias(gemm(x, w, trans_b=True), b), "bf16")


@pytest.mark.gpu
def test_gpu_plan_key_names_the_cached_plan(cp, lt, rng):
    """``plan_key`` (what tools/probes/probe_lt_algos.py finds plans by) is the cache's key: a repeated call reuses its
    plan; a view aligned to 32 bytes instead of 256 gets a plan of its own, under a key that says so."""
    x, w = _dev(cp, rng, (88, 56), "bf16"), _dev(cp, rng, (40, 56), "bf16")  # a shape no other test uses
    dev, n0 = cp.cuda.Device().id, gemm_lt.plan_count()
    out = cp.empty((88, 40), dtype=x.dtype)
    key = gemm_lt.plan_key(dev, x, w, False, True, out, None, "none", None, 88, 40, 56, ())
    assert key not in gemm_lt._PLANS
    lt_gemm(x, w, trans_b=True, out=out)
    assert key in gemm_lt._PLANS and gemm_lt.plan_count() == n0 + 1
    lt_gemm(x, w, trans_b=True, out=out)
    assert gemm_lt.plan_count() == n0 + 1
    flat = _dev(cp, rng, (16 + 40 * 56,), "bf16")
    w32 = flat[16:].reshape(40, 56)  # 32 bytes past a 256-byte boundary
    lt_gemm(x, w32, trans_b=True, out=out)
    key32 = gemm_lt.plan_key(dev, x, w32, False, True, out, None, "none", None, 88, 40, 56, ())
    assert gemm_lt.plan_count() == n0 + 2 and key32 in gemm_lt._PLANS
    assert key[-1] == (256, 256, 256) and key32[-1] == (256, 32, 256)


@pytest.mark.gpu
def test_gpu_plan_asks_the_heuristic_for_more_candidates(cp, lt, rng):
    """``_Plan.ask_heuristic(n)`` (tools/probes/probe_lt_algos.py, instead of a module switch): the plan keeps running
    the heuristic's first choice, bit for bit, and every candidate ``use(i)`` switches to computes the product."""
    x, w = _dev(cp, rng, (136, 72), "bf16"), _dev(cp, rng, (48, 72), "bf16")  # a shape no other test uses
    out = cp.empty((136, 48), dtype=np.float32)
    first = lt_gemm(x, w, trans_b=True, out=out).copy()
    plan = gemm_lt._PLANS[gemm_lt.plan_key(cp.cuda.Device().id, x, w, False, True, out, None, "none", None, 136,
                                           48, 72, ())]
    assert plan.n_algos == 1
    plan.ask_heuristic(8)
    assert 1 <= plan.n_algos <= 8
    assert cp.array_equal(lt_gemm(x, w, trans_b=True, out=out), first)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    for i in range(plan.n_algos):
        try:
            plan.use(i)
        except IndexError:  # a candidate the heuristic marks unusable
            continue
        assert_close(lt_gemm(x, w, trans_b=True, out=out), want, "bf16")
    plan.use(0)


@pytest.mark.gpu
def test_gpu_mixed_numpy_cupy_refused(cp, lt, rng):
    a = _dev(cp, rng, (4, 8), "bf16")
    with pytest.raises(TypeError, match="b=ndarray"):
        lt_gemm(a, np.ones((8, 8), dtype=backend.bfloat16))
    with pytest.raises(ValueError, match="divisible by 8"):
        lt_gemm(a, _dev(cp, rng, (8, 12), "bf16"), epilogue="dgelu", aux=_dev(cp, rng, (4, 12), "bf16"))


def _mlp_buffers(cp, rng, N=512, C=64, O=256, dtype="bf16"):
    d = {"x": _dev(cp, rng, (N, C), dtype), "W": _dev(cp, rng, (O, C), dtype, C**-0.5), "b": _dev(cp, rng, (O,), dtype),
         "W2": _dev(cp, rng, (C, O), dtype, O**-0.5), "dout": _dev(cp, rng, (N, C), dtype)}
    for n, shape, dt in (("h", (N, O), dtype), ("pre", (N, O), dtype), ("dpre", (N, O), dtype),
                         ("dW", (O, C), "fp32"), ("db", (O,), "fp32"), ("y", (N, C), dtype)):
        d[n] = cp.zeros(shape, dtype=backend.resolve_dtype(dt))
    return d


def _mlp_sequence(d):
    """fc forward (GELU_AUX_BIAS), a plain GEMM, dgrad (DGELU), wgrad (BGRADB): the MLP's fused calls."""
    lt_gemm(d["x"], d["W"], trans_b=True, out=d["h"], bias=d["b"], epilogue="gelu_bias", aux=d["pre"])
    lt_gemm(d["h"], d["W2"], trans_b=True, out=d["y"])
    lt_gemm(d["dout"], d["W2"], out=d["dpre"], epilogue="dgelu", aux=d["pre"])
    lt_gemm(d["dpre"], d["x"], trans_a=True, out=d["dW"], epilogue="bgradb", dbias=d["db"])


OUTS = ("h", "pre", "y", "dpre", "dW", "db")


def _bits(cp, a):
    return cp.asnumpy(a.view(cp.uint16 if a.dtype.itemsize == 2 else cp.uint32))


def _check_replay(cp, d, eager, eager2, replayed):
    for n in OUTS:
        deterministic = np.array_equal(eager[n], eager2[n])
        if deterministic:
            assert np.array_equal(replayed[n], eager[n]), f"{n}: replay differs from eager"
        else:  # a split-K reduction may be order-dependent; then only closeness can be asked
            assert rel_error(cp.asarray(replayed[n]).view(d[n].dtype), cp.asarray(eager[n]).view(d[n].dtype)) < 1e-5


@pytest.mark.gpu
def test_gpu_capture_replay_bit_identical(cp, lt, rng):
    d = _mlp_buffers(cp, rng)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _mlp_sequence(d)  # warm-up: plans built, workspace allocated, outside capture
        s.synchronize()
        eager = {n: _bits(cp, d[n]) for n in OUTS}
        _mlp_sequence(d)
        s.synchronize()
        eager2 = {n: _bits(cp, d[n]) for n in OUTS}
        for n in OUTS:
            d[n].fill(np.nan)
        s.begin_capture()
        try:
            _mlp_sequence(d)
        finally:
            g = s.end_capture()
        s.synchronize()
        assert all(cp.isnan(d[n].astype(np.float32)).all() for n in OUTS), "capture must record, not run"
        g.launch(s)
        s.synchronize()
        _check_replay(cp, d, eager, eager2, {n: _bits(cp, d[n]) for n in OUTS})
        # new inputs written in place: the replay must follow them
        for n in ("x", "dout"):
            d[n][...] = _dev(cp, rng, d[n].shape, "bf16")
        _mlp_sequence(d)
        s.synchronize()
        eager = {n: _bits(cp, d[n]) for n in OUTS}
        for n in OUTS:
            d[n].fill(np.nan)
        g.launch(s)
        s.synchronize()
        _check_replay(cp, d, eager, eager, {n: _bits(cp, d[n]) for n in OUTS})


@pytest.mark.gpu
def test_gpu_capture_through_graphs_helper(cp, lt, rng):
    from llmgpu.perf.graphs import capture

    d = _mlp_buffers(cp, rng, N=96, C=32, O=64)
    g = capture(lambda: _mlp_sequence(d))
    cp.cuda.Device().synchronize()
    eager = {n: _bits(cp, d[n]) for n in OUTS}
    for n in OUTS:
        d[n].fill(np.nan)
    g.replay()
    cp.cuda.Device().synchronize()
    _check_replay(cp, d, eager, eager, {n: _bits(cp, d[n]) for n in OUTS})
    assert g.kernel_count() >= 4


# =========================================================================== cuDNN attention: NumPy reference


def _attention64(q, k, v, causal, scale):
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) * scale
    if causal:
        T = s.shape[-1]
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(s - m).sum(-1))
    return np.exp(s - lse[..., None]) @ v, lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1, 4), (2, 3, 7, 5), (1, 2, 33, 8)])
def test_flash_reference_forward_matches_float64(rng, causal, shape):
    q, k, v = (random_array(rng, shape) for _ in range(3))
    o, stats = fa.flash_attention_forward(q, k, v, causal)
    ref_o, ref_lse = _attention64(q, k, v, causal, 1.0 / math.sqrt(shape[-1]))
    assert_close(o, ref_o, "fp32")
    assert isinstance(stats, AttentionStats) and stats.kind == "lse" and stats.p is None
    assert stats.lse.shape == shape[:3] and stats.lse.dtype == np.float32
    assert_close(stats.lse, ref_lse, "fp32")
    o2, _ = attention_forward(q, k, v, causal)
    assert_close(o, o2, "fp32")


@pytest.mark.parametrize("causal", [True, False])
def test_flash_reference_backward_matches_finite_differences(rng, causal):
    shape = (1, 2, 5, 3)
    q, k, v = (rng.standard_normal(shape) for _ in range(3))
    r = rng.standard_normal(shape)
    o, stats = fa.flash_attention_forward(q, k, v, causal)
    dq, dk, dv = fa.flash_attention_backward(r, q, k, v, o, stats, causal)

    def f():
        return float((fa.flash_attention_forward(q, k, v, causal)[0] * r).sum())

    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        check_gradient(f, x, g, name=name)


def test_flash_reference_backward_matches_math_path(rng):
    shape = (2, 3, 17, 8)
    q, k, v, do = (random_array(rng, shape) for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v)
    got = fa.flash_attention_backward(do, q, k, v, o, st)
    o2, st2 = attention_forward(q, k, v)
    want = attention_backward(do, q, k, v, o2, st2)
    for g, w, n in zip(got, want, ("dq", "dk", "dv")):
        assert_close(g, w, "fp32", rtol=1e-5, name=n)


def test_flash_strided_views(rng):
    B, T, H, D = 2, 9, 3, 4
    qkv = random_array(rng, (B, T, 3 * H * D))
    q, k, v = fa.split_qkv(qkv, H)
    assert q.shape == (B, H, T, D) and np.shares_memory(q, qkv)
    assert np.array_equal(q[1, 2, 5], qkv[1, 5, 2 * D:3 * D])
    assert np.array_equal(v[0, 1, 3], qkv[0, 3, 2 * H * D + D:2 * H * D + 2 * D])
    y = poisoned((B, T, H * D), "fp32", np)
    o, st = fa.flash_attention_forward(q, k, v, out=fa.heads_view(y, H))
    qc, kc, vc = (np.ascontiguousarray(a) for a in (q, k, v))
    oc, _ = fa.flash_attention_forward(qc, kc, vc)
    np.testing.assert_array_equal(y, oc.transpose(0, 2, 1, 3).reshape(B, T, H * D))
    dqkv = poisoned((B, T, 3 * H * D), "fp32", np)
    do = random_array(rng, (B, H, T, D))
    dq, dk, dv = fa.split_qkv(dqkv, H)
    fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv)
    assert np.all(np.isfinite(dqkv))
    want = fa.flash_attention_backward(do, qc, kc, vc, oc, st)
    for g, w in zip((dq, dk, dv), want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_flash_bad_arguments(rng):
    q = random_array(rng, (1, 2, 5, 4))
    o, st = fa.flash_attention_forward(q, q, q)
    with pytest.raises(ValueError, match="k must have shape"):
        fa.flash_attention_forward(q, q[:, :, :3], q)
    with pytest.raises(ValueError, match="v must have shape"):  # one K head (grouped-query) but two V heads
        fa.flash_attention_forward(q, q[:, :1], q)
    with pytest.raises(TypeError, match="v must be"):
        fa.flash_attention_forward(q, q, q.astype(np.float16))
    with pytest.raises(ValueError, match="must be \\[B, H, T, D\\]"):
        fa.flash_attention_forward(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="unit stride along D"):
        fa.flash_attention_forward(q[..., ::2], q[..., ::2], q[..., ::2])
    _, st_p = attention_forward(q, q, q)
    with pytest.raises(ValueError, match="no lse"):
        fa.flash_attention_backward(q, q, q, q, o, st_p)
    with pytest.raises(ValueError, match="causal"):
        fa.flash_attention_backward(q, q, q, q, o, st, causal=False)
    with pytest.raises(TypeError, match="AttentionStats"):
        fa.flash_attention_backward(q, q, q, q, o, st.lse)
    with pytest.raises(ValueError, match="qkv must be"):
        fa.split_qkv(random_array(rng, (2, 3, 10)), 3)


def test_missing_cudnn_says_what_to_install(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "_import_cudnn", lambda: (None, "the cuDNN frontend is not installed; " +
                                                                   fa.INSTALL_HINT))
    with pytest.raises(fa.CudnnUnavailableError, match=r"llmgpu\[fast\]"):
        cudnn_attention._cudnn()


# =========================================================================== cuDNN attention: GPU


@pytest.fixture
def cudnn_fa(cp):
    reason = cudnn_attention.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuDNN flash attention not available: {reason}")
    return fa


def _attn_ref_gpu(cp, q, k, v, do, causal):
    """llmgpu.ops.attention in fp32 on the same (upcast) inputs: forward, backward and the lse."""
    f = [a.astype(np.float32) for a in (q, k, v, do)]
    o, st = attention_forward(*[cp.ascontiguousarray(a) for a in f[:3]], causal)
    grads = attention_backward(cp.ascontiguousarray(f[3]), *[cp.ascontiguousarray(a) for a in f[:3]], o, st, causal)
    _, lse = _attention64(cp.asnumpy(f[0]), cp.asnumpy(f[1]), cp.asnumpy(f[2]), causal, 1.0 / math.sqrt(q.shape[-1])) \
        if q.size <= 2**16 else (None, None)
    return o, grads, lse


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("shape,causal", [((1, 1, 1, 64), True), ((1, 2, 64, 64), True), ((2, 3, 257, 64), True),
                                          ((2, 3, 100, 64), False), ((1, 2, 128, 32), True),
                                          ((2, 12, 1024, 64), True)])
def test_gpu_cudnn_matches_math_path(cp, cudnn_fa, rng, dtype, shape, causal):
    q, k, v, do = (_dev(cp, rng, shape, dtype) for _ in range(4))
    o, st = fa.flash_attention_forward(q, k, v, causal, out=poisoned(shape, dtype, cp), kernel="cudnn")
    dq, dk, dv = fa.flash_attention_backward(do, q, k, v, o, st, causal, dq=poisoned(shape, dtype, cp),
                                             dk=poisoned(shape, dtype, cp), dv=poisoned(shape, dtype, cp),
                                             kernel="cudnn")
    ro, (rdq, rdk, rdv), rlse = _attn_ref_gpu(cp, q, k, v, do, causal)
    assert_close(o, ro, rtol=2e-2, name="o")
    for g, r, n in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert_close(g, r, rtol=2e-2, name=n)
    assert st.lse.dtype == np.float32 and st.lse.shape == shape[:3]
    if rlse is not None:
        assert_close(st.lse, rlse, rtol=1e-3, name="lse")


@pytest.mark.gpu
def test_gpu_cudnn_qkv_views(cp, cudnn_fa, rng):
    """q, k, v as strided views of one [B, T, 3C] buffer, o written into [B, T, C], dq/dk/dv into [B, T, 3C]."""
    B, T, H, D = 2, 192, 4, 64
    C = H * D
    qkv = _dev(cp, rng, (B, T, 3 * C), "bf16")
    q, k, v = fa.split_qkv(qkv, H)
    y = poisoned((B, T, C), "bf16", cp)
    o, st = fa.flash_attention_forward(q, k, v, out=fa.heads_view(y, H), kernel="cudnn")
    dout = _dev(cp, rng, (B, T, C), "bf16")
    dqkv = poisoned((B, T, 3 * C), "bf16", cp)
    dq, dk, dv = fa.split_qkv(dqkv, H)
    fa.flash_attention_backward(fa.heads_view(dout, H), q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="cudnn")
    assert not cp.isnan(y.astype(np.float32)).any() and not cp.isnan(dqkv.astype(np.float32)).any()
    ro, (rdq, rdk, rdv), _ = _attn_ref_gpu(cp, q, k, v, fa.heads_view(dout, H), True)
    assert_close(fa.heads_view(y, H), ro, rtol=2e-2, name="o")
    for g, r, n in ((dq, rdq, "dq"), (dk, rdk, "dk"), (dv, rdv, "dv")):
        assert_close(g, r, rtol=2e-2, name=n)


@pytest.mark.gpu
def test_gpu_cudnn_captured_in_graph(cp, cudnn_fa, rng):
    from llmgpu.perf.graphs import capture

    shape = (2, 4, 128, 64)
    q, k, v, do = (_dev(cp, rng, shape, "bf16") for _ in range(4))
    o, lse = cp.empty(shape, backend.bfloat16), cp.empty(shape[:3], np.float32)
    dq, dk, dv = (cp.empty(shape, backend.bfloat16) for _ in range(3))

    def step():
        _, st = fa.flash_attention_forward(q, k, v, out=o, lse=lse, kernel="cudnn")
        fa.flash_attention_backward(do, q, k, v, o, st, dq=dq, dk=dk, dv=dv, kernel="cudnn")

    g = capture(step)
    cp.cuda.Device().synchronize()
    eager = {n: a.copy() for n, a in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv))}
    for a in (o, dq, dk, dv, lse):
        a.fill(np.nan)
    g.replay()
    cp.cuda.Device().synchronize()
    assert cp.array_equal(o.view(cp.uint16), eager["o"].view(cp.uint16))
    assert cp.array_equal(lse, eager["lse"])
    for n, a in (("dq", dq), ("dk", dk), ("dv", dv)):  # dQ is not bitwise deterministic run to run
        assert_close(a, eager[n], rtol=1e-2, name=n)


@pytest.mark.gpu
def test_gpu_cudnn_bad_inputs(cp, cudnn_fa, rng):
    q = _dev(cp, rng, (1, 2, 16, 64), "fp32")
    with pytest.raises(TypeError, match="supports fp16, bf16"):
        fa.flash_attention_forward(q, q, q, kernel="cudnn")
    qb = q.astype(backend.bfloat16)
    with pytest.raises(TypeError, match="k=ndarray"):
        fa.flash_attention_forward(qb, cp.asnumpy(qb), qb, kernel="cudnn")
    odd = _dev(cp, rng, (1, 2, 16, 12), "bf16")
    with pytest.raises(ValueError, match="divisible by 8"):
        fa.flash_attention_forward(odd, odd, odd, kernel="cudnn")


def test_gelu_epilogue_probe_runs(capsys):
    """tools/probes/probe_gelu_epilogue.py: without a GPU one line saying so; with one, a small run of every case."""
    probe = load_tool("probes/probe_gelu_epilogue")
    gpu = backend.gpu_available() and gemm_lt.available()
    assert probe.main(["--batches", "1", "--reps", "3"] if gpu else []) == 0
    out = capsys.readouterr().out
    if not gpu:
        assert out.startswith("no GPU") or "cuBLASLt" in out
        return
    for case in ("fc fwd, GELU_BIAS (no aux)", "fc fwd, GELU_AUX_BIAS", "proj dgrad, DGELU", "inference trunk"):
        assert case in out, out
