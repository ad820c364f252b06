// gemm_wgmma.cu (dev/cuda): a Hopper GEMM whose operands arrive by TMA, steps 1-3 of gemm_epilogue_plan.md.
//
// D [M, N] = A [M, K] · B [N, K]ᵀ, bf16 in, fp32 accumulate, bf16 out, both operands K-major (row-major A, and B
// as PyTorch stores a Linear's weight). The fc forward is Y = X · Wᵀ; the projection's dgrad dG = dY · W₂ takes
// B = W₂ᵀ (a transposed copy of the [C, 4C] weight). Epilogues (EPI):
//   0 none          D = acc
//   1 bias          D = acc + bias
//   2 gelu_aux_bias F = acc + bias → aux, D = GELU(F)        (cuBLASLt's GELU_AUX_BIAS: the fc forward)
//   3 dgelu         D = acc · GELU'(aux)                      (cuBLASLt's DGELU: the projection's dgrad)
// GELU, the tanh approximation, is evaluated with one MUFU.TANH (tanh.approx.f32, max relative error about 2^-11;
// the results are rounded to bf16, 2^-9) where gelu.cu's fast sigmoid form takes two MUFU ops (ex2 and rcp): the
// SM's 16 MUFU results a clock, not its 128 FMAs, bound an epilogue over 32768 elements a tile.
//
// * A block owns a 128 x 256 tile of D at a time: two consumer warpgroups, rows 0-63 and 64-127, each one wgmma
//   m64n256k16 per 16 of K (A and B from shared memory by descriptor), and a ninth warp that only issues loads.
//   Persistent: the blocks walk the tiles in turn; consecutive tiles share A's rows (N fastest), so the blocks
//   resident together read each slice of A from DRAM once and from L2 after.
// * Operands: a ring of STAGES k-blocks (A 128 x 64 and B 256 x 64, bf16, 128 bytes a row), each written by TMA
//   loads in the 128-byte swizzle (the layout wgmma_probe.py pinned, "sw128": SBO = 1024, the next k step 32 bytes
//   in). Per slot an mbarrier "full" (one arrival with the expected bytes; the TMA completes the transaction) and
//   an mbarrier "empty" (one arrival per consumer warp once its wgmma on the slot is done). k-blocks run through
//   the tiles without a break, so the next tile's first k-blocks load while this tile's epilogue runs.
// * CLUSTER = 2: two blocks on two SMs form a cluster and take vertically adjacent tiles (the same 256 columns of
//   B); each loads its own A and half of B, and multicasts that half into both blocks' shared memory. Each block
//   then reads 32 KiB per k-block from L2 instead of 48. A slot is refilled only when the consumers of both blocks
//   are done with it: each consumer warp arrives on its own block's and on the other block's "empty" barrier.
// * The epilogue writes each warpgroup's 64 x 256 result to its own staging area in shared memory (four boxes of
//   64 x 64 in the 128-byte swizzle, which keeps the 4-byte writes free of bank conflicts), and one thread of the
//   warpgroup hands it to TMA stores, which run while the warpgroup goes on to its next tile; the area is written
//   again only after those stores have read it (cp.async.bulk.wait_group.read). DGELU's aux tile comes the same
//   way: TMA loads it into the staging area during the tile's main loop (from its third k-block on).
// * PART != 0 runs one part of the kernel alone, to time it (METHOD.md: leave a stage out and take differences):
//   1 the loads alone (the consumers wait for each k-block and release it at once: no wgmma, no epilogue), 2 the
//   math alone (the ring is loaded once; the consumers run every wgmma on the resident slots: no loads after the
//   first STAGES, no epilogue), 3 loads and math without the epilogue (nothing is written). Only PART 0 computes D.
// Requires M % (128 · CLUSTER) == 0, N % 256 == 0, K % 64 == 0 (the script checks).
#include "common.cuh"
#include "wgmma.cuh"

// llmgpu:kernel gemm_tma<{0,1,2,3}, {1,2}, 0>
// llmgpu:kernel gemm_tma<0, 1, {1,2,3}>

// The 128 accumulators of an m64n256 result per thread, as PTX operands and asm constraints.
#define GW_D128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63," \
    " %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
    " %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
    " %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
    " %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define GW_ACC128(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
    "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), \
    "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
    "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
    "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63]), \
    "+f"((d)[64]), "+f"((d)[65]), "+f"((d)[66]), "+f"((d)[67]), "+f"((d)[68]), "+f"((d)[69]), "+f"((d)[70]), "+f"((d)[71]), \
    "+f"((d)[72]), "+f"((d)[73]), "+f"((d)[74]), "+f"((d)[75]), "+f"((d)[76]), "+f"((d)[77]), "+f"((d)[78]), "+f"((d)[79]), \
    "+f"((d)[80]), "+f"((d)[81]), "+f"((d)[82]), "+f"((d)[83]), "+f"((d)[84]), "+f"((d)[85]), "+f"((d)[86]), "+f"((d)[87]), \
    "+f"((d)[88]), "+f"((d)[89]), "+f"((d)[90]), "+f"((d)[91]), "+f"((d)[92]), "+f"((d)[93]), "+f"((d)[94]), "+f"((d)[95]), \
    "+f"((d)[96]), "+f"((d)[97]), "+f"((d)[98]), "+f"((d)[99]), "+f"((d)[100]), "+f"((d)[101]), "+f"((d)[102]), "+f"((d)[103]), \
    "+f"((d)[104]), "+f"((d)[105]), "+f"((d)[106]), "+f"((d)[107]), "+f"((d)[108]), "+f"((d)[109]), "+f"((d)[110]), "+f"((d)[111]), \
    "+f"((d)[112]), "+f"((d)[113]), "+f"((d)[114]), "+f"((d)[115]), "+f"((d)[116]), "+f"((d)[117]), "+f"((d)[118]), "+f"((d)[119]), \
    "+f"((d)[120]), "+f"((d)[121]), "+f"((d)[122]), "+f"((d)[123]), "+f"((d)[124]), "+f"((d)[125]), "+f"((d)[126]), "+f"((d)[127])

// One wgmma m64n256k16, bf16 in, fp32 accumulate, A and B from shared memory by descriptor; scale_d 0 ignores d.
__device__ __forceinline__ void gw_mma(float (&d)[128], unsigned long long desc_a, unsigned long long desc_b,
                                       int scale_d) {
#ifdef LLMGPU_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " GW_D128 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : GW_ACC128(d)
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}
// Pin the accumulators here: after a wait, no read of them moves above it (wgmma.cuh's wg_pin, for m64n256).
__device__ __forceinline__ void gw_pin(float (&d)[128]) { asm volatile("" : GW_ACC128(d)::"memory"); }

// mbarrier, TMA and cluster PTX (PTX ISA: "mbarrier", "cp.async.bulk.tensor", "mapa", "barrier.cluster").
// Addresses are shared-memory (.shared::cta) offsets; the tensor maps live in global memory.
__device__ __forceinline__ void gw_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void gw_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gw_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Arrive on the barrier at the same offset in block `rank` of the cluster.
__device__ __forceinline__ void gw_mbar_arrive_cluster(unsigned bar, unsigned rank) {
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                 : "memory");
}
// Wait until the phase of parity `parity` has completed (the n-th completion of a barrier has parity n & 1).
__device__ __forceinline__ void gw_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    }
}
// The box at (c0 = column, c1 = row) of the tensor a map describes, into shared memory at dst; completes bytes on bar.
__device__ __forceinline__ void gw_tma_load(unsigned dst, const void* map, int c0, int c1, unsigned bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}
// The same into dst of every block in `mask` (one bit per cluster rank), completing bytes on each one's bar.
__device__ __forceinline__ void gw_tma_load_multicast(unsigned dst, const void* map, int c0, int c1, unsigned bar,
                                                      unsigned short mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
                 : "memory");
}
// A box of shared memory at src to (c0 = column, c1 = row) of the tensor a map describes (bulk async-group).
__device__ __forceinline__ void gw_tma_store(const void* map, int c0, int c1, unsigned src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 ::"l"(map), "r"(c0), "r"(c1), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void gw_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's committed bulk stores have read their shared memory (its writes may not be done yet).
__device__ __forceinline__ void gw_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void gw_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// The 128 threads of warpgroup wg (named barrier 1 + wg; 0 is __syncthreads').
__device__ __forceinline__ void gw_wg_sync(int wg) { asm volatile("bar.sync %0, 128;" ::"r"(1 + wg) : "memory"); }
// Every thread of every block of the cluster (a block's barriers are initialised before any other block uses them,
// and no block exits while another may still arrive on its barriers or write into its shared memory).
__device__ __forceinline__ void gw_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned gw_cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// tanh-GELU and its derivative (gelu.cu's block comment has the math): t = tanh(u), u = x (C0 + C1 x²);
// GELU = x/2 + x/2 t; GELU' = (1 + t)/2 + x/2 (1 - t²) (C0 + 3 C1 x²), x² clamped as in gelu_grad.
#define GW_C0 0.7978845608028654f   // sqrt(2/pi)
#define GW_C1 0.035677408136300125f // 0.044715 sqrt(2/pi)
__device__ __forceinline__ float gw_tanh(float u) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
    return t;
}
__device__ __forceinline__ float gw_gelu(float x) {
    const float h = 0.5f * x, t = gw_tanh(x * fmaf(GW_C1, x * x, GW_C0));
    return fmaf(h, t, h);
}
__device__ __forceinline__ float gw_gelu_grad(float x) {
    const float x2 = fminf(x * x, 1e30f), t = gw_tanh(x * fmaf(GW_C1, x2, GW_C0));
    return fmaf(0.5f * x * fmaf(-t, t, 1.0f), fmaf(3.0f * GW_C1, x2, GW_C0), fmaf(0.5f, t, 0.5f));
}
__device__ __forceinline__ float2 gw_unpack(unsigned u) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ unsigned gw_pack(float a, float b) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&p);
}

namespace gw {
constexpr int BM = 128, BN = 256, BK = 64, STAGES = 3, THREADS = 288;  // two consumer warpgroups + the producer
constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
constexpr int BOX = 64 * 64 * 2, STAGING = (BM / 64) * (BN / 64) * BOX;  // 64 x 64 boxes of the result
constexpr int BARS = STAGES * STAGE + STAGING;  // then the barriers: full[STAGES], empty[STAGES], aux[2]
constexpr int SMEM = 1024 + BARS + (2 * STAGES + 2) * 8;  // with the alignment slack
static_assert(SMEM <= 227 * 1024, "one block per SM: at most 227 KiB of shared memory");
}  // namespace gw

// Clusters exist from sm_90 on; the compile checks for older targets build the kernels without one.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GW_CLUSTER_DIMS(x) __cluster_dims__(x, 1, 1)
#else
#define GW_CLUSTER_DIMS(x)
#endif

// The descriptor of a K-major 128-byte-swizzled tile at saddr (SBO = 1024: the next 8 rows; LBO unused).
__device__ __forceinline__ unsigned long long gw_desc(unsigned saddr) { return wg_desc(saddr, 16, 1024, 1); }

template <int EPI, int CLUSTER, int PART>
__global__ void GW_CLUSTER_DIMS(CLUSTER) __launch_bounds__(gw::THREADS, 1)
gemm_tma(const void* __restrict__ map_a, const void* __restrict__ map_b, const void* __restrict__ map_d,
         const void* __restrict__ map_aux, const __nv_bfloat16* __restrict__ bias, int M, int N, int K) {
#ifdef LLMGPU_WGMMA
    using namespace gw;
    extern __shared__ __align__(1024) unsigned char gw_smem[];
    const unsigned raw = wg_saddr(gw_smem);
    const unsigned s0 = raw + ((1024u - (raw & 1023u)) & 1023u);  // slot s: A at s0 + s·STAGE, B A_BYTES on
    const unsigned bars = s0 + BARS;  // full[s] at bars + 8s, empty[s] at + 8·STAGES, aux[wg] after them
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (STAGES + s); };
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const unsigned aux_bar = bars + 8 * (2 * STAGES + (wg & 1));
    const unsigned rank = CLUSTER > 1 ? gw_cluster_rank() : 0;
    // Tiles come in groups of CLUSTER vertically adjacent ones (the same columns); cluster c takes groups c,
    // c + n_clusters, ...; its block of rank r the r-th tile of each.
    const int tiles_n = N / BN, n_groups = (M / (BM * CLUSTER)) * tiles_n, nk = K / BK;
    const int cluster = blockIdx.x / CLUSTER, n_clusters = gridDim.x / CLUSTER;
    const int my_tiles = cluster < n_groups ? (n_groups - 1 - cluster) / n_clusters + 1 : 0;
    const int total = my_tiles * nk;  // k-blocks this block loads and consumes, in order
    auto tile_row = [&](int i) { return ((cluster + i * n_clusters) / tiles_n * CLUSTER + rank) * BM; };
    auto tile_col = [&](int i) { return (cluster + i * n_clusters) % tiles_n * BN; };
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            gw_mbar_init(full(s), 1);
            gw_mbar_init(empty(s), 8 * CLUSTER);  // every consumer warp of every block of the cluster
        }
        gw_mbar_init(bars + 16 * STAGES, 1);
        gw_mbar_init(bars + 16 * STAGES + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (CLUSTER > 1) gw_cluster_sync();
    else __syncthreads();

    if (tid >= 256) {  // the producer warp: every load, each as soon as its slot is free in the whole cluster
        if (lane == 0) {
            for (int L = 0; L < (PART == 2 ? min(total, STAGES) : total); ++L) {
                const int i = L / nk, kb = L % nk, slot = L % STAGES;
                if (L >= STAGES) gw_mbar_wait(empty(slot), (L / STAGES - 1) & 1);
                const unsigned dst = s0 + slot * STAGE;
                gw_mbar_expect_tx(full(slot), STAGE);
                gw_tma_load(dst, map_a, kb * BK, tile_row(i), full(slot));
                if constexpr (CLUSTER == 1) {
                    gw_tma_load(dst + A_BYTES, map_b, kb * BK, tile_col(i), full(slot));
                } else {  // this block's share of B's rows, into every block of the cluster
                    constexpr int ROWS = BN / CLUSTER;
                    gw_tma_load_multicast(dst + A_BYTES + rank * ROWS * 128, map_b, kb * BK, tile_col(i) + rank * ROWS,
                                          full(slot), static_cast<unsigned short>((1u << CLUSTER) - 1));
                }
            }
        }
        __syncwarp();
        if constexpr (CLUSTER > 1) gw_cluster_sync();
        return;
    }
    // Consumer warps: k-block c's slot is done with (this warp's wgmmas on it completed), in every block.
    auto release = [&](int c) {
        if (lane == 0) {
            if constexpr (CLUSTER == 1) gw_mbar_arrive(empty(c % STAGES));
            else
                for (unsigned r = 0; r < CLUSTER; ++r) gw_mbar_arrive_cluster(empty(c % STAGES), r);
        }
        __syncwarp();
    };

    float acc[BN / 2];
    const int g = lane >> 2, q = (lane & 3) * 2;
    const bool elected = (tid & 127) == 0;  // issues and waits for this warpgroup's bulk stores and aux loads
    const unsigned stage_wg = s0 + STAGES * STAGE + wg * (BN / 64) * BOX;  // this warpgroup's boxes
    // Staging: element (r, col) of the warpgroup's 64 rows is in box col / 64, row r's 128 bytes, 16-byte chunk
    // (col % 64) / 8 swizzled by r % 8 (TMA's 128-byte swizzle; for the accumulator pairs r % 8 = g, which keeps
    // the 4-byte writes of a warp on 32 different banks).
    auto at = [&](int j, int h) {  // accumulators 4j + 2h, 4j + 2h + 1
        return stage_wg + (j / 8) * BOX + (warp * 16 + g + 8 * h) * 128 + (((j % 8) ^ g) << 4) + 2 * q;
    };
    auto put = [&](int j, int h, float v0, float v1) {
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(at(j, h)), "r"(gw_pack(v0, v1)) : "memory");
    };
    auto publish = [&](const void* map, int row0, int col0) {  // the staged boxes to global memory, by TMA
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        gw_wg_sync(wg);
        if (elected) {
            for (int b = 0; b < BN / 64; ++b) gw_tma_store(map, col0 + 64 * b, row0 + wg * 64, stage_wg + b * BOX);
            gw_bulk_commit();
        }
        __syncwarp();
    };
    auto staging_free = [&]() {  // the last stores from the staging area have read it
        if (elected) gw_bulk_wait_read();
        __syncwarp();
        gw_wg_sync(wg);
    };

    int c = 0;  // k-blocks consumed
    for (int i = 0; i < my_tiles; ++i) {
        const int row0 = tile_row(i), col0 = tile_col(i);
        for (int kb = 0; kb < nk; ++kb, ++c) {
            if constexpr (EPI == 3 && PART == 0) {  // the aux tile into the staging area, once the last stores read it
                if (kb == (nk > 2 ? 2 : nk - 1) && elected) {
                    gw_bulk_wait_read();
                    gw_mbar_expect_tx(aux_bar, (BN / 64) * BOX);
                    for (int b = 0; b < BN / 64; ++b)
                        gw_tma_load(stage_wg + b * BOX, map_aux, col0 + 64 * b, row0 + wg * 64, aux_bar);
                }
                __syncwarp();
            }
            const int slot = c % STAGES;
            if (PART != 2 || c < STAGES) gw_mbar_wait(full(slot), (c / STAGES) & 1);
            if constexpr (PART == 1) {
                release(c);
                continue;
            }
            const unsigned a = s0 + slot * STAGE + wg * 64 * 128, b = s0 + slot * STAGE + A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) gw_mma(acc, gw_desc(a + 32 * kk), gw_desc(b + 32 * kk), kb > 0 || kk > 0);
            wg_commit();
            wg_wait<1>();
            if (PART != 2 && kb > 0) release(c - 1);
        }
        if constexpr (PART == 1) continue;
        wg_wait<0>();
        gw_pin(acc);
        if constexpr (PART != 2) release(c - 1);
        if constexpr (PART != 0) {
            if (K < 0) {  // never taken; keeps the accumulators live, else ptxas drops the wgmmas as dead code
                float sum = 0.f;
#pragma unroll
                for (int e = 0; e < BN / 2; ++e) sum += acc[e];
                static_cast<float*>(const_cast<void*>(map_d))[tid] = sum;
            }
            continue;
        }

        // Epilogue: accumulator i of a thread is row 16·warp + g (+8 for i % 4 >= 2), column 8·(i / 4) + q (+1).
        if constexpr (EPI == 3) {
            gw_mbar_wait(aux_bar, i & 1);
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    unsigned u;
                    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(u) : "r"(at(j, h)) : "memory");
                    const float2 f = gw_unpack(u);
                    put(j, h, acc[4 * j + 2 * h] * gw_gelu_grad(f.x), acc[4 * j + 2 * h + 1] * gw_gelu_grad(f.y));
                }
        } else {
            staging_free();
#pragma unroll
            for (int j = 0; j < BN / 8; ++j) {
                float2 bj = make_float2(0.f, 0.f);
                if constexpr (EPI == 1 || EPI == 2)
                    bj = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + col0 + 8 * j + q));
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    acc[4 * j + 2 * h] += bj.x;
                    acc[4 * j + 2 * h + 1] += bj.y;
                    put(j, h, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
                }
            }
            if constexpr (EPI == 2) {  // that was the pre-activation; now GELU of it
                publish(map_aux, row0, col0);
#pragma unroll
                for (int e = 0; e < BN / 2; ++e) acc[e] = gw_gelu(acc[e]);
                staging_free();
#pragma unroll
                for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) put(j, h, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
            }
        }
        publish(map_d, row0, col0);
    }
    if (elected) gw_bulk_wait();  // shared memory stays until the last stores have read it
    __syncwarp();
    if constexpr (CLUSTER > 1) gw_cluster_sync();
#else
    __trap();  // wgmma exists on sm_90a only
#endif
}
