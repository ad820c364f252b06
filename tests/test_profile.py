"""Profiling tools (chapter 8): per-op timing tables, NVTX ranges, occupancy, roofline, launch overhead,
and CUDA-graph capture (``llmgpu.perf.profile``, ``llmgpu.perf.graphs``)."""

import numpy as np
import pytest

from llmgpu import backend, instrument, plotting
from llmgpu.kernels.launch import SMLimits
from llmgpu.perf import graphs, occupancy, profile
from llmgpu.perf.occupancy import theoretical_occupancy
from llmgpu.perf.profile import summarize

pytestmark = pytest.mark.ch8


# --------------------------------------------------------------------------- table math (CPU)


def test_summarize_aggregates_and_rates():
    recs = [
        {"name": "attn.fwd", "ms": 2.0, "bytes": 4e9, "flops": None, "depth": 0},
        {"name": "mlp.fc", "ms": 1.0, "bytes": None, "flops": 5e11, "depth": 0},
        {"name": "attn.fwd", "ms": 2.0, "bytes": 4e9, "flops": None, "depth": 0},
        {"name": "attn.fwd/softmax", "ms": 0.5, "bytes": 1e9, "flops": None, "depth": 1},
    ]
    rows = summarize(recs, gbps_ceiling=4000.0, tflops_ceiling=800.0)
    by = {r["op"]: r for r in rows}
    assert [r["op"] for r in rows] == ["attn.fwd", "mlp.fc", "attn.fwd/softmax"]  # by total time
    a = by["attn.fwd"]
    assert a["calls"] == 2 and a["total_ms"] == 4.0 and a["ms_per_call"] == 2.0
    assert a["step_ms"] == 5.0  # depth-0 records only: 2 + 1 + 2
    assert a["pct_of_step"] == pytest.approx(80.0)
    assert a["gbps"] == pytest.approx(8e9 / 4e-3 / 1e9)  # 2000 GB/s
    assert a["pct_of_copy"] == pytest.approx(50.0)
    assert a["tflops"] is None and a["pct_of_gemm"] is None
    m = by["mlp.fc"]
    assert m["tflops"] == pytest.approx(500.0) and m["pct_of_gemm"] == pytest.approx(62.5) and m["gbps"] is None
    assert by["attn.fwd/softmax"]["depth"] == 1 and by["attn.fwd/softmax"]["pct_of_step"] == pytest.approx(10.0)
    rows2 = summarize(recs, step_ms=10.0, sort=False)
    assert [r["op"] for r in rows2][0] == "attn.fwd" and rows2[0]["pct_of_step"] == pytest.approx(40.0)
    assert rows2[0]["pct_of_copy"] is None


def test_format_table_lists_every_op():
    rows = summarize([{"name": "lm_head.fwd", "ms": 3.0, "bytes": None, "flops": 3e12, "depth": 0},
                      {"name": "layernorm.fwd", "ms": 1.0, "bytes": 2e9, "flops": None, "depth": 0}],
                     gbps_ceiling=4000.0, tflops_ceiling=800.0)
    text = profile.format_table(rows)
    assert "lm_head.fwd" in text and "layernorm.fwd" in text and "step: 4.000 ms" in text
    assert "1000.0" in text and "75.0" in text  # 3e12 FLOP / 3 ms = 1000 TFLOP/s, 75 % of the step
    assert profile.format_table([]).count("\n") == 1


def test_cpu_timer_records_regions_and_nesting():
    t = profile.OpTimer(xp=np)
    x = np.ones((64, 64), np.float32)
    with t.step():
        for _ in range(3):
            with t.region("matmul", flops=2 * 64**3):
                x = x @ x * 1e-3
                with t.region("inner"):
                    x = x + 1.0
    rows = {r["op"]: r for r in t.rows()}
    assert rows["matmul"]["calls"] == 3 and rows["inner"]["calls"] == 3
    assert rows["inner"]["depth"] == 1 and rows["matmul"]["depth"] == 0
    assert rows["matmul"]["total_ms"] >= rows["inner"]["total_ms"] > 0
    assert rows["matmul"]["tflops"] is not None and rows["matmul"]["pct_of_step"] <= 100.0 + 1e-9
    assert len(t.step_ms()) == 1
    t.reset()
    assert t.records() == [] and t.step_ms() == []


def test_disabled_timer_and_inactive_region_are_noops():
    t = profile.OpTimer(enabled=False, xp=np)
    r1, r2 = t.region("a"), t.region("b", bytes=10)
    assert r1 is r2  # one shared object, nothing allocated per call
    with r1:
        pass
    assert t.records() == []
    assert instrument.active_timer() is None
    assert instrument.region("x") is r1
    on = profile.OpTimer(xp=np)
    with instrument.activate(on):
        with instrument.region("hooked", bytes=100):
            pass
    assert instrument.active_timer() is None
    assert [r["name"] for r in on.records()] == ["hooked"] and on.records()[0]["bytes"] == 100


def test_nvtx_range_never_fails():
    with instrument.nvtx_range("chapter8"):
        pass
    old = instrument.set_nvtx(True)
    try:
        with instrument.region("with-nvtx"):
            pass
    finally:
        instrument.set_nvtx(old)


# --------------------------------------------------------------------------- occupancy formula (CPU)


H100 = SMLimits()


@pytest.mark.parametrize("block,regs,smem,blocks,occ,limiter", [
    (256, 32, 0, 8, 1.0, "warps"),  # 8 warps per block, 64 warps per SM
    (256, 64, 0, 4, 0.5, "registers"),  # 2048 registers per warp: 8 warps per sub-partition
    (256, 40, 0, 6, 0.75, "registers"),  # 1280 per warp: 12 per sub-partition -> 48 warps -> 6 blocks
    (128, 16, 48 * 1024, 4, 0.25, "shared memory"),  # 49152 + 1024 reserved -> 4 blocks of 228 KiB
    (32, 16, 0, 32, 0.5, "blocks"),  # 32-thread blocks: the 32-blocks-per-SM limit
    (1024, 65, 0, 0, 0.0, "registers"),  # 65 regs x 1024 threads > 65536 per block: cannot launch
    (96, 0, 0, 21, 21 * 3 / 64, "warps"),  # 3 warps per block, regs unknown (0): no register limit
])
def test_theoretical_occupancy_formula(block, regs, smem, blocks, occ, limiter):
    r = theoretical_occupancy(block=block, regs=regs, smem_bytes=smem, limits=H100)
    assert r["blocks_per_sm"] == blocks
    assert r["occupancy"] == pytest.approx(occ)
    assert r["limiter"] == limiter


def test_occupancy_limits_on_cpu_and_bad_args():
    assert SMLimits.for_device(np) == SMLimits()
    assert SMLimits().max_warps_per_sm == 64
    with pytest.raises(ValueError, match="block"):
        theoretical_occupancy(block=0, regs=32)
    r = theoretical_occupancy(block=256, regs=32, max_threads_per_block=128)
    assert r["blocks_per_sm"] == 0 and r["limiter"] == "max threads per block"


# --------------------------------------------------------------------------- roofline (CPU)


def test_roofline_plot_saves_png(tmp_path):
    rows = [{"name": "gemm 8192³", "flops": 2 * 8192.0**3, "bytes": 3 * 8192**2 * 2, "ms": 1.4},
            {"name": "layernorm", "flops": 8 * 65536 * 768, "bytes": 4 * 65536 * 768, "ms": 0.05},
            {"name": "copy", "flops": 0, "bytes": 1e9, "ms": 0.3}]  # no FLOPs: skipped
    path = tmp_path / "roofline.png"
    ax = plotting.roofline_plot(rows, peak_tflops=790.0, peak_gbps=4200.0, path=path, title="test")
    assert path.is_file() and path.stat().st_size > 5000
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert len(ax.collections[0].get_offsets()) == 2  # the two kernels with FLOPs and bytes, in one scatter
    with pytest.raises(ValueError, match="positive"):
        plotting.roofline_plot(rows, peak_tflops=0.0, peak_gbps=1.0)
    import matplotlib.pyplot as plt

    plt.close("all")


def test_roofline_names_do_not_cover_each_other():
    """A step's GEMMs sit within a few percent of each other (chapter 8's roofline): 30 kernels on three spots still
    get 30 names that do not overlap, each joined to its own point."""
    rng = np.random.default_rng(0)
    rows = [{"name": f"kernel {i:02d} {'gemm' if i % 3 else 'norm'}", "flops": f, "bytes": b,
             "ms": f / (t * 1e9)} for i, (f, b, t) in enumerate(
                 (2e11 * (1 + 0.01 * rng.random()), 4e8, 700.0) if i % 3 else (4e7, 4e7, 4.0) for i in range(30))]
    ax = plotting.roofline_plot(rows, peak_tflops=790.0, peak_gbps=4200.0)
    fig = ax.figure
    fig.canvas.draw()
    names = [a for a in ax.texts if a.get_text().startswith("kernel")]
    assert len(names) == 30
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(a) for a in names]  # the words only (an Annotation's own box has its line)
    overlaps = [(names[i].get_text(), names[j].get_text()) for i in range(30) for j in range(i + 1, 30)
                if boxes[i].overlaps(boxes[j])]
    assert not overlaps, overlaps[:5]
    by_name = {r["name"]: (r["flops"] / r["bytes"], r["flops"] / r["ms"] / 1e9) for r in rows}
    for a in names:  # each name points at its own kernel
        assert np.allclose(a.xy, by_name[a.get_text()])
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_fusion_bars_legend_covers_no_bar():
    """Chapter 8's fusion plot: the longest bar is the last one (attention), where a legend in the corner sat."""
    rows = [{"comparison": c, "variant": v, "ms": ms, "speedup": sp}
            for c, sep, fus in (("bias+GELU", 0.22, 0.15), ("LayerNorm", 0.08, 0.03), ("attention", 1.62, 0.45))
            for v, ms, sp in (("separate", sep, 1.0), ("fused", fus, sep / fus))]
    ax = plotting.plot_fusions(rows, title="separate vs fused")
    ax.figure.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert not any(legend.overlaps(p.get_window_extent()) for p in ax.patches)
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


@pytest.mark.parametrize("targets", [[0.5, 0.5, 0.5], [0.99, 1.0, 0.98, 0.0], [0.2, 0.9, 0.21, 0.5, 0.22], [0.3]])
def test_spread_positions_keep_the_gap_and_the_order(targets):
    pos = plotting.spread_positions(targets, 0.1)
    by_target = [pos[i] for i in sorted(range(len(targets)), key=lambda i: targets[i])]
    assert all(b - a >= 0.1 - 1e-12 for a, b in zip(by_target, by_target[1:]))  # in order, a gap apart
    assert all(0.0 <= p <= 1.0 for p in pos)
    assert plotting.spread_positions([0.1, 0.6], 0.1) == [0.1, 0.6]  # far enough apart: where they are
    assert plotting.spread_positions([0.5] * 21, 0.1) == pytest.approx([j / 20 for j in range(21)])  # too many: packed


def test_gpu_only_helpers_say_so_on_cpu():
    if backend.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(backend.GPUUnavailableError):
        profile.launch_overhead(10)
    with pytest.raises(backend.GPUUnavailableError):
        graphs.capture(lambda: None)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_timer_tables_kernels(cp):
    from llmgpu.ops.vector_add import vector_add

    n = 1 << 22
    a, b = cp.ones(n, np.float32), cp.ones(n, np.float32)
    c = cp.empty_like(a)
    t = profile.OpTimer(nvtx=True)
    with t.step():
        for _ in range(5):
            with t.region("vector_add", bytes=3 * 4 * n):
                vector_add(a, b, out=c)
        with t.region("copy", bytes=2 * 4 * n):
            c[...] = a
    rows = {r["op"]: r for r in t.rows(gbps_ceiling=4000.0)}
    assert rows["vector_add"]["calls"] == 5 and rows["copy"]["calls"] == 1
    assert all(r["total_ms"] > 0 and r["gbps"] > 0 for r in rows.values())
    assert 0 < rows["vector_add"]["pct_of_step"] < 100
    assert "vector_add" in t.table(gbps_ceiling=4000.0)
    t.reset()
    with t.region("again"):
        vector_add(a, b, out=c)
    assert len(t.records()) == 1  # recycled events still time correctly


@pytest.mark.gpu
def test_gpu_occupancy_api_agrees_with_formula(cp):
    from llmgpu.kernels import get_kernel

    ks = {"vector_add<float>": get_kernel("vector_add", "vector_add", np.float32),
          "gelu_forward<bf16,vec>": get_kernel("gelu", "gelu_forward", backend.bfloat16, 1)}
    rows = occupancy.occupancy_table(ks, block={"vector_add<float>": 256, "gelu_forward<bf16,vec>": 256})
    for r in rows:
        assert r["regs"] > 0 and r["max_threads_per_block"] >= 256 and r["local_bytes"] == 0
        assert r["blocks_per_sm"] >= 1
        if r["blocks_per_sm_api"] is not None:
            assert r["blocks_per_sm"] == r["blocks_per_sm_api"], r
    assert "vector_add<float>" in occupancy.format_occupancy_table(rows)


@pytest.mark.gpu
def test_gpu_launch_overhead_graph_is_cheaper(cp):
    r = profile.launch_overhead(500, reps=3)
    assert r.kernels_in_graph == 500
    assert r.eager_host_us > 0 and r.graph_wall_us > 0
    assert r.graph_wall_us < r.eager_wall_us


@pytest.mark.gpu
def test_gpu_capture_rawkernels_replay_equals_eager(cp, rng):
    from llmgpu.ops.vector_add import vector_add

    n = 1000  # not a multiple of the block size
    a = cp.asarray(rng.standard_normal(n).astype(np.float32))
    b = cp.asarray(rng.standard_normal(n).astype(np.float32))
    acc = cp.zeros(n, np.float32)

    def step():
        t = vector_add(a, b)  # allocated during capture: served by the graph's private pool
        vector_add(acc, t, out=acc)
        return vector_add(t, t)

    g = graphs.capture(step, warmup=1)  # the warm-up ran once: acc = a + b
    cp.cuda.Device().synchronize()
    eager_acc = acc.copy()
    out = g.replay()
    cp.cuda.Device().synchronize()
    assert out is g.outputs
    cp.testing.assert_array_equal(out, 2 * (a + b))
    cp.testing.assert_array_equal(acc, eager_acc + (a + b))  # the captured step ran exactly once more
    a[...] = 1.0
    g.replay()
    cp.cuda.Device().synchronize()
    cp.testing.assert_array_equal(out, cp.full(n, 2.0, np.float32) + 2 * b)
    counts = g.node_counts()
    assert counts.get("kernel") == 3, counts
    assert profile.launch_count(lambda: vector_add(a, b, out=out)).get("kernel") == 1


@pytest.mark.gpu
def test_gpu_capture_refuses_cupy_cublas_with_advice(cp):
    a = cp.ones((64, 64), np.float32)
    # warm-up outside capture works; under capture CuPy's cuBLAS refuses the capturing stream
    with pytest.raises(graphs.GraphCaptureError, match="lt_gemm"):
        graphs.capture(lambda: a @ a)
    # the failed capture left the device usable
    cp.testing.assert_array_equal(a @ a, cp.full((64, 64), 64.0, np.float32))


def test_step_floor_gives_each_op_the_best_rate_of_its_kind():
    """GEMMs at the best GEMM rate of the table, memory-bound ops at 90 % of the copy, attention as measured."""
    rows = [  # a 10 ms step: 1 ms outside any region
        {"op": "slow gemm", "total_ms": 4.0, "flops": 2e12, "bytes": None, "tflops": 500.0, "depth": 0},
        {"op": "fast gemm", "total_ms": 2.0, "flops": 1.6e12, "bytes": None, "tflops": 800.0, "depth": 0},
        {"op": "layernorm", "total_ms": 1.0, "flops": 1e9, "bytes": 3.6e9, "tflops": 1.0, "depth": 0},
        {"op": "attn.core bwd", "total_ms": 2.0, "flops": 4e11, "bytes": 1e9, "tflops": 200.0, "depth": 0},
        {"op": "inner", "total_ms": 0.5, "flops": None, "bytes": 1e9, "tflops": None, "depth": 1},
    ]
    for r in rows:
        r["step_ms"] = 10.0
    f = profile.step_floor(rows, copy_gbps=4000.0)
    assert f["gemm_tflops"] == 800.0 and f["gemm_ops"] == ["slow gemm", "fast gemm"]
    # slow gemm 2e12 / 800 TF/s = 2.5 ms (1.5 above), layernorm 3.6 GB / 3.6 TB/s = 1 ms (0), the rest as they are
    assert f["gaps"][0][1] == "slow gemm" and len(f["gaps"]) == 4  # the nested row is part of its parent
    np.testing.assert_allclose(f["gaps"][0][0], 1.5)
    np.testing.assert_allclose(f["floor_ms"], 8.5)
    g = profile.step_floor(rows, copy_gbps=4000.0, gemm_tflops=500.0)  # another rate: the fast GEMM is above it
    np.testing.assert_allclose(g["floor_ms"], 11.2)  # 1 + 4 + 3.2 + 1 + 2
    assert profile.step_floor([], copy_gbps=1.0)["floor_ms"] == 0.0
