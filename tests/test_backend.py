import json

import numpy as np
import pytest

from llmgpu import backend


def test_import_without_cupy_in_a_subprocess(tmp_path):
    """`import llmgpu` must work where CuPy cannot be imported, falling back to NumPy."""
    import subprocess
    import sys

    # A fake `cupy` package that fails to import stands in for a machine without CuPy.
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("raise ImportError('no cupy here')\n")
    code = (
        "import numpy as np, llmgpu\n"
        "from llmgpu import backend\n"
        "assert backend.cupy_module() is None\n"
        "assert backend.default_xp() is np\n"
        "print(backend.gpu_unavailable_reason())\n"
    )
    import os
    from pathlib import Path

    import llmgpu

    repo = Path(llmgpu.__file__).resolve().parent.parent
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)]), "PATH": "/usr/bin:/bin", "LLMGPU_DEVICE": "auto"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(tmp_path.parent))
    assert r.returncode == 0, r.stderr
    assert "llmgpu[cuda13]" in r.stdout  # the message says which extra to install


def test_device_override_cpu(monkeypatch):
    monkeypatch.setenv("LLMGPU_DEVICE", "cpu")
    assert backend.default_xp() is np
    assert backend.device_info().backend == "numpy"


def test_device_override_gpu_without_gpu_raises(monkeypatch):
    if backend.gpu_available():
        pytest.skip("a GPU is present; this checks the error raised without one")
    monkeypatch.setenv("LLMGPU_DEVICE", "gpu")
    with pytest.raises(backend.GPUUnavailableError, match="LLMGPU_DEVICE=gpu"):
        backend.default_xp()


def test_the_environment_variable_is_named_as_itself_not_as_a_flag(monkeypatch):
    """LLMGPU_DEVICE=gpu without a GPU was reported as '--device gpu: ...', a flag the user never gave; under
    LLMGPU_DEVICE=cpu a run still said 'no usable GPU ... (--device cpu skips the check)'."""
    from llmgpu.train.config import ConfigError, select_xp

    if backend.gpu_available():
        pytest.skip("a GPU is present; this checks the messages given without one")
    monkeypatch.setenv("LLMGPU_DEVICE", "gpu")
    with pytest.raises(ConfigError, match="^LLMGPU_DEVICE=gpu but ") as e:
        select_xp("auto")
    assert "--device" not in str(e.value)
    monkeypatch.setenv("LLMGPU_DEVICE", "cpu")
    said = []
    backend.use_cpu(np, "auto", None, said.append)
    assert not [s for s in said if "no usable GPU" in s]
    monkeypatch.setenv("LLMGPU_DEVICE", "auto")
    backend.use_cpu(np, "auto", None, said.append)
    assert backend.cupy_module() is None or [s for s in said if "no usable GPU" in s]


def test_bad_device_value(monkeypatch):
    monkeypatch.setenv("LLMGPU_DEVICE", "tpu")
    with pytest.raises(ValueError, match="LLMGPU_DEVICE"):
        backend.default_xp()


@pytest.mark.parametrize(
    "name, expect",
    [("bf16", backend.bfloat16), ("fp16", np.float16), ("float32", np.float32), ("fp64", np.float64)],
)
def test_resolve_dtype(name, expect):
    assert backend.resolve_dtype(name) == np.dtype(expect)
    assert backend.resolve_dtype(backend.resolve_dtype(name)) == np.dtype(expect)


def test_resolve_dtype_rejects_unknown():
    with pytest.raises(ValueError, match="unknown dtype"):
        backend.resolve_dtype("fp8")


def test_cuda_c_types():
    assert backend.cuda_c_type("bf16") == "__nv_bfloat16"
    assert backend.cuda_c_type(np.float16) == "__half"
    assert backend.cuda_c_type("fp32") == "float"
    with pytest.raises(TypeError):
        backend.cuda_c_type(np.int32)


def test_bfloat16_roundtrip_numpy():
    x = np.array([1.0, 3.140625, -2.5e-3], dtype=np.float32)
    y = x.astype(backend.bfloat16).astype(np.float32)
    assert np.allclose(x, y, rtol=2**-8)


def test_mixed_numpy_and_other_rejected():
    with pytest.raises(TypeError, match="NumPy arrays or all CuPy arrays"):
        backend.get_array_module(np.ones(3), [1, 2, 3])


@pytest.mark.gpu
def test_mixed_numpy_cupy_rejected(cp):
    with pytest.raises(TypeError, match="NumPy arrays or all CuPy arrays"):
        backend.get_array_module(np.ones(3), cp.ones(3), names=["x", "w"])


@pytest.mark.gpu
def test_device_info_on_gpu(cp):
    info = backend.device_info(cp)
    assert info.backend == "cupy" and info.sm_count > 0 and info.memory_bytes > 2**30
    assert info.compute_capability.count(".") == 1
    assert "SMs" in info.summary()


@pytest.mark.gpu
def test_bfloat16_on_gpu_roundtrip(cp, rng):
    x = rng.standard_normal(1000).astype(backend.bfloat16)
    y = backend.to_numpy(backend.to_device(x, cp))
    assert y.dtype == backend.bfloat16 and np.array_equal(x.view(np.uint16), y.view(np.uint16))


@pytest.mark.parametrize("value", ["banana", "cuda", "1"])
def test_bad_device_value_names_variable_and_choices(monkeypatch, value):
    monkeypatch.setenv("LLMGPU_DEVICE", value)
    with pytest.raises(backend.DeviceSettingError, match=r"LLMGPU_DEVICE must be 'cpu', 'gpu' or 'auto'") as e:
        backend.requested_device()
    assert isinstance(e.value, ValueError) and repr(value) in str(e.value)
    with pytest.raises(ValueError, match="LLMGPU_DEVICE"):
        backend.select_xp("auto")


def test_blas_threads_sets_and_reports_the_count():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    if not any(i.get("user_api") == "blas" for i in threadpoolctl.threadpool_info()):
        pytest.skip("NumPy's BLAS is not visible to threadpoolctl here")
    old = backend.blas_threads(1)
    try:
        assert backend.blas_threads(2) == 1  # the previous count comes back
        assert [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"][0] == 2
        assert backend.blas_threads(None) is None
    finally:
        if old:
            backend.blas_threads(old)


# --------------------------------------------------------------------------- the CPU backend's threads, no GPU


def test_cpu_threads_above_the_cores_are_capped_with_a_note(monkeypatch):
    set_to, notes = [], []
    monkeypatch.setattr(backend, "blas_threads", set_to.append)
    cores = backend.cpu_cores()
    assert cores >= 1
    backend.use_cpu(np, "cpu", cores + 7, notes.append)
    assert set_to == [cores] and len(notes) == 1 and f"--cpu-threads {cores + 7}" in notes[0]
    backend.use_cpu(np, "cpu", cores, notes.append)  # at the cores: as asked, no note
    backend.use_cpu(np, "cpu", None, notes.append)  # the default: one thread
    backend.use_cpu(np, "cpu", 0, notes.append)  # the BLAS default: untouched
    backend.use_cpu(object(), "gpu", 99, notes.append)  # not NumPy: nothing
    assert set_to == [cores, cores, 1] and len(notes) == 1


def test_a_run_with_too_many_cpu_threads_notes_the_cap(tmp_path):
    from llmgpu.train import TrainConfig, Trainer

    n = backend.cpu_cores() + 100
    t = Trainer(TrainConfig(preset="tiny", device="cpu", batch=2, seq=16, steps=1, cpu_threads=n, progress=False,
                            plot=False, sample_tokens=0, eval_every=0, out=str(tmp_path / "r")))
    assert any(f"--cpu-threads {n} is more than the {backend.cpu_cores()} CPU core" in x for x in t.notes)
    t.run()
    assert any("--cpu-threads" in x for x in json.loads((tmp_path / "r" / "config.json").read_text())["notes"])


class _FakeRuntime:
    def __init__(self, error, driver):
        self.error, self.driver = error, driver

    def getDeviceCount(self):  # noqa: N802 - CUDA's name
        raise self.error

    def driverGetVersion(self):  # noqa: N802
        return self.driver


class CUDARuntimeError(RuntimeError):
    pass


@pytest.mark.parametrize("error,driver,needle", [
    ("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version", 0,
     "no NVIDIA GPU/driver found"),
    ("cudaErrorNoDevice: no CUDA-capable device is detected", 12080, "no NVIDIA GPU found"),
    ("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version", 11040,
     "driver version is insufficient"),  # a real old driver: CUDA's words are the right ones
])  # fmt: skip
def test_the_no_gpu_reason_says_what_the_machine_lacks(monkeypatch, error, driver, needle):
    import sys
    import types

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=_FakeRuntime(CUDARuntimeError(error), driver))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    backend._probe_cupy.cache_clear()
    try:
        reason = backend.gpu_unavailable_reason()
        assert needle in reason and "\n" not in reason
        if driver == 0:
            assert "insufficient" not in reason
    finally:
        monkeypatch.undo()
        backend._probe_cupy.cache_clear()  # the real probe again for the tests that follow


@pytest.mark.parametrize("xp,want", [(None, np), (np, np), ("cpu", np), ("CPU", np), ("auto", np)])
def test_resolve_xp_takes_modules_and_device_names(monkeypatch, xp, want):
    monkeypatch.setenv("LLMGPU_DEVICE", "cpu")
    assert backend.resolve_xp(xp) is want


def test_resolve_xp_refuses_anything_else(monkeypatch):
    with pytest.raises(ValueError, match="auto, cpu or gpu"):
        backend.resolve_xp("tpu")
    with pytest.raises(TypeError, match="xp must be numpy, cupy"):
        backend.resolve_xp(pytest)
    if not backend.gpu_available():
        with pytest.raises(backend.GPUUnavailableError):
            backend.resolve_xp("gpu")
