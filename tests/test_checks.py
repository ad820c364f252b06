"""The shared argument checks (llmgpu.checks) and launch arithmetic (llmgpu.kernels.launch), on the CPU:
vector width and alignment, resident blocks and grids against hand-computed values, the dtype and
method messages, the optional-dependency import."""

from types import SimpleNamespace

import numpy as np
import pytest

from llmgpu import backend, checks
from llmgpu.checks import check_gpu_dtype, check_method, gpu_path_unavailable_reason, optional_import, require_module
from llmgpu.kernels import launch
from llmgpu.kernels.launch import (
    SMLimits,
    blocks_per_sm,
    elements_aligned,
    is_aligned,
    kernel_registers,
    opt_in_shared_memory,
    persistent_grid,
    resident_blocks,
    resident_grid,
    stride_grid,
    vector_width,
)

H100 = SMLimits()  # sm_90: 65536 registers, 2048 threads, 32 blocks, 228 KiB per SM; 132 SMs


def _buf(ptr, dtype=np.float32):
    """A stand-in for a CuPy array: only the pointer and the dtype matter to the alignment checks."""
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), dtype=np.dtype(dtype))


def _kernel(regs):
    return SimpleNamespace(num_regs=regs)


# --------------------------------------------------------------------------- vector width and alignment


@pytest.mark.parametrize("dtype,c,expected", [
    (np.float32, 768, 4), (np.float32, 6, 1), (backend.bfloat16, 768, 8), (backend.bfloat16, 12, 1),
    (np.float16, 8, 8), (np.float16, 1, 1), (np.float32, 7, 1), (backend.bfloat16, 769, 1),
])
def test_vector_width_by_row_length(dtype, c, expected):
    assert vector_width(dtype, c) == expected


def test_vector_width_misaligned_pointers():
    assert vector_width(np.float32, 256, _buf(4096)) == 4
    assert vector_width(np.float32, 256, _buf(4096), _buf(4100)) == 1  # one pointer 4 bytes off
    assert vector_width(backend.bfloat16, 64, _buf(4096 + 8, backend.bfloat16)) == 1  # 8-byte aligned only
    assert vector_width(backend.bfloat16, 64, _buf(4096 + 16, backend.bfloat16)) == 8
    assert vector_width(np.float32, 255, _buf(4096)) == 1  # odd rows win over alignment
    assert vector_width(np.float32, 256, _buf(4096), None) == 4  # None: an absent optional array


def test_alignment_in_bytes_and_in_elements():
    assert is_aligned(16, _buf(32), _buf(48)) and not is_aligned(16, _buf(32), _buf(40))
    # 4-wide vectors of each array's own type: 8 bytes for fp16, 16 for fp32
    assert elements_aligned(4, _buf(8, np.float16))
    assert not elements_aligned(4, _buf(8, np.float32))
    assert elements_aligned(4, _buf(16, np.float32), _buf(8, backend.bfloat16), None)
    assert not elements_aligned(4, _buf(16, np.float32), _buf(4, backend.bfloat16))


@pytest.mark.gpu
def test_gpu_vector_width_unaligned_pointer(cp):
    buf = cp.zeros(1024 + 8, dtype=cp.float32)
    assert vector_width(np.float32, 256, buf[:1024]) == 4
    assert vector_width(np.float32, 256, buf[:1024], buf[1:1025]) == 1  # 4 bytes past a 16-byte boundary
    assert vector_width(np.float32, 256, buf[4:1028]) == 4  # 16 bytes past: aligned again


# --------------------------------------------------------------------------- resident blocks and grids


@pytest.mark.parametrize("regs,threads,smem,expected", [
    (32, 256, 0, 8),  # the thread limit: 2048 / 256
    (62, 256, 0, 4),  # 62 regs -> 2048 per warp (units of 256): 65536 / (2048 * 8)
    (33, 256, 0, 6),  # 33 regs -> 1280 per warp: 65536 / 10240 = 6 (7 without the allocation unit)
    (68, 256, 0, 3),  # 2304 per warp: 65536 / 18432
    (32, 128, 48 * 1024, 4),  # shared memory: 233472 / (49152 + 1024 reserved)
    (32, 128, 45 * 1024, 4),  # 233472 / (46080 + 1024) = 4.96: the reservation costs the fifth block
    (16, 32, 0, 32),  # the block limit
    (255, 1024, 0, 1),  # does not fit at all: still one (the launch itself would fail)
])
def test_blocks_per_sm_by_hand(regs, threads, smem, expected):
    assert blocks_per_sm(regs, threads, smem, H100) == expected


def test_resident_blocks_from_given_limits():
    small = SMLimits(regs_per_sm=32768, max_threads_per_sm=1024, max_blocks_per_sm=16, smem_per_sm=65536,
                     sm_count=10)
    assert resident_blocks(_kernel(32), 128, limits=small) == 10 * 8  # registers: 32768 / (1024 * 4); threads 8
    assert resident_blocks(_kernel(32), 64, 15 * 1024, limits=small) == 10 * 4  # 65536 / (15360 + 1024)
    assert resident_blocks(_kernel(80), 128, limits=H100) == 132 * 6  # 2560 per warp: 65536 / 10240
    # a kernel that does not report its registers counts as 64: 2048 per warp -> 4 blocks of 256 threads
    assert resident_blocks(object(), 256, limits=H100) == 132 * 4
    assert kernel_registers(_kernel(40)) == 40 and kernel_registers(_kernel(0)) == 64


def test_resident_and_stride_grids():
    assert resident_grid(_kernel(62), 1000, 256, limits=H100) == 4  # less work than one wave
    assert resident_grid(_kernel(62), 10**9, 256, limits=H100) == 132 * 4  # one wave
    assert resident_grid(_kernel(62), 0, 256, limits=H100) == 1
    assert stride_grid(1000, 256, limits=H100) == 4
    assert stride_grid(10**9, 256, limits=H100) == 8 * 132
    assert stride_grid(10**9, 256, limits=H100, per_sm=16) == 16 * 132
    assert stride_grid(10**9, 256, limits=SMLimits(sm_count=78)) == 8 * 78
    assert stride_grid(0, 256, limits=H100) == 1


def test_persistent_grid_by_hand():
    # 80 regs, 4-warp blocks: 6 per SM, 792 blocks = 3168 warps resident. 65536 rows need 21 per warp
    # (20 cover only 63360), and 21-row warps fill ceil(65536 / 84) = 781 blocks.
    assert persistent_grid(_kernel(80), 65536, 128, 0, limits=H100) == 781
    # fewer rows than resident warps: one row each
    assert persistent_grid(_kernel(80), 1000, 128, 0, limits=H100) == 250
    # shared memory limits residency: 2 blocks of 100 KiB per SM -> 264 blocks x 8 warps = 2112 warps
    assert persistent_grid(_kernel(32), 2112 * 3, 256, 100 * 1024, limits=H100) == 264


def test_opt_in_shared_memory():
    kern = SimpleNamespace(max_dynamic_shared_size_bytes=0)
    assert not opt_in_shared_memory(kern, H100.smem_per_block_optin + 1, limits=H100)
    assert kern.max_dynamic_shared_size_bytes == 0  # untouched when the device cannot give that much
    assert opt_in_shared_memory(kern, 100 * 1024, limits=H100)
    assert kern.max_dynamic_shared_size_bytes == 100 * 1024

    class Refuses:
        @property
        def max_dynamic_shared_size_bytes(self):
            return 0

        @max_dynamic_shared_size_bytes.setter
        def max_dynamic_shared_size_bytes(self, value):
            raise RuntimeError("the driver said no")

    assert not opt_in_shared_memory(Refuses(), 100 * 1024, limits=H100)
    # remembered per kernel: no more than the limit set costs no driver call, and the limit is never lowered
    kern.max_dynamic_shared_size_bytes = -1  # a set below would show
    assert opt_in_shared_memory(kern, 64 * 1024, limits=H100) and kern.max_dynamic_shared_size_bytes == -1
    assert opt_in_shared_memory(kern, 120 * 1024, limits=H100) and kern.max_dynamic_shared_size_bytes == 120 * 1024
    fresh = SimpleNamespace(max_dynamic_shared_size_bytes=0)  # up to 48 KiB nothing is needed
    assert opt_in_shared_memory(fresh, launch.SMEM_WITHOUT_OPT_IN, limits=H100)
    assert fresh.max_dynamic_shared_size_bytes == 0


def test_device_limits_on_numpy_are_the_sm90_defaults():
    assert launch.device_limits(np) == SMLimits() == SMLimits.for_device(np)
    assert SMLimits().sm_count == 132 and SMLimits().smem_per_block_optin == 227 * 1024


# --------------------------------------------------------------------------- dtype and method checks


def test_check_gpu_dtype_messages():
    assert check_gpu_dtype("x", np.zeros(2, np.float32)) is not None
    check_gpu_dtype("x", backend.bfloat16)
    check_gpu_dtype("x", "fp16")
    with pytest.raises(TypeError) as e:
        check_gpu_dtype("x", np.zeros(2))
    assert str(e.value) == ("x has dtype float64; the GPU path supports fp32, fp16, bf16 "
                            "(float64 runs on the NumPy path only)")
    with pytest.raises(TypeError) as e:
        check_gpu_dtype("idx", np.dtype(np.int32))
    assert str(e.value) == "idx has dtype int32; the GPU path supports fp32, fp16, bf16"
    with pytest.raises(TypeError) as e:
        check_gpu_dtype("q", np.zeros(2, np.float32), (backend.float16, backend.bfloat16), hint="fp32 runs elsewhere")
    assert str(e.value) == "q has dtype float32; the GPU path supports fp16, bf16 (fp32 runs elsewhere)"
    assert checks.GPU_DTYPES == (backend.float32, backend.float16, backend.bfloat16)


def test_check_method_messages():
    assert check_method("gelu_forward", "fast", ("naive", "fast")) == "fast"
    with pytest.raises(ValueError) as e:
        check_method("gelu_forward", "tanh", ("naive", "fast"))
    assert str(e.value) == "gelu_forward: method must be one of ('naive', 'fast'), got 'tanh'"
    with pytest.raises(ValueError, match="^kind must be one of"):
        checks.check_choice("kind", "x", ("a", "b"))


# --------------------------------------------------------------------------- optional dependencies


def test_optional_import_found_missing_and_broken(tmp_path, monkeypatch):
    mod, reason = optional_import("json", "the json module", "nothing to do")
    assert reason is None and mod.dumps([1]) == "[1]"
    mod, reason = optional_import("llmgpu_no_such_module", "no-such-package", "pip install 'llmgpu[fast]'")
    assert mod is None
    assert reason == ("no-such-package is not installed (No module named 'llmgpu_no_such_module'); "
                      "pip install 'llmgpu[fast]'")
    (tmp_path / "llmgpu_broken_module.py").write_text("raise RuntimeError('no driver')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod, reason = optional_import("llmgpu_broken_module", "broken", "reinstall")
    assert mod is None and reason == "broken failed to import (RuntimeError: no driver); reinstall"


def test_gpu_path_reason_and_require_module(monkeypatch):
    calls = []

    def importer():
        calls.append(1)
        return None, "module missing"

    monkeypatch.setattr(backend, "gpu_unavailable_reason", lambda: "no GPU")
    assert gpu_path_unavailable_reason(importer) == "no GPU" and calls == []  # the GPU is asked first
    monkeypatch.setattr(backend, "gpu_unavailable_reason", lambda: None)
    assert gpu_path_unavailable_reason(importer) == "module missing"
    assert gpu_path_unavailable_reason(lambda: (np, None)) is None
    with pytest.raises(LookupError, match="module missing"):
        require_module(importer, LookupError)
    assert require_module(lambda: (np, None), LookupError) is np


# --------------------------------------------------------------------------- values of the user-facing API


def test_check_token_ids_refuses_what_it_would_otherwise_round(rng):
    v = int(rng.integers(2, 1000))
    ids = rng.integers(0, v, int(rng.integers(1, 9)))
    assert checks.check_token_ids(ids, v) == ids.tolist()  # a NumPy integer array: fine
    assert checks.check_token_ids([np.int64(v - 1), 0], v) == [v - 1, 0]
    for bad, err, needle in (([1.5], TypeError, "integer token ids"), ([2.0], TypeError, "float 2.0"),
                             ([True], TypeError, "bool"), (np.array([1.0]), TypeError, "integer"),
                             ([], ValueError, "no token"), ([v], ValueError, f"token id {v}"),
                             ([-1], ValueError, "token id -1"), ("abc", TypeError, "sequence"),
                             (7, TypeError, "sequence")):
        with pytest.raises(err, match=needle):
            checks.check_token_ids(bad, v, "prompt")


def test_check_field_types_names_the_field_and_never_rounds():
    from dataclasses import dataclass

    @dataclass
    class C:
        n: int = 1
        k: int | None = None
        x: float = 0.5
        s: str | None = None
        b: bool | None = None

    assert checks.check_field_types(C(n=np.int32(3), k=2, x=1, s="a", b=np.bool_(True)))
    for kw, needle in ((dict(n=2.5), "n must be an integer, got float 2.5"), (dict(n=True), "n must be an integer"),
                       (dict(k="2"), "k must be an integer or None"), (dict(x="1"), "x must be a number"),
                       (dict(x=False), "x must be a number"), (dict(s=3), "s must be a string or None"),
                       (dict(b=1), "b must be true or false or None"), (dict(n=None), "n must be an integer")):
        with pytest.raises(TypeError, match=needle):
            checks.check_field_types(C(**kw))
    with pytest.raises(ValueError, match="--n must be"):
        checks.check_field_types(C(n=1.0), lambda f: f"--{f}", ValueError)


@pytest.mark.parametrize("field,value", [("steps", 2.5), ("steps", True), ("batch", 2.0), ("seq", "16"),
                                         ("sample_tokens", 1.5), ("seed", 1.0), ("cpu_threads", 1.5),
                                         ("lr", "3e-3"), ("prompt", 5), ("progress", 1)])
def test_train_config_fields_of_the_wrong_type_are_refused_not_rounded(tmp_path, field, value):
    from llmgpu.train import ConfigError, TrainConfig, train

    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')} must be"):
        train(TrainConfig(preset="tiny", device="cpu", batch=2, seq=16, steps=2, eval_every=0, plot=False,
                          sample_tokens=0, progress=False, out=str(tmp_path / "r")), **{field: value})
    assert not (tmp_path / "r").exists()
    with pytest.raises(TypeError, match=f"--{field.replace('_', '-')} must be"):  # a saved configuration
        TrainConfig.from_dict({**TrainConfig().as_dict(), field: value})


# --------------------------------------------------------------------------- overlap of strided views


def _bytes_of(a, base):
    """The set of byte offsets (from ``base``'s start) that the view ``a`` of ``base`` covers, element by element."""
    start = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    offsets = np.zeros(1, np.int64) + start
    for n, s in zip(a.shape, a.strides):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).ravel()
    return set((offsets[:, None] + np.arange(a.itemsize)[None, :]).ravel().tolist())


def test_overlaps_row_views_of_one_buffer():
    """gate = gu[:, :F] and up = gu[:, F:] (one row period, disjoint columns) are apart; shifted views, the same
    columns of other rows, and a view against its whole buffer are not."""
    n, f = 5, 6
    gu = np.zeros((n, 2 * f), np.float32)
    gate, up = gu[:, :f], gu[:, f:]
    assert not checks.overlaps(gate, up) and not checks.overlaps(up, gate)
    assert not checks.overlaps(gu[::2, :f], gu[1::2, :f])  # every other row: one period of 2 rows
    assert not checks.overlaps(gu[0, :f], up)  # a contiguous piece against a row view
    for other in (gu[:, 1:f + 1], gu[:, f - 1:], gu, gu[:, :1], gate):
        assert checks.overlaps(gate, other), other.strides
    assert checks.overlaps(gu[1:, :f], gu[:-1, :f])  # the same columns one row down: rows 1..3 shared
    assert checks.overlaps(gate, gu.view(np.int8)[:, 4 * f - 1:])  # bytes, not elements: gate's last byte
    assert not checks.overlaps(gate, gu.view(np.int8)[:, 4 * f:])
    qkv = np.zeros((2, 3, 8 * 4), np.float16).reshape(2, 3, 8, 4)  # 4 q, 2 k, 2 v heads of D = 4
    assert not checks.overlaps(qkv[:, :, :6], qkv[:, :, 6:])  # q|k vs v
    assert checks.overlaps(qkv[:, :, :6], qkv[:, :, 5:])
    assert not checks.overlaps(None, gate) and not checks.overlaps(gate, gu[:0])


def test_overlaps_never_misses_a_shared_byte(rng):
    """Random 2-D and 3-D views of one buffer (slices, steps, reversals, transposes): whenever two share a byte
    (counted element by element) overlaps says so; and at least some disjoint pairs are recognised as such."""
    base = np.zeros(4 * 6 * 10, np.float32).reshape(4, 6, 10)
    said_apart = 0
    for _ in range(400):
        views = []
        for _ in range(2):
            v = base
            for axis, n in enumerate(base.shape):
                a = int(rng.integers(0, n))
                sl = [slice(None)] * base.ndim
                sl[axis] = slice(a, int(rng.integers(a + 1, n + 1)), int(rng.choice([1, 1, 2])))
                v = v[tuple(sl)]
                if rng.random() < 0.15:
                    v = np.flip(v, axis)
            if rng.random() < 0.3:
                v = v[0]
            if rng.random() < 0.2:
                v = v.T
            views.append(v)
        u, v = views
        shared = bool(_bytes_of(u, base) & _bytes_of(v, base))
        got = checks.overlaps(u, v)
        assert got == checks.overlaps(v, u)
        assert got or not shared, (u.shape, u.strides, v.shape, v.strides)
        said_apart += not got
    assert said_apart > 20


def test_same_buffer_compares_layout():
    gu = np.zeros((4, 8), np.float32)
    assert checks.same_buffer(gu[:, :4], gu[:, :4])
    assert checks.same_buffer(gu.reshape(4, 1, 8), gu[:, None, :])  # size-1 axes' strides do not matter
    assert not checks.same_buffer(gu[:, :4], gu[:, :3])
    assert not checks.same_buffer(gu[:2, :4], gu.reshape(8, 4)[:2])  # same start and bytes, other elements
    assert not checks.same_buffer(gu[:, :4], gu[:, :4].T)
    assert not checks.same_buffer(gu[:, :4], gu[:, :8:2])
    checks.check_alias("dgate", gu[:, :4], "up", gu[:, 4:])
    checks.check_alias("out", gu[:, :4], "gate", gu[:, :4])
    with pytest.raises(ValueError, match="out overlaps gate without being the same buffer"):
        checks.check_alias("out", gu[:, 1:5], "gate", gu[:, :4])


def test_row_stride():
    msg = "rows please"
    gu = np.zeros((5, 12), np.float16)
    assert checks.row_stride("g", gu[:, :6], 1, msg) == 12
    assert checks.row_stride("g", gu, 1, msg) == 12 and checks.row_stride("g", gu[1:2, 3:7], 1, msg) == 4
    assert checks.row_stride("g", gu[::2, 3:7], 1, msg) == 24
    qkv = np.zeros((2, 3, 8 * 4), np.float32)
    assert checks.row_stride("x", qkv.reshape(2, 3, 8, 4)[:, :, :6], 2, msg) == 32
    wide = np.zeros((2, 4, 8, 4), np.float32)
    for bad in (gu.T, gu[:, ::2], gu[:, ::-1], gu[::-1, :6], np.broadcast_to(gu[0], (3, 12)),
                wide[:, :3, :6],  # B and T steps do not collapse into one token stride
                wide[:, :, :, :2]):  # head_dim not contiguous with the heads
        with pytest.raises(ValueError, match=r"^x must be rows please; got shape .* strides .* \(bytes\)$"):
            checks.row_stride("x", bad, 2 if bad.ndim == 4 else 1, msg)
