// The "wgmma" search path of the CUDA backend (sm_90a, Hopper): fused float16 tensor-core scoring
// and exact top-k, without a B x N score matrix. From the measured prototype in bench/fused/
// (fused_topk.cu + fused_wgmma.cu, NOTES.md "wgmma version"); wgmma.py compiles it with NVRTC for
// sm_90a (wgmma.mma_async exists only there) and hands every constant over as -D (see below).
//
// One search = three launches on the backend's stream (queries already copied to the device):
//   kw_prep   float32 queries -> float16 queries scaled by a power of two (qscale), |q|^2, and the
//             per-query global gate reset to -inf. One block per query row of the padded tile.
//   kw_fused  grid = P row parts x QY query tiles, one CTA per SM (one wave), 3 warpgroups:
//     warpgroup 0 (producer): cp.async 16-byte copies of the next (row tile, 64-half k-slice)
//       step into a FW_STAGES-deep ring of shared-memory stages in the 128-byte-swizzled K-major
//       layout wgmma reads (chunk c of row r at chunk c ^ (r % 8)); it waits for its own copies
//       FW_LAG steps later, fences them to the async proxy and arrives on the stage's "full"
//       mbarrier. Rows past N are zero-filled (only rows [0, N) are ever read).
//     warpgroups 1, 2 (consumers): rows 0-63 / 64-127 of each 128-row tile: 4 x
//       wgmma.mma_async.m64n{BQ}k16.f32.f16.f16 per stage; after a tile's last k-slice the
//       accumulators (its 128 x BQ scaled scores) go through the gated selection: per-query sorted
//       lists of KC candidates, staging areas of CAP, lazy warp merges, a global gate by atomicMax
//       on order-preserving uints (read back one tile late). Each CTA writes its lists to
//       cand[B][P][KC].
//   kw_merge  one block per query: tree-merges the P lists into the global top-KC by approximate
//             score, rescores those KC rows in float32 against the float32 query, sorts them and
//             writes the top kk (int32 rows, float32 scores) and a flag where the proof fails,
//             straight into the backend's answer buffer (pinned host memory).
// kw_exact (float32 scores of every row, for the backend's top-k kernel) redoes flagged queries.
//
// Exactness: the approximate score a of a row differs from its float32 score s by at most
// E = 1.25 (|q| xmax (2^-10 + D 2^-23) + qscale 2^-25 (sqrt(D) xmax + 1)) (query rounding to
// float16, subnormal underflow of the scaled query, tensor-core and float32 accumulation; xmax
// bounds every row norm). Rows outside the KC candidates have a <= last (the KC-th candidate's
// approximate score), so if the kk-th rescored score tk >= last + E the answer is the exact top-kk
// under float32 scores; otherwise the query is flagged and the host redoes it.
//
// ptxas pitfall (warning C7518, "wgmma serialized ... divergent path"): any branch ptxas thinks
// may diverge in the consumer loop makes it wait after every wgmma; the mbarrier arrive is
// predicated inside the asm, the vote and the warp index are broadcast through __shfl_sync.

#if !defined(FW_BQ) || !defined(FW_STAGES) || !defined(FT_KC) || !defined(FT_CAP) || \
    !defined(FT_WARPS) || !defined(FT_MTHREADS) || !defined(FT_PF)
#error "compile through wgmma.py: every constant comes from -D options"
#endif
#define FT_THREADS (FT_WARPS * 32)  // kw_prep / kw_exact block size
#define FT_SENT 0x7fffffff
#define FULL_MASK 0xffffffffu
#define FW_BM 128  // rows per tile (2 consumer warpgroups x 64)
#define FW_BK 64   // halves per stage: one 128-byte swizzle line per row (D % 64 == 0)
#define FW_THREADS 384
#define FW_NACC (FW_BQ / 2)
#define FW_LAG (FW_STAGES - 2)  // producer waits for the copies of step i - LAG (LAG <= S - 2)
#define FW_A_BYTES (FW_BM * 128)
#define FW_B_BYTES (FW_BQ * 128)
#define FW_STAGE_BYTES (FW_A_BYTES + FW_B_BYTES)

static_assert(FT_KC >= 32 && (FT_KC & (FT_KC - 1)) == 0, "KC: power of two >= 32");
static_assert(FT_CAP == 32, "staging areas hold one candidate per lane");
static_assert(FW_BQ >= 16 && FW_BQ <= 128 && FW_BQ % 16 == 0, "FW_BQ: 16..128, multiple of 16");
static_assert(FW_STAGES >= 3, "at least 3 stages");
static_assert(FW_NACC <= 64, "one pending bit per accumulator");
static_assert(FW_STAGE_BYTES % 1024 == 0, "stages must stay 1024-byte aligned");

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


__device__ __forceinline__ void half2_to_floats(unsigned w, float& a, float& b) {
    asm("{.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}\n"
        : "=f"(a), "=f"(b) : "r"(w));
}

// This lane's part of the float32 dot product of query q with float16 row x (8 halves per 16-byte
// load, lanes interleaved); warp_sum adds the parts. The merge's rescore and the exact redo both
// use it, so a row gets the same float32 score from either.
__device__ __forceinline__ float lane_dot(const float* q, const unsigned short* x, int D, int lane) {
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
    return a;
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
// offered, their gate being +inf in kw_fused).
extern "C" __global__ void __launch_bounds__(FT_THREADS)
    kw_prep(const float* __restrict__ q32, int B, int D, int Bpad, unsigned short* __restrict__ qh,
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
        else e = 100;  // E is infinite then: the query is flagged and redone by the host
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

// ------------------------------------------------------------------ wgmma scoring + selection
// fw_mma(acc, desc_a, desc_b, scale_d): one wgmma.mma_async.m64n{FW_BQ}k16.f32.f16.f16; its FW_BQ / 2
// accumulators are listed as asm operands (the count is part of the instruction), so wgmma.py
// generates it for the compiled FW_BQ and puts it in place of the next line.
// @FW_MMA@

__device__ __forceinline__ void mb_init(unsigned a, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(a), "r"(count) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned a) {
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a)
                 : "memory");
}
// The spin loop lives inside the asm: a C++ loop on a per-thread flag looks divergent to ptxas,
// which then serializes the wgmma instructions after it (warning C7518).
// Arrive from lane 0 only, predicated inside the asm (a C++ "if (lane == 0)" around it makes the
// wgmma path divergent to ptxas: C7518 again).
__device__ __forceinline__ void mb_arrive_lane0(unsigned a, int lane) {
    asm volatile("{\n\t.reg .pred p;\n\t.reg .b64 st;\n\tsetp.eq.s32 p, %1, 0;\n\t"
                 "@p mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(a), "r"(lane)
                 : "memory");
}
__device__ __forceinline__ void mb_wait(unsigned a, unsigned parity) {
    asm volatile(
        "{\n\t.reg .pred p;\n"
        "MBW_WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
        "@!p bra MBW_WAIT;\n}\n" ::"r"(a), "r"(parity) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator accesses across the asynchronous wgmma window.
__device__ __forceinline__ void acc_fence(float (&d)[FW_NACC]) {
#pragma unroll
    for (int i = 0; i < FW_NACC; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart
// (stride byte offset), leading byte offset unused for swizzled K-major (1 by convention).
__device__ __forceinline__ u64 fw_desc(unsigned saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);
}
// Consumer-only barriers (named barrier 1, the 256 consumer threads).
__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }
__device__ __forceinline__ int cbar_or(int v) {
    int r;
    asm volatile(
        "{\n\t.reg .pred p, q;\n\tsetp.ne.s32 p, %1, 0;\n\tbar.red.or.pred q, 1, 256, p;\n\t"
        "selp.s32 %0, 1, 0, q;\n}\n"
        : "=r"(r) : "r"(v) : "memory");
    // the same value in every thread, but ptxas cannot tell: a loop on it made the wgmma path
    // "divergent" (C7518, serialized wgmma); a shuffle makes it provably warp-uniform
    return __shfl_sync(FULL_MASK, r, 0);
}

// Shared memory (dynamic, aligned up to 1024 here): FW_STAGES stages of [rows | queries], then per
// query a sorted list of KC (score, row), a staging area of CAP, the gate and the staging count,
// then the 2 x FW_STAGES mbarriers (full, empty).
extern "C" __global__ void __launch_bounds__(FW_THREADS, 1)
    kw_fused(const unsigned short* __restrict__ X, int N, int D,
             const unsigned short* __restrict__ Qh, int B, int QY, int P,
             unsigned* __restrict__ gate, float* __restrict__ cand_s, int* __restrict__ cand_r) {
    const unsigned raw = smem_u32(ft_smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    unsigned char* sm = ft_smem + (base - raw);
    float* ls = reinterpret_cast<float*>(sm + FW_STAGES * FW_STAGE_BYTES);
    int* lr = reinterpret_cast<int*>(ls + FW_BQ * FT_KC);
    float* ss = reinterpret_cast<float*>(lr + FW_BQ * FT_KC);
    int* sr = reinterpret_cast<int*>(ss + FW_BQ * FT_CAP);
    float* sgate = reinterpret_cast<float*>(sr + FW_BQ * FT_CAP);
    int* scnt = reinterpret_cast<int*>(sgate + FW_BQ);
    const unsigned bar_full = smem_u32(scnt + FW_BQ);  // 8-byte aligned: everything above is
    const unsigned bar_empty = bar_full + 8 * FW_STAGES;  // a multiple of 8 bytes

    const int tid = threadIdx.x, lane = tid & 31;
    // warp index through a shuffle: provably warp-uniform, so the role branches below are not
    // "divergent paths" to ptxas (else it serializes the wgmma instructions, warning C7518)
    const int warp = __shfl_sync(FULL_MASK, tid >> 5, 0);
    const int qt = blockIdx.x % QY, part = blockIdx.x / QY;
    const int qbase = qt * FW_BQ;
    const int T = (N + FW_BM - 1) / FW_BM;
    const int t0 = (int)((i64)T * part / P), t1 = (int)((i64)T * (part + 1) / P);
    const int KS = D / FW_BK;
    const int steps = (t1 - t0) * KS;

    for (int i = tid; i < FW_BQ * FT_KC; i += FW_THREADS) {
        ls[i] = neg_inf();
        lr[i] = FT_SENT;
    }
    if (tid < FW_BQ) {
        sgate[tid] = qbase + tid < B ? from_ord(gate[qbase + tid]) : pos_inf();
        scnt[tid] = 0;
    }
    if (tid == 0) {
        for (int s = 0; s < FW_STAGES; ++s) {
            mb_init(bar_full + 8 * s, 128);  // every producer thread, after its copies landed
            mb_init(bar_empty + 8 * s, 8);   // lane 0 of every consumer warp
        }
    }
    __syncthreads();

    if (warp < 4) {
        // ---------------------------------------------------------------- producer
        // Thread p owns 16-byte chunk c8 = p % 8 of rows p / 8 + 16 i: its swizzled column offset
        // is the same for all of them (16 i does not change r % 8).
        const int c8 = tid & 7, r0 = tid >> 3;
        const unsigned swz = (unsigned)((c8 ^ (r0 & 7)) * 16);
        const unsigned short* Qb = Qh + (i64)qbase * D;
        int tile = t0, kb = 0, buf = 0, round = 0;
        for (int i = 0; i < steps; ++i) {
            if (i >= FW_STAGES) mb_wait(bar_empty + 8 * buf, (round + 1) & 1);
            const unsigned sA = base + buf * FW_STAGE_BYTES;
            const unsigned sB = sA + FW_A_BYTES;
            const int rows_left = N - tile * FW_BM;
            const unsigned short* g = X + ((i64)tile * FW_BM + r0) * D + kb * FW_BK + c8 * 8;
#pragma unroll
            for (int it = 0; it < FW_BM / 16; ++it) {
                const int r = r0 + 16 * it;
                const bool ok = r < rows_left;
                cp_async16_pf(sA + r * 128 + swz, ok ? g + (i64)16 * it * D : X, ok ? 16 : 0);
            }
            const unsigned short* gq = Qb + (i64)r0 * D + kb * FW_BK + c8 * 8;
#pragma unroll
            for (int it = 0; it < FW_BQ / 16; ++it)
                cp_async16(sB + (r0 + 16 * it) * 128 + swz, gq + (i64)16 * it * D, 16);
            cp_commit();
            if (i >= FW_LAG) {
                cp_wait<FW_LAG>();
                fence_proxy_async();
                const int j = i - FW_LAG;
                mb_arrive(bar_full + 8 * (j % FW_STAGES));
            }
            if (++kb == KS) {
                kb = 0;
                ++tile;
            }
            if (++buf == FW_STAGES) {
                buf = 0;
                ++round;
            }
        }
        cp_wait<0>();
        fence_proxy_async();
        for (int j = steps - FW_LAG < 0 ? 0 : steps - FW_LAG; j < steps; ++j)
            mb_arrive(bar_full + 8 * (j % FW_STAGES));
    } else {
        // ---------------------------------------------------------------- consumers
        // Deadlock-free: the consumer frees step s - 1 only after the wgmma of step s is issued,
        // which needs step s full, which the producer signals at its iteration s + LAG, which
        // waits for step s + LAG - S <= s - 2 to be freed (LAG <= S - 2).
        const int ctid = tid - 128, cw = warp - 4, wg = cw >> 2;
        float acc[FW_NACC];
#pragma unroll
        for (int i = 0; i < FW_NACC; ++i) acc[i] = 0.0f;
        unsigned gprev = ord_f(neg_inf());
        if (ctid < FW_BQ && qbase + ctid < B) gprev = *(volatile unsigned*)(gate + qbase + ctid);
        int c_tile = t0, c_k = 0, buf = 0, round = 0, prev_buf = -1;
        for (int s = 0; s < steps; ++s) {
            mb_wait(bar_full + 8 * buf, round & 1);
            const unsigned sA = base + buf * FW_STAGE_BYTES + wg * (64 * 128);
            const unsigned sB = base + buf * FW_STAGE_BYTES + FW_A_BYTES;
            const u64 da = fw_desc(sA), db = fw_desc(sB);
            wg_fence();
            acc_fence(acc);
#pragma unroll
            for (int kk = 0; kk < FW_BK / 16; ++kk)
                fw_mma(acc, da + 2 * kk, db + 2 * kk, (c_k > 0 || kk > 0) ? 1 : 0);
            wg_commit();
            const bool last = c_k + 1 == KS;
            if (!last) {
                wg_wait<1>();
                acc_fence(acc);
                if (prev_buf >= 0) mb_arrive_lane0(bar_empty + 8 * prev_buf, lane);
                prev_buf = buf;
            } else {
                wg_wait<0>();
                acc_fence(acc);
                if (prev_buf >= 0) mb_arrive_lane0(bar_empty + 8 * prev_buf, lane);
                mb_arrive_lane0(bar_empty + 8 * buf, lane);
                prev_buf = -1;
            }
            if (++buf == FW_STAGES) {
                buf = 0;
                ++round;
            }
            if (!last) {
                ++c_k;
                continue;
            }
            c_k = 0;
            const int tile = c_tile++;
            // ---- epilogue of one row tile: acc[4 j + e] = row rbase + 8 (e >> 1), query
            // qcol + 8 j + (e & 1) (scaled scores).
            const i64 rbase = (i64)tile * FW_BM + wg * 64 + (cw & 3) * 16 + (lane >> 2);
            const int rleft = N - (int)rbase;
            const int qcol = 2 * (lane & 3);
            cbar();  // the gate updates of the last tile are visible
            u64 pend = 0;
#pragma unroll
            for (int j = 0; j < FW_BQ / 8; ++j) {
                const float g0 = sgate[qcol + j * 8], g1 = sgate[qcol + j * 8 + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if ((e >> 1) * 8 < rleft && acc[j * 4 + e] > ((e & 1) ? g1 : g0))
                        pend |= 1ull << (j * 4 + e);
            }
            while (cbar_or(pend != 0)) {
                int filled = 0;
#pragma unroll
                for (int j = 0; j < FW_BQ / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const u64 bit = 1ull << (j * 4 + e);
                        if (pend & bit) {
                            const int q = qcol + j * 8 + (e & 1);
                            const float v = acc[j * 4 + e];
                            if (v > sgate[q]) {
                                const int pos = atomicAdd(&scnt[q], 1);
                                if (pos < FT_CAP) {
                                    ss[q * FT_CAP + pos] = v;
                                    sr[q * FT_CAP + pos] = (int)(rbase + (e >> 1) * 8);
                                    pend &= ~bit;
                                    filled |= pos == FT_CAP - 1;
                                }
                            } else {
                                pend &= ~bit;
                            }
                        }
                    }
                if (!cbar_or(filled)) break;
                for (int q = cw; q < FW_BQ; q += 8)
                    if (scnt[q] >= FT_CAP)  // warp-uniform
                    {
                        list_insert(ls, lr, ss, sr, sgate, scnt, gate, qbase, B, q, FT_CAP, lane);
                    }
            }
            if (ctid < FW_BQ && qbase + ctid < B) {
                sgate[ctid] = fmaxf(sgate[ctid], from_ord(gprev));  // read one tile ago
                gprev = *(volatile unsigned*)(gate + qbase + ctid);
            }
        }
    }
    __syncthreads();
    for (int q = warp; q < FW_BQ; q += FW_THREADS / 32) {
        const int c = scnt[q];
        if (c > 0) list_insert(ls, lr, ss, sr, sgate, scnt, gate, qbase, B, q, c, lane);
    }
    __syncthreads();
    for (int i = tid; i < FW_BQ * FT_KC; i += FW_THREADS) {
        const int q = i / FT_KC;
        if (qbase + q < B) {
            const i64 o = ((i64)(qbase + q) * P + part) * FT_KC + (i % FT_KC);
            cand_s[o] = ls[i];
            cand_r[o] = lr[i];
        }
    }
}

// ------------------------------------------------------------------ merge, rescore, prove
// One block of 32 warps per query. Shared: P lists of KC (score, row), then KC exact scores and rows.
extern "C" __global__ void __launch_bounds__(FT_MTHREADS)
    kw_merge(const float* __restrict__ cand_s, const int* __restrict__ cand_r, int P,
             const unsigned short* __restrict__ X, int D, const float* __restrict__ q32,
             const float* __restrict__ qn, const float* __restrict__ qscale, float xmax, int kk,
             int* __restrict__ out_r, float* __restrict__ out_s, int* __restrict__ flags) {
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
        if (r != FT_SENT) a = lane_dot(q, X + (i64)r * D, D, lane);
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
        out_r[(i64)b * kk + t] = er[t] == FT_SENT ? -1 : er[t];
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
// float32 scores of rows [0, N) for F queries: S[f][r] = q32[f] . X[r] (the layout cuBLAS writes
// on the GEMM path, so the backend's top-k kernel selects from it). Grid (blocks, F), one warp per
// row at a time. X may be a chunk of the stored rows (the backend offsets it).
extern "C" __global__ void __launch_bounds__(FT_THREADS)
    kw_exact(const unsigned short* __restrict__ X, int N, int D, const float* __restrict__ q32,
             float* __restrict__ S) {
    const int f = blockIdx.y;
    const float* q = q32 + (i64)f * D;
    const int lane = threadIdx.x & 31;
    const i64 nw = (i64)gridDim.x * (FT_THREADS / 32);
    for (i64 r = (i64)blockIdx.x * (FT_THREADS / 32) + (threadIdx.x >> 5); r < N; r += nw) {
        float a = lane_dot(q, X + r * D, D, lane);
        a = warp_sum(a);
        if (lane == 0) S[(i64)f * N + r] = a;
    }
}
