"""Compile the kernels for an AMD GPU with HIP, without a GPU: which ones are portable, which NVIDIA-only.

    python tools/checks/hip_compile_check.py                 # every kernel file, gfx90a (MI200)
    python tools/checks/hip_compile_check.py cast gelu -v    # some files, with the compiler's messages
    python tools/checks/hip_compile_check.py --arch gfx942   # another target

Needs ``hipcc`` (Debian/Ubuntu: ``apt-get install hipcc``, ROCm 5.2 in Debian 12) and no GPU. Each
``llmgpu/kernels/<name>.cu`` is compiled as HIP for the device only (``hipcc -x hip --cuda-device-only
--offload-arch=gfx90a -std=c++17``), with ``tools/checks/hip/`` first on the include path (stand-ins for
``cuda_fp16.h`` and ``cuda_bf16.h``) and ``tools/checks/hip/hip_compat.h`` force-included (CUDA's ``*_sync``
warp shuffles as HIP shuffles of width 32). Every ``// llmgpu:kernel`` instantiation is referenced, so
each template is compiled exactly as the loader would ask for it at run time. CuPy's ROCm build compiles
the same sources at run time with hiprtc.

What this shows and what it does not: a file that compiles here is free of CUDA-only syntax,
intrinsics and inline PTX for this target. It has not run: nothing here checks results on an AMD GPU, nor
speed (the kernels are tuned for NVIDIA's 32-lane warps, and a gfx90a wavefront has 64 lanes).

``NVIDIA_ONLY`` lists the files that do not compile, with the reason. The check fails (exit 1) when a
file outside it does not compile, and also when a file in it starts compiling (then the list is out of
date); exit 2 when there is no hipcc.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmgpu.kernels import loader  # noqa: E402

COMPAT = Path(__file__).resolve().parent / "hip"
DEFAULT_ARCH = "gfx90a"

# file -> why it does not compile for an AMD GPU (the NVIDIA-only fast paths)
NVIDIA_ONLY = {
    "embedding": "warp match and cache-hinted loads: __match_any_sync (the counting backward groups equal "
                 "token ids of a warp) and __ldcg have no HIP 5.2 counterpart",
    "flash_attention": "inline PTX mma.sync (m16n8k16 tensor-core MMAs, sm_80+): a HIP build would need AMD's "
                       "MFMA intrinsics and a 64-lane fragment layout instead",
    "flash_attention_wgmma": "Hopper's warpgroup MMAs (wgmma: inline PTX for sm_90a, NVIDIA Hopper GPUs "
                             "only)",
    "fp8": "cuda_fp8.h's OCP FP8 conversions (cvt.rn.satfinite.e4m3x2/e5m2x2 on sm_89+): ROCm 5.2 has no FP8 "
           "header, and AMD's MI300 FP8 types are the FNUZ variants (another NaN, another bias)",
    "spin": "inline PTX (%globaltimer) and __nanosleep: a timing tool for NVIDIA GPUs",
}
_ERROR = re.compile(r"error: (.*)")


def hipcc() -> str | None:
    return shutil.which("hipcc")


def translation_unit(name: str) -> str:
    """The file's source followed by a reference to every kernel instantiation it declares."""
    exprs = loader.name_expressions(name)
    refs = ",\n    ".join(f"(const void*)&{e}" for e in exprs)
    return (f'#include "{name}.cu"\n\n// every // llmgpu:kernel instantiation, as the loader asks for them\n'
            f"static const void* llmgpu_hip_refs[] = {{\n    {refs}\n}};\n")


def compile_file(name: str, arch: str = DEFAULT_ARCH, compiler: str | None = None) -> tuple[bool, str, float]:
    """(compiled, compiler output, seconds) for ``llmgpu/kernels/<name>.cu``."""
    compiler = compiler or hipcc()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{name}_hip.cpp"
        src.write_text(translation_unit(name))
        cmd = [compiler, "-x", "hip", "--cuda-device-only", f"--offload-arch={arch}", "-std=c++17",
               f"-I{COMPAT}", f"-I{loader.KERNEL_DIR}", "-include", str(COMPAT / "hip_compat.h"),
               "-c", str(src), "-o", str(Path(tmp) / f"{name}.o")]
        # HIP_PLATFORM=amd: with a CUDA toolkit on the machine, hipcc would otherwise hand the file to nvcc
        env = {**os.environ, "HIP_PLATFORM": "amd"}
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        return r.returncode == 0, r.stdout + r.stderr, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="kernel files (without .cu); default: all")
    ap.add_argument("--arch", default=DEFAULT_ARCH, help=f"AMD GPU target (default {DEFAULT_ARCH})")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="files compiled at once")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the compiler's messages")
    args = ap.parse_args(argv)
    compiler = hipcc()
    if compiler is None:
        print("hip_compile_check: no hipcc on PATH (Debian/Ubuntu: apt-get install hipcc)", file=sys.stderr)
        return 2
    files = args.files or loader.available()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda f: compile_file(f, args.arch, compiler), files))
    bad = 0
    for name, (ok, log, secs) in zip(files, results):
        errors = _ERROR.findall(log)
        if ok and name not in NVIDIA_ONLY:
            print(f"ok      {name}.cu [{args.arch}]: {len(loader.name_expressions(name))} kernels ({secs:.1f} s)")
        elif ok:
            bad += 1
            print(f"STALE   {name}.cu [{args.arch}] compiles now: take it out of NVIDIA_ONLY in {Path(__file__).name}")
        elif name in NVIDIA_ONLY:
            print(f"nvidia  {name}.cu: {NVIDIA_ONLY[name]} (first error: {errors[0] if errors else '?'})")
        else:
            bad += 1
            print(f"FAIL    {name}.cu [{args.arch}]: {errors[0] if errors else log.strip()[-300:]}")
        if args.verbose and log.strip():
            print("    " + log.strip().replace("\n", "\n    "))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
