"""LayerNorm writing FP8 (chapter 5b, issue 37): a block's residual add + LayerNorm with its output written as
E4M3 bytes, for the LayerNorms whose output only FP8 GEMMs read (ln_1 before QKV, ln_2 before MLP-in).

Under delayed scaling the scale of a LayerNorm's output is known before the LayerNorm runs, so the kernel that
computes the output can quantize it, record its amax and never write it in bf16. The weight gradient also needs
the transposed bytes, which a byte transpose makes. Per element of the output, beyond reading a, b and writing the
residual stream s::

    before     s, y = add_layernorm(a, b)          y8, y8ᵀ = fp8_cast(y)      write 2, read 2, write 1 + 1: 6 bytes
    here       s, y8 = fp8_add_layernorm(a, b)     y8ᵀ = fp8_transpose(y8)    write 1, read 1, write 1:     3 bytes

The bytes come from the fp32 LayerNorm value, not from a bf16 rounding of it (one rounding instead of two), so
they can differ from the unfused pair's by one code; mean, rstd and s are ``add_layernorm_forward``'s bits (the
kernels share ``kernels/layernorm.cuh``). Rows the vectorized kernel cannot take (C not a multiple of the 16-byte
pack, unaligned inputs, rows over 8 packs per lane) run as an add, an fp32 LayerNorm and ``fp8_cast``.
"""

from __future__ import annotations

import numpy as np

from ..checks import array_module, check_alias, check_array, check_float, check_out, check_same_dtype, overlaps
from ..kernels import get_kernel
from ..kernels.launch import elements_aligned
from .fp8 import (
    ACT_DTYPES,
    BYTES,
    THREADS,
    TILE,
    Fp8Tensor,
    bytes_out,
    check_scalar,
    check_scale_outputs,
    fp8_amax,
    fp8_cast,
    fp8_format,
    optional_arg,
    quantize_reference,
)
from .layernorm import (
    ADD_WARPS,
    add_layernorm_forward_reference,
    check_gpu_rows,
    layernorm_forward,
    rows_of,
    vector_plan,
)

FORMAT = fp8_format("e4m3")  # a LayerNorm's output is an activation


def fp8_transpose(bits, out=None):
    """The transposed bytes of FP8 bytes ``bits [R, C]`` (uint8): ``[C, R]``, into ``out`` when given."""
    xp = array_module(bits=bits, out=out)
    check_array("bits", bits, dtype=BYTES, dtypes=None)
    if bits.ndim != 2:
        raise ValueError(f"bits must be 2-D [R, C], got shape {tuple(bits.shape)}")
    R, C = bits.shape
    yt = bytes_out("out", out, (C, R), xp)
    if overlaps(yt, bits):
        raise ValueError("out overlaps bits: the transpose needs a buffer of its own")
    if xp is np:
        yt[...] = bits.T
        return yt
    grid = (-(-R // TILE), -(-C // TILE))
    if grid[1] > 65535:
        raise ValueError(f"fp8_transpose takes at most {65535 * TILE} columns, got {C}")
    vec = 4 if (C % 4 == 0 and R % 4 == 0 and elements_aligned(4, bits, yt)) else 1
    if R and C:
        get_kernel("fp8", "fp8_transpose_kernel", vec)(grid, (THREADS,), (bits, yt, np.int64(R), np.int64(C)))
    return yt


def fp8_add_layernorm(a, b, gamma, beta, scale, eps=1e-5, *, residual_out=None, transpose=False, amax=None,
                      accumulate_amax=False, scale_inv=None):
    """Residual add and LayerNorm with the output as E4M3 bytes: ``(s, Fp8Tensor, mean, rstd)``.

    ``s = a + b`` (rounded to a's dtype; into ``residual_out`` when given, which may be ``a`` or ``b``), the
    LayerNorm of s in fp32 (``gamma``, ``beta`` [C]) cast with ``scale`` (fp32 [1] on the device) into the
    tensor's ``data`` [..., C] and, with ``transpose``, its ``data_t`` [C, R]. ``amax``: fp32 [1] that receives
    max |LN(s)| (overwritten, or raised with ``accumulate_amax``); ``scale_inv``: fp32 [1] that receives 1/scale
    (new when None). ``a``, ``b``, ``gamma``, ``beta``: float32 or bfloat16, one dtype.
    """
    xp = array_module(a=a, b=b, gamma=gamma, beta=beta, scale=scale, residual_out=residual_out, amax=amax,
                      scale_inv=scale_inv)
    check_array("a", a, dtypes=ACT_DTYPES)
    n_rows, c = rows_of(a, "a")
    check_array("b", b, shape=tuple(a.shape))
    check_array("gamma", gamma, shape=(c,))
    check_array("beta", beta, shape=(c,))
    check_same_dtype(a=a, b=b, gamma=gamma, beta=beta)
    check_scalar("scale", scale, xp)
    eps = check_float("eps", eps, low=0.0)
    if residual_out is not None:
        check_out(residual_out, a.shape, a.dtype, xp, name="residual_out")
    check_alias("residual_out", residual_out, "a", a)
    check_alias("residual_out", residual_out, "b", b)
    scale_inv = check_scale_outputs(amax, accumulate_amax, scale_inv, xp)
    for name, arr in (("amax", amax), ("scale_inv", scale_inv)):
        if any(overlaps(arr, other) for other in (scale, a, b, gamma, beta, residual_out)):
            raise ValueError(f"{name} overlaps an input or s: the kernel reads those while it writes {name}")
    lead = tuple(a.shape[:-1])

    if xp is np:
        s, y, mean, rstd = add_layernorm_forward_reference(a.reshape(n_rows, c), b.reshape(n_rows, c), gamma, beta,
                                                           eps, rounded=False)
        y = y.astype(np.float32)
        s = s.reshape(a.shape)
        if residual_out is not None:
            residual_out[...] = s
            s = residual_out
        if amax is not None:
            fp8_amax(y, amax, accumulate=accumulate_amax)
        q = quantize_reference(y, scale[0], FORMAT)
        scale_inv[0] = np.float32(1.0) / scale[0]
        data_t = np.ascontiguousarray(q.T) if transpose else None
        return s, Fp8Tensor(q.reshape(a.shape), data_t, scale_inv, FORMAT), mean.reshape(lead), rstd.reshape(lead)

    check_gpu_rows(a, n_rows, c, name="a")
    s = xp.empty(a.shape, dtype=a.dtype) if residual_out is None else residual_out
    vec, packs = vector_plan(c, a.dtype, (a, b, s, gamma, beta))
    if not (vec and packs > 0):  # the unfused form: add, an fp32 LayerNorm, the cast (the module docstring)
        s[...] = a.astype(np.float32, copy=False) + b.astype(np.float32, copy=False)
        f32 = lambda t: t.astype(np.float32, copy=False)  # noqa: E731
        y, mean, rstd = layernorm_forward(f32(s), f32(gamma), f32(beta), eps)
        y8 = fp8_cast(y, scale, FORMAT, transpose=transpose, amax=amax, accumulate_amax=accumulate_amax,
                      scale_inv=scale_inv)
        return s, y8, mean, rstd
    if amax is not None and not accumulate_amax:
        amax.fill(0)
    y = xp.empty(a.shape, dtype=BYTES)
    mean = xp.empty(lead, dtype=np.float32)
    rstd = xp.empty(lead, dtype=np.float32)
    kern = get_kernel("fp8", "fp8_add_layernorm_kernel", a.dtype, packs, FORMAT.c_name)
    kern((-(-n_rows // ADD_WARPS),), (32 * ADD_WARPS,),
         (a, b, gamma, beta, s, y, mean, rstd, np.int32(n_rows), np.int32(c), np.float32(eps), scale, scale_inv,
          optional_arg(amax)))
    data_t = fp8_transpose(y.reshape(n_rows, c)) if transpose else None
    return s, Fp8Tensor(y, data_t, scale_inv, FORMAT), mean, rstd


__all__ = ["FORMAT", "fp8_add_layernorm", "fp8_transpose"]
