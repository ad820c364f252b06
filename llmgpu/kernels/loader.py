"""Compile the package's CUDA C sources with CuPy and hand out their kernels.

Each ``llmgpu/kernels/<name>.cu`` file is one small module (one layer, one concept). Its kernels are
usually templated on the element type, and the file itself lists the instantiations the package
uses, one directive per line::

    // llmgpu:kernel vector_add<{float,__half,__nv_bfloat16}>

Braces expand (every combination), so that line declares three name expressions. The loader
compiles the whole file once with exactly those expressions (NVRTC, through ``cupy.RawModule`` with
``name_expressions``), caches the module per device, and returns ``RawKernel`` objects. The same list
drives the GPU-free compile check (``python -m llmgpu.kernels.compile_check``), so what CI compiles
is what runs.

A file that uses instructions of one architecture only (Hopper's ``wgmma`` exists on the arch-specific
target ``sm_90a``, not ``sm_90``) says so with ``// llmgpu:arch sm_90a``: it is compiled for that target
alone (CuPy's ``RawModule`` would pick the device's generic ``sm_90``), and only on a GPU of that
architecture (``arch_unsupported``).

A number that a kernel and its host code both rely on (a block size the kernel assumes, a flag bit, a tile
shape) is written once, in the ``.cu``, as ``#define NAME <number>`` or a file-scope
``constexpr int NAME = <number>;``, and the host reads it from there (``constants``, ``constant``) instead of
typing it again. Numbers that C computes (template structs such as ``fa_cfg<HD>``) stay in C; the Python
that mirrors them is checked against the compiler (``tests/test_kernel_constants.py``).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from .. import backend

KERNEL_DIR = Path(__file__).resolve().parent
_DIRECTIVE = re.compile(r"^\s*//\s*llmgpu:kernel\s+(.+?)\s*$", re.MULTILINE)
_ARCH = re.compile(r"^\s*//\s*llmgpu:arch\s+(sm_\d+a?)\s*$", re.MULTILINE)
_BRACES = re.compile(r"\{([^{}]*)\}")
# `#define NAME 256`, `#define NAME 1e-6f`, `constexpr int NAME = 3;` (file scope: the line starts with it)
_CONSTANT = re.compile(r"^(?:#define\s+(\w+)\s+|constexpr\s+(?:unsigned\s+)?(?:int|long|float|double)\s+(\w+)\s*=\s*)"
                       r"(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)([uUlLfF]*)\s*;?\s*(?://.*)?$", re.MULTILINE)

# Why these flags: C++17 for `if constexpr`; -I so that .cu files can include common.cuh;
# no --use_fast_math: every kernel decides for itself where an approximate intrinsic is fine.
BASE_OPTIONS = ("-std=c++17",)


def available() -> list[str]:
    """Names of all kernel source files (without .cu)."""
    return sorted(p.stem for p in KERNEL_DIR.glob("*.cu"))


def source_path(name: str) -> Path:
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise FileNotFoundError(f"no kernel source {name}.cu in {KERNEL_DIR}; available: {available()}")
    return path


def source(name: str) -> str:
    """The full CUDA C source of ``<name>.cu``."""
    return source_path(name).read_text()


def _expand(expr: str) -> list[str]:
    parts = _BRACES.split(expr)  # literal, group, literal, group, ...
    literals, groups = parts[0::2], [[s.strip() for s in g.split(",")] for g in parts[1::2]]
    out = []
    for combo in itertools.product(*groups):
        pieces = [literals[0]]
        for value, lit in zip(combo, literals[1:]):
            pieces += [value, lit]
        out.append("".join(pieces))
    return out


def expressions_in(text: str) -> list[str]:
    """The kernel instantiations a CUDA source declares with ``// llmgpu:kernel`` lines, expanded."""
    exprs = []
    for line in _DIRECTIVE.findall(text):
        exprs += _expand(line)
    return exprs


def name_expressions(name: str) -> list[str]:
    """The kernel instantiations that ``<name>.cu`` declares with ``// llmgpu:kernel`` lines."""
    exprs = expressions_in(source(name))
    if not exprs:
        raise ValueError(f"{name}.cu declares no kernels (add '// llmgpu:kernel <expr>' lines)")
    return exprs


def constants_in(text: str) -> dict:
    """The numbers a CUDA source defines at file scope: ``{NAME: int or float}`` from its ``#define NAME <number>``
    and ``constexpr <int|float ...> NAME = <number>;`` lines (a literal with a point, an exponent or an ``f``
    suffix is a float). Macros with other bodies (expressions, bit patterns) are not numbers and are left out."""
    out = {}
    for define, const, number, suffix in _CONSTANT.findall(text):
        is_float = any(c in number for c in ".eE") or "f" in suffix.lower()
        out[define or const] = float(number) if is_float else int(number)
    return out


@functools.cache
def _constants(name: str) -> dict:
    return constants_in(source(name))


def constants(name: str) -> dict:
    """The numbers ``<name>.cu`` defines (``constants_in``); what host code reads instead of retyping them."""
    return dict(_constants(name))


def constant(name: str, key: str):
    """The number ``<name>.cu`` defines as ``key`` (``#define key <number>`` or ``constexpr ... key = <number>;``)."""
    found = _constants(name)
    if key not in found:
        raise KeyError(f"{name}.cu defines no number {key} (as '#define {key} <number>' or 'constexpr int {key} = "
                       f"<number>;'); it defines {sorted(found)}")
    return found[key]


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_bf16.h when CUDA comes from pip wheels.

    With a full CUDA toolkit CuPy finds the headers itself; with pip-installed CUDA
    (``nvidia-cuda-runtime``) they live in site-packages, which NVRTC does not search.
    """
    dirs = []
    for root in sys.path:
        for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include"):
            d = Path(root) / sub
            if (d / "cuda_bf16.h").is_file():
                dirs.append(str(d))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            d = Path(os.environ[env]) / "include"
            if (d / "cuda_bf16.h").is_file():
                dirs.append(str(d))
    d = Path("/usr/local/cuda/include")
    if (d / "cuda_bf16.h").is_file():
        dirs.append(str(d))
    return list(dict.fromkeys(dirs))


def compile_options() -> tuple[str, ...]:
    return BASE_OPTIONS + (f"-I{KERNEL_DIR}",) + tuple(f"-I{d}" for d in cuda_include_dirs())


def arch_in(text: str) -> str | None:
    """The one target a CUDA source is built for (its ``// llmgpu:arch`` line), or None: any GPU's own."""
    m = _ARCH.search(text)
    return m.group(1) if m else None


def required_arch(name: str) -> str | None:
    """The one target ``<name>.cu`` is built for, or None (see the module docstring)."""
    return arch_in(source(name))


def arch_unsupported(name: str, device_id: int | None = None) -> str | None:
    """Why ``<name>.cu`` cannot run on the current GPU (None when it can, or when it runs on any GPU)."""
    cp = backend.require_gpu()
    return _arch_unsupported(name, cp.cuda.Device().id if device_id is None else device_id)


@functools.cache
def _arch_unsupported(name: str, device_id: int) -> str | None:  # asked on every launch: read the file once
    arch = required_arch(name)
    if arch is None:
        return None
    have = "sm_" + backend.require_gpu().cuda.Device(device_id).compute_capability
    if have != arch.rstrip("a"):
        return f"{name}.cu is built for {arch} only; this GPU is {have}"
    return None


def compile_for_arch(text: str, filename: str, exprs, arch: str, include_dirs=()) -> dict:
    """{name expression: cupy.RawKernel} of CUDA source ``text`` compiled with NVRTC for ``arch`` exactly (e.g.
    sm_90a), the package's flags and ``include_dirs`` searched first; loaded on the current device. The cubin is
    kept in CuPy's kernel cache directory, keyed by everything that goes into it, as RawModule keeps its own."""
    cp = backend.require_gpu()
    from cupy.cuda import nvrtc

    exprs = list(exprs)
    options = [f"-I{d}" for d in include_dirs] + [*compile_options(), f"-arch={arch}"]
    headers = sorted(h for d in (*include_dirs, KERNEL_DIR) for h in Path(d).glob("*.cuh"))
    key = hashlib.sha256("\0".join([text, *options, *exprs, str(nvrtc.getVersion())]).encode())
    for h in headers:
        key.update(h.read_bytes())
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cubin_path = cache / f"llmgpu_{Path(filename).stem}_{arch}_{key.hexdigest()[:24]}.cubin"
    names_path = cubin_path.with_suffix(".json")
    if not (cubin_path.is_file() and names_path.is_file()):
        prog = nvrtc.createProgram(text, filename, [], [])
        try:
            for e in exprs:
                nvrtc.addNameExpression(prog, e)
            try:
                nvrtc.compileProgram(prog, options)
            except nvrtc.NVRTCError:
                raise RuntimeError(f"{filename} does not compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from None
            names = {e: nvrtc.getLoweredName(prog, e) for e in exprs}
            cubin = nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
        cache.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_path, cubin), (names_path, json.dumps(names).encode())):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # another process may write the same file
            tmp.write_bytes(data)
            os.replace(tmp, path)
    names = json.loads(names_path.read_text())
    mod = cp.RawModule(path=str(cubin_path))  # RawModule loads a cubin from a file (documented API)
    return {e: mod.get_function(names[e]) for e in exprs}


class _ArchModule:
    """The kernels of an arch-specific file, with RawModule's ``get_function(name expression)``."""

    def __init__(self, kernels: dict):
        self._kernels = kernels

    def get_function(self, expr: str):
        return self._kernels[expr]


@functools.cache
def _module(name: str, device_id: int):
    cp = backend.require_gpu()
    arch = required_arch(name)
    if arch is not None:
        why = arch_unsupported(name, device_id)
        if why:
            raise RuntimeError(why)
        return _ArchModule(compile_for_arch(source(name), f"{name}.cu", name_expressions(name), arch))
    return cp.RawModule(
        code=source(name),
        options=compile_options(),
        name_expressions=name_expressions(name),
    )


def load(name: str):
    """The compiled ``cupy.RawModule`` of ``<name>.cu`` for the current device (cached)."""
    cp = backend.require_gpu()
    return _module(name, cp.cuda.Device().id)


def template_args(*args) -> str:
    """Spell template arguments: dtypes become C types (float, __half, ...), others str()."""
    spelled = []
    for a in args:
        if isinstance(a, (int, np.integer)) and not isinstance(a, bool):
            spelled.append(str(a))
        elif isinstance(a, str) and not _looks_like_dtype(a):
            spelled.append(a)
        else:
            spelled.append(backend.cuda_c_type(a))
    return ", ".join(spelled)


def _looks_like_dtype(s: str) -> bool:
    try:
        backend.resolve_dtype(s)
        return True
    except (ValueError, TypeError):
        return False


@functools.cache
def _kernel(name: str, expr: str, device_id: int):
    declared = name_expressions(name)
    if expr not in declared:
        raise KeyError(f"{name}.cu does not instantiate {expr!r}; it declares {declared}")
    return _module(name, device_id).get_function(expr)


def get_kernel(name: str, function: str, *targs):
    """The RawKernel ``function<targs...>`` from ``<name>.cu``, e.g.

    ``get_kernel("vector_add", "vector_add", np.float32)`` → ``vector_add<float>``.
    """
    cp = backend.require_gpu()
    expr = f"{function}<{template_args(*targs)}>" if targs else function
    return _kernel(name, expr, cp.cuda.Device().id)


# --------------------------------------------------------------------------- showing source


def kernel_source(name: str, function: str | None = None) -> str:
    """Source of one ``__global__`` function (with the comment block above it), or the whole file."""
    text = source(name)
    if function is None:
        return text
    m = re.search(r"__global__[^;{]*?\b" + re.escape(function) + r"\s*\(", text)
    if m is None:
        raise KeyError(f"no __global__ function {function!r} in {name}.cu")
    # start: back up over `template <...>` / `extern "C"` / attribute lines and the comment above
    lines = text[: m.start()].split("\n")
    start_line = len(lines) - 1
    while start_line > 0:
        prev = lines[start_line - 1].strip()
        if prev.startswith(("//", "template", "extern", "__launch_bounds__", "/*", "*")) and not prev.startswith(
            "// llmgpu:"
        ):
            start_line -= 1
        else:
            break
    start = sum(len(s) + 1 for s in lines[:start_line])
    # end: the matching brace of the function body
    depth, i = 0, text.index("{", m.end())
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start : j + 1]
    raise ValueError(f"unbalanced braces in {name}.cu")


def show_source(name: str, function: str | None = None):
    """Display a kernel's CUDA source with syntax highlighting in a notebook (plain text elsewhere)."""
    text = kernel_source(name, function)
    try:
        from IPython.display import Code
    except ImportError:
        return text
    return Code(text, language="cuda")
