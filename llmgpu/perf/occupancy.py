"""Occupancy (chapter 8): how many blocks of a kernel fit on one SM, by the calculator's formula and the API.

* ``theoretical_occupancy(block=, regs=, smem_bytes=)``: the four limits of CUDA's occupancy calculator
  (warps, registers, shared memory, blocks), usable without a GPU, over ``SMLimits``
  (``llmgpu.kernels.launch``: the per-SM resources, read from the device).
* ``occupancy_table(kernels, block)``: registers, static shared memory, local memory (spills) and blocks
  per SM / theoretical occupancy for a block size, from the CUDA occupancy API
  (``cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor``) next to the formula.
"""

from __future__ import annotations

from .. import backend
from ..kernels.launch import SMLimits


def theoretical_occupancy(*, block: int, regs: int, smem_bytes: int = 0, limits: SMLimits | None = None,
                          max_threads_per_block: int | None = None) -> dict:
    """Resident blocks per SM and theoretical occupancy for one kernel launch configuration.

    The formula of CUDA's occupancy calculator (``cuda_occupancy.h``), four limits, the smallest wins:

    * warps:     ``⌊max_warps_per_sm / warps_per_block⌋`` with ``warps_per_block = ⌈block / 32⌉``
    * registers: each warp holds ``⌈regs · 32 / 256⌉ · 256`` registers; each of the 4 sub-partitions
      (``regs_per_sm / 4`` registers) fits ``⌊(regs_per_sm / 4) / regs_per_warp⌋`` warps; blocks =
      ``⌊4 · that / warps_per_block⌋`` (0 when one block needs more than ``regs_per_block``)
    * shared memory: ``⌊smem_per_sm / (⌈(smem + 1 KiB reserved) / 128⌉ · 128)⌋``
    * blocks:    ``max_blocks_per_sm`` (32 on sm_80 / sm_90)

    occupancy = resident warps / max warps per SM. ``smem_bytes`` = static + dynamic shared memory
    per block. Returns ``{blocks_per_sm, active_warps, occupancy, limiter, limits}``.
    """
    lim = limits or SMLimits()
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if regs < 0 or smem_bytes < 0:
        raise ValueError("regs and smem_bytes must be >= 0")
    wpb = -(-block // lim.warp_size)
    by = {"warps": lim.max_warps_per_sm // wpb, "blocks": lim.max_blocks_per_sm}
    if regs > 0:
        per_warp = -(-regs * lim.warp_size // lim.reg_alloc_unit) * lim.reg_alloc_unit
        warps_per_part = (lim.regs_per_sm // lim.sub_partitions) // per_warp
        by["registers"] = (warps_per_part * lim.sub_partitions) // wpb
        # the per-block limit, checked as if every sub-partition got the same number of warps
        if per_warp * (-(-wpb // lim.sub_partitions) * lim.sub_partitions) > lim.regs_per_block:
            by["registers"] = 0
    smem = smem_bytes + lim.reserved_smem_per_block
    smem = -(-smem // lim.smem_alloc_unit) * lim.smem_alloc_unit
    by["shared memory"] = lim.smem_per_sm // smem
    if max_threads_per_block is not None and block > max_threads_per_block:
        by["max threads per block"] = 0
    blocks = max(0, min(by.values()))
    limiter = min(by, key=lambda k: (by[k], ["warps", "registers", "shared memory", "blocks",
                                                "max threads per block"].index(k)))
    warps = blocks * wpb
    return {"blocks_per_sm": blocks, "active_warps": warps, "occupancy": warps / lim.max_warps_per_sm,
            "limiter": limiter, "limits": by}


def kernel_attributes(kernel) -> dict:
    """Compiled attributes of a ``cupy.RawKernel``: registers per thread, static shared memory, local
    memory (spills), constant memory, max threads per block, PTX / binary version."""
    return {"regs": int(kernel.num_regs), "static_smem": int(kernel.shared_size_bytes),
            "local_bytes": int(kernel.local_size_bytes), "const_bytes": int(kernel.const_size_bytes),
            "max_threads_per_block": int(kernel.max_threads_per_block), "ptx_version": int(kernel.ptx_version),
            "binary_version": int(kernel.binary_version)}


def occupancy(kernel, block: int, *, dynamic_smem: int = 0, limits: SMLimits | None = None) -> dict:
    """Attributes of ``kernel`` plus blocks per SM / occupancy at ``block`` threads: from the CUDA occupancy
    API (``blocks_per_sm_api``) and from ``theoretical_occupancy`` (the formula), side by side."""
    cp = backend.require_gpu()
    attrs = kernel_attributes(kernel)
    lim = limits or SMLimits.for_device(cp)
    calc = theoretical_occupancy(block=block, regs=attrs["regs"], smem_bytes=attrs["static_smem"] + dynamic_smem,
                                 limits=lim, max_threads_per_block=attrs["max_threads_per_block"])
    row = {**attrs, "block": int(block), "dynamic_smem": int(dynamic_smem), "blocks_per_sm": calc["blocks_per_sm"],
           "occupancy": calc["occupancy"], "limiter": calc["limiter"], "blocks_per_sm_api": None,
           "occupancy_api": None}
    try:
        n = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(kernel.kernel.ptr, int(block),
                                                                      int(dynamic_smem))
        row["blocks_per_sm_api"] = int(n)
        row["occupancy_api"] = int(n) * (-(-block // lim.warp_size)) / lim.max_warps_per_sm
    except Exception as e:  # no driver API in this CuPy build: the formula stands alone
        row["api_error"] = f"{type(e).__name__}: {e}"
    return row


def occupancy_table(kernels, block=256, *, dynamic_smem=0) -> list[dict]:
    """``occupancy`` for several kernels. ``kernels``: a mapping name → RawKernel or an iterable of
    RawKernels (named by ``kernel.name``); ``block`` / ``dynamic_smem``: a number or a mapping name → number."""
    items = list(kernels.items()) if hasattr(kernels, "items") else [(k.name, k) for k in kernels]
    rows = []
    for name, k in items:
        b = block[name] if hasattr(block, "items") else block
        s = dynamic_smem[name] if hasattr(dynamic_smem, "items") else dynamic_smem
        rows.append({"kernel": name, **occupancy(k, b, dynamic_smem=s)})
    return rows


def format_occupancy_table(rows, *, max_name: int = 40) -> str:
    head = (f"{'kernel':<{max_name}}{'regs':>5}{'smem B':>8}{'local B':>8}{'block':>6}{'blocks/SM':>10}"
            f"{'occupancy':>10}{'API':>6}  limiter")
    lines = [head, "-" * len(head)]
    for r in rows:
        api = "-" if r.get("blocks_per_sm_api") is None else str(r["blocks_per_sm_api"])
        lines.append(f"{r['kernel'][:max_name]:<{max_name}}{r['regs']:>5}{r['static_smem'] + r['dynamic_smem']:>8}"
                     f"{r['local_bytes']:>8}{r['block']:>6}{r['blocks_per_sm']:>10}{100 * r['occupancy']:>9.0f}%"
                     f"{api:>6}  {r['limiter']}")
    return "\n".join(lines)




__all__ = ["SMLimits", "format_occupancy_table", "kernel_attributes", "occupancy", "occupancy_table",
           "theoretical_occupancy"]
