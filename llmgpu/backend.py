"""NumPy or CuPy: which array library runs the code, and what the GPU is.

Every op in llmgpu has two implementations that share one signature: a NumPy reference (the math of
the chapter) and a CUDA path (our kernels through CuPy). The array type picks the path, the way
CuPy's own ``cupy.get_array_module`` does: CuPy arrays in, CUDA kernels run; NumPy arrays in, the
reference runs. ``LLMGPU_DEVICE=cpu|gpu`` forces the default array library for new arrays.

CuPy is optional and imported lazily, so ``import llmgpu`` works on a laptop without CUDA.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np

INSTALL_HINT = (
    "install CuPy with the extra that matches your driver: "
    "pip install 'llmgpu[cuda13]' (CUDA 13 driver) or 'llmgpu[cuda12]' (CUDA 12 driver)"
)

# bfloat16 is not a NumPy dtype; ml_dtypes provides it, and CuPy 14 uses the same type.
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

_DTYPE_NAMES = {
    "fp32": float32, "float32": float32, "f32": float32,
    "fp16": float16, "float16": float16, "f16": float16, "half": float16,
    "bf16": bfloat16, "bfloat16": bfloat16,
    "fp64": float64, "float64": float64, "f64": float64,
}


class GPUUnavailableError(RuntimeError):
    """Asked for the GPU path where no usable GPU (or no CuPy) is present."""


# --------------------------------------------------------------------------- CuPy, lazily


@functools.cache
def _probe_cupy():
    """Import CuPy and count devices once. Returns (module or None, reason-if-unusable)."""
    try:
        import cupy
    except ImportError:
        return None, f"CuPy is not installed; {INSTALL_HINT}"
    except Exception as e:  # a broken CUDA install raises all sorts of things on import
        return None, f"CuPy failed to import ({type(e).__name__}: {e}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return cupy, _no_device_reason(cupy, e)
    if n == 0:
        return cupy, "CuPy is installed but no CUDA device was found"
    return cupy, None


def _no_device_reason(cupy, error) -> str:
    """Why CuPy sees no device, in words that fit the machine. Without any NVIDIA driver CUDA's runtime says
    'driver version is insufficient', which reads like an old driver; ``cudaDriverGetVersion`` is 0 exactly when
    no driver is installed, so that case says what it is."""
    try:
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception:
        driver = None
    if driver == 0:
        return "no NVIDIA GPU/driver found (CuPy is installed, but this machine has no NVIDIA driver)"
    if "NoDevice" in str(error) or "no CUDA-capable device" in str(error):
        return "no NVIDIA GPU found (the NVIDIA driver is installed but sees no GPU; check CUDA_VISIBLE_DEVICES)"
    return f"CuPy is installed but no CUDA device is usable ({type(error).__name__}: {error})"


def cupy_module():
    """The imported CuPy module, or None when it is not installed (a GPU may still be missing)."""
    return _probe_cupy()[0]


def gpu_unavailable_reason() -> str | None:
    """None when a GPU is usable; otherwise one line saying why not (and what to install)."""
    return _probe_cupy()[1]


def gpu_available() -> bool:
    return gpu_unavailable_reason() is None


class DeviceSettingError(ValueError):
    """LLMGPU_DEVICE holds something other than cpu, gpu or auto (the CLI prints it as one line)."""


def requested_device() -> str:
    """'cpu', 'gpu' or 'auto', from LLMGPU_DEVICE (unset or empty: 'auto'); DeviceSettingError otherwise."""
    value = os.environ.get("LLMGPU_DEVICE", "auto").strip().lower() or "auto"
    if value not in ("cpu", "gpu", "auto"):
        raise DeviceSettingError(f"the environment variable LLMGPU_DEVICE must be 'cpu', 'gpu' or 'auto' "
                                 f"(or unset), not {os.environ.get('LLMGPU_DEVICE')!r}")
    return value


_warned_fallback = False


def default_xp():
    """The array library new arrays are made with: CuPy on a usable GPU, else NumPy.

    LLMGPU_DEVICE=cpu forces NumPy; LLMGPU_DEVICE=gpu raises when no GPU is usable instead of
    falling back. With 'auto', a missing GPU falls back to NumPy with one warning saying why.
    """
    global _warned_fallback
    want = requested_device()
    if want == "cpu":
        return np
    reason = gpu_unavailable_reason()
    if reason is None:
        return cupy_module()
    if want == "gpu":
        raise GPUUnavailableError(f"LLMGPU_DEVICE=gpu but {reason}")
    if not _warned_fallback and cupy_module() is not None:
        # CuPy present but unusable is worth one line; no CuPy at all is the expected CPU set-up.
        warnings.warn(f"llmgpu runs on NumPy: {reason}", stacklevel=2)
        _warned_fallback = True
    return np


def on_gpu() -> bool:
    """True when default_xp() is CuPy."""
    return default_xp() is not np


def require_gpu():
    """Return CuPy, or raise GPUUnavailableError saying what is missing."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise GPUUnavailableError(reason)
    return cupy_module()


def resolve_xp(xp):
    """The array module an ``xp=`` argument names: None (the active backend, ``default_xp``), the ``numpy`` or
    ``cupy`` module, or a device name as ``--device`` and ``TrainConfig(device=)`` take it ('auto', 'cpu',
    'gpu', ``select_xp``); anything else is a TypeError/ValueError saying what is accepted."""
    if xp is None:
        return default_xp()
    if isinstance(xp, str):
        return select_xp(xp)
    if xp is np or xp is cupy_module():
        return xp
    raise TypeError(f"xp must be numpy, cupy, None or one of 'auto', 'cpu', 'gpu', got {type(xp).__name__} {xp!r}")


def select_xp(device: str = "auto"):
    """NumPy or CuPy for a ``--device`` choice: 'cpu', 'gpu' (raises GPUUnavailableError saying why) or
    'auto' (``default_xp`` without its fallback warning: the commands say why in their own words)."""
    device = (device or "auto").lower()
    if device == "cpu":
        return np
    if device == "gpu":
        return require_gpu()
    if device != "auto":
        raise ValueError(f"the device must be auto, cpu or gpu, not {device!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return default_xp()


# --------------------------------------------------------------------------- dispatch


def is_gpu_array(a) -> bool:
    cp = cupy_module()
    return cp is not None and isinstance(a, cp.ndarray)


def get_array_module(*arrays, names=None):
    """NumPy or CuPy for these arrays; refuses a mix of both (that is always a bug).

    ``None`` entries are ignored (optional arguments such as a missing bias). ``names`` labels the
    arguments in the error message.
    """
    kinds = set()
    for a in arrays:
        if a is None:
            continue
        if is_gpu_array(a):
            kinds.add("cupy")
        elif isinstance(a, np.ndarray):
            kinds.add("numpy")
        else:
            kinds.add(type(a).__name__)
    if len(kinds) > 1 or (kinds and not kinds <= {"numpy", "cupy"}):
        labels = names or [f"arg{i}" for i in range(len(arrays))]
        desc = ", ".join(
            f"{n}={'cupy' if is_gpu_array(a) else type(a).__name__}"
            for n, a in zip(labels, arrays)
            if a is not None
        )
        raise TypeError(
            f"arguments must all be NumPy arrays or all CuPy arrays, got {desc}; "
            "move them with llmgpu.backend.to_device / to_numpy first"
        )
    return cupy_module() if kinds == {"cupy"} else np


def to_numpy(a):
    """A NumPy copy of a (or a itself when it already is NumPy)."""
    if is_gpu_array(a):
        return a.get()
    return np.asarray(a)


def to_device(a, xp=None):
    """a as an array of ``xp`` (default: default_xp()); no copy when it already lives there."""
    xp = xp or default_xp()
    if xp is np:
        return to_numpy(a)
    return xp.asarray(a)


def synchronize():
    """Wait for the GPU (no-op on NumPy). Use it before reading a host clock, never inside a step."""
    if gpu_available() and requested_device() != "cpu":
        cupy_module().cuda.get_current_stream().synchronize()


def is_capturing(xp) -> bool:
    """Whether ``xp``'s current stream is recording a CUDA graph (never on NumPy)."""
    if xp is np:
        return False
    try:
        return bool(xp.cuda.get_current_stream().is_capturing())
    except Exception:  # the legacy default stream may refuse the query while another stream captures
        return False


# --------------------------------------------------------------------------- dtypes


def resolve_dtype(dtype) -> np.dtype:
    """np.dtype from 'bf16', 'fp16', 'fp32', np.float32, cupy dtypes, ..."""
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32, fp64")
    return np.dtype(dtype)


def dtype_name(dtype) -> str:
    """Short name: 'fp32', 'fp16', 'bf16', 'fp64'."""
    d = resolve_dtype(dtype)
    return {float32: "fp32", float16: "fp16", bfloat16: "bf16", float64: "fp64"}.get(d, d.name)


# C type of each dtype in our .cu sources; kernels are templated on it.
CUDA_C_TYPES = {float32: "float", float16: "__half", bfloat16: "__nv_bfloat16", float64: "double"}


def cuda_c_type(dtype) -> str:
    d = resolve_dtype(dtype)
    try:
        return CUDA_C_TYPES[d]
    except KeyError:
        raise TypeError(f"no CUDA kernel type for dtype {d}") from None


# --------------------------------------------------------------------------- device facts


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # 'cupy' or 'numpy'
    name: str
    compute_capability: str | None = None  # '9.0'
    sm_count: int | None = None
    memory_bytes: int | None = None
    l2_bytes: int | None = None
    shared_memory_per_block_optin: int | None = None
    clock_mhz: float | None = None
    cuda_runtime: str | None = None
    cupy_version: str | None = None
    pci_bus_id: str | None = None  # '00000000:19:00.0', as nvidia-smi prints it (perf.clocks: its -i)

    def as_dict(self):
        return asdict(self)

    def summary(self) -> str:
        if self.backend == "numpy":
            return f"NumPy backend on the CPU ({self.name})"
        return (
            f"{self.name} (sm_{self.compute_capability.replace('.', '')}, {self.sm_count} SMs, "
            f"{self.memory_bytes / 2**30:.0f} GiB, L2 {self.l2_bytes / 2**20:.0f} MiB; "
            f"CuPy {self.cupy_version}, CUDA runtime {self.cuda_runtime})"
        )


def device_info(xp=None) -> DeviceInfo:
    """Facts about the device that ``xp`` (default: default_xp()) runs on."""
    xp = xp or default_xp()
    if xp is np:
        import platform

        return DeviceInfo(backend="numpy", name=platform.processor() or platform.machine())
    return _gpu_info(xp.cuda.Device().id)


@functools.cache
def _gpu_info(device_id: int) -> DeviceInfo:
    cp = cupy_module()
    dev = cp.cuda.Device(device_id)
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    rt = cp.cuda.runtime.runtimeGetVersion()
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else name
    return DeviceInfo(
        backend="cupy",
        name=name,
        compute_capability=f"{props['major']}.{props['minor']}",
        sm_count=int(props["multiProcessorCount"]),
        memory_bytes=int(props["totalGlobalMem"]),
        l2_bytes=int(props["l2CacheSize"]),
        shared_memory_per_block_optin=int(props.get("sharedMemPerBlockOptin", 0)) or None,
        clock_mhz=props.get("clockRate", 0) / 1000 or None,
        cuda_runtime=f"{rt // 1000}.{(rt % 1000) // 10}",
        cupy_version=cp.__version__,
        pci_bus_id=f"{props.get('pciDomainID', 0):08x}:{props['pciBusID']:02x}:{props['pciDeviceID']:02x}.0"
        if "pciBusID" in props else None,
    )


# --------------------------------------------------------------------------- the NumPy backend's BLAS


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else every core)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def use_cpu(xp, device: str, threads: int | None, note=print):
    """Set up the NumPy backend for a run (nothing when ``xp`` is CuPy): say why it is the CPU when ``device``
    was 'auto' and CuPy is installed (``note``: called with one line), and set NumPy's BLAS threads to
    ``threads`` (``--cpu-threads``; None: 1, 0: the BLAS default), at most ``cpu_cores()``, with a note when
    that caps it (more threads than cores only wait for each other)."""
    if xp is not np:
        return
    if device == "auto" and requested_device() == "auto" and cupy_module() is not None:  # not LLMGPU_DEVICE=cpu
        # CuPy installed but no GPU usable: on a machine without a GPU CUDA's reason reads like a fault
        note(f"no usable GPU, so this run trains on the CPU with NumPy (expected on a machine without a GPU; "
             f"--device cpu skips the check): {gpu_unavailable_reason()}")
    if threads == 0:
        return
    n, cores = threads or 1, cpu_cores()
    if n > cores:
        note(f"--cpu-threads {n} is more than the {cores} CPU core(s) this process may use: {cores} BLAS thread(s)")
        n = cores
    blas_threads(n)


def blas_threads(n: int | None) -> int | None:
    """Set the thread count of the BLAS that NumPy uses (through ``threadpoolctl``); returns the previous
    count (None: unknown, or ``n`` is None and nothing changes).

    The tiny model's GEMMs are small (128-wide) and many (batched attention products loop over B·H
    matrices): BLAS threads spend more time handing work around than computing, and on a loaded
    machine a spinning BLAS thread that lost its core slows a step down tenfold. One thread is the
    robust default for the CPU backend.
    """
    if n is None:
        return None
    import threadpoolctl  # a dependency; imported here because only the CPU backend needs it

    before = [i.get("num_threads") for i in threadpoolctl.threadpool_info() if i.get("user_api") == "blas"]
    threadpoolctl.threadpool_limits(int(n), user_api="blas")
    return before[0] if before else None
