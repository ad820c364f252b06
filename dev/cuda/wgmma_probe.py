"""Pin the wgmma facts the Hopper flash attention needs (issue 16, step 1 of flash_wgmma_plan.md), on the GPU.

    python dev/cuda/wgmma_probe.py                 # every hypothesis, nk = 1 and 4; prints a table
    python dev/cuda/wgmma_probe.py --json benchmarks/results/ch2b/wgmma_probe.json

``wgmma_probe.cu`` runs ``nk`` chained ``wgmma.mma_async.m64n64k16.f32.bf16.bf16`` on shared-memory images,
descriptors and (``A_REGS``) register fragments that this script builds, and returns the 32 raw accumulators of
each of the 128 threads. Each *hypothesis* below is one claim about the hardware: how a K-major or MN-major bf16
tile is laid out in shared memory (no swizzle, core matrices of 8 rows x 16 bytes; or the 128-byte swizzle),
which descriptor strides (LBO, SBO) say so, how the start address moves from one k step of 16 to the next, how a
register A fragment is ordered, and where accumulator ``i`` of thread ``t`` sits in the 64 x 64 result. A
hypothesis passes when every accumulator equals ``A @ B`` (float64 of the bf16 inputs) at the place it predicts.
Counter-hypotheses (LBO and SBO swapped) are run too: they must fail, which shows the probe can.

The flash forward needs three of them: S = Q Kᵀ with Q and K from shared memory (both K-major), O += P V with P
from registers and V MN-major (``imm-trans-b``). Independently of the hypotheses, the accumulator layout is
*recovered* from the values (the entries of a product of random inputs are distinct), so a wrong guess about
it still yields the right one.

The addressing model (``decode``) is the one the hypotheses are built from, and the CPU test checks that each
image decodes back to its matrix: an element's byte address is start + its core matrix's offset (LBO along K,
SBO along M/N, in both majors) + row within the core matrix x 16 bytes, and the 128-byte
swizzle XORs address bits 4-6 with bits 7-9 (so a tile must start on a 1024-byte boundary, and moving to the
next k step inside a 128-byte row is start + 32 bytes). Source of these facts: the PTX ISA, "Asynchronous
Warpgroup Level Matrix Multiply-Accumulate" (matrix descriptor, canonical layouts, register fragments).

Without a GPU (or on a GPU other than sm_90) the script says so in one line and exits 0. Exit status 1 when a
hypothesis expected to pass fails or a counter-hypothesis passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
import _devscript  # noqa: E402  (first: puts the package on the path)

from llmgpu import backend  # noqa: E402
from llmgpu.kernels import loader  # noqa: E402

SOURCE = HERE / "wgmma_probe.cu"
M = N = 64  # m64n64k16, chained over K = 16 nk
REGION = 16 * 1024  # bytes of shared memory per operand image: every stride tried stays inside (33 KB in all)
SW128 = 1  # descriptor swizzle field (bits 62-63): 0 none, 1 128-byte, 2 64-byte, 3 32-byte


# --------------------------------------------------------------------------- layouts (bf16 as uint16 bits)


def bits(x) -> np.ndarray:
    """bf16 bit patterns (uint16) of a float array, rounded to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(b) -> np.ndarray:
    return (np.asarray(b, np.uint32) << 16).view(np.float32)


def core_layout(rows: int, cols: int, k_stride: int, mn_stride: int, *, mn_major: bool = False):
    """Byte offset of element (r, c) of a [rows, cols] tile (c contiguous), no swizzle: core matrices of 8 rows x
    16 bytes (8 elements), 128 contiguous bytes each, ``k_stride`` bytes apart along K and ``mn_stride`` along
    M/N. K-major: c = k; MN-major: r = k, c = n. The descriptor's LBO is the K stride and SBO the M/N stride in
    both majors (the H200, 2026-12-02: the first guess for MN-major, LBO along N, failed and its swap passed)."""
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    core = (r // 8) * k_stride + (c // 8) * mn_stride if mn_major else (c // 8) * k_stride + (r // 8) * mn_stride
    return core + (r % 8) * 16 + (c % 8) * 2


def sw128_layout(rows: int, cols: int = 64):
    """Byte offset of element (r, c) of a [rows, 64] bf16 tile (c contiguous, one 128-byte row per r) with the
    128-byte swizzle: 8-row atoms of 1024 bytes, chunk c // 8 of row r stored at chunk (c // 8) ^ (r % 8)."""
    assert cols == 64
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    return (r // 8) * 1024 + (r % 8) * 128 + (((c // 8) ^ (r % 8)) * 16) + (c % 8) * 2


def image(x, offsets) -> np.ndarray:
    """The shared-memory image (uint16 words, REGION bytes) holding tile x at the given byte offsets."""
    img = np.zeros(REGION // 2, np.uint16)
    img[offsets.ravel() // 2] = bits(x).ravel()
    return img


def descriptor(start: int, lbo: int, sbo: int, swizzle: int) -> int:
    """The 64-bit matrix descriptor: start, LBO and SBO in 16-byte units (bits 0-13, 16-29, 32-45), swizzle in
    bits 62-63 (base offset 0: tiles start on 1024-byte boundaries)."""
    for v in (start, lbo, sbo):
        assert v % 16 == 0 and 0 <= v >> 4 < 1 << 14, v
    return (start >> 4) | ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swizzle << 62)


def decode(img, desc: int, rows: int, cols: int, *, mn_major: bool = False) -> np.ndarray:
    """The [rows, cols] tile (floats, cols contiguous: one k step of 16 for K-major, 16 k rows for MN-major) that
    descriptor ``desc`` names in ``img`` under the addressing model of the module docstring."""
    start, lbo, sbo, sw = ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4,
                           desc >> 62)
    if sw == SW128:  # one 128-byte row per r (K-major: per m/n row; MN-major: per k row), 1024-byte atoms
        r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
        addr = start + (r // 8) * sbo + (r % 8) * 128 + c * 2
        addr = addr ^ (((addr >> 7) & 7) << 4)  # address bits 4-6 ^= bits 7-9
    else:
        addr = start + core_layout(rows, cols, lbo, sbo, mn_major=mn_major)
    return from_bits(np.asarray(img)[addr // 2])


# mma.m16n8k16's A fragment (and wgmma's register A): register j of a lane holds rows g + dr, k pair 2q + dk
A_FRAG = ((0, 0), (8, 0), (0, 8), (8, 8))


def lane_of(t: int) -> tuple[int, int, int]:
    """Thread t of the warpgroup as (warp, g = lane // 4, q = lane % 4): warp w owns rows 16w..16w+15."""
    return t // 32, (t % 32) // 4, t % 4


def a_fragments(a) -> np.ndarray:
    """[nk, 128, 4] uint32: thread t's A registers per k step, as mma.m16n8k16's A fragment, warp w = t // 32
    giving rows 16w..16w+15: reg 0 (row g, k 2q, 2q+1), 1 (row g+8), 2 (row g, k+8), 3 (row g+8, k+8);
    g = lane // 4, q = lane % 4, the lower k in the low half."""
    b = bits(a).astype(np.uint32)
    nk = a.shape[1] // 16
    out = np.zeros((nk, 128, 4), np.uint32)
    for t in range(128):
        w, g, q = lane_of(t)
        for ks in range(nk):
            for j, (dr, dk) in enumerate(A_FRAG):
                r, k = 16 * w + g + dr, 16 * ks + 2 * q + dk
                out[ks, t, j] = b[r, k] | (b[r, k + 1] << 16)
    return out


def d_positions() -> np.ndarray:
    """[128, 32, 2]: (row, col) of accumulator i of thread t: mma.m16n8's C fragment repeated over N / 8 —
    warp w rows 16w.., i // 4 the 8-column block, i % 4: (g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)."""
    pos = np.zeros((128, 32, 2), int)
    for t in range(128):
        w, g, q = lane_of(t)
        for i in range(32):
            j = i % 4
            pos[t, i] = (16 * w + g + 8 * (j // 2), 8 * (i // 4) + 2 * q + (j % 2))
    return pos


# --------------------------------------------------------------------------- hypotheses


@dataclass
class Operand:
    """One operand's layout claim: offsets of the [rows, cols] tile (cols contiguous), and its k-step descriptors."""

    name: str
    offsets: np.ndarray
    descs: list
    mn_major: bool


def k_major(layout: str, rows: int, nk: int, *, swap: bool = False) -> Operand:
    """A [rows, 16 nk] tile, k contiguous (Q, K; B without imm-trans-b)."""
    k = 16 * nk
    if layout == "sw128":
        assert k == 64
        lbo, sbo = (1024, 16) if swap else (16, 1024)  # LBO is unused by a swizzled K-major tile of one atom in K
        return Operand(f"K-major sw128 LBO={lbo} SBO={sbo}", sw128_layout(rows),
                       [descriptor(32 * s, lbo, sbo, SW128) for s in range(nk)], False)
    strides = 128, (k // 8) * 128  # core matrices along K adjacent, 8-row groups one K row of cores apart
    lbo, sbo = strides[::-1] if swap else strides
    return Operand(f"K-major interleaved LBO={lbo} SBO={sbo}", core_layout(rows, k, *strides),
                   [descriptor(256 * s, lbo, sbo, 0) for s in range(nk)], False)


def mn_major(layout: str, nk: int, *, swap: bool = False) -> Operand:
    """A [16 nk, 64] tile, n contiguous (V as the B operand of O += P V, with imm-trans-b)."""
    k = 16 * nk
    if layout == "sw128":
        # SBO = 1024: the next 8 k rows (along K here, unlike without swizzle); LBO would step to the next
        # 64 n, unused by one atom across N (a far value)
        lbo, sbo = (1024, 8192) if swap else (8192, 1024)
        return Operand(f"MN-major sw128 LBO={lbo} SBO={sbo}", sw128_layout(k),
                       [descriptor(2048 * s, lbo, sbo, SW128) for s in range(nk)], True)
    strides = 1024, 128  # along K, along N: cores along N adjacent; the next 8 k rows after the 8 cores across N
    lbo, sbo = strides[::-1] if swap else strides
    return Operand(f"MN-major interleaved LBO={lbo} SBO={sbo}", core_layout(k, N, *strides, mn_major=True),
                   [descriptor(2048 * s, lbo, sbo, 0) for s in range(nk)], True)


def hypotheses(nk: int):
    """(name, A operand or "regs", B operand, trans_b, expected to pass)."""
    out = []
    for lay in ("interleaved", "sw128"):
        if lay == "sw128" and nk * 16 != 64:
            continue
        a, b = k_major(lay, M, nk), k_major(lay, N, nk)
        out.append((f"SS, A and B {lay}", a, b, 0, True))
        out.append((f"SS, A and B {lay}, LBO/SBO swapped", k_major(lay, M, nk, swap=True),
                    k_major(lay, N, nk, swap=True), 0, False))
        out.append((f"RS, B {lay}", "regs", b, 0, True))
    for lay in ("interleaved", "sw128"):
        out.append((f"RS, B MN-major {lay} (imm-trans-b)", "regs", mn_major(lay, nk), 1, True))
        out.append((f"RS, B MN-major {lay}, LBO/SBO swapped", "regs", mn_major(lay, nk, swap=True), 1, False))
    return out


# --------------------------------------------------------------------------- the run


def compile_sm90a(cp, path: Path) -> dict:
    """{name expression: cupy.RawKernel} of a .cu compiled for sm_90a (``llmgpu.kernels.loader.compile_for_arch``:
    NVRTC, the package's flags, the file's own directory on the include path)."""
    return loader.compile_for_arch(path.read_text(), path.name, loader.expressions_in(path.read_text()), "sm_90a",
                                   include_dirs=(path.parent,))


def run(cp, kernels, a, bmat, hyp):
    """Raw accumulators [128, 32] of one hypothesis (B given as the math operand [K, N])."""
    name, aop, bop, trans_b, _ = hyp
    nk = a.shape[1] // 16
    regs = not isinstance(aop, Operand)
    a_img = np.zeros(REGION // 2, np.uint16) if regs else image(a, aop.offsets)
    descs_a = [0] * nk if regs else aop.descs
    frags = a_fragments(a) if regs else np.zeros((nk, 128, 4), np.uint32)
    b_tile = bmat if bop.mn_major else bmat.T  # MN-major: [K, N] as stored; K-major: [N, K]
    b_img = image(b_tile, bop.offsets)
    out = cp.full((128, 32), np.nan, np.float32)
    dev = [cp.asarray(x) for x in (a_img, frags, b_img, np.array(descs_a, np.uint64), np.array(bop.descs, np.uint64))]
    fn = kernels[f"wgmma_probe<{int(regs)}, {trans_b}>"]
    fn((1,), (128,), (dev[0], np.int32(REGION), dev[1], dev[2], np.int32(REGION), dev[3], dev[4], np.int32(nk), out),
       shared_mem=1024 + 2 * REGION)
    cp.cuda.Device().synchronize()
    return cp.asnumpy(out)


def emulate_launch(a_regs: int, trans_b: int, args) -> None:
    """What ``wgmma_probe<a_regs, trans_b>`` does with the arguments ``run`` launches it with, if the hardware
    follows the addressing model (``decode``), the fragment order of ``a_fragments`` and ``d_positions``: the CPU
    stand-in for the kernel in tests/test_dev_cuda.py, a check of this script's own bookkeeping, not of the GPU."""
    a_img, _, frags, b_img, _, desc_a, desc_b, nk, out = args
    acc = np.zeros((M, N))
    for ks in range(int(nk)):
        if a_regs:  # the fragments read back the way a_fragments wrote them
            a_ks = np.zeros((M, 16))
            for t in range(128):
                w, g, q = lane_of(t)
                for j, (dr, dk) in enumerate(A_FRAG):
                    word = int(frags[ks, t, j])
                    a_ks[16 * w + g + dr, 2 * q + dk: 2 * q + dk + 2] = from_bits([word & 0xFFFF, word >> 16])
        else:
            a_ks = decode(a_img, int(desc_a[ks]), M, 16)
        d = int(desc_b[ks])
        acc += a_ks @ (decode(b_img, d, 16, N, mn_major=True) if trans_b else decode(b_img, d, N, 16).T)
    pos = d_positions()
    out[...] = acc[pos[..., 0], pos[..., 1]]


def judge(raw, ref) -> dict:
    """Against the predicted accumulator positions; and, for a diagnosis when that fails, where each value is
    found in ``A @ B`` at all (every value found but not in place: the accumulator layout guess is wrong, and
    the recovered positions of thread 0 and 37 say what it is; values not found: the operands are misread)."""
    pos = d_positions()
    pred = ref[pos[..., 0], pos[..., 1]]
    tol = 1e-4 * (np.abs(ref).max() + 1)
    in_place = np.isclose(raw, pred, rtol=0, atol=tol)
    flat = ref.ravel()
    nearest = np.abs(raw.reshape(-1, 1) - flat[None, :]).argmin(axis=1)
    found = np.isclose(raw.ravel(), flat[nearest], rtol=0, atol=tol)
    recovered = np.stack(np.unravel_index(nearest, ref.shape), axis=-1).reshape(128, 32, 2)
    err = float(np.abs(raw - pred).max()) if np.isfinite(raw).all() else float("nan")
    return {"max_error": err, "passed": bool(in_place.all()), "in_place": float(in_place.mean()),
            "values_found": float(found.mean()),
            "recovered_positions": {t: recovered[t].tolist() for t in (0, 37)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the table here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    cp = _devscript.hopper_or_say_why(" (the CPU checks are in tests/test_dev_cuda.py)")
    if cp is None:
        return 0
    kernels = compile_sm90a(cp, SOURCE)
    rng = np.random.default_rng(a.seed)
    rows, bad = [], 0
    for nk in (1, 4):
        A = from_bits(bits(rng.standard_normal((M, 16 * nk))))
        B = from_bits(bits(rng.standard_normal((16 * nk, N))))
        ref = A.astype(np.float64) @ B.astype(np.float64)
        for hyp in hypotheses(nk):
            res = judge(run(cp, kernels, A, B, hyp), ref)
            expect = hyp[4]
            ok = res["passed"] == expect
            bad += not ok
            aname = hyp[1].name if isinstance(hyp[1], Operand) else "A from registers"
            rows.append({"hypothesis": hyp[0], "nk": nk, "a": aname, "b": hyp[2].name, "trans_b": hyp[3],
                         "expected_to_pass": expect, **res})
            print(f"{'ok  ' if ok else 'FAIL'} nk={nk} {hyp[0]:<46} passed={res['passed']!s:<5} "
                  f"(expected {expect!s:<5}) max err {res['max_error']:.2e}, in place {res['in_place']:.0%}, "
                  f"values found {res['values_found']:.0%}", flush=True)
            if a.json:  # written after every row: a launch that kills the context leaves the rows before it
                a.json.write_text(json.dumps({"device": backend.device_info(cp).summary(), "rows": rows}, indent=1))
    print(f"{len(rows) - bad} of {len(rows)} as expected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
