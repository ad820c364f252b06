"""llmgpu.perf.timing on the CPU: medians, bandwidth arithmetic, the PyTorch event timer's logic."""

import numpy as np

from llmgpu.perf import timing


def test_time_fn_numpy_median_and_rates():
    t = timing.time_fn(lambda: np.ones(1000).sum(), xp=np, warmup=1, reps=5)
    assert t.reps == 5 and 0 < t.min_ms <= t.median_ms <= t.max_ms
    assert len(t.samples_ms) == 5 and (min(t.samples_ms), max(t.samples_ms)) == (t.min_ms, t.max_ms)
    assert t.median_ms == float(np.median(t.samples_ms))
    assert np.isclose(t.gbps(1e9), 1e9 / (t.median_ms * 1e-3) / 1e9)
    assert np.isclose(t.tflops(2e12), 2e12 / (t.median_ms * 1e-3) / 1e12)


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing):
        assert enable_timing
        self.t = None

    def record(self):
        _FakeEvent.clock += 1.0
        self.t = _FakeEvent.clock

    def elapsed_time(self, other):
        return other.t - self.t


class _FakeTorch:
    """Stands in for torch: events that tick on every record, so each timed call reads 1 ms."""

    class cuda:
        Event = _FakeEvent
        synced = 0

        @staticmethod
        def synchronize():
            _FakeTorch.cuda.synced += 1


def test_time_torch_brackets_every_call():
    calls = []
    ms = timing.time_torch(_FakeTorch, lambda: calls.append(1), reps=7, warmup=2, host_ahead=False)
    assert len(calls) == 9 and ms == 1.0 and _FakeTorch.cuda.synced == 1


def test_torch_cuda_is_none_without_a_cuda_torch():
    torch = timing.torch_cuda()
    assert torch is None or torch.cuda.is_available()
