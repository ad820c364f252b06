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
// * A block owns a 128 x BN tile of D at a time: two consumer warpgroups, rows 0-63 and 64-127, each one wgmma
//   m64nBNk16 per 16 of K (A and B from shared memory by descriptor). Persistent: gridDim.x blocks walk the tiles
//   blockIdx.x, + gridDim.x, ...; consecutive tiles share A's rows (N fastest), so the blocks resident together
//   read each 128-row slice of A from DRAM once and from L2 after. PRODUCER = 1 adds a ninth warp that only
//   issues the loads; otherwise thread 0, a consumer too, issues each load when its slot is released.
// * Operands: a ring of STAGES k-blocks (A 128 x 64 and B BN x 64, bf16, 128 bytes a row), each written by two TMA
//   loads in the 128-byte swizzle (the layout wgmma_probe.py pinned, "sw128": SBO = 1024, the next k step 32 bytes
//   in). Per slot an mbarrier "full" (one arrival with the expected bytes; the TMA completes the transaction) and
//   an mbarrier "empty" (one arrival per consumer warp once its wgmma on the slot is done). Thread 0 issues every
//   load (no producer warp): k-blocks run through the tiles without a break, so the first k-blocks of the next tile
//   are in flight while this tile's epilogue stores.
// * The epilogue (STORE = 0) stores from the accumulators (two bf16 per store) straight to global memory; with
//   MINB = 2 blocks per SM one block's epilogue runs beside the other's main loop. STORE = 1 writes each
//   warpgroup's 64 x BN result to its own staging area in shared memory instead (BN / 64 boxes of 64 x 64 in the
//   128-byte swizzle, which keeps the 4-byte writes free of bank conflicts), and one thread of the warpgroup hands
//   it to TMA stores, which run while the warpgroup goes on to its next tile; the area is written again only
//   after those stores have read it (cp.async.bulk.wait_group.read). DGELU's aux tile comes the same way: TMA
//   loads it into the staging area during the tile's main loop (from its third k-block on).
// Requires M % 128 == 0, N % BN == 0, K % 64 == 0 (the script checks).
#include "common.cuh"
#include "wgmma.cuh"

// llmgpu:arch sm_90a
// llmgpu:kernel gemm_tma<256, 3, {0,1,2,3}, 1, 0, {0,1}>
// llmgpu:kernel gemm_tma<256, 3, {2,3}, 1, 1, {0,1}>

// The accumulators of an m64n128 (64 per thread) and m64n256 (128) result, as PTX operands and asm constraints.
#define GW_D64 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
    " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31," \
    " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
    " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define GW_ACC64(d) \
    "+f"((d)[0]), "+f"((d)[1]), "+f"((d)[2]), "+f"((d)[3]), "+f"((d)[4]), "+f"((d)[5]), "+f"((d)[6]), "+f"((d)[7]), \
    "+f"((d)[8]), "+f"((d)[9]), "+f"((d)[10]), "+f"((d)[11]), "+f"((d)[12]), "+f"((d)[13]), "+f"((d)[14]), "+f"((d)[15]), \
    "+f"((d)[16]), "+f"((d)[17]), "+f"((d)[18]), "+f"((d)[19]), "+f"((d)[20]), "+f"((d)[21]), "+f"((d)[22]), "+f"((d)[23]), \
    "+f"((d)[24]), "+f"((d)[25]), "+f"((d)[26]), "+f"((d)[27]), "+f"((d)[28]), "+f"((d)[29]), "+f"((d)[30]), "+f"((d)[31]), \
    "+f"((d)[32]), "+f"((d)[33]), "+f"((d)[34]), "+f"((d)[35]), "+f"((d)[36]), "+f"((d)[37]), "+f"((d)[38]), "+f"((d)[39]), \
    "+f"((d)[40]), "+f"((d)[41]), "+f"((d)[42]), "+f"((d)[43]), "+f"((d)[44]), "+f"((d)[45]), "+f"((d)[46]), "+f"((d)[47]), \
    "+f"((d)[48]), "+f"((d)[49]), "+f"((d)[50]), "+f"((d)[51]), "+f"((d)[52]), "+f"((d)[53]), "+f"((d)[54]), "+f"((d)[55]), \
    "+f"((d)[56]), "+f"((d)[57]), "+f"((d)[58]), "+f"((d)[59]), "+f"((d)[60]), "+f"((d)[61]), "+f"((d)[62]), "+f"((d)[63])

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

template <int BN>
__device__ __forceinline__ void gw_mma(float (&d)[BN / 2], unsigned long long desc_a, unsigned long long desc_b,
                                       int scale_d) {
#ifdef LLMGPU_WGMMA
    if constexpr (BN == 128) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " GW_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                     : GW_ACC64(d)
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " GW_D128 ", %128, %129, p, 1, 1, 0, 0;\n}\n"
                     : GW_ACC128(d)
                     : "l"(desc_a), "l"(desc_b), "r"(scale_d));
    }
#endif
}

// mbarrier and TMA (PTX ISA: "Parallel Synchronization and Communication Instructions: mbarrier", "Data Movement:
// cp.async.bulk.tensor"). Addresses are shared-memory (.shared::cta) offsets; the tensor map lives in global memory.
__device__ __forceinline__ void gw_mbar_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void gw_mbar_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void gw_mbar_arrive(unsigned bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
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

// Pin the accumulators here: after a wait, no read of them moves above it (wgmma.cuh's wg_pin, for m64n128/256).
template <int BN> __device__ __forceinline__ void gw_pin(float (&d)[BN / 2]) {
    if constexpr (BN == 128) asm volatile("" : GW_ACC64(d)::"memory");
    else asm volatile("" : GW_ACC128(d)::"memory");
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

template <int BN, int STAGES> struct gw_cfg {
    static constexpr int BM = 128, BK = 64, THREADS = 256;
    static constexpr int A_BYTES = BM * BK * 2, B_BYTES = BN * BK * 2, STAGE = A_BYTES + B_BYTES;
    static constexpr int BOX = 64 * 64 * 2, STAGING = (BM / 64) * (BN / 64) * BOX;  // 64 x 64 boxes of the result
    static constexpr int BARS = STAGES * STAGE + STAGING;  // barriers: full[STAGES], empty[STAGES], aux[2]
    static constexpr int SMEM = 1024 + BARS + (2 * STAGES + 2) * 8;  // with the alignment slack
    static constexpr int CHUNKS = 64 * BN * 2 / 16 / 128;  // 16-byte chunks of a warpgroup's result per thread
    static constexpr int PARTS = 8;                         // DEFER: the deferred pass in this many k-blocks
    static constexpr int PER_PART = CHUNKS / PARTS;
};

// The descriptor of a K-major 128-byte-swizzled tile at saddr (SBO = 1024: the next 8 rows; LBO unused).
__device__ __forceinline__ unsigned long long gw_desc(unsigned saddr) { return wg_desc(saddr, 16, 1024, 1); }

__device__ __forceinline__ float2 gw_unpack(unsigned u) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ unsigned gw_pack(float a, float b) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&p);
}

template <int BN, int STAGES, int EPI, int MINB, int DEFER, int PRODUCER>
__global__ void __launch_bounds__(256 + 32 * PRODUCER, MINB)
gemm_tma(const void* __restrict__ map_a, const void* __restrict__ map_b, const void* __restrict__ map_d,
         const void* __restrict__ map_aux, const __nv_bfloat16* __restrict__ aux,
         const __nv_bfloat16* __restrict__ bias, int M, int N, int K) {
#ifdef LLMGPU_WGMMA
    using cfg = gw_cfg<BN, STAGES>;
    extern __shared__ __align__(1024) unsigned char gw_smem[];
    const unsigned raw = wg_saddr(gw_smem);
    const unsigned s0 = raw + ((1024u - (raw & 1023u)) & 1023u);  // slot s: A at s0 + s·STAGE, B A_BYTES on
    const unsigned bars = s0 + cfg::BARS;  // full[s] at bars + 8s, empty[s] at + 8·STAGES, aux[wg] after them
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (STAGES + s); };
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const unsigned aux_bar = bars + 8 * (2 * STAGES + wg);
    const int tiles_n = N / BN, n_tiles = (M / cfg::BM) * tiles_n, nk = K / cfg::BK;
    const int my_tiles = blockIdx.x < n_tiles ? (n_tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int total = my_tiles * nk;  // k-blocks this block loads and consumes, in order
    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            gw_mbar_init(full(s), 1);
            gw_mbar_init(empty(s), 8);
        }
        gw_mbar_init(bars + 16 * STAGES, 1);
        gw_mbar_init(bars + 16 * STAGES + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    // Thread 0: k-block L of this block's sequence into slot L % STAGES, once its last reader has released it.
    auto issue = [&](int L) {
        const int t = blockIdx.x + (L / nk) * gridDim.x, kb = L % nk, slot = L % STAGES;
        if (L >= STAGES) gw_mbar_wait(empty(slot), (L / STAGES - 1) & 1);
        const unsigned dst = s0 + slot * cfg::STAGE;
        gw_mbar_expect_tx(full(slot), cfg::STAGE);
        gw_tma_load(dst, map_a, kb * cfg::BK, (t / tiles_n) * cfg::BM, full(slot));
        gw_tma_load(dst + cfg::A_BYTES, map_b, kb * cfg::BK, (t % tiles_n) * BN, full(slot));
    };
    // Consumer warps: k-block c's slot is done with (this warp's wgmmas on it completed).
    auto release = [&](int c) {
        if (lane == 0) gw_mbar_arrive(empty(c % STAGES));
        if (!PRODUCER && tid == 0 && c + STAGES < total) issue(c + STAGES);
        __syncwarp();  // warp 0 converged again before the next warp-aligned wgmma instruction
    };
    if (PRODUCER && tid >= 256) {  // the producer warp: every load, each as soon as its slot is free
        if (lane == 0)
            for (int L = 0; L < total; ++L) issue(L);
        return;
    }
    if (!PRODUCER && tid == 0)
        for (int L = 0; L < STAGES && L < total; ++L) issue(L);
    __syncwarp();

    float acc[BN / 2];
    const int g = lane >> 2, q = (lane & 3) * 2;
    const bool elected = (tid & 127) == 0;  // issues and waits for this warpgroup's bulk stores and aux loads
    const unsigned stage_wg = s0 + STAGES * cfg::STAGE + wg * (BN / 64) * cfg::BOX;  // this warpgroup's boxes

    // Staging: element (r, col) of the warpgroup's 64 rows is in box col / 64, row r's 128 bytes, 16-byte chunk
    // (col % 64) / 8 swizzled by r % 8 (TMA's 128-byte swizzle; for the accumulator pairs r % 8 = g, which keeps
    // the 4-byte writes of a warp on 32 different banks).
    auto at = [&](int j, int h) {  // accumulators 4j + 2h, 4j + 2h + 1
        return stage_wg + (j / 8) * cfg::BOX + (warp * 16 + g + 8 * h) * 128 + (((j % 8) ^ g) << 4) + 2 * q;
    };
    auto put = [&](int j, int h, float v0, float v1) {
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(at(j, h)), "r"(gw_pack(v0, v1)) : "memory");
    };
    auto publish = [&](const void* map, int row0, int col0) {  // the staged boxes to global memory, by TMA
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        gw_wg_sync(wg);
        if (elected) {
            for (int b = 0; b < BN / 64; ++b) gw_tma_store(map, col0 + 64 * b, row0 + wg * 64, stage_wg + b * cfg::BOX);
            gw_bulk_commit();
        }
        __syncwarp();
    };
    auto staging_free = [&]() {  // the last stores from the staging area have read it
        if (elected) gw_bulk_wait_read();
        __syncwarp();
        gw_wg_sync(wg);
    };
    // DEFER: the previous tile's element-wise pass over the staged result (GELU of the stored pre-activation, or
    // the staged dgrad times GELU' of aux read from global memory), 16-byte chunks in any order: part p of PARTS.
    int pend_row = -1, pend_col = 0, parts_done = 0;
    uint4 aux_next[cfg::PER_PART];  // DGELU: aux of the next part's chunks, loaded one part ahead
    auto chunk = [&](int k, int& box, int& r, int& slot) {
        const int idx = (tid & 127) + 128 * k;
        box = idx / 512, r = (idx / 8) % 64, slot = idx % 8;
    };
    auto load_aux = [&](int p) {
#pragma unroll
        for (int e = 0; e < cfg::PER_PART; ++e) {
            int box, r, slot;
            chunk(p * cfg::PER_PART + e, box, r, slot);
            const long long o = static_cast<long long>(pend_row + wg * 64 + r) * N + pend_col + 64 * box +
                                8 * (slot ^ (r % 8));
            aux_next[e] = *reinterpret_cast<const uint4*>(aux + o);
        }
    };
    auto deferred_part = [&](int p) {
        if (p == 0) {
            if constexpr (EPI == 2) staging_free();  // the pre-activation's stores have read it
            else gw_wg_sync(wg);                     // every thread's staged values are written
        }
        uint4 av4[cfg::PER_PART];
        if constexpr (EPI == 3) {
#pragma unroll
            for (int e = 0; e < cfg::PER_PART; ++e) av4[e] = aux_next[e];
            if (p + 1 < cfg::PARTS) load_aux(p + 1);
        }
#pragma unroll
        for (int e = 0; e < cfg::PER_PART; ++e) {
            int box, r, slot;
            chunk(p * cfg::PER_PART + e, box, r, slot);
            const unsigned sa = stage_wg + box * cfg::BOX + r * 128 + slot * 16;
            uint4 v;
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(sa));
            unsigned* w = &v.x;
            const unsigned* av = &av4[e].x;
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const float2 f = gw_unpack(w[u]);
                if constexpr (EPI == 2) {
                    w[u] = gw_pack(gw_gelu(f.x), gw_gelu(f.y));
                } else {
                    const float2 a2 = gw_unpack(av[u]);
                    w[u] = gw_pack(f.x * gw_gelu_grad(a2.x), f.y * gw_gelu_grad(a2.y));
                }
            }
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(sa), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                         : "memory");
        }
        if (p == cfg::PARTS - 1) {
            publish(map_d, pend_row, pend_col);
            pend_row = -1;
        }
    };

    int c = 0;  // k-blocks consumed
    for (int i = 0; i < my_tiles; ++i) {
        const int t = blockIdx.x + i * gridDim.x, row0 = (t / tiles_n) * cfg::BM, col0 = (t % tiles_n) * BN;
        for (int kb = 0; kb < nk; ++kb, ++c) {
            if constexpr (!DEFER && EPI == 3) {  // the aux tile into the staging area, once the last stores read it
                if (kb == (nk > 2 ? 2 : nk - 1) && elected) {
                    gw_bulk_wait_read();
                    gw_mbar_expect_tx(aux_bar, (BN / 64) * cfg::BOX);
                    for (int b = 0; b < BN / 64; ++b)
                        gw_tma_load(stage_wg + b * cfg::BOX, map_aux, col0 + 64 * b, row0 + wg * 64, aux_bar);
                }
                __syncwarp();
            }
            const int slot = c % STAGES;
            gw_mbar_wait(full(slot), (c / STAGES) & 1);
            const unsigned a = s0 + slot * cfg::STAGE + wg * 64 * 128, b = s0 + slot * cfg::STAGE + cfg::A_BYTES;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) gw_mma<BN>(acc, gw_desc(a + 32 * kk), gw_desc(b + 32 * kk), kb > 0 || kk > 0);
            wg_commit();
            if constexpr (DEFER) {  // while the tensor cores work: part of the previous tile's pass
                if (pend_row >= 0 && kb >= 1) {
                    const int upto = kb == nk - 1 ? cfg::PARTS : min(cfg::PARTS, kb);
                    while (parts_done < upto) deferred_part(parts_done++);
                }
            }
            wg_wait<1>();
            if (kb > 0) release(c - 1);
        }
        wg_wait<0>();
        gw_pin<BN>(acc);
        release(c - 1);
        if constexpr (DEFER) {  // a tile of one k-block never reached its pass
            while (pend_row >= 0) deferred_part(parts_done++);
        }

        // Epilogue: accumulator i of a thread is row 16·warp + g (+8 for i % 4 >= 2), column 8·(i / 4) + q (+1).
        if constexpr (EPI == 3 && !DEFER) {
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
            publish(map_d, row0, col0);
            continue;
        }
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
        if constexpr (EPI == 2) publish(map_aux, row0, col0);  // that was the pre-activation
        if constexpr (DEFER && (EPI == 2 || EPI == 3)) {        // GELU or GELU' in the next tile's main loop
            pend_row = row0;
            pend_col = col0;
            parts_done = 0;
            if constexpr (EPI == 3) load_aux(0);
            continue;
        }
        if constexpr (EPI == 2) {
#pragma unroll
            for (int e = 0; e < BN / 2; ++e) acc[e] = gw_gelu(acc[e]);
            staging_free();
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int h = 0; h < 2; ++h) put(j, h, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
        publish(map_d, row0, col0);
    }
    if constexpr (DEFER) {  // the last tile's pass
        while (pend_row >= 0) deferred_part(parts_done++);
    }
    if (elected) gw_bulk_wait();  // shared memory stays until the last stores have read it
#else
    __trap();  // wgmma exists on sm_90a only
#endif
}
