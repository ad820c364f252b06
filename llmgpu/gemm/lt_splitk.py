"""Split-K for the cuBLASLt GEMMs that leave SMs idle: an opt-in table of problems (chapter 10, issue 36).

A weight gradient ``dW [M, N] = dyᵀ x`` sums over the K = B·T tokens of a batch, so its output is small and its
reduction long. Llama's ``attn.qkv`` wgrad at SmolLM-360M, ``[1600, 960]`` over K = 32768, has about 47 output
tiles of 128x256 for 132 SMs: the heuristic's algorithm runs one wave that leaves a third of the GPU idle (63 %
of the GEMM rate where the other wgrads reach 75-92 %). Splitting K into ``s`` parts gives ``s`` times as many
tiles, then adds the ``s`` partial products (``LtPlan.use_split_k``: cuBLASLt's ``SPLITK_NUM`` and
``REDUCTION_SCHEME`` on the heuristic's own algorithm; every scheme adds the parts in a fixed order, so the
result is the same bits run to run).

Which problems gain, and with how many parts, is measured (``tools/probes/probe_wgrad_splitk.py``), not guessed
from tile counts: the table maps a problem, :func:`problem_key`, to ``(splits, reduction, base)``: run the heuristic's
``base``-th algorithm (0, its first choice, unless the probe found a later candidate faster) with K split ``splits``
ways (``(splits, reduction)`` alone means base 0). ``lt_gemm`` looks its problem up when it builds a plan (once
per shape, outside any capture), so a launch costs nothing more and a CUDA graph captures the configured algorithm.
``DEFAULT_TABLE`` holds the probe's winners on the GPU the book measures; every other GEMM runs the heuristic's
first choice. ``cublaslt.set_split_k(table)`` installs another table (and rebuilds the plans it touches). The
probe prints its winners in this format, ready to become ``DEFAULT_TABLE`` (measured on one GPU model and one
cuBLASLt: another SM count may want other splits, another library may order its candidates differently; either
way the product is the same, only its speed differs).
"""

from __future__ import annotations

from .. import backend
from .lt_plan import REDUCTIONS

MAX_SPLITS = 64  # a sanity bound for table entries (the probe tries up to 8)
MAX_BASE = 63  # the same for the heuristic's candidate index (the probe asks for 8)

_table: dict[tuple, tuple[int, str, int]] = {}  # the table in force: check_table(DEFAULT_TABLE) until replaced


def problem_key(m: int, n: int, k: int, in_dtype, out_dtype, *, trans_a: bool = False, trans_b: bool = False,
                epilogue: str = "none") -> tuple:
    """The table's key for ``lt_gemm``'s ``out [m, n] = op(a) [m, k] @ op(b) [k, n]`` (row-major terms, dtype names
    as ``backend.dtype_name``: 'bf16', 'fp32', ...). A weight gradient through ``wgrad_gemm`` is
    ``problem_key(M, N, tokens, 'bf16', 'fp32', trans_a=True)``."""
    return (int(m), int(n), int(k), backend.dtype_name(in_dtype), backend.dtype_name(out_dtype), bool(trans_a),
            bool(trans_b), str(epilogue))


def wgrad_key(m: int, n: int, tokens: int, in_dtype="bf16", out_dtype="fp32") -> tuple:
    """``problem_key`` of the weight gradient ``dW [m, n]`` summed over ``tokens`` rows (the fast steps' call)."""
    return problem_key(m, n, tokens, in_dtype, out_dtype, trans_a=True)


# problem_key(...) -> (splits, reduction, base); filled from probe_wgrad_splitk.py's output on the GPU the book measures
DEFAULT_TABLE: dict[tuple, tuple[int, str, int]] = {
    # SmolLM-360M's q|k|v weight gradient at 32 x 1024 tokens: the heuristic's second candidate (a 192x128 tile,
    # K split in two, summed in fp32 in the workspace) beats its first (96x128, one wave on a third of the SMs);
    # in the step the saving shrinks, but it showed in every round of the probe's A/B (the chapter 10 results)
    wgrad_key(1600, 960, 32768): (2, "compute_type", 1),
}


def check_table(table: dict) -> dict:
    """A validated copy of a split-K table; ValueError/TypeError naming the bad entry."""
    if not isinstance(table, dict):
        raise TypeError("a split-K table is a dict problem_key(...) -> (splits, reduction[, base]), "
                        f"got {type(table).__name__}")
    out = {}
    for key, val in table.items():
        if not (isinstance(key, tuple) and len(key) == 8):
            raise ValueError(f"split-K table key {key!r} is not a problem_key(...) tuple")
        m, n, k, a_dt, o_dt, ta, tb, ep = key
        key = problem_key(m, n, k, a_dt, o_dt, trans_a=ta, trans_b=tb, epilogue=ep)
        if min(key[:3]) < 1:
            raise ValueError(f"split-K table key {key!r}: sizes must be >= 1")
        if not (isinstance(val, tuple) and len(val) in (2, 3)):
            raise ValueError(f"split-K table entry for {key!r} must be (splits, reduction[, base]), got {val!r}")
        splits, reduction, base = val if len(val) == 3 else (*val, 0)
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"split-K table entry for {key!r}: splits must be an int in 1..{MAX_SPLITS}, "
                             f"got {splits!r}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"split-K table entry for {key!r}: reduction must be one of {', '.join(REDUCTIONS)}, "
                             f"got {reduction!r}")
        if isinstance(base, bool) or not isinstance(base, int) or not 0 <= base <= MAX_BASE:
            raise ValueError(f"split-K table entry for {key!r}: base must be an int in 0..{MAX_BASE}, got {base!r}")
        out[key] = (splits, reduction, base)
    return out


def table() -> dict:
    """The split-K table in force (a copy)."""
    return dict(_table)


def as_records(tab: dict | None = None) -> list:
    """A table (None: the one in force) as JSON rows ``[[*problem_key], [splits, reduction, base]]``, as the bench
    and the probe record it."""
    return [[list(k), list(v)] for k, v in (_table if tab is None else tab).items()]


def replace_table(new: dict | None) -> dict:
    """Install ``new`` (None: ``DEFAULT_TABLE``) and return the previous table. ``cublaslt.set_split_k`` calls this
    and rebuilds the cached plans of every problem either table names; call that, not this."""
    global _table
    checked = check_table(DEFAULT_TABLE if new is None else new)
    old, _table = _table, checked
    return old


def lookup(key: tuple):
    """``(splits, reduction, base)`` for a ``problem_key``, or None (the heuristic's pick)."""
    return _table.get(key)


_table = check_table(DEFAULT_TABLE)

__all__ = ["DEFAULT_TABLE", "MAX_BASE", "MAX_SPLITS", "as_records", "check_table", "lookup", "problem_key",
           "replace_table", "table", "wgrad_key"]
