"""How our flash attention kernels are launched (``kernels/flash_attention.cu``; the API is ``ops.flash_attention``).

Tile shapes are ``fa_cfg<HD>`` of the .cu (``FA_CFG``, checked against the compiler), shared memory is computed
from them, and the backward comes in variants (``BWD_VARIANTS``), so that one process can time them side by side
before one becomes the default:

* ``"wide"``    (``DEFAULT_BWD_VARIANT``) ``flash_bwd_dq_wide`` (32 query rows per warp, 128 per block, key tiles
  of 32, three blocks per SM; it also computes D = rowsum(dO ⊙ O) and writes each row's (lse · log2 e, D) as one
  float2, so no separate kernel for it), then ``flash_bwd_dkdv_wide`` (32 keys per warp, 128 per block, query
  tiles of 32; head dim 128: 16 keys per warp, query tiles of 32).
* ``"wgmma"``   ``flash_bwd_dq_wide``, then ``flash_bwd_dkdv_wgmma`` (``kernels/flash_attention_wgmma.cu``: warpgroup
  MMAs, 64 keys per warpgroup, two warpgroups per block, query tiles of 64; sm_90a only), the default where it runs
  (``bwd_variant``).
* ``"base"``    the first version, kept as the chapter's simpler kernels: ``flash_bwd_dot`` (D), ``flash_bwd_dkdv``
  (16 keys per warp, 64 per block) and ``flash_bwd_dq`` (16 query rows per warp, 64 per block).

A warp that owns 32 rows instead of 16 feeds twice the MMAs from each fragment it reads from shared memory, which
is what limits these kernels (the FlashAttention-2 paper's work partitioning, Dao 2023, section 3). A third
variant, the wide dK/dV kernel with the base dQ and D kernels, was measured between the two and dropped
(benchmarks/results/ch2b/flash_backward_variants.json).

Every variant is deterministic (no atomics) and capturable in a CUDA graph; they agree with each other to rounding
(the wide kernels round P to 16 bits before dS, and the wide dQ kernel sums D in another order).

The forward has two tensor-core kernels: ``flash_fwd`` (``mma.sync``, any sm_80+ GPU) and, on Hopper,
``flash_fwd_wgmma`` (``kernels/flash_attention_wgmma.cu``: warpgroup MMAs, built for sm_90a only), with the same
arguments and results up to rounding; ``ours_forward(impl="ours")`` takes the Hopper one where it runs.

Grouped-query attention (k, v with H_kv = H / G heads): every kernel takes G; the forward and dQ kernels run over
the B·H query heads and read K/V head h // G, the dK/dV kernels over the B·H_kv K/V heads, each block summing over
its G query heads in registers (kernels/flash_attention.cu says why), so G = 1 is the multi-head launch unchanged.

RoPE (Llama): the wide and wgmma kernels come in two instantiations, ``ROPE = 0`` and ``ROPE = 1``; the second
takes RoPE's fp32 cos/sin tables and applies RoPE's backward (the inverse rotation) to dQ and dK in registers before
storing them (``ours_backward(rope=...)``), so the fast Llama step needs no separate pass over them.

Every tensor-core kernel takes its (head, tile) from a grid of heads in groups (``plan``, ``tile_group``; the order
is ``fa_block_head`` in kernels/flash_common.cuh): the same results bit for bit in any order, faster in a good one
(dev/cuda/flash_tile_order.py measured it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .. import backend
from ..checks import check_choice
from ..kernels import get_kernel, loader
from ..kernels.launch import opt_in_shared_memory, resident_blocks

THREADS = loader.constant("flash_attention", "FA_THREADS")  # the scalar forward's block
PAD = loader.constant("flash_attention", "FA_PAD")  # elements of padding per shared-memory row
# fa_cfg<HD> of flash_attention.cu, the tile shapes of the tensor-core kernels per head dim: warps per block (each
# warp owns 16 rows of the block's tile per MT, so 32 in the wide kernels and the D = 64 forward), inner tiles and
# their buffers. C computes them from HD, so they are written here again: tests/test_kernel_constants.py checks
# every entry against the compiler (NVRTC static_asserts), so the two cannot drift apart.
FA_CFG = {
    64: {"FWD_MT": 2, "FWD_WARPS": 4, "FWD_BN": 64, "FWD_BUFS": 3, "DKDV_WARPS": 4, "DKDV_BM": 64, "DQ_WARPS": 4,
         "DQ_BN": 64, "WIDE_MT": 2, "WIDE_KV_BM": 32, "WIDE_DQ_BN": 32, "WIDE_DQ_BUFS": 3},
    128: {"FWD_MT": 1, "FWD_WARPS": 8, "FWD_BN": 64, "FWD_BUFS": 3, "DKDV_WARPS": 4, "DKDV_BM": 16, "DQ_WARPS": 4,
          "DQ_BN": 32, "WIDE_MT": 1, "WIDE_KV_BM": 32, "WIDE_DQ_BN": 32, "WIDE_DQ_BUFS": 2},
}

WGMMA_FILE = "flash_attention_wgmma"
FW_BUFS = loader.constant(WGMMA_FILE, "FW_BUFS")  # flash_fwd_wgmma's ring of K/V tiles


def _wgmma_shipped(function: str, n: int) -> tuple[int, ...]:
    """The last ``n`` template arguments of ``function``'s instantiations in the .cu (its ``// llmgpu:kernel``
    line), which must be one tile configuration."""
    shipped = {tuple(int(a) for a in e[e.index("<") + 1:-1].split(",")[-n:])
               for e in loader.name_expressions(WGMMA_FILE) if e.startswith(function + "<")}
    if len(shipped) != 1:
        raise RuntimeError(f"{WGMMA_FILE}.cu should ship one configuration of {function}, found {shipped}")
    return shipped.pop()


# flash_fwd_wgmma: K/V tiles of BN keys, WG warpgroups of 64 query rows (128 threads each) per block, PIPE (the
# MMA/softmax overlap) on or off
WGMMA_PIPE, WGMMA_BN, WGMMA_WG = _wgmma_shipped("flash_fwd_wgmma", 3)
BW_BQ = loader.constant(WGMMA_FILE, "BW_BQ")  # flash_bwd_dkdv_wgmma's query rows per tile
(WGMMA_BWD_WG,) = _wgmma_shipped("flash_bwd_dkdv_wgmma", 1)  # and its warpgroups (of 64 keys) per block
FLASH_DTYPES = (backend.float16, backend.bfloat16)  # what the fused kernels take on the GPU
FWD_IMPLS = ("ours", "mma", "wgmma", "scalar")  # ours: wgmma where it runs, else mma

# the launch order's groups of heads (tile_group): the blocks of a group fill the GPU at least this many times
GROUP_WAVES = 2

BWD_VARIANTS = ("wide", "wgmma", "base")
DEFAULT_BWD_VARIANT = "wide"  # on any sm_80+ GPU; where the Hopper kernels run, "wgmma" (bwd_variant)


ROPE_VARIANTS = ("wide", "wgmma")  # the backward variants that fold RoPE's backward into their dQ, dK stores


def fwd_rows(D) -> int:
    """Query rows per flash_fwd block: FWD_WARPS · 16 · FWD_MT (128 for both head dims)."""
    c = FA_CFG[D]
    return c["FWD_WARPS"] * 16 * c["FWD_MT"]


def _strides(a):
    it = a.dtype.itemsize
    return [np.int64(s // it) for s in a.strides[:3]]


def _kernel(function, smem, *targs, file="flash_attention"):
    kern = get_kernel(file, function, *targs)
    if not opt_in_shared_memory(kern, smem):
        raise RuntimeError(f"{function} (D={targs[1]}) needs {smem} bytes of shared memory per block; this GPU "
                           "does not allow that much")
    return kern


def smem_bytes(function: str, D: int, itemsize: int = 2) -> int:
    """Dynamic shared memory of one block of ``function`` (0 for the kernels with static shared memory).
    The inner tiles are double-buffered (two copies of Q, dO and the row statistics in dK, dV; of K, V in the base
    dQ) or come through a ring of three (K, V in the forward and, head dim 64, in the wide dQ)."""
    row = (D + PAD) * itemsize
    c = FA_CFG[D]
    bm, bn, wide = c["DKDV_BM"], c["DQ_BN"], 16 * c["WIDE_MT"]
    return {"flash_fwd": (fwd_rows(D) + c["FWD_BUFS"] * 2 * c["FWD_BN"]) * row,
            "flash_bwd_dkdv": (2 * 16 * c["DKDV_WARPS"] + 2 * 2 * bm) * row + 2 * 2 * bm * 4,
            "flash_bwd_dq": (2 * 16 * c["DQ_WARPS"] + 2 * 2 * bn) * row,
            "flash_bwd_dkdv_wide": (2 * wide * c["DKDV_WARPS"] + 2 * 2 * c["WIDE_KV_BM"]) * row
            + 2 * c["WIDE_KV_BM"] * 8,
            "flash_bwd_dq_wide": (2 * wide * c["DQ_WARPS"] + c["WIDE_DQ_BUFS"] * 2 * c["WIDE_DQ_BN"]) * row,
            }.get(function, 0)


def wgmma_smem_bytes(D: int, bn: int = WGMMA_BN, wg: int = WGMMA_WG) -> int:
    """fw_cfg::SMEM of flash_fwd_wgmma: 1 KiB of alignment slack (its tiles start on 1024-byte boundaries), the
    padded Q rows of 64·wg queries, a ring of three K/V tiles of bn keys (unpadded, swizzled)."""
    return 1024 + 64 * wg * (D + PAD) * 2 + FW_BUFS * 2 * bn * D * 2


def bwd_smem_bytes(D: int, wg: int = WGMMA_BWD_WG) -> int:
    """bw_cfg::SMEM of flash_bwd_dkdv_wgmma: 1 KiB of alignment slack, the block's K and V (64·wg keys), two buffers
    of a Q and a dO tile of BW_BQ rows (all unpadded, swizzled) and of their rows' statistics (8 bytes a row)."""
    return 1024 + 2 * 64 * wg * D * 2 + 2 * 2 * BW_BQ * D * 2 + 2 * BW_BQ * 8


def wgmma_unsupported(q) -> str | None:
    """Why the Hopper forward cannot run for q (a [B, H, T, D] array) here; None when it can."""
    if backend.get_array_module(q) is np:
        return "q is a NumPy array (the reference runs)"
    why = loader.arch_unsupported(WGMMA_FILE)
    if why is None and q.dtype not in FLASH_DTYPES:
        why = f"flash_fwd_wgmma takes fp16 or bf16, got {q.dtype}"
    return why


def tile_group(n_bh: int, n_tiles: int, resident: int) -> int:
    """Heads per group of the blocks' launch order (``fa_block_head`` in kernels/flash_common.cuh) for n_bh heads of
    n_tiles tiles on a GPU that holds ``resident`` blocks at once: the fewest heads that divide n_bh evenly and
    whose blocks fill the GPU at least ``GROUP_WAVES`` times. Fewer heads share more of the L2; a group that divides
    n_bh leaves no small last group, and one of several waves keeps the longest-first order inside it, so the last
    blocks of the grid are short ones (a small or ragged last group starts its longest tiles at the very end).
    n_bh itself (the plain order) when no smaller divisor is enough."""
    need = -(-GROUP_WAVES * resident // n_tiles)
    return next((g for g in range(need, n_bh) if n_bh % g == 0), n_bh)


@dataclass(frozen=True)
class Launch:
    """One flash kernel's launch for a [B, H, T, D] problem: the kernel, grid (group, tiles, groups), block, shared
    memory."""

    kernel: object
    grid: tuple[int, int, int]
    block: tuple[int]
    smem: int

    @property
    def group(self) -> int:
        return self.grid[0]


def plan(name: str, q, group: int | None = None, kv_heads: int | None = None, rope: bool = False) -> Launch:
    """How tensor-core flash kernel ``name`` (flash_fwd, flash_fwd_wgmma, flash_bwd_dkdv[_wide],
    flash_bwd_dq[_wide]) is launched on q's shape and dtype. ``group``: heads per group of the launch order;
    None: ``tile_group``'s choice for the kernel's occupancy on this GPU. ``kv_heads``: H_kv (None: H), the heads
    the dK/dV kernels' grid runs over. ``rope``: the wide backward kernels' instantiation that folds RoPE's
    backward into its dQ/dK stores."""
    B, H, T, D = q.shape
    heads = (kv_heads or H) if "dkdv" in name else H
    if name == "flash_fwd_wgmma":
        smem, rows, threads = wgmma_smem_bytes(D), 64 * WGMMA_WG, 128 * WGMMA_WG
        kern = _kernel(name, smem, q.dtype, D, WGMMA_PIPE, WGMMA_BN, WGMMA_WG, file=WGMMA_FILE)
    elif name == "flash_bwd_dkdv_wgmma":
        smem, rows, threads = bwd_smem_bytes(D), 64 * WGMMA_BWD_WG, 128 * WGMMA_BWD_WG
        kern = _kernel(name, smem, q.dtype, D, int(rope), WGMMA_BWD_WG, file=WGMMA_FILE)
    else:
        smem = smem_bytes(name, D)
        kern = _kernel(name, smem, q.dtype, D, *((int(rope),) if name.endswith("_wide") else ()))
        c = FA_CFG[D]
        if name == "flash_fwd":
            rows, threads = fwd_rows(D), 32 * c["FWD_WARPS"]
        else:
            warps = c["DKDV_WARPS"] if "dkdv" in name else c["DQ_WARPS"]
            rows, threads = 16 * (c["WIDE_MT"] if name.endswith("_wide") else 1) * warps, 32 * warps
    return Launch(kern, launch_grid(kern, threads, smem, B * heads, -(-T // rows), group), (threads,), smem)


def launch_grid(kern, threads: int, smem: int, n_bh: int, n_tiles: int, group: int | None = None):
    """``ordered_grid`` for ``kern`` launched with ``threads`` threads and ``smem`` bytes of shared memory a block;
    ``group`` None: ``tile_group``'s choice for the kernel's occupancy on this GPU."""
    return ordered_grid(n_bh, n_tiles, _default_group(kern, threads, smem, n_bh, n_tiles) if group is None else group)


@functools.cache  # every launch asks: the kernel's occupancy and the search over divisors, once per kernel and shape
def _default_group(kern, threads: int, smem: int, n_bh: int, n_tiles: int) -> int:
    return tile_group(n_bh, n_tiles, resident_blocks(kern, threads, smem))


def ordered_grid(n_bh: int, n_tiles: int, group: int) -> tuple[int, int, int]:
    """The grid (group, n_tiles, groups) of n_bh heads of n_tiles tiles in groups of ``group`` heads (at most n_bh;
    more where gridDim.z's 65535 groups would not hold them)."""
    if group < 1:
        raise ValueError(f"group must be a positive number of heads, got {group}")
    group = max(min(group, n_bh), -(-n_bh // 65535))
    return group, n_tiles, -(-n_bh // group)


def backward_kernels(variant: str) -> tuple[str, ...]:
    """The kernels one backward of ``variant`` launches, in order."""
    return {"base": ("flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq"),
            "wide": ("flash_bwd_dq_wide", "flash_bwd_dkdv_wide"),
            "wgmma": ("flash_bwd_dq_wide", "flash_bwd_dkdv_wgmma")}[variant]


def bwd_variant(q, variant: str | None = None) -> str:
    """The backward variant that runs for q: ``variant``, or by default "wgmma" where the Hopper kernels run, else
    ``DEFAULT_BWD_VARIANT``. "wgmma" where they cannot run is a RuntimeError naming why."""
    if variant is None:
        return "wgmma" if wgmma_unsupported(q) is None else DEFAULT_BWD_VARIANT
    check_choice("variant", variant, BWD_VARIANTS)
    if variant == "wgmma" and (why := wgmma_unsupported(q)):
        raise RuntimeError(f"the Hopper flash backward cannot run here: {why} (variant='wide' runs on any sm_80+ GPU)")
    return variant


def forward_impl(q, impl: str = "ours") -> str:
    """The kernel ``impl`` runs for q: "ours" is "wgmma" where the Hopper forward runs, else "mma"."""
    check_choice("impl", impl, FWD_IMPLS)
    if impl == "ours":
        return "wgmma" if wgmma_unsupported(q) is None else "mma"
    if impl == "wgmma" and (why := wgmma_unsupported(q)):
        raise RuntimeError(f"the Hopper flash forward cannot run here: {why} (kernel='mma' runs on any sm_80+ GPU)")
    return impl


def kv_group_size(q, k) -> int:
    """G = H / H_kv, what the kernels take (the caller checked that H_kv divides H)."""
    return q.shape[1] // k.shape[1]


def ours_forward(q, k, v, o, lse, scale, causal, impl="ours", group=None):
    """Launch our forward ``impl`` (``FWD_IMPLS``) on [B, H, T, D] views q, o and [B, H_kv, T, D] k, v; o, lse
    written. ``group``: heads per group of the launch order (default: ``plan``; the scalar kernel keeps the plain
    order)."""
    B, H, T, D = q.shape
    head = (np.int32(H), np.int32(kv_group_size(q, k)), np.int32(T), np.float32(scale), np.int32(bool(causal)))
    views = (*_strides(q), *_strides(k), *_strides(v), *_strides(o))
    impl = forward_impl(q, impl)
    if impl == "scalar":
        rows = THREADS // (D // 16)  # TPR = D / 16 threads per query row
        get_kernel("flash_attention", "flash_fwd_scalar", q.dtype, D)((B * H, -(-T // rows)), (THREADS,),
                                                                      (q, k, v, o, lse, *head, *views))
        return
    args = (q, k, v, o, lse, *head, np.int32(B * H), *views)
    run = plan("flash_fwd_wgmma" if impl == "wgmma" else "flash_fwd", q, group)
    run.kernel(run.grid, run.block, args, shared_mem=run.smem)


_ROW_STATS: dict = {}  # (device, B, H, T, per row) -> fp32 [B, H, T, per row], made once per shape


def row_stats_buffer(cp, B, H, T, variant=DEFAULT_BWD_VARIANT):
    """The per-row statistics the backward of ``variant`` passes between its kernels: [B, H, T, 1] D = rowsum(dO ⊙
    O) ("base": ``flash_bwd_dot`` writes it), [B, H, T, 2] (lse · log2 e, D) ("wide": ``flash_bwd_dq_wide``)."""
    per_row = 1 if variant == "base" else 2
    key = (cp.cuda.Device().id, B, H, T, per_row)
    d = _ROW_STATS.get(key)
    if d is None:
        d = _ROW_STATS[key] = cp.empty((B, H, T, per_row), dtype=np.float32)
    return d


def ours_backward(do, q, k, v, o, lse, scale, causal, dq, dk, dv, variant=DEFAULT_BWD_VARIANT, only=None,
                  group=None, rope=None):
    """dq, dk, dv by the kernels of ``variant`` (k, v, dk, dv with H_kv heads: dk, dv summed over each K/V head's
    query heads). ``only`` (benchmarks: one kernel's time) launches just the kernel of that name from the variant's
    list; the others' outputs are then left as they were. ``group``: heads per group of the launch order (default:
    ``plan``). ``rope``: ``(cos, sin)``, C-contiguous fp32 ``[S >= T, D / 2]`` tables on 8-byte boundaries (the
    caller checks): dq and dk come out through RoPE's backward, folded into the stores (``ROPE_VARIANTS`` only)."""
    cp = backend.cupy_module()
    B, H, T, D = q.shape
    H_kv, G = k.shape[1], kv_group_size(q, k)
    stats = row_stats_buffer(cp, B, H, T, variant)

    def head(n_heads):  # H, G, T, scale, causal and the heads the kernel's grid runs over
        return np.int32(H), np.int32(G), np.int32(T), np.float32(scale), np.int32(bool(causal)), np.int32(B * n_heads)

    if rope is not None and variant not in ROPE_VARIANTS:
        raise ValueError(f"RoPE's backward folds into the {' and '.join(ROPE_VARIANTS)} backward kernels only, not "
                         f"variant={variant!r}")
    tables = tuple(rope) if rope is not None else (np.uint64(0), np.uint64(0))  # null: the ROPE = 0 kernels ignore them
    ins = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    kv = (*ins, *_strides(dk), *_strides(dv))
    rows = B * H * T
    for name in backward_kernels(variant):
        if only is not None and name != only:
            continue
        if name == "flash_bwd_dot":
            get_kernel("flash_attention", name, q.dtype)(
                (-(-rows // 8),), (256,), (do, o, stats, np.int32(H), np.int32(T), np.int32(D), np.int64(rows),
                                           *_strides(do), *_strides(o)))
            continue
        if name == "flash_bwd_dkdv":
            args = (q, k, v, do, lse, stats, dk, dv, *head(H_kv), *kv)
        elif name in ("flash_bwd_dkdv_wide", "flash_bwd_dkdv_wgmma"):  # lse · log2 e comes with D in stats
            args = (q, k, v, do, stats, dk, dv, *head(H_kv), *kv, *tables)
        elif name == "flash_bwd_dq":
            args = (q, k, v, do, lse, stats, dq, *head(H), *ins, *_strides(dq))
        else:  # flash_bwd_dq_wide: also reads O and writes the row stats
            args = (q, k, v, do, o, lse, stats, dq, *head(H), *ins, *_strides(o), *_strides(dq), *tables)
        run = plan(name, q, group, kv_heads=H_kv, rope=rope is not None)
        run.kernel(run.grid, run.block, args, shared_mem=run.smem)
