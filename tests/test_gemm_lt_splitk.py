"""Split-K for cuBLASLt GEMMs (``llmgpu.gemm.lt_splitk``, ``LtPlan.use_split_k``; issue 36).

On the CPU: the table's keys and checks, ``set_split_k`` rebuilding exactly the plans it touches, a refused entry
falling back with a warning, and ``use_split_k``'s attribute writes and workspace check against a stand-in of the
cuBLASLt bindings. On the GPU: a split weight gradient is the heuristic's product, the same bits twice, beta kept;
and ``tools/probes/probe_wgrad_splitk.py``'s pure parts.
"""

from __future__ import annotations

import ctypes
import json
import types
import warnings

import numpy as np
import pytest
from repo_tools import load_tool

from llmgpu.gemm import cublaslt, lt_splitk
from llmgpu.gemm.lt_plan import LtPlan
from llmgpu.model.llama_config import LlamaConfig
from llmgpu.testing import assert_close, random_array

pytestmark = pytest.mark.ch10


@pytest.fixture
def restore_table():
    yield
    cublaslt.set_split_k(None)  # the default table, and no plan left configured by a test


# --------------------------------------------------------------------------- the table


def test_problem_key_normalizes_dtypes_and_flags():
    k = lt_splitk.problem_key(1600, 960, 32768, np.dtype("float32"), "fp32", trans_a=1, epilogue="none")
    assert k == (1600, 960, 32768, "fp32", "fp32", True, False, "none")
    assert lt_splitk.wgrad_key(1600, 960, 32768) == (1600, 960, 32768, "bf16", "fp32", True, False, "none")


@pytest.mark.parametrize("table, match", [
    ([1, 2], "dict"),
    ({(1, 2, 3): (2, "inplace")}, "not a problem_key"),
    ({lt_splitk.wgrad_key(8, 8, 64): 2}, r"\(splits, reduction\[, base\]\)"),
    ({lt_splitk.wgrad_key(8, 8, 64): (2, "inplace", 0, 1)}, r"\(splits, reduction\[, base\]\)"),
    ({lt_splitk.wgrad_key(8, 8, 64): (2, "inplace", -1)}, "base must be an int"),
    ({lt_splitk.wgrad_key(8, 8, 64): (2, "inplace", 1.0)}, "base must be an int"),
    ({lt_splitk.wgrad_key(8, 8, 64): (2, "inplace", 64)}, "base must be an int"),
    ({lt_splitk.wgrad_key(8, 8, 64): (0, "inplace")}, "splits must be an int"),
    ({lt_splitk.wgrad_key(8, 8, 64): (True, "inplace")}, "splits must be an int"),
    ({lt_splitk.wgrad_key(8, 8, 64): (2, "atomics")}, "reduction must be one of"),
    ({lt_splitk.wgrad_key(0, 8, 64): (2, "inplace")}, "sizes must be >= 1"),
])
def test_check_table_refuses_bad_entries(table, match, restore_table):
    before = lt_splitk.table()
    with pytest.raises((TypeError, ValueError), match=match):
        lt_splitk.replace_table(table)
    assert lt_splitk.table() == before  # a refused table changes nothing


def test_replace_table_returns_the_previous_and_none_restores_the_default(restore_table):
    assert lt_splitk.table() == lt_splitk.check_table(lt_splitk.DEFAULT_TABLE)
    key = lt_splitk.wgrad_key(1600, 960, 32768)
    old = lt_splitk.replace_table({key: (3, "compute_type")})
    assert old == lt_splitk.check_table(lt_splitk.DEFAULT_TABLE)
    assert lt_splitk.lookup(key) == (3, "compute_type", 0)  # no base: the heuristic's first choice
    assert lt_splitk.lookup(lt_splitk.wgrad_key(1600, 960, 65536)) is None  # another K: another problem
    assert lt_splitk.replace_table(None) == {key: (3, "compute_type", 0)}
    assert lt_splitk.table() == lt_splitk.check_table(lt_splitk.DEFAULT_TABLE)


def test_as_records_is_the_table_in_force_as_json_rows(restore_table):
    key = lt_splitk.wgrad_key(1600, 960, 32768)
    lt_splitk.replace_table({key: (3, "compute_type")})
    rows = lt_splitk.as_records()
    assert rows == [[list(key), [3, "compute_type", 0]]]
    assert json.loads(json.dumps(rows)) == rows  # what the bench and the probe write
    assert lt_splitk.as_records({}) == []

def _fake_plan():
    plan = cublaslt._Plan.__new__(cublaslt._Plan)  # destroy() of a plan with nothing to destroy
    plan.layouts, plan.desc, plan.lt = [], None, None
    return plan


def _plan_key(m, n, k, epilogue="none"):  # cublaslt._plan_key's layout: device, epilogue, dtypes, ..., sizes, ...
    return (0, epilogue, "bfloat16", "float32", None, True, False, m, n, k, 1, False, (256, 256, 256))


def test_set_split_k_rebuilds_only_the_plans_either_table_names(monkeypatch, restore_table):
    touched, other, foreign = _plan_key(1600, 960, 32768), _plan_key(960, 960, 32768), ("fp8", 1)
    plans = {touched: _fake_plan(), other: _fake_plan(), foreign: object()}  # foreign: e.g. an fp8 plan
    monkeypatch.setattr(cublaslt, "_PLANS", dict(plans))
    cublaslt.set_split_k({lt_splitk.wgrad_key(1600, 960, 32768): (2, "inplace")})
    assert set(cublaslt._PLANS) == {other, foreign}
    cublaslt._PLANS[touched] = _fake_plan()
    cublaslt.set_split_k(None)  # the old table named it: rebuilt again
    assert set(cublaslt._PLANS) == {other, foreign}


def test_configure_split_k_uses_the_entry_or_warns_and_keeps_the_heuristic(restore_table):
    key = lt_splitk.wgrad_key(1600, 960, 32768)
    problem = cublaslt._problem_of(_plan_key(1600, 960, 32768))
    assert problem == key
    calls, asked = [], []
    plan = types.SimpleNamespace(n_algos=1, use_split_k=lambda s, r, b: calls.append((s, r, b)),
                                 ask_heuristic=lambda n: asked.append(n) or setattr(plan, "n_algos", n))
    lt_splitk.replace_table({})
    cublaslt._configure_split_k(plan, problem)
    assert calls == []  # no entry: nothing
    lt_splitk.replace_table({key: (4, "inplace")})
    cublaslt._configure_split_k(plan, problem)
    assert calls == [(4, "inplace", 0)] and asked == []  # base 0: the heuristic's first choice, already asked
    lt_splitk.replace_table({key: (2, "compute_type", 1)})
    cublaslt._configure_split_k(plan, problem)
    assert asked == [2] and calls[-1] == (2, "compute_type", 1)  # a later candidate: the heuristic asked for it

    def refuse(s, r, b):
        raise ValueError("cuBLASLt refuses split-K 4")
    with pytest.warns(RuntimeWarning, match="split-K table entry not used: cuBLASLt refuses"):
        cublaslt._configure_split_k(types.SimpleNamespace(n_algos=4, use_split_k=refuse), problem)

    def too_few(s, r, b):
        raise IndexError("algorithm 1 of 1 is not usable")
    short = types.SimpleNamespace(n_algos=1, use_split_k=too_few, ask_heuristic=lambda n: None)
    with pytest.warns(RuntimeWarning, match="not used: algorithm 1 of 1"):
        cublaslt._configure_split_k(short, problem)


def test_default_table_entries_are_valid_wgrad_problems():
    for key, entry in lt_splitk.check_table(lt_splitk.DEFAULT_TABLE).items():
        m, n, k, a_dt, o_dt, ta, tb, ep = key
        assert (a_dt, o_dt, ta, tb, ep) == ("bf16", "fp32", True, False, "none"), key  # weight gradients only
        assert len(entry) == 3 and entry != (1, "inplace", 0), entry  # (1, "inplace", 0) is the heuristic's pick


# --------------------------------------------------------------------------- LtPlan.use_split_k, stand-in bindings


RESULT = np.dtype([("algo", np.uint64, 8), ("workspace_size", np.uint64), ("state", np.int32),
                   ("waves_count", np.float32), ("reserved", np.int32, 4)])


class _FakeLt:
    """The few nvmath.bindings.cublasLt calls use_split_k makes: config attributes written into the algo's words
    (word = attribute number), and a check that asks splits * 1 MiB of workspace (refusing splits > 8)."""

    MatmulAlgoConfigAttribute = types.SimpleNamespace(SPLITK_NUM=2, REDUCTION_SCHEME=3)
    ReductionScheme = types.SimpleNamespace(NONE=0, INPLACE=1, COMPUTE_TYPE=2, OUTPUT_TYPE=4)
    matmul_heuristic_result_dtype = RESULT

    @staticmethod
    def get_matmul_algo_config_attribute_dtype(attr):
        return np.uint32

    @staticmethod
    def _view(ptr):
        return np.frombuffer((ctypes.c_char * RESULT.itemsize).from_address(ptr), dtype=RESULT)

    def matmul_algo_config_set_attribute(self, algo_ptr, attr, buf, size):
        self._view(algo_ptr)["algo"][0, attr] = np.frombuffer((ctypes.c_char * size).from_address(buf), np.uint32)[0]

    def matmul_algo_check(self, handle, desc, la, lb, lc, ld, algo_ptr, result_ptr):
        splits = int(self._view(algo_ptr)["algo"][0, 2])
        if splits > 8:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        self._view(result_ptr)["workspace_size"][0] = splits << 20


def _plan_with_fake_lt(ws_size=5 << 20):
    st = types.SimpleNamespace(handle=1, ws_size=ws_size)
    plan = LtPlan(_FakeLt(), st, "a test problem", (256, 256, 256))
    plan.la = plan.lb = plan.lc = 0  # layout handles the stand-in's check does not read
    plan.algos = np.zeros(3, dtype=RESULT)
    plan.algos["algo"][:, 0] = [66, 67, 68]  # word 0: the algorithm id, kept by the configuration
    plan.algos["state"][2] = 7  # candidate 2: unusable
    plan.n_algos = 3
    plan.use(0)
    return plan


def test_use_split_k_configures_a_copy_checks_it_and_switches():
    plan = _plan_with_fake_lt()
    heuristic_ptr = plan.algo_ptr
    plan.use_split_k(4, "compute_type", base=1)
    assert plan.split_k == (4, "compute_type") and plan.ws_need == 4 << 20
    words = np.frombuffer((ctypes.c_char * RESULT.itemsize).from_address(plan.algo_ptr), dtype=RESULT)["algo"][0]
    assert (int(words[0]), int(words[2]), int(words[3])) == (67, 4, 2)
    assert plan.algo_ptr != heuristic_ptr and int(plan.algos["algo"][1, 2]) == 0  # the heuristic's own untouched
    plan.use_split_k(1, "inplace")  # 1: no split, scheme NONE
    words = np.frombuffer((ctypes.c_char * RESULT.itemsize).from_address(plan.algo_ptr), dtype=RESULT)["algo"][0]
    assert (int(words[0]), int(words[2]), int(words[3])) == (66, 1, 0)
    plan.use(0)
    assert plan.split_k is None and plan.algo_ptr == heuristic_ptr


@pytest.mark.parametrize("args, err, match", [
    ((0,), ValueError, "splits must be >= 1"),
    ((2, "atomics"), ValueError, "reduction must be one of"),
    ((2, "inplace", 2), IndexError, "not usable"),
    ((2, "inplace", 5), IndexError, "not usable"),
    ((16, "inplace"), ValueError, "cuBLASLt refuses split-K 16"),
    ((6, "inplace"), ValueError, "needs 6291456 bytes of workspace"),
])
def test_use_split_k_refusals_leave_the_plan_as_it_was(args, err, match):
    plan = _plan_with_fake_lt()
    plan.use_split_k(2, "inplace")
    before = (plan.algo_ptr, plan.ws_need, plan.split_k)
    with pytest.raises(err, match=match):
        plan.use_split_k(*args)
    assert (plan.algo_ptr, plan.ws_need, plan.split_k) == before


# --------------------------------------------------------------------------- the probe's pure parts


def test_probe_shapes_runs_and_winner():
    probe = load_tool("probes/probe_wgrad_splitk")
    shapes = probe.wgrad_shapes(LlamaConfig.preset("smollm-360m"))
    assert shapes == {"attn.qkv": (1600, 960), "attn.proj": (960, 960), "mlp.gate,up": (5120, 960),
                      "mlp.down": (960, 2560)}
    assert probe.wgrad_shapes(LlamaConfig.preset("smollm-135m"))["attn.qkv"] == (960, 576)
    assert probe.parse_runs("smollm-360m:32, smollm-135m:64") == [("smollm-360m", 32), ("smollm-135m", 64)]
    for bad in ("smollm-360m", "smollm-360m:0", "smollm-360m:x", ""):
        with pytest.raises(ValueError, match="preset:batch"):
            probe.parse_runs(bad)
    with pytest.raises(ValueError, match="unknown Llama preset"):
        probe.parse_runs("nope:4")

    def split(s, ms, base=0, **kw):
        return {"splits": s, "reduction": "inplace", "base": base, "ms": ms, "repeatable": True, "beta_ok": True,
                "rel_vs_heuristic": 1e-7, **kw}

    def candidate(i, ms, splitk_num, scheme, **kw):
        return {"splits": None, "reduction": None, "base": i, "ms": ms, "splitk_num": splitk_num,
                "reduction_scheme": scheme, "repeatable": True, "beta_ok": True, "rel_vs_heuristic": 1e-7, **kw}
    first = candidate(0, 0.2, 1, 0)
    rec = {"heuristic_ms": 0.2, "configs": [first, split(2, 0.17), split(3, 0.15, repeatable=False),
                                             split(4, 0.18, base=1),
                                             {"splits": 8, "reduction": "inplace", "base": 0, "error": "refused"}]}
    assert probe.winner(rec, 1.03) == (2, "inplace", 0)  # not the unrepeatable 3
    assert probe.winner(rec, 1.2) is None  # 0.2 / 0.17 < 1.2
    rec["configs"].append(split(4, 0.12, base=1))
    assert probe.winner(rec, 1.03) == (4, "inplace", 1)  # a split of a later candidate
    rec["configs"] += [candidate(1, 0.11, 2, 2), candidate(2, 0.10, 3, 3), candidate(3, 0.09, 1, 0, beta_ok=False)]
    assert probe.winner(rec, 1.03) == (2, "compute_type", 1)  # a candidate as configured; scheme 3 has no name
    rec["configs"].append(candidate(4, 0.10, 1, 0))
    assert probe.winner(rec, 1.03) == (1, "inplace", 4)  # no split: (1, any scheme) runs it as the heuristic did
    assert probe.table_entry(first) == (1, "inplace", 0)
    assert probe.winner({"heuristic_ms": 0.2, "configs": [first]}, 1.0) is None  # the pick itself is no entry
    assert probe.main(["--runs", "bad"]) == 2


# --------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["inplace", "compute_type"])
def test_gpu_split_wgrad_is_the_same_product_repeatable_with_beta(cp, rng, reduction, restore_table):
    if cublaslt.unavailable_reason() is not None:
        pytest.skip(f"cuBLASLt path not available: {cublaslt.unavailable_reason()}")
    K, M, N = 8192, 200, 96  # a shape no other test uses: 2 x 1 tiles, the case split-K is for
    dy = cp.asarray(random_array(rng, (K, M), "bf16"))
    x = cp.asarray(random_array(rng, (K, N), "bf16"))
    acc = cp.asarray(random_array(rng, (M, N), "fp32"))
    cublaslt.set_split_k({})
    want = cublaslt.lt_gemm(dy, x, trans_a=True, out=acc.copy(), beta=1.0)
    cublaslt.set_split_k({lt_splitk.wgrad_key(M, N, K): (4, reduction)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry must be used, not fall back
        got = cublaslt.lt_gemm(dy, x, trans_a=True, out=acc.copy(), beta=1.0)
    key = cublaslt.plan_key(cp.cuda.Device().id, dy, x, True, False, got, None, "none", None, M, N, K, ())
    assert cublaslt._PLANS[key].split_k == (4, reduction)
    assert_close(got, want, "fp32")
    assert cp.array_equal(cublaslt.lt_gemm(dy, x, trans_a=True, out=acc.copy(), beta=1.0), got)
    ref = dy.astype(cp.float64).T @ x.astype(cp.float64) + acc
    assert_close(got, ref, "bf16")
    cublaslt.set_split_k(None)
    assert key not in cublaslt._PLANS  # rebuilt (with the heuristic's pick) on its next call


@pytest.mark.gpu
@pytest.mark.parametrize("entry", [(1, "inplace", 1), (2, "compute_type", 1)])
def test_gpu_later_candidate_entry_asks_the_heuristic_and_runs_it(cp, rng, entry, restore_table):
    """An entry naming the heuristic's second candidate (base 1): the plan asks for it and runs it, repeatably, with
    ``beta = 1`` honoured, the same product as the first choice (float64 reference)."""
    if cublaslt.unavailable_reason() is not None:
        pytest.skip(f"cuBLASLt path not available: {cublaslt.unavailable_reason()}")
    K, M, N = 6144, 320, 192  # several candidates exist for a bf16 -> fp32 weight gradient of this size
    dy = cp.asarray(random_array(rng, (K, M), "bf16"))
    x = cp.asarray(random_array(rng, (K, N), "bf16"))
    acc = cp.asarray(random_array(rng, (M, N), "fp32"))
    cublaslt.set_split_k({lt_splitk.wgrad_key(M, N, K): entry})
    out = cp.full((M, N), cp.nan, dtype=cp.float32)  # poisoned: beta = 0 must overwrite every element
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the entry must be used, not fall back
        cublaslt.lt_gemm(dy, x, trans_a=True, out=out, beta=0.0)
    key = cublaslt.plan_key(cp.cuda.Device().id, dy, x, True, False, out, None, "none", None, M, N, K, ())
    plan = cublaslt._PLANS[key]
    assert plan.n_algos >= 2 and plan.split_k == entry[:2]
    got = cublaslt.lt_gemm(dy, x, trans_a=True, out=acc.copy(), beta=1.0)
    assert cp.array_equal(cublaslt.lt_gemm(dy, x, trans_a=True, out=acc.copy(), beta=1.0), got)
    assert_close(got - acc, out, "fp32")
    ref = dy.astype(cp.float64).T @ x.astype(cp.float64) + acc
    assert_close(got, ref, "bf16")
