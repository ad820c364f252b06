"""The hooks model and op code wraps its work in: named regions, NVTX ranges (chapter 8's instruments).

Every op of the model sits in ``with region("attn.qkv fwd", flops=..., bytes=...):``. Nothing happens
unless someone listens: a timer made current by ``activate(timer)`` (``llmgpu.perf.profile.OpTimer``)
records CUDA events around each region, or ``set_nvtx(True)`` (or ``LLMGPU_NVTX=1`` in the environment)
pushes an NVTX range per region so an Nsight timeline reads like the model. Otherwise ``region()``
returns one shared no-op context manager: two global reads per call.

This module is the ground floor the model imports; the tools that listen (timers, tables, plots) live
in ``llmgpu.perf`` above it.
"""

from __future__ import annotations

import contextlib
import functools
import os

from . import backend


@functools.cache
def nvtx_module():
    """cupy.cuda.nvtx when importable and usable, else None."""
    cp = backend.cupy_module()
    if cp is None:
        return None
    try:
        from cupy.cuda import nvtx
    except Exception:
        return None
    return nvtx if getattr(nvtx, "available", False) else None


class _Null:
    """The shared no-op context manager of disabled regions (no allocation per call)."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NULL_REGION = _Null()


class _NvtxRange:
    __slots__ = ("name", "mod")

    def __init__(self, name, mod):
        self.name, self.mod = name, mod

    def __enter__(self):
        self.mod.RangePush(self.name)
        return self

    def __exit__(self, *exc):
        self.mod.RangePop()
        return False


def nvtx_range(name: str):
    """Context manager: an NVTX range named ``name`` (push on enter, pop on exit); no-op without CuPy/NVTX."""
    mod = nvtx_module()
    return NULL_REGION if mod is None else _NvtxRange(str(name), mod)


_NVTX_ON = os.environ.get("LLMGPU_NVTX", "0") not in ("", "0")  # LLMGPU_NVTX=1: NVTX ranges from the start
_ACTIVE = None  # the OpTimer that module-level region() reports to


def set_nvtx(enabled: bool = True) -> bool:
    """Make module-level ``region()`` push NVTX ranges even when no timer is active; returns the old value."""
    global _NVTX_ON
    old, _NVTX_ON = _NVTX_ON, bool(enabled)
    return old


def region(name: str, *, bytes=None, flops=None):  # noqa: A002 - 'bytes' reads best at the call sites
    """The hook model code wraps layers and ops in: ``with region("attn.fwd", flops=f): ...``.

    Reports to the timer made current by ``activate(timer)``; without one, an NVTX range when
    ``set_nvtx(True)`` was called, else a shared no-op (two global reads per call).
    """
    t = _ACTIVE
    if t is not None:
        return t.region(name, bytes=bytes, flops=flops)
    if _NVTX_ON:
        return nvtx_range(name)
    return NULL_REGION


@contextlib.contextmanager
def activate(timer):
    """Make ``timer`` the target of module-level ``region()`` calls inside the block."""
    global _ACTIVE
    prev, _ACTIVE = _ACTIVE, timer
    try:
        yield timer
    finally:
        _ACTIVE = prev


def active_timer():
    return _ACTIVE




__all__ = ["NULL_REGION", "activate", "active_timer", "nvtx_module", "nvtx_range", "region", "set_nvtx"]
