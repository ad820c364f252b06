"""Compile every ``.cu`` file for sm_80 and sm_90 without a GPU, and fail on errors or spills.

NVRTC needs no driver, so CI (which has no GPU) builds each kernel exactly as the loader would at
run time (same source, same name expressions, same flags) plus ``-Xptxas -v``, and reads ptxas'
resource report. A spill (registers pushed to local memory) fails the check: it means a kernel
silently runs slower than its design. Stack frames are reported, since a nonzero frame usually means
a register array indexed at run time.

    python -m llmgpu.kernels.compile_check            # every file, sm_80 and sm_90
    python -m llmgpu.kernels.compile_check gemm -a sm_90 -v
    python -m llmgpu.kernels.compile_check dev/cuda/layernorm_forward_fast.cu   # a .cu file anywhere

A path ending in ``.cu`` is compiled the same way (its own ``// llmgpu:kernel`` lines, the package's
flags and include path), so experiments outside the package (``dev/cuda``) are checked like it. A file with
an ``// llmgpu:arch`` line (Hopper's ``sm_90a``) is compiled for that target only, whatever ``-a`` says.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import loader

DEFAULT_ARCHS = ("sm_80", "sm_90")
_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class KernelReport:
    file: str
    arch: str
    mangled: str
    expression: str = ""
    registers: int = 0
    stack_bytes: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    smem_bytes: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


@dataclass
class FileReport:
    file: str
    arch: str
    ok: bool
    log: str
    expressions: list[str] = field(default_factory=list)
    kernels: list[KernelReport] = field(default_factory=list)


def _nvrtc():
    try:
        from cupy.cuda import nvrtc
    except ImportError as e:
        raise SystemExit(
            f"the compile check needs CuPy's NVRTC bindings ({e}); {loader.backend.INSTALL_HINT}"
        ) from e
    return nvrtc


def compile_file(name: str, arch: str) -> FileReport:
    """Compile the package's ``<name>.cu`` for ``arch`` with NVRTC and parse ptxas' report."""
    return compile_source(loader.source(name), name, loader.name_expressions(name), arch)


def compile_path(path, arch: str) -> FileReport:
    """Compile a ``.cu`` file anywhere (e.g. dev/cuda) as the package's are, with its own declarations."""
    path = Path(path)
    text = path.read_text()
    exprs = loader.expressions_in(text)
    if not exprs:
        raise ValueError(f"{path} declares no kernels (add '// llmgpu:kernel <expr>' lines)")
    return compile_source(text, path.stem, exprs, arch, include_dirs=(path.parent,))  # its own headers too


def compile_source(text: str, name: str, exprs: list[str], arch: str, include_dirs=()) -> FileReport:
    """Compile CUDA source ``text`` (reported as ``<name>.cu``) with the name expressions ``exprs`` (and
    ``include_dirs`` searched for headers before the package's)."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(text, f"{name}.cu", [], [])
    try:
        for e in exprs:
            nvrtc.addNameExpression(prog, e)
        opts = [f"-I{d}" for d in include_dirs] + list(loader.compile_options()) + [f"-arch={arch}", "-Xptxas", "-v"]
        try:
            nvrtc.compileProgram(prog, opts)
            ok = True
        except nvrtc.NVRTCError:
            ok = False
        log = nvrtc.getProgramLog(prog)
        lowered = {}
        if ok:
            lowered = {nvrtc.getLoweredName(prog, e): e for e in exprs}
    finally:
        nvrtc.destroyProgram(prog)
    report = FileReport(file=name, arch=arch, ok=ok, log=log, expressions=list(exprs))
    current = None
    for line in log.splitlines():
        if m := _FUNC.search(line):
            current = KernelReport(file=name, arch=arch, mangled=m.group(1), expression=lowered.get(m.group(1), ""))
            report.kernels.append(current)
        elif current is not None and (m := _PROPS.search(line)):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _REGS.search(line)):
            current.registers = int(m.group(1))
            if s := _SMEM.search(line):
                current.smem_bytes = int(s.group(1))
    # keep only the kernels we asked for (device functions may show up too)
    report.kernels = [k for k in report.kernels if k.expression]
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="kernel files (without .cu) or paths to .cu files; default: all")
    ap.add_argument("-a", "--arch", action="append", help="target, e.g. sm_90 (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every kernel's resources")
    args = ap.parse_args(argv)
    files = args.files or loader.available()
    archs = args.arch or list(DEFAULT_ARCHS)
    failures = 0
    n_kernels = n_builds = 0
    for name in files:
        text = Path(name).read_text() if name.endswith(".cu") else loader.source(name)
        own = loader.arch_in(text)
        for arch in [own] if own else archs:
            n_builds += 1
            r = compile_path(name, arch) if name.endswith(".cu") else compile_file(name, arch)
            label = r.file
            if not r.ok:
                failures += 1
                print(f"FAIL {label}.cu [{arch}]: compile error\n{r.log}")
                continue
            spilled = [k for k in r.kernels if k.spills]
            missing = set(r.expressions) - {k.expression for k in r.kernels}
            n_kernels += len(r.kernels)
            status = "ok  "
            if spilled or missing:
                failures += 1
                status = "FAIL"
            print(f"{status} {label}.cu [{arch}]: {len(r.kernels)} kernels")
            for k in r.kernels:
                flag = " SPILL" if k.spills else (" (stack frame)" if k.stack_bytes else "")
                if args.verbose or k.spills or k.stack_bytes:
                    print(
                        f"       {k.expression:<48} {k.registers:3d} regs {k.smem_bytes:6d} B smem "
                        f"{k.stack_bytes:4d} B stack {k.spill_stores}/{k.spill_loads} B spill{flag}"
                    )
            for e in sorted(missing):
                print(f"       {e}: declared but no kernel compiled")
    print(f"compile check: {len(files)} files, {n_builds} builds ({', '.join(archs)}; a file with its own "
          f"// llmgpu:arch: that one), {n_kernels} kernels, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
