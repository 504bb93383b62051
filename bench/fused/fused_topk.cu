// Fused tensor-core scoring + exact top-k for batched recalls (issue 14, item 1).
//
// Why this exists: the GEMM paths of sidecar_cuda write a B x N score matrix to HBM with cuBLAS
// and read it back for the top-k (1 GB at B = 256, N = 1M in float32). Here the scores never leave
// the chip: each block multiplies a tile of rows by a tile of queries on the tensor cores and feeds
// the accumulators straight into per-query candidate lists held in shared memory.
//
// Compiled by cupy.RawModule (NVRTC, the device's own architecture; no CUDA headers needed) with
// the tile shape as -D constants from fused.py. Three launches make one search:
//   ft_prep    float32 queries -> float16 queries scaled by a power of two (qscale), |q|^2, and the
//              per-query global gate reset to -inf.
//   ft_fused   grid = P row parts x QY query tiles (one wave: every block resident at once, so the
//              blocks that share a row part run side by side and the second query tile's rows come
//              from L2). A block streams BM-row tiles of its part through a STAGES-deep cp.async
//              pipeline, mma.sync m16n8k16 (f16 in, f32 accumulate), and offers each tile's
//              scores to sorted per-query lists of KC candidates (approximate scores), then writes
//              the lists to cand[B][P][KC].
//   ft_merge   one block per query: tree-merges the P lists into the global top-KC by approximate
//              score, rescores those KC rows in float32 against the float32 query, sorts them and
//              writes the top k; flags[b] = 1 when the answer is not proven exact (see below).
// ft_exact (float32 scores of every row for the few flagged queries) backs the proof up.
//
// Exactness (the project's half-score argument, with float32 accumulation instead of float16
// scores): the approximate score a of a row differs from its float32 score s by at most
// E = 1.25 (|q| xmax (2^-10 + D 2^-23) + qscale 2^-25 (sqrt(D) xmax + 1)) (query rounding to
// float16, subnormal underflow of the scaled query, tensor-core and float32 accumulation; xmax
// bounds every row norm). Every row outside the KC candidates has a <= last (the KC-th
// candidate's approximate score), so if the k-th rescored score tk >= last + E no outside row can
// beat the answer: it is the exact top-k under float32 scores. Otherwise the host redoes the query
// with ft_exact.
//
// Gating: a row is offered to a query's list only if its score beats the list's KC-th entry and
// the query's global gate, the best KC-th entry of any block so far (a lower bound on the global
// KC-th best, shared through an atomicMax on order-preserving uints). Random data fills the gate
// within the first tiles, after which a tile costs only the multiply and one block barrier.

#ifndef FT_BM
#define FT_BM 128  // rows per tile
#endif
#ifndef FT_BQ
#define FT_BQ 64  // queries per block
#endif
#ifndef FT_WN
#define FT_WN 2  // warps along the queries (8 / FT_WN along the rows)
#endif
#ifndef FT_BK
#define FT_BK 32  // k-slice per pipeline stage (halves)
#endif
#ifndef FT_STAGES
#define FT_STAGES 4
#endif
#ifndef FT_KC
#define FT_KC 32  // candidates per query (power of two, >= 32)
#endif
#ifndef FT_MINB
#define FT_MINB 1  // blocks per SM promised to ptxas (caps registers)
#endif
#ifndef FT_PF
#define FT_PF 0  // 1: row copies ask L2 to prefetch 256 bytes (later stages of the same rows)
#endif
#ifndef FT_ROT
#define FT_ROT 1  // 1: each block walks the k-slices starting at its own offset (see load)
#endif
#ifndef FT_NOEPI
#define FT_NOEPI 0  // diagnostic only: skip the selection (answers are wrong) to time the multiply
#endif
#define FT_MTHREADS 1024  // ft_merge: one block of 32 warps per query

#ifndef FT_WARPS
#define FT_WARPS 8  // warps per block of ft_fused (and of ft_prep / ft_exact, launched alike)
#endif
#define FT_THREADS (FT_WARPS * 32)
#define FT_WARPS_M (FT_WARPS / FT_WN)
#define FT_WM (FT_BM / FT_WARPS_M)  // rows per warp
#define FT_WQ (FT_BQ / FT_WN)       // queries per warp
#define FT_MI (FT_WM / 16)
#define FT_NI (FT_WQ / 8)
// Shared-memory row stride in halves: +8 halves (16 bytes) puts the 8 row addresses of every
// ldmatrix phase in distinct bank quads (no swizzle needed, cp.async stays 16-byte aligned).
#define FT_LDS (FT_BK + 8)
#define FT_CAP 32  // staged candidates per query per insertion round (one per lane)
#define FT_SENT 0x7fffffff
#define FULL_MASK 0xffffffffu

static_assert(FT_WARPS % FT_WN == 0, "warps must split evenly");
static_assert(FT_WM >= 16 && FT_WM % 16 == 0, "rows per warp: multiple of 16");
static_assert(FT_WQ >= 16 && FT_WQ % 16 == 0, "queries per warp: multiple of 16");
static_assert(FT_MI * FT_NI * 4 <= 64, "one pending bit per accumulator (64 max)");
static_assert(FT_BK % 16 == 0, "k-slice: multiple of 16");
static_assert(FT_KC >= 32 && (FT_KC & (FT_KC - 1)) == 0, "KC: power of two >= 32");

typedef long long i64;
typedef unsigned long long u64;

extern __shared__ __align__(16) unsigned char ft_smem[];

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// Floats as uints whose unsigned order is the float order (atomicMax on scores).
__device__ __forceinline__ unsigned ord_f(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float from_ord(unsigned o) {
    return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Total order on (score, row): ties by row so sorts and merge ranks are well defined.
__device__ __forceinline__ bool better(float s1, int r1, float s2, int r2) {
    return s1 > s2 || (s1 == s2 && r1 < r2);
}

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ void half2_to_floats(unsigned w, float& a, float& b) {
    asm("{.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}\n"
        : "=f"(a), "=f"(b) : "r"(w));
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL_MASK, a, off);
    return a;
}
__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, off));
    return a;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte async copy global -> shared; src_bytes 0 zero-fills (rows past N).
__device__ __forceinline__ void cp_async16(unsigned saddr, const void* g, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g),
                 "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16_pf(unsigned saddr, const void* g, int src_bytes) {
#if FT_PF
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g),
                 "r"(src_bytes) : "memory");
#else
    cp_async16(saddr, g, src_bytes);
#endif
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2,
                                        unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Number of entries of arr (sorted best first, length L) better than (s, r) / better or equal.
template <int L>
__device__ __forceinline__ int count_better(const float* as, const int* ar, float s, int r) {
    int lo = 0, hi = L;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (better(as[mid], ar[mid], s, r)) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
template <int L>
__device__ __forceinline__ int count_better_eq(const float* as, const int* ar, float s, int r) {
    int lo = 0, hi = L;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (!better(s, r, as[mid], ar[mid])) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// One warp: A (LA entries) := best LA of A u B, both sorted best first, in shared memory. Each
// entry's output position is its rank in the union (its index plus the entries of the other list
// ahead of it; A wins ties), so no sort is needed and only positions < LA are written. All reads
// happen before the first write because the writes land in A.
template <int LA, int LB>
__device__ __forceinline__ void warp_merge(float* As, int* Ar, const float* Bs, const int* Br,
                                           int lane) {
    constexpr int UA = LA / 32, UB = LB / 32;
    float av[UA], bv[UB];
    int ar[UA], br[UB], ra[UA], rb[UB];
#pragma unroll
    for (int u = 0; u < UA; ++u) {
        const int i = u * 32 + lane;
        av[u] = As[i];
        ar[u] = Ar[i];
        ra[u] = i + count_better<LB>(Bs, Br, av[u], ar[u]);
    }
#pragma unroll
    for (int u = 0; u < UB; ++u) {
        const int j = u * 32 + lane;
        bv[u] = Bs[j];
        br[u] = Br[j];
        rb[u] = j + count_better_eq<LA>(As, Ar, bv[u], br[u]);
    }
    __syncwarp();
#pragma unroll
    for (int u = 0; u < UA; ++u)
        if (ra[u] < LA) {
            As[ra[u]] = av[u];
            Ar[ra[u]] = ar[u];
        }
#pragma unroll
    for (int u = 0; u < UB; ++u)
        if (rb[u] < LA) {
            As[rb[u]] = bv[u];
            Ar[rb[u]] = br[u];
        }
    __syncwarp();
}

// Bitonic sort of one (score, row) per lane across the warp, best first.
__device__ __forceinline__ void warp_sort(float& s, int& r, int lane) {
#pragma unroll
    for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const float os = __shfl_xor_sync(FULL_MASK, s, stride);
            const int orr = __shfl_xor_sync(FULL_MASK, r, stride);
            const bool want_better = ((lane & stride) == 0) == ((lane & size) == 0);
            if (want_better ? better(os, orr, s, r) : better(s, r, os, orr)) {
                s = os;
                r = orr;
            }
        }
    }
}

// ------------------------------------------------------------------ queries
// Scale: 2^e > max|q_i| / 2^14, so the scaled query fits float16 with room to spare and its
// largest entries are normal numbers (float32 accumulation cannot overflow: |acc| < 2^14 |x|_1).
// One block per query row of the padded tile set (rows >= B are zeros: they score 0 and are never
// offered, their gate being +inf in ft_fused).
extern "C" __global__ void __launch_bounds__(FT_THREADS)
    ft_prep(const float* __restrict__ q32, int B, int D, int Bpad, unsigned short* __restrict__ qh,
            float* __restrict__ qn, float* __restrict__ qscale, unsigned* __restrict__ gate) {
    __shared__ float red_a[FT_WARPS], red_m[FT_WARPS];
    const int b = blockIdx.x;  // one block per query row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned short* dst = qh + (i64)b * D;
    if (b >= B) {
        for (int j = tid; j < D; j += FT_THREADS) dst[j] = 0;
        return;  // block-uniform
    }
    const float* q = q32 + (i64)b * D;
    float a = 0.0f, mx = 0.0f;
    for (int j = tid; j < D; j += FT_THREADS) {
        const float v = q[j];
        a = fmaf(v, v, a);
        mx = fmaxf(mx, fabsf(v));
    }
    a = warp_sum(a);
    mx = warp_max(mx);
    if (lane == 0) {
        red_a[warp] = a;
        red_m[warp] = mx;
    }
    __syncthreads();
    a = 0.0f;
    mx = 0.0f;
#pragma unroll
    for (int w = 0; w < FT_WARPS; ++w) {
        a += red_a[w];
        mx = fmaxf(mx, red_m[w]);
    }
    const float need = mx * (1.0f / 16384.0f);
    int e = 0;
    if (need > 0.0f) {
        if (isfinite(need)) frexpf(need, &e);  // need < 2^e
        else e = 100;  // E is infinite then: the query is flagged and redone by ft_exact
    }
    e = max(-100, min(100, e));
    const float sc = ldexpf(1.0f, -e);
    for (int j = tid; j < D; j += FT_THREADS) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(q[j] * sc));
        dst[j] = h;
    }
    if (tid == 0) {
        qn[b] = a;
        qscale[b] = ldexpf(1.0f, e);
        gate[b] = ord_f(neg_inf());
    }
}

// ------------------------------------------------------------------ fused scoring + selection
// One warp: merge query q's m staged candidates into its sorted list of KC, raise its gate to the
// list's KC-th score, and publish that to the global gate (a reduction: nothing waits for it; the
// blocks read the global gate back once per tile).
__device__ __forceinline__ void list_insert(float* ls, int* lr, float* ss, int* sr, float* sgate,
                                            int* scnt, unsigned* gate, int qbase, int B, int q,
                                            int m, int lane) {
    float sv = neg_inf();
    int rv = FT_SENT;
    if (lane < m) {
        sv = ss[q * FT_CAP + lane];
        rv = sr[q * FT_CAP + lane];
    }
    warp_sort(sv, rv, lane);
    ss[q * FT_CAP + lane] = sv;
    sr[q * FT_CAP + lane] = rv;
    __syncwarp();
    warp_merge<FT_KC, FT_CAP>(ls + q * FT_KC, lr + q * FT_KC, ss + q * FT_CAP, sr + q * FT_CAP,
                              lane);
    if (lane == 0) {
        scnt[q] = 0;
        const float th = ls[q * FT_KC + FT_KC - 1];  // -inf until the list is full
        if (th > sgate[q]) {
            sgate[q] = th;
            if (qbase + q < B) atomicMax(gate + qbase + q, ord_f(th));
        }
    }
    __syncwarp();
}

// FT_NO_MMA_SYNC=1 (fused_wgmma.py) leaves this kernel out: that build reuses only the helpers,
// ft_prep, ft_merge and ft_exact of this file.
#ifndef FT_NO_MMA_SYNC
#define FT_NO_MMA_SYNC 0
#endif
#if !FT_NO_MMA_SYNC
// Shared memory: STAGES x (BM rows + BQ queries) x LDS halves of pipeline, then per query a sorted
// list of KC (score, row), a staging area of CAP (score, row), the gate and the staging count.
extern "C" __global__ void __launch_bounds__(FT_THREADS, FT_MINB)
    ft_fused(const unsigned short* __restrict__ X, int N, int D,
             const unsigned short* __restrict__ Qh, int B, int QY, int P,
             unsigned* __restrict__ gate, float* __restrict__ cand_s, int* __restrict__ cand_r) {
    constexpr int STAGE_H = (FT_BM + FT_BQ) * FT_LDS;
    unsigned short* pipe = reinterpret_cast<unsigned short*>(ft_smem);
    float* ls = reinterpret_cast<float*>(ft_smem + FT_STAGES * STAGE_H * 2);
    int* lr = reinterpret_cast<int*>(ls + FT_BQ * FT_KC);
    float* ss = reinterpret_cast<float*>(lr + FT_BQ * FT_KC);
    int* sr = reinterpret_cast<int*>(ss + FT_BQ * FT_CAP);
    float* sgate = reinterpret_cast<float*>(sr + FT_BQ * FT_CAP);
    int* scnt = reinterpret_cast<int*>(sgate + FT_BQ);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / FT_WN, wn = warp % FT_WN;
    // Query tile fastest: blocks sharing a row part are launched (and run) next to each other.
    const int qt = blockIdx.x % QY, part = blockIdx.x / QY;
    const int qbase = qt * FT_BQ;
    const int T = (N + FT_BM - 1) / FT_BM;
    const int t0 = (int)((i64)T * part / P), t1 = (int)((i64)T * (part + 1) / P);
    const int KS = D / FT_BK;
    const int steps = (t1 - t0) * KS;

    for (int i = tid; i < FT_BQ * FT_KC; i += FT_THREADS) {
        ls[i] = neg_inf();
        lr[i] = FT_SENT;
    }
    if (tid < FT_BQ) {
        sgate[tid] = qbase + tid < B ? from_ord(gate[qbase + tid]) : pos_inf();
        scnt[tid] = 0;
    }
    // (the main loop's first barrier orders these before any use)

    const unsigned pipe_s = smem_u32(pipe);
    const unsigned short* Qb = Qh + (i64)qbase * D;

    // Every block starts at a different k-slice (rot): all blocks run in lockstep, and without the
    // rotation they all read the same query slice from the same L2 lines at the same moment.
    const int rot = FT_ROT ? (int)(blockIdx.x % KS) : 0;
    // Each thread's 16-byte chunks of a stage are fixed: their offsets are computed once, so a
    // stage's copies cost an add and a compare each (the generic loop with divisions and 64-bit
    // products per chunk was a visible share of the issue slots).
    constexpr int RCH = FT_BM * (FT_BK / 8), QCH = FT_BQ * (FT_BK / 8);
    constexpr int RIT = (RCH + FT_THREADS - 1) / FT_THREADS;
    constexpr int QIT = (QCH + FT_THREADS - 1) / FT_THREADS;
    int r_rr[RIT];
    unsigned r_so[RIT], q_so[QIT];
    i64 r_go[RIT], q_go[QIT];
#pragma unroll
    for (int it = 0; it < RIT; ++it) {
        const int c = tid + it * FT_THREADS;
        const int rr = c / (FT_BK / 8), c8 = c % (FT_BK / 8);
        r_rr[it] = rr;
        r_so[it] = (unsigned)((rr * FT_LDS + c8 * 8) * 2);
        r_go[it] = (i64)rr * D + c8 * 8;
    }
#pragma unroll
    for (int it = 0; it < QIT; ++it) {
        const int c = tid + it * FT_THREADS;
        const int qq = c / (FT_BK / 8), c8 = c % (FT_BK / 8);
        q_so[it] = (unsigned)(((FT_BM + qq) * FT_LDS + c8 * 8) * 2);
        q_go[it] = (i64)qq * D + c8 * 8;
    }
    auto load = [&](int tile, int kl, int buf) {
        int kb = kl + rot;
        if (kb >= KS) kb -= KS;
        const unsigned sbase = pipe_s + buf * STAGE_H * 2;
        const unsigned short* gt = X + (i64)tile * FT_BM * D + kb * FT_BK;
        const int rows_left = N - tile * FT_BM;
#pragma unroll
        for (int it = 0; it < RIT; ++it) {
            if (RCH % FT_THREADS == 0 || tid + it * FT_THREADS < RCH) {
                const bool ok = r_rr[it] < rows_left;
                cp_async16_pf(sbase + r_so[it], ok ? gt + r_go[it] : X, ok ? 16 : 0);
            }
        }
        const unsigned short* gq = Qb + kb * FT_BK;
#pragma unroll
        for (int it = 0; it < QIT; ++it)
            if (QCH % FT_THREADS == 0 || tid + it * FT_THREADS < QCH)
                cp_async16(sbase + q_so[it], gq + q_go[it], 16);
    };
    // The next step to load, as (tile, k-slice) counters (no divisions in the loop).
    int ld_tile = t0, ld_k = 0, ld_buf = 0;
    auto load_next = [&]() {
        load(ld_tile, ld_k, ld_buf);
        if (++ld_k == KS) {
            ld_k = 0;
            ++ld_tile;
        }
        if (++ld_buf == FT_STAGES) ld_buf = 0;
    };

    float acc[FT_MI][FT_NI][4];
#pragma unroll
    for (int i = 0; i < FT_MI; ++i)
#pragma unroll
        for (int j = 0; j < FT_NI; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < FT_STAGES - 1; ++s) {
        if (s < steps) load_next();
        cp_commit();
    }
    int c_tile = t0, c_k = 0, c_buf = 0;  // the step being computed
    // The global gate is read one tile ahead of its use, so its L2 round trip overlaps a whole
    // tile of work instead of stalling the epilogue (it stalled every block once per tile).
    unsigned gprev = ord_f(neg_inf());
    if (tid < FT_BQ && qbase + tid < B) gprev = *(volatile unsigned*)(gate + qbase + tid);

    // ldmatrix lane offsets (halves) within a stage: A = rows (m16 x k16, row-major), B = queries
    // stored [query][k], i.e. the "col" operand of mma directly.
    const int a_off = (wm * FT_WM + (lane & 15)) * FT_LDS + (lane >> 4) * 8;
    const int b_off = (FT_BM + wn * FT_WQ + (lane & 7) + ((lane >> 4) << 3)) * FT_LDS +
                      ((lane >> 3) & 1) * 8;

    for (int s = 0; s < steps; ++s) {
        cp_wait<FT_STAGES - 2>();
        __syncthreads();
        // Refill the buffer consumed in step s - 1 (every thread is past it: the barrier).
        if (s + FT_STAGES - 1 < steps) load_next();
        cp_commit();
        const unsigned sbase = pipe_s + c_buf * STAGE_H * 2;
        if (++c_buf == FT_STAGES) c_buf = 0;
        // Fragments double-buffered across the k16 steps of a stage: the ldmatrix of step kk + 1
        // is issued before the mma of step kk, so the tensor cores do not wait on shared memory
        // (the asm statements are volatile, so source order is issue order).
        unsigned a[2][FT_MI][4], b[2][FT_NI][2];
        auto frags = [&](int kk, int buf) {
#pragma unroll
            for (int i = 0; i < FT_MI; ++i)
                ldsm_x4(sbase + (a_off + i * 16 * FT_LDS + kk * 16) * 2, a[buf][i][0], a[buf][i][1],
                        a[buf][i][2], a[buf][i][3]);
#pragma unroll
            for (int jj = 0; jj < FT_NI / 2; ++jj)
                ldsm_x4(sbase + (b_off + jj * 16 * FT_LDS + kk * 16) * 2, b[buf][2 * jj][0],
                        b[buf][2 * jj][1], b[buf][2 * jj + 1][0], b[buf][2 * jj + 1][1]);
        };
        frags(0, 0);
#pragma unroll
        for (int kk = 0; kk < FT_BK / 16; ++kk) {
            if (kk + 1 < FT_BK / 16) frags(kk + 1, (kk + 1) & 1);
#pragma unroll
            for (int i = 0; i < FT_MI; ++i)
#pragma unroll
                for (int j = 0; j < FT_NI; ++j)
                    mma16816(acc[i][j], a[kk & 1][i], b[kk & 1][j][0], b[kk & 1][j][1]);
        }
        if (++c_k != KS) continue;
        c_k = 0;
        const int tile = c_tile++;
#if FT_NOEPI
        {
            float t = 0.0f;
#pragma unroll
            for (int i = 0; i < FT_MI; ++i)
#pragma unroll
                for (int j = 0; j < FT_NI; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        t += acc[i][j][e];
                        acc[i][j][e] = 0.0f;
                    }
            if (t == 1.2345e-30f) cand_s[0] = t;  // keeps the multiply alive
            continue;
        }
#endif

        // ---- epilogue of one row tile: the accumulators hold its BM x BQ scores (scaled).
        // Fragment layout: acc[i][j][e] is row wm*WM + i*16 + lane/4 + 8*(e>>1), query
        // wn*WQ + j*8 + 2*(lane%4) + (e&1).
        const i64 rbase = (i64)tile * FT_BM + wm * FT_WM + (lane >> 2);
        const int rleft = N - (int)rbase;  // rows of this thread's fragments: rbase + 0..WM-1
        const int qcol = wn * FT_WQ + 2 * (lane & 3);
        u64 pend = 0;
        {
            float gq[FT_NI][2];
#pragma unroll
            for (int j = 0; j < FT_NI; ++j) {
                gq[j][0] = sgate[qcol + j * 8];
                gq[j][1] = sgate[qcol + j * 8 + 1];
            }
#pragma unroll
            for (int i = 0; i < FT_MI; ++i)
#pragma unroll
                for (int j = 0; j < FT_NI; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        if (i * 16 + (e >> 1) * 8 < rleft && acc[i][j][e] > gq[j][e & 1])
                            pend |= 1ull << ((i * FT_NI + j) * 4 + e);
                    }
        }
        // Survivors are appended to the query's staging area; only a full one (CAP entries) is
        // merged into the list, by one warp per query, and survivors that found it full stay
        // pending for the next round. Merging lazily (not every tile) matters: a merge is a
        // latency-bound chain of shuffles and searches (~1-2k cycles), and with per-tile merging
        // the first ~KC tiles of every block merged every query (measured: 4.2 ms at B = 256).
        while (__syncthreads_or(pend != 0)) {
            int filled = 0;  // this thread took a staging area's last slot
#pragma unroll
            for (int i = 0; i < FT_MI; ++i)
#pragma unroll
                for (int j = 0; j < FT_NI; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 bit = 1ull << ((i * FT_NI + j) * 4 + e);
                        if (pend & bit) {
                            const int q = qcol + j * 8 + (e & 1);
                            const float v = acc[i][j][e];
                            if (v > sgate[q]) {
                                const int pos = atomicAdd(&scnt[q], 1);
                                if (pos < FT_CAP) {
                                    ss[q * FT_CAP + pos] = v;
                                    sr[q * FT_CAP + pos] = (int)(rbase + i * 16 + (e >> 1) * 8);
                                    pend &= ~bit;
                                    filled |= pos == FT_CAP - 1;
                                }
                            } else {
                                pend &= ~bit;
                            }
                        }
                    }
            // No area filled up: nothing to merge, and nothing is left pending (a failed push
            // implies a full area), so the tile is done with one barrier fewer.
            if (!__syncthreads_or(filled)) break;
            for (int q = warp; q < FT_BQ; q += FT_WARPS)
                if (scnt[q] >= FT_CAP)  // warp-uniform
                    list_insert(ls, lr, ss, sr, sgate, scnt, gate, qbase, B, q, FT_CAP, lane);
        }
        if (tid < FT_BQ && qbase + tid < B) {
            sgate[tid] = fmaxf(sgate[tid], from_ord(gprev));  // read one tile ago
            gprev = *(volatile unsigned*)(gate + qbase + tid);
        }
#pragma unroll
        for (int i = 0; i < FT_MI; ++i)
#pragma unroll
            for (int j = 0; j < FT_NI; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    }
    __syncthreads();
    for (int q = warp; q < FT_BQ; q += FT_WARPS) {
        const int c = scnt[q];
        if (c > 0) list_insert(ls, lr, ss, sr, sgate, scnt, gate, qbase, B, q, c, lane);
    }
    __syncthreads();
    for (int i = tid; i < FT_BQ * FT_KC; i += FT_THREADS) {
        const int q = i / FT_KC;
        if (qbase + q < B) {
            const i64 o = ((i64)(qbase + q) * P + part) * FT_KC + (i % FT_KC);
            cand_s[o] = ls[i];
            cand_r[o] = lr[i];
        }
    }
}

#endif  // !FT_NO_MMA_SYNC
// ------------------------------------------------------------------ merge, rescore, prove
// One block of 32 warps per query. Shared: P lists of KC (score, row), then KC exact scores and rows.
extern "C" __global__ void __launch_bounds__(FT_MTHREADS)
    ft_merge(const float* __restrict__ cand_s, const int* __restrict__ cand_r, int P,
             const unsigned short* __restrict__ X, int D, const float* __restrict__ q32,
             const float* __restrict__ qn, const float* __restrict__ qscale, float xmax, int kk,
             long long* __restrict__ out_r, float* __restrict__ out_s, int* __restrict__ flags) {
    float* ls = reinterpret_cast<float*>(ft_smem);
    int* lr = reinterpret_cast<int*>(ls + P * FT_KC);
    float* es = reinterpret_cast<float*>(lr + P * FT_KC);
    int* er = reinterpret_cast<int*>(es + FT_KC);
    const int b = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 base = (i64)b * P * FT_KC;
    for (int i = tid; i < P * FT_KC; i += FT_MTHREADS) {
        ls[i] = cand_s[base + i];
        lr[i] = cand_r[base + i];
    }
    __syncthreads();
    for (int w = 1; w < P; w <<= 1) {
        for (int p = warp * 2 * w; p + w < P; p += (FT_MTHREADS / 32) * 2 * w)
            warp_merge<FT_KC, FT_KC>(ls + p * FT_KC, lr + p * FT_KC, ls + (p + w) * FT_KC,
                                     lr + (p + w) * FT_KC, lane);
        __syncthreads();
    }
    // Rescore the KC candidates in float32 against the float32 query (one warp per candidate).
    const float* q = q32 + (i64)b * D;
    for (int c = warp; c < FT_KC; c += FT_MTHREADS / 32) {
        const int r = lr[c];  // warp-uniform
        float a = 0.0f;
        if (r != FT_SENT) {
            const unsigned short* x = X + (i64)r * D;
            for (int j = lane * 8; j < D; j += 256) {
                const uint4 u = *reinterpret_cast<const uint4*>(x + j);
                float f[8];
                half2_to_floats(u.x, f[0], f[1]);
                half2_to_floats(u.y, f[2], f[3]);
                half2_to_floats(u.z, f[4], f[5]);
                half2_to_floats(u.w, f[6], f[7]);
#pragma unroll
                for (int t = 0; t < 8; ++t) a = fmaf(q[j + t], f[t], a);
            }
        }
        a = warp_sum(a);
        if (lane == 0) {
            es[c] = r == FT_SENT ? neg_inf() : a;
            er[c] = r;
        }
    }
    // Block bitonic sort of the KC rescored candidates, best first.
    for (int size = 2; size <= FT_KC; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = tid; t < FT_KC / 2; t += FT_MTHREADS) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const bool desc = (i & size) == 0;
                const float si = es[i], sj = es[j];
                const int ri = er[i], rj = er[j];
                if (desc ? better(sj, rj, si, ri) : better(si, ri, sj, rj)) {
                    es[i] = sj;
                    er[i] = rj;
                    es[j] = si;
                    er[j] = ri;
                }
            }
        }
    }
    __syncthreads();
    for (int t = tid; t < kk; t += FT_MTHREADS) {
        out_s[(i64)b * kk + t] = es[t];
        out_r[(i64)b * kk + t] = er[t] == FT_SENT ? -1LL : (long long)er[t];
    }
    if (tid == 0) {
        const float tk = es[kk - 1];
        const int last_r = lr[FT_KC - 1];
        const float qs = qscale[b];
        const float last = ls[FT_KC - 1] * qs;  // approximate score, unscaled (exact: 2^e)
        const float qx = sqrtf(qn[b]) * xmax;   // bounds |q||x| and |q.x| for every row
        const float ev = 1.25f * (qx * (ldexpf(1.0f, -10) + (float)D * ldexpf(1.0f, -23)) +
                                  qs * ldexpf(1.0f, -25) * (sqrtf((float)D) * xmax + 1.0f));
        flags[b] = (last_r != FT_SENT && !(tk >= last + ev)) ? 1 : 0;
    }
}

// ------------------------------------------------------------------ fallback
// float32 scores of every row for F flagged queries: S[f][r] = q32[qidx[f]] . X[r]. Grid
// (blocks, F), one warp per row at a time.
extern "C" __global__ void __launch_bounds__(FT_THREADS)
    ft_exact(const unsigned short* __restrict__ X, int N, int D, const float* __restrict__ q32,
             const int* __restrict__ qidx, float* __restrict__ S) {
    const int f = blockIdx.y;
    const float* q = q32 + (i64)qidx[f] * D;
    const int lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (FT_THREADS / 32);
    for (i64 r = (i64)blockIdx.x * (FT_THREADS / 32) + (threadIdx.x >> 5); r < N; r += nw) {
        const unsigned short* x = X + r * D;
        float a = 0.0f;
        for (int j = lane * 8; j < D; j += 256) {
            const uint4 u = *reinterpret_cast<const uint4*>(x + j);
            float v[8];
            half2_to_floats(u.x, v[0], v[1]);
            half2_to_floats(u.y, v[2], v[3]);
            half2_to_floats(u.z, v[4], v[5]);
            half2_to_floats(u.w, v[6], v[7]);
#pragma unroll
            for (int t = 0; t < 8; ++t) a = fmaf(q[j + t], v[t], a);
        }
        a = warp_sum(a);
        if (lane == 0) S[(i64)f * N + r] = a;
    }
}
