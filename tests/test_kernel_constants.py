"""Numbers that kernels and their host code share are written once (issue 35, item 4).

Scalar constants live as ``#define`` / file-scope ``constexpr`` in the ``.cu`` and the host reads them through
``loader.constants``. What C computes from template arguments (``fa_cfg<HD>``, ``fw_cfg<HD, BN, WG>``) is mirrored
in ``ops/flash_launch.py``; here the compiler itself checks every mirrored value (NVRTC ``static_assert``s, no GPU
needed), so the two cannot drift apart unnoticed.
"""

import pytest

from llmgpu.kernels import loader
from llmgpu.ops import cross_entropy, embedding, flash_launch, gelu, softmax
from llmgpu.optim import adamw, clip


def test_constants_in_reads_numbers_only():
    text = ("#define A 256\n#define B 1e-6f  // a comment\n#define C -3\n  #define INDENTED 4\n"
            "#define EXPR (A * 2)\n#define BITS __int_as_float(0x7f800000)\nconstexpr int D = 3;  // ring\n"
            "constexpr float E = 0.5f;\n    static constexpr int IN_STRUCT = 9;\n#define U 16u\n")
    assert loader.constants_in(text) == {"A": 256, "B": 1e-6, "C": -3, "D": 3, "E": 0.5, "U": 16}
    assert isinstance(loader.constants_in(text)["A"], int) and isinstance(loader.constants_in(text)["B"], float)


def test_constant_names_what_is_missing():
    assert loader.constant("adamw", "ADAMW_VEC") == 128
    with pytest.raises(KeyError, match=r"adamw.cu defines no number ADAMW_NOPE .*ADAMW_VEC"):
        loader.constant("adamw", "ADAMW_NOPE")


def test_host_numbers_are_the_kernels():
    """Each host number equals the .cu's (read there, not retyped): a renamed or removed #define fails at import."""
    flags = [adamw.LR_PTR, adamw.GS_PTR, adamw.FOUND_INF, adamw.STEP_PTR, adamw.INCREMENT, adamw.ZERO_GRAD,
             adamw.WRITE_WORKING, adamw.VEC]
    assert sorted(flags) == [1 << k for k in range(8)]  # distinct bits
    assert (cross_entropy.FAST_THREADS, cross_entropy.FB_THREADS) == (256, 512)
    assert softmax.BLOCK_VECTORS_PER_THREAD == loader.constant("softmax", "SOFTMAX_CACHE")
    assert (gelu.FAST_UNROLL, gelu.FAST_THREADS, gelu.CUBIC) == (2, 256, 0.044715)
    assert (clip.THREADS, clip.CLIP_EPS) == (256, 1e-6)
    assert embedding.WARPS_PER_BLOCK == 4 and embedding.MAX_PACKS_PER_LANE == 3
    assert (flash_launch.THREADS, flash_launch.PAD, flash_launch.FW_BUFS) == (128, 8, 3)
    expr = f"flash_fwd_wgmma<__half, 64, {flash_launch.WGMMA_PIPE}, {flash_launch.WGMMA_BN}, {flash_launch.WGMMA_WG}>"
    assert expr in loader.name_expressions(flash_launch.WGMMA_FILE)


def _nvrtc_compile(text: str, arch: str):
    pytest.importorskip("cupy", reason="CuPy (with NVRTC) is not installed: pip install 'llmgpu[cuda13]'")
    from llmgpu.kernels import compile_check

    return compile_check.compile_source(text, "constants_check", [], arch)


def _fa_asserts(table) -> str:
    return "".join(f'static_assert(fa_cfg<{hd}>::{k} == {v}, "fa_cfg<{hd}>::{k} is not {v}");\n'
                   for hd, cfg in table.items() for k, v in cfg.items())


def test_fa_cfg_mirror_matches_the_compiler():
    r = _nvrtc_compile('#include "flash_attention.cu"\n' + _fa_asserts(flash_launch.FA_CFG), "sm_90")
    assert r.ok, r.log


def test_fa_cfg_check_fails_on_a_wrong_value():
    wrong = {64: {**flash_launch.FA_CFG[64], "DKDV_BM": flash_launch.FA_CFG[64]["DKDV_BM"] + 16}}
    r = _nvrtc_compile('#include "flash_attention.cu"\n' + _fa_asserts(wrong), "sm_90")
    assert not r.ok and "fa_cfg<64>::DKDV_BM is not" in r.log


def test_wgmma_shared_memory_matches_the_compiler():
    """The forward's and the dK/dV kernel's shared memory and block shape, as flash_launch computes them."""
    fl = flash_launch
    cfg = f"fw_cfg<{{d}}, {fl.WGMMA_BN}, {fl.WGMMA_WG}>"
    checks = "".join(
        f'static_assert({cfg.format(d=d)}::SMEM == {fl.wgmma_smem_bytes(d)}, "SMEM of D={d}");\n'
        f'static_assert({cfg.format(d=d)}::BM == {64 * fl.WGMMA_WG} && {cfg.format(d=d)}::NT == {128 * fl.WGMMA_WG},'
        f' "block of D={d}");\n' for d in (64, 128))
    bw = f"bw_cfg<{{d}}, {fl.WGMMA_BWD_WG}>"  # the dK/dV kernel's
    checks += "".join(
        f'static_assert({bw.format(d=d)}::SMEM == {fl.bwd_smem_bytes(d)}, "dK/dV SMEM of D={d}");\n'
        f'static_assert({bw.format(d=d)}::BN == {64 * fl.WGMMA_BWD_WG} && {bw.format(d=d)}::NT == '
        f'{128 * fl.WGMMA_BWD_WG}, "dK/dV block of D={d}");\n' for d in (64, 128))
    r = _nvrtc_compile(f'#include "{fl.WGMMA_FILE}.cu"\n' + checks, "sm_90a")
    assert r.ok, r.log


def test_layernorm_fast_block_matches_the_compiler():
    """The host launches layernorm_backward_fast with _FAST_WARPS (_FAST_SACC_WARPS with shared accumulators)
    warps: LnFastPlan::threads in the .cu, for every instantiated pack count; the packs the host may ask for are
    the ones the .cu declares."""
    from llmgpu.ops import layernorm as ln

    checks = "".join(
        f'static_assert(LnFastPlan<{t}, {p}, 0, {sacc}>::threads == {32 * warps}, "{t} P={p} SACC={sacc}");\n'
        for t, size in (("__half", 2), ("float", 4)) for p in ln._FAST_PACKS[size]
        for sacc, warps in ((0, ln._FAST_WARPS), (1, ln._FAST_SACC_WARPS)) if size == 2 or sacc == 0)
    r = _nvrtc_compile('#include "layernorm.cu"\n' + checks, "sm_90")
    assert r.ok, r.log
    declared = loader.name_expressions("layernorm")
    for p in ln._REGISTER_PACKS:
        assert f"add_layernorm_forward_warp<float, {p}>" in declared and \
            f"layernorm_backward_warp<__nv_bfloat16, 1, {p}>" in declared
