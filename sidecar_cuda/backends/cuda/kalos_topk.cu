// Exact top-k similarity search for the Kalos sidecar.
//
// Compiled once per process by cupy.RawModule (NVRTC, for the device's own architecture). Every
// constant the host code shares with these kernels comes from sidecar_cuda/backends/cuda/kernels.py
// as a -D option (compile_options); none has a default here, so a build without them fails:
//   KALOS_STORAGE      0|1|2: matrix rows stored as float32, float16 or bfloat16 (the two 16-bit
//                      formats are held as raw unsigned shorts and widened here; no CUDA headers)
//   KALOS_VEC          storage elements per 16-byte vector (rows are padded to 16 bytes)
//   KALOS_BLOCK        threads per block of every search kernel
//   KALOS_HEADER_INTS  int32 words of the request header before the queries
//   KALOS_HC           candidates rescored per query on the half-score path (one per lane)
// All arithmetic accumulates in float32.
//
// Layout shared with sidecar_cuda/backends/cuda/ (backend.py, paths.py):
//   matrix X      store_t [capacity][dpad]  rows padded with zeros to dpad (16-byte rows)
//   sqn           float   [capacity]        squared norm of each stored (rounded) row, for l2
//   request       int32 header[16] = {n, B, k, l2, 0...} then float32 queries [B][dpad]
//   candidates    float/int [B][P][k]       per-(query, partition) top-k lists, best first
//   counters      uint32 [tiles or B]       zero between launches; the last block resets its own
//   output        float/int [B][kk]         written straight into mapped pinned host memory
//
// Two selection schemes, both exact (ties may come back in any order):
//   * k <= 32, "warp lists": each warp keeps a sorted top-k per query in registers, one entry per
//     lane; a candidate is inserted only if it beats the list's k-th score (a ballot, then a shift).
//     Warps are merged through shared memory, blocks through the candidate array: the last block
//     to finish (a counter plus __threadfence, the classic "threadFenceReduction" pattern) merges
//     every block's list, so a search is one launch.
//   * k > 32, "block buffer": candidates above a running threshold are appended to a shared-memory
//     buffer of C = next_pow2(k + blockDim) entries; whenever it could overflow within the next
//     step it is bitonic-sorted and cut back to k, which raises the threshold.

#if !defined(KALOS_STORAGE) || !defined(KALOS_VEC) || !defined(KALOS_BLOCK) || \
    !defined(KALOS_HEADER_INTS) || !defined(KALOS_HC)
#error "compile with the -D options of sidecar_cuda/backends/cuda/kernels.py (compile_options)"
#endif
#if KALOS_HC != 32
#error "KALOS_HC must be 32: kalos_rescore_h gives each lane of a warp one candidate"
#endif
#if KALOS_BLOCK % 32 != 0
#error "KALOS_BLOCK must be a whole number of warps"
#endif

#define FULL_MASK 0xffffffffu
#define VEC KALOS_VEC

typedef long long i64;

#if KALOS_STORAGE == 0
typedef float store_t;
#else
typedef unsigned short store_t;
#endif
#if KALOS_VEC * (KALOS_STORAGE == 0 ? 4 : 2) != 16
#error "KALOS_VEC must fill 16 bytes with the storage type"
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Dynamic shared memory of every kernel that takes some (one declaration: NVRTC links them).
extern __shared__ __align__(16) unsigned char kalos_smem[];

// ------------------------------------------------------------------ storage conversions
__device__ __forceinline__ void half2_to_floats(unsigned w, float& a, float& b) {
    asm("{.reg .f16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;}\n"
        : "=f"(a), "=f"(b) : "r"(w));
}

__device__ __forceinline__ void bf162_to_floats(unsigned w, float& a, float& b) {
    a = __uint_as_float(w << 16);
    b = __uint_as_float(w & 0xffff0000u);
}

// Saturating round-to-nearest-even into the storage format (a row never holds an infinity).
__device__ __forceinline__ store_t to_store(float x) {
#if KALOS_STORAGE == 0
    return x;
#elif KALOS_STORAGE == 1
    x = fminf(fmaxf(x, -65504.0f), 65504.0f);
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    x = fminf(fmaxf(x, -3.3895313892515355e38f), 3.3895313892515355e38f);
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#endif
}

__device__ __forceinline__ float from_store(store_t v) {
#if KALOS_STORAGE == 0
    return v;
#elif KALOS_STORAGE == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#else
    return __uint_as_float(((unsigned)v) << 16);
#endif
}

// One 16-byte vector of a row: read-only path, no L1 allocation, 256-byte L2 prefetch (the rows
// are streamed once per search).
__device__ __forceinline__ uint4 ld_row_vec(const store_t* p) {
    uint4 u;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(u.x), "=r"(u.y), "=r"(u.z), "=r"(u.w) : "l"(p));
    return u;
}

// A 16-byte vector of VEC storage elements widened to float32.
__device__ __forceinline__ void widen(const uint4 u, float (&f)[VEC]) {
#if KALOS_STORAGE == 0
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
#elif KALOS_STORAGE == 1
    half2_to_floats(u.x, f[0], f[1]); half2_to_floats(u.y, f[2], f[3]);
    half2_to_floats(u.z, f[4], f[5]); half2_to_floats(u.w, f[6], f[7]);
#else
    bf162_to_floats(u.x, f[0], f[1]); bf162_to_floats(u.y, f[2], f[3]);
    bf162_to_floats(u.z, f[4], f[5]); bf162_to_floats(u.w, f[6], f[7]);
#endif
}

// L2-only loads: candidates written by other blocks of the same launch must not come from L1.
__device__ __forceinline__ float ldcg_f(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int ldcg_i(const int* p) {
    int v;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ float warp_sum(float a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(FULL_MASK, a, off);
    return a;
}

// ------------------------------------------------------------------ warp lists (k <= 32)
// Lane j holds the j-th best (score, row) of the list; lanes >= k are scratch. `th` is the k-th
// score, the same in every lane. Every lane may offer one candidate (s = -inf offers nothing);
// all 32 lanes must call this together.
__device__ __forceinline__ void warp_offer(float& ls, int& lr, float& th, float s, int r, int k,
                                           int lane) {
    unsigned m = __ballot_sync(FULL_MASK, s > th);
    while (m) {
        const int src = __ffs(m) - 1;
        m &= m - 1;
        const float cs = __shfl_sync(FULL_MASK, s, src);
        const int cr = __shfl_sync(FULL_MASK, r, src);
        if (cs > th) {  // th may have risen since the ballot; warp-uniform
            const int pos = __popc(__ballot_sync(FULL_MASK, lane < k && ls >= cs));
            const float us = __shfl_up_sync(FULL_MASK, ls, 1);
            const int ur = __shfl_up_sync(FULL_MASK, lr, 1);
            if (lane > pos) {
                ls = us;
                lr = ur;
            } else if (lane == pos) {
                ls = cs;
                lr = cr;
            }
            th = __shfl_sync(FULL_MASK, ls, k - 1);
        }
    }
}

// Floats as ints that order the same way (for atomicMax on a score); the map is its own inverse.
__device__ __forceinline__ int ord_f(float f) {
    const int i = __float_as_int(f);
    return i >= 0 ? i : i ^ 0x7fffffff;
}
__device__ __forceinline__ float unord_f(int i) { return __int_as_float(i >= 0 ? i : i ^ 0x7fffffff); }

// The block's gate: the best k-th score of any of its warps' lists (as ord_f). A score at or
// below it cannot enter the block's top-k (that warp already holds k scores at least as good), so
// warps skip it: with one shared gate a block inserts about k ln(n/k) candidates over n scores,
// instead of k ln(n/(W k)) per warp.
__device__ __forceinline__ float block_gate(const int* gate, float th) {
    return fmaxf(th, unord_f(*reinterpret_cast<const volatile int*>(gate)));
}

// Empty warp lists (every entry -inf, row -1) for QT queries.
template <int QT>
__device__ __forceinline__ void empty_lists(float (&ls)[QT], float (&th)[QT], int (&lr)[QT]) {
#pragma unroll
    for (int q = 0; q < QT; ++q) {
        ls[q] = neg_inf();
        th[q] = neg_inf();
        lr[q] = -1;
    }
}

// Merge the block's warp lists (QT queries each) into one list per query and write entries
// [0, nw) of list q to dst_s/dst_r[q * dstride + j]. Warp w merges queries w, w + W, ...
template <int QT>
__device__ void block_merge_lists(const float (&ls)[QT], const int (&lr)[QT], int nq, int k,
                                  float* wl_s, int* wl_r, float* dst_s, int* dst_r, i64 dstride,
                                  int nw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
#pragma unroll
    for (int q = 0; q < QT; ++q) {
        wl_s[(warp * QT + q) * 32 + lane] = ls[q];
        wl_r[(warp * QT + q) * 32 + lane] = lr[q];
    }
    __syncthreads();
    for (int q = warp; q < nq; q += W) {
        float ms = wl_s[q * 32 + lane];
        int mr = wl_r[q * 32 + lane];
        float mth = __shfl_sync(FULL_MASK, ms, k - 1);
        for (int w2 = 1; w2 < W; ++w2) {
            const float s = lane < k ? wl_s[(w2 * QT + q) * 32 + lane] : neg_inf();
            const int r = wl_r[(w2 * QT + q) * 32 + lane];
            warp_offer(ms, mr, mth, s, r, k, lane);
        }
        if (lane < nw) {
            dst_s[q * dstride + lane] = ms;
            dst_r[q * dstride + lane] = mr;
        }
    }
    __syncthreads();
}

// True in every thread of the block that finishes last among `total` blocks counted on *counter.
// Everything the block wrote before the call is visible to that last block.
__device__ bool last_block(unsigned* counter, unsigned total, int* flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned prev = atomicAdd(counter, 1u);
        *flag = prev == total - 1;
    }
    __syncthreads();
    const bool last = *flag != 0;
    if (last) __threadfence();
    return last;
}

// The last block merges every block's list: P lists of k per query, list p of query q at
// cs/cr[q * qstride + p * k].
template <int QT>
__device__ void merge_block_lists(const float* cs, const int* cr, i64 qstride, int P, int nq,
                                  int k, int kk, float* wl_s, int* wl_r, float* out_s,
                                  int* out_r) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    float ls[QT], th[QT];
    int lr[QT];
    empty_lists<QT>(ls, th, lr);
    for (int p = warp; p < P; p += W) {
#pragma unroll
        for (int q = 0; q < QT; ++q) {
            if (q < nq) {
                const i64 off = q * qstride + (i64)p * k + lane;
                const float s = lane < k ? ldcg_f(cs + off) : neg_inf();
                const int r = lane < k ? ldcg_i(cr + off) : -1;
                warp_offer(ls[q], lr[q], th[q], s, r, k, lane);
            }
        }
    }
    block_merge_lists<QT>(ls, lr, nq, k, wl_s, wl_r, out_s, out_r, kk, kk);
}

// ------------------------------------------------------------------ block buffer (k > 32)
__device__ void block_compact(float* bs, int* br, int* meta, int c, int k) {
    const int T = blockDim.x, tid = threadIdx.x;
    int L = 2;
    while (L < c) L <<= 1;
    for (int i = c + tid; i < L; i += T) {
        bs[i] = neg_inf();
        br[i] = -1;
    }
    __syncthreads();
    for (int size = 2; size <= L; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < (L >> 1); i += T) {
                const int lo = 2 * i - (i & (stride - 1));
                const int hi = lo + stride;
                const bool desc = (lo & size) == 0;
                const float a = bs[lo], b = bs[hi];
                if (desc ? (a < b) : (a > b)) {
                    bs[lo] = b;
                    bs[hi] = a;
                    const int t = br[lo];
                    br[lo] = br[hi];
                    br[hi] = t;
                }
            }
            __syncthreads();
        }
    }
    if (tid == 0) {
        meta[0] = min(c, k);
        meta[1] = __float_as_int(c >= k ? bs[k - 1] : neg_inf());
    }
    __syncthreads();
}

struct ScoreSource {  // a row of the score matrix (GEMM path), with the l2 correction
    const float* s;
    const float* sqn;
    float qn;
    int l2;
    i64 row0;
    __device__ __forceinline__ void get(i64 i, float& v, int& r) const {
        v = s[i];
        if (l2) v = 2.0f * v - sqn[i] - qn;
        r = (int)(row0 + i);
    }
};

struct ListSource {  // candidate lists written by other blocks of this launch
    const float* s;
    const int* r;
    __device__ __forceinline__ void get(i64 i, float& v, int& rr) const {
        v = ldcg_f(s + i);
        rr = ldcg_i(r + i);
    }
};

// Exact top-k of `count` candidates with one block; writes entries [0, nout) best first.
// Buffer: bs/br of C entries, C a power of two >= k + blockDim.x; meta[0] count, meta[1] threshold.
template <class Src>
__device__ void block_select(const Src& src, i64 count, int k, float* bs, int* br, int* meta,
                             int C, float* outs, int* outr, int nout) {
    const int T = blockDim.x, tid = threadIdx.x;
    if (tid == 0) {
        meta[0] = 0;
        meta[1] = __float_as_int(neg_inf());
    }
    __syncthreads();
    for (i64 base = 0; base < count; base += T) {
        const i64 i = base + tid;
        if (i < count) {
            float v;
            int r;
            src.get(i, v, r);
            if (v > __int_as_float(meta[1])) {
                const int p = atomicAdd(&meta[0], 1);
                bs[p] = v;
                br[p] = r;
            }
        }
        __syncthreads();
        const int c = meta[0];
        __syncthreads();  // every thread has read c before a compaction changes it
        if (c > C - T) block_compact(bs, br, meta, c, k);
    }
    const int c = meta[0];
    __syncthreads();
    block_compact(bs, br, meta, c, k);
    const int m = min(c, k);
    for (int j = tid; j < nout; j += T) {
        outs[j] = j < m ? bs[j] : neg_inf();
        outr[j] = j < m ? br[j] : -1;
    }
    __syncthreads();
}

// ------------------------------------------------------------------ fused small-batch search
// Grid (tiles, P): block (t, p) scores queries [t*QT, t*QT + QT) against rows
// [n*p/P, n*(p+1)/P). Rows are read in 16-byte vectors by groups of GL lanes (about 4 vectors per
// lane, GL a power of two <= 32), U rows per group in flight; the group's partial sums are
// reduced with xor shuffles. k <= 32.
template <int QT>
struct SmallUnroll {
    enum { U = QT >= 16 ? 1 : (QT >= 8 ? 2 : 4) };
};

// One tile of queries (nq <= QT of them, at qsrc, QT rows readable) over rows [0, n) of X, part
// `part` of P; answers written best first at out_s/out_r + q * kk, kk entries each (fewer than
// k rows: the rest -inf, row -1); cand_s/cand_r: this tile's candidate lists, counter: its
// counter (P > 1).
template <int QT>
__device__ __forceinline__ void small_core(const store_t* __restrict__ X,
                                           const float* __restrict__ sqn, int dpad, int n, int nq,
                                           int k, int kk, int l2, const float* qsrc, int part,
                                           int P, float* cand_s, int* cand_r, unsigned* counter,
                                           float* out_s, int* out_r) {
    constexpr int U = SmallUnroll<QT>::U;
    unsigned char* smem = kalos_smem;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;

    float* sq = reinterpret_cast<float*>(smem);  // [QT][dpad]
    float* qn = sq + QT * dpad;                  // [QT]
    float* wl_s = qn + QT;                       // [W][QT][32]
    int* wl_r = reinterpret_cast<int*>(wl_s + W * QT * 32);
    int* flag = wl_r + W * QT * 32;

    for (int i = tid; i < QT * dpad; i += blockDim.x) sq[i] = qsrc[i];
    __syncthreads();
    for (int q = warp; q < QT; q += W) {
        float a = 0.0f;
        for (int j = lane; j < dpad; j += 32) a = fmaf(sq[q * dpad + j], sq[q * dpad + j], a);
        a = warp_sum(a);
        if (lane == 0) qn[q] = a;
    }
    __syncthreads();

    const i64 rb = (i64)n * part / P, re = (i64)n * (part + 1) / P;
    // Lanes per row: enough for about 4 vectors each (short rows: several rows per warp, fewer
    // shuffle levels, more loads in flight), at most 32.
    const int nvec = dpad / VEC;
    int GL = 1;
    while (GL * 4 < nvec && GL < 32) GL <<= 1;
    const int grp = lane / GL, lig = lane & (GL - 1);
    const int rows_per_warp = (32 / GL) * U;
    constexpr int CPL = 4;  // vectors per lane and row loaded before any arithmetic

    float ls[QT], th[QT];
    int lr[QT];
    empty_lists<QT>(ls, th, lr);

    // The loop bound is warp-uniform: shuffles and ballots below need every lane.
    for (i64 wb = rb + (i64)warp * rows_per_warp; wb < re; wb += (i64)W * rows_per_warp) {
        const i64 r0 = wb + (i64)grp * U;
        float acc[U][QT];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int q = 0; q < QT; ++q) acc[u][q] = 0.0f;
        // Up to CPL vectors of each of the U rows per lane, all loads issued first (usually one
        // pass: GL is chosen so that CPL * GL >= the row's vectors for rows up to 2 KB).
        for (int cb = 0; cb < nvec; cb += CPL * GL) {
            uint4 raw[U][CPL];
#pragma unroll
            for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int j = 0; j < CPL; ++j) {
                    const int c = cb + j * GL + lig;
                    if (r0 + u < re && c < nvec) {
                        raw[u][j] = ld_row_vec(X + (r0 + u) * dpad + c * VEC);
                    } else {
                        raw[u][j] = make_uint4(0u, 0u, 0u, 0u);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < CPL; ++j) {
                const int c = cb + j * GL + lig;
                if (c < nvec) {
                    float xv[U][VEC];
#pragma unroll
                    for (int u = 0; u < U; ++u) widen(raw[u][j], xv[u]);
#pragma unroll
                    for (int q = 0; q < QT; ++q) {
                        const float4* qp = reinterpret_cast<const float4*>(sq + q * dpad + c * VEC);
#pragma unroll
                        for (int e4 = 0; e4 < VEC / 4; ++e4) {
                            const float4 qv = qp[e4];
#pragma unroll
                            for (int u = 0; u < U; ++u) {
                                acc[u][q] = fmaf(xv[u][4 * e4 + 0], qv.x, acc[u][q]);
                                acc[u][q] = fmaf(xv[u][4 * e4 + 1], qv.y, acc[u][q]);
                                acc[u][q] = fmaf(xv[u][4 * e4 + 2], qv.z, acc[u][q]);
                                acc[u][q] = fmaf(xv[u][4 * e4 + 3], qv.w, acc[u][q]);
                            }
                        }
                    }
                }
            }
        }
        for (int off = GL >> 1; off > 0; off >>= 1) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int q = 0; q < QT; ++q) acc[u][q] += __shfl_xor_sync(FULL_MASK, acc[u][q], off);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 r = r0 + u;
            const bool valid = lig == 0 && r < re;
            const float rn = (l2 && valid) ? sqn[r] : 0.0f;
#pragma unroll
            for (int q = 0; q < QT; ++q) {
                if (q < nq) {
                    float s = neg_inf();
                    if (valid) s = l2 ? 2.0f * acc[u][q] - rn - qn[q] : acc[u][q];
                    warp_offer(ls[q], lr[q], th[q], s, (int)r, k, lane);
                }
            }
        }
    }

    if (P == 1) {
        block_merge_lists<QT>(ls, lr, nq, k, wl_s, wl_r, out_s, out_r, kk, kk);
        return;
    }
    const i64 qstride = (i64)P * k;
    block_merge_lists<QT>(ls, lr, nq, k, wl_s, wl_r, cand_s + (i64)part * k,
                          cand_r + (i64)part * k, qstride, k);
    if (!last_block(counter, P, flag)) return;
    merge_block_lists<QT>(cand_s, cand_r, qstride, P, nq, k, kk, wl_s, wl_r, out_s, out_r);
    if (tid == 0) *counter = 0;
}

template <int QT>
__device__ __forceinline__ void small_search(const store_t* __restrict__ X,
                                             const float* __restrict__ sqn, int dpad,
                                             const int* req, float* cand_s, int* cand_r,
                                             unsigned* counters, float* out_s, int* out_r) {
    const int n = req[0], B = req[1], k = req[2], l2 = req[3];
    const int tile = blockIdx.x, part = blockIdx.y, P = gridDim.y;
    const int q0 = tile * QT;
    const int kk = min(k, n);
    const i64 qstride = (i64)P * k;
    // The staging buffer holds whole tiles, so the query loads need not wait for the header (over
    // PCIe, when the request is read in place, that saves a round trip). Rows >= nq hold stale
    // but finite values whose scores are never offered.
    const float* qsrc = reinterpret_cast<const float*>(req + KALOS_HEADER_INTS) + (i64)q0 * dpad;
    small_core<QT>(X, sqn, dpad, n, min(QT, B - q0), k, kk, l2, qsrc, part, P,
                   cand_s + q0 * qstride, cand_r + q0 * qstride, counters + tile,
                   out_s + (i64)q0 * kk, out_r + (i64)q0 * kk);
}

#define KALOS_SMALL_KERNEL(QT)                                                                  \
    extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_small_q##QT(                 \
        const store_t* __restrict__ X, const float* __restrict__ sqn, int dpad, const int* req,  \
        float* cand_s, int* cand_r, unsigned* counters, float* out_s, int* out_r) {               \
        small_search<QT>(X, sqn, dpad, req, cand_s, cand_r, counters, out_s, out_r);             \
    }

KALOS_SMALL_KERNEL(1)
KALOS_SMALL_KERNEL(2)
KALOS_SMALL_KERNEL(4)
KALOS_SMALL_KERNEL(8)
KALOS_SMALL_KERNEL(16)

// ------------------------------------------------------------------ mixed namespaces
// A batch whose queries each search their own namespace's rows (a namespace per user), in one
// launch: grid (B, P), block (b, p) runs the fused search of query b over part p of the rows of
// its own matrix: xs[b] (store_t rows of dpad), sqns[b] (their squared norms), ns[b] rows (>= 1).
// The answer of query b: k entries at out + b * k, best first, row -1 and -inf past ns[b] rows.
// req: float32 queries [B][dpad], then xs [B] u64, sqns [B] u64, ns [B] int32.
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_mixed(
    const int* __restrict__ req, int B, int dpad, int k, int l2, float* cand_s, int* cand_r,
    unsigned* counters, float* out_s, int* out_r) {
    const int b = blockIdx.x;
    const float* q = reinterpret_cast<const float*>(req) + (i64)b * dpad;
    const unsigned long long* xs =
        reinterpret_cast<const unsigned long long*>(reinterpret_cast<const float*>(req) + (i64)B * dpad);
    const unsigned long long* sqns = xs + B;
    const int* ns = reinterpret_cast<const int*>(sqns + B);
    const i64 qstride = (i64)gridDim.y * k;
    small_core<1>(reinterpret_cast<const store_t*>(xs[b]), reinterpret_cast<const float*>(sqns[b]),
                  dpad, ns[b], 1, k, k, l2, q, blockIdx.y, gridDim.y, cand_s + b * qstride,
                  cand_r + b * qstride, counters + b, out_s + (i64)b * k, out_r + (i64)b * k);
}

// ------------------------------------------------------------------ top-k of a score matrix
// GEMM path: S[b][c] = q_b . x_(row0 + c) for one chunk of nc rows (cuBLAS wrote it). Grid
// (Pc, B): block (px, b) selects the top-k of columns [nc*px/Pc, nc*(px+1)/Pc) into partition
// p_off + px of P; the last of a query's P blocks (over all chunk launches) merges them.
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_scores_topk_w(
    const float* __restrict__ S, int nc, i64 row0, const float* __restrict__ sqn,
    const float* __restrict__ qn, int l2, int k, int kk, int Pc, int p_off, int P, float* cand_s,
    int* cand_r, unsigned* counters, float* out_s, int* out_r) {
    __shared__ float wl_s[(KALOS_BLOCK / 32) * 32];
    __shared__ int wl_r[(KALOS_BLOCK / 32) * 32];
    __shared__ int flag, gate;
    const int b = blockIdx.y, px = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int cb = (int)((i64)nc * px / Pc), ce = (int)((i64)nc * (px + 1) / Pc);
    if (threadIdx.x == 0) gate = ord_f(neg_inf());
    __syncthreads();
    const float* Sb = S + (i64)b * nc;
    const float qb = l2 ? qn[b] : 0.0f;
    float ls[1] = {neg_inf()}, th[1] = {neg_inf()};
    int lr[1] = {-1};
    constexpr int UN = 4;
    for (int wb = cb + warp * 32 * UN; wb < ce; wb += W * 32 * UN) {
        float v[UN];
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            const int c = wb + u * 32 + lane;
            v[u] = c < ce ? Sb[c] : neg_inf();
        }
        const float g = block_gate(&gate, th[0]);
        float mx = neg_inf();
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            const int c = wb + u * 32 + lane;
            if (l2 && c < ce) v[u] = 2.0f * v[u] - sqn[row0 + c] - qb;
            if (!(v[u] > g)) v[u] = neg_inf();
            mx = fmaxf(mx, v[u]);
        }
        if (!__any_sync(FULL_MASK, mx > th[0])) continue;  // nothing here beats the gate
#pragma unroll
        for (int u = 0; u < UN; ++u)
            warp_offer(ls[0], lr[0], th[0], v[u], (int)(row0 + wb + u * 32 + lane), k, lane);
        if (lane == 0 && th[0] > g) atomicMax(&gate, ord_f(th[0]));
    }
    const i64 qstride = (i64)P * k;
    block_merge_lists<1>(ls, lr, 1, k, wl_s, wl_r, cand_s + b * qstride + (i64)(p_off + px) * k,
                         cand_r + b * qstride + (i64)(p_off + px) * k, qstride, k);
    if (!last_block(counters + b, P, &flag)) return;
    merge_block_lists<1>(cand_s + b * qstride, cand_r + b * qstride, qstride, P, 1, k, kk, wl_s,
                         wl_r, out_s + (i64)b * kk, out_r + (i64)b * kk);
    if (threadIdx.x == 0) counters[b] = 0;
}

// Same for k > 32, with the block buffer (dynamic shared memory: C floats, C ints, 4 ints).
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_scores_topk_b(
    const float* __restrict__ S, int nc, i64 row0, const float* __restrict__ sqn,
    const float* __restrict__ qn, int l2, int k, int kk, int Pc, int p_off, int P, float* cand_s,
    int* cand_r, unsigned* counters, float* out_s, int* out_r, int C) {
    float* bs = reinterpret_cast<float*>(kalos_smem);
    int* br = reinterpret_cast<int*>(bs + C);
    int* meta = br + C;
    const int b = blockIdx.y, px = blockIdx.x;
    const int cb = (int)((i64)nc * px / Pc), ce = (int)((i64)nc * (px + 1) / Pc);
    ScoreSource src;
    src.s = S + (i64)b * nc + cb;
    src.sqn = sqn + row0 + cb;
    src.qn = l2 ? qn[b] : 0.0f;
    src.l2 = l2;
    src.row0 = row0 + cb;
    const i64 qstride = (i64)P * k;
    block_select(src, (i64)(ce - cb), k, bs, br, meta, C,
                 cand_s + b * qstride + (i64)(p_off + px) * k,
                 cand_r + b * qstride + (i64)(p_off + px) * k, k);
    if (!last_block(counters + b, P, meta + 2)) return;
    ListSource ls;
    ls.s = cand_s + b * qstride;
    ls.r = cand_r + b * qstride;
    block_select(ls, qstride, k, bs, br, meta, C, out_s + (i64)b * kk, out_r + (i64)b * kk, kk);
    if (threadIdx.x == 0) counters[b] = 0;
}

// ------------------------------------------------------------------ half-score GEMM path
// float16 storage, k <= 16 (backends/cuda/planner.py). Each query is scaled by a power of two 2^-e
// (qscale = 2^e) so that no score can overflow float16, rounded to float16, and cuBLAS writes the
// scores S'[b][c] = 2^-e q'.x as float16 (half the bytes of float32 scores, written once, read
// once). The 32 best rows by these approximate scores are kept per query, rescored in float32
// against the float32 query, and sorted. The approximate score a of any row obeys
// |a - s| <= E (s its float32 score; E from the rounding of the query, of the score and of both
// accumulations, below); so if the k-th rescored score is >= the 32nd approximate score + E, no
// row outside the 32 can beat the answer, and the answer is the exact top-k. A query where that
// does not hold (near-ties, degenerate data) is flagged and redone on the float32 path by the host.

__device__ __forceinline__ float warp_max(float a) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL_MASK, a, off));
    return a;
}

// |q|^2 and max |q_j| over one query's dpad floats, reduced over the warp (every lane gets both).
__device__ __forceinline__ float2 warp_norm2_absmax(const float* __restrict__ q, int dpad, int lane) {
    float a = 0.0f, mx = 0.0f;
    for (int j = lane; j < dpad; j += 32) {
        const float v = q[j];
        a = fmaf(v, v, a);
        mx = fmaxf(mx, fabsf(v));
    }
    return make_float2(warp_sum(a), warp_max(mx));
}

// Queries for the half-score path: qs = float16(q * 2^-e) with 2^e > max(|q| xmax, max|q_i|) / 2^14,
// so |q'.x| < 2^14 for every stored row (xmax bounds the row norms); qn = |q|^2, qscale = 2^e.
// One warp per query.
extern "C" __global__ void kalos_prep_queries_h(const float* __restrict__ q32, unsigned short* qs,
                                                float* __restrict__ qn, float* __restrict__ qscale,
                                                int B, int dpad, float xmax) {
    const int b = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (b >= B) return;  // warp-uniform
    const float* q = q32 + (i64)b * dpad;
    const float2 nm = warp_norm2_absmax(q, dpad, lane);
    const float a = nm.x, mx = nm.y;
    const float need = fmaxf(sqrtf(a) * xmax, mx) * (1.0f / 16384.0f);
    int e = 0;
    if (need > 0.0f) {
        if (isfinite(need)) frexpf(need, &e);  // need < 2^e
        else e = 100;  // E is infinite then: the query is flagged and redone in float32
    }
    e = max(-100, min(100, e));
    const float sc = ldexpf(1.0f, -e);
    for (int j = lane; j < dpad; j += 32) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(q[j] * sc));
        qs[(i64)b * dpad + j] = h;
    }
    if (lane == 0) {
        qn[b] = a;
        qscale[b] = ldexpf(1.0f, e);
    }
}

// Top-32 of one chunk of float16 scores (S[b][c], c < nc, row stride ld, a multiple of 8, so a
// lane reads 8 scores per 16-byte load). Grid (Pc, B) as kalos_scores_topk_w; the last of a
// query's P blocks writes its 32 candidates (approximate scores, rows) to top_s/top_r[b][32].
template <int UN>
__device__ __forceinline__ void hscores_top(
    const unsigned short* __restrict__ S, int nc, int ld, i64 row0, const float* __restrict__ sqn,
    const float* __restrict__ qn, const float* __restrict__ qscale, int l2, int Pc, int p_off, int P,
    float* cand_s, int* cand_r, unsigned* counters, float* top_s, int* top_r) {
    __shared__ float wl_s[(KALOS_BLOCK / 32) * 32];
    __shared__ int wl_r[(KALOS_BLOCK / 32) * 32];
    __shared__ int flag, gate;
    const int b = blockIdx.y, px = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    if (threadIdx.x == 0) gate = ord_f(neg_inf());
    __syncthreads();
    const int nv = (nc + 7) >> 3;
    const int vb = (int)((i64)nv * px / Pc), ve = (int)((i64)nv * (px + 1) / Pc);
    const unsigned short* Sb = S + (i64)b * ld;
    const float sc = qscale[b];
    const float qb = l2 ? qn[b] : 0.0f;
    float ls[1], th[1];
    int lr[1];
    empty_lists<1>(ls, th, lr);
    for (int wb = vb + warp * 32 * UN; wb < ve; wb += W * 32 * UN) {
        uint4 u[UN];
#pragma unroll
        for (int t = 0; t < UN; ++t) {
            const int v = wb + t * 32 + lane;
            if (v < ve) {
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(u[t].x), "=r"(u[t].y), "=r"(u[t].z), "=r"(u[t].w)
                             : "l"(Sb + (i64)v * 8));
            } else {
                u[t] = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        const float g = block_gate(&gate, th[0]);
#pragma unroll
        for (int t = 0; t < UN; ++t) {
            const int v = wb + t * 32 + lane;
            float f[8];
            half2_to_floats(u[t].x, f[0], f[1]);
            half2_to_floats(u[t].y, f[2], f[3]);
            half2_to_floats(u[t].z, f[4], f[5]);
            half2_to_floats(u[t].w, f[6], f[7]);
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int c = v * 8 + j;
                float s = f[j] * sc;
                if (v >= ve || c >= nc) s = neg_inf();
                else if (l2) s = 2.0f * s - sqn[row0 + c] - qb;
                f[j] = s > g ? s : neg_inf();
                mx = fmaxf(mx, f[j]);
            }
            if (!__any_sync(FULL_MASK, mx > th[0])) continue;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                warp_offer(ls[0], lr[0], th[0], f[j], (int)(row0 + v * 8 + j), KALOS_HC, lane);
        }
        if (lane == 0 && th[0] > g) atomicMax(&gate, ord_f(th[0]));
    }
    const i64 qstride = (i64)P * KALOS_HC;
    block_merge_lists<1>(ls, lr, 1, KALOS_HC, wl_s, wl_r,
                         cand_s + b * qstride + (i64)(p_off + px) * KALOS_HC,
                         cand_r + b * qstride + (i64)(p_off + px) * KALOS_HC, qstride, KALOS_HC);
    if (!last_block(counters + b, P, &flag)) return;
    merge_block_lists<1>(cand_s + b * qstride, cand_r + b * qstride, qstride, P, 1, KALOS_HC,
                         KALOS_HC, wl_s, wl_r, top_s + (i64)b * KALOS_HC,
                         top_r + (i64)b * KALOS_HC);
    if (threadIdx.x == 0) counters[b] = 0;
}

// UN 16-byte loads per lane in flight (the host's HSCORE_UNROLL names the one built; more measured
// slower on the H200).
#define KALOS_HSCORES_KERNEL(UN)                                                                  \
    extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_hscores_top_u##UN(           \
        const unsigned short* __restrict__ S, int nc, int ld, i64 row0,                           \
        const float* __restrict__ sqn, const float* __restrict__ qn,                              \
        const float* __restrict__ qscale, int l2, int Pc, int p_off, int P, float* cand_s,        \
        int* cand_r, unsigned* counters, float* top_s, int* top_r) {                              \
        hscores_top<UN>(S, nc, ld, row0, sqn, qn, qscale, l2, Pc, p_off, P, cand_s, cand_r,       \
                        counters, top_s, top_r);                                                  \
    }
KALOS_HSCORES_KERNEL(2)

// Rescore query b's 32 candidates in float32 (float32 query, widened rows), sort them, write the
// best kk to out_s/out_r[b][kk] (pinned host memory) and flags[b] = 1 if the answer is not proven
// exact (see above). Grid (B), one warp per candidate at a time.
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_rescore_h(
    const store_t* __restrict__ X, const float* __restrict__ sqn, int dpad,
    const float* __restrict__ q32, const float* __restrict__ qn, const float* __restrict__ qscale,
    int l2, float xmax, int kk, const float* __restrict__ top_s, const int* __restrict__ top_r,
    float* out_s, int* out_r, int* flags) {
    __shared__ float es[KALOS_HC];
    const int b = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const float* q = q32 + (i64)b * dpad;
    for (int c = warp; c < KALOS_HC; c += W) {
        const int r = top_r[(i64)b * KALOS_HC + c];  // warp-uniform
        float a = 0.0f;
        if (r >= 0) {
            const store_t* x = X + (i64)r * dpad;
            for (int j = lane * VEC; j < dpad; j += 32 * VEC) {
                float f[VEC];
                widen(*reinterpret_cast<const uint4*>(x + j), f);
#pragma unroll
                for (int t = 0; t < VEC; ++t) a = fmaf(q[j + t], f[t], a);
            }
        }
        a = warp_sum(a);
        if (lane == 0) es[c] = r < 0 ? neg_inf() : (l2 ? 2.0f * a - sqn[r] - qn[b] : a);
    }
    __syncthreads();
    if (warp != 0) return;
    float s = es[lane];
    int r = top_r[(i64)b * KALOS_HC + lane];
    // Bitonic sort across the warp, best first; ties by row so the order is total.
    for (int size = 2; size <= 32; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            const float os = __shfl_xor_sync(FULL_MASK, s, stride);
            const int orr = __shfl_xor_sync(FULL_MASK, r, stride);
            const bool keep_better = ((lane & stride) == 0) == ((lane & size) == 0);
            const bool other_better = os > s || (os == s && orr < r);
            const bool mine_better = s > os || (s == os && r < orr);
            if (keep_better ? other_better : mine_better) {
                s = os;
                r = orr;
            }
        }
    }
    if (lane < kk) {
        out_s[(i64)b * kk + lane] = s;
        out_r[(i64)b * kk + lane] = r;
    }
    const float tk = __shfl_sync(FULL_MASK, s, kk - 1);
    if (lane == 0) {
        const float last = top_s[(i64)b * KALOS_HC + KALOS_HC - 1];
        const int last_r = top_r[(i64)b * KALOS_HC + KALOS_HC - 1];
        const float qx = sqrtf(qn[b]) * xmax;  // bounds |q||x| and |q.x| for every stored row
        // |a - s| for one dot product: query rounding (2^-11 |q||x|), score rounding (2^-11 of
        // |q.x|), two float32 accumulations over dpad terms (dpad 2^-24 |q||x| each), float16
        // underflow of the scaled query and score (2^(e-25) sqrt(dpad) xmax and 2^(e-25)); x1.25.
        const float ev = 1.25f * (qx * (ldexpf(1.0f, -10) + (float)dpad * ldexpf(1.0f, -23)) +
                                  qscale[b] * ldexpf(1.0f, -25) * (sqrtf((float)dpad) * xmax + 1.0f));
        // l2 scores are 2 q.x - |x|^2 - |q|^2: twice that, plus the rounding of the sum.
        const float e = l2 ? 2.0f * ev + ldexpf(1.0f, -21) * (2.0f * qx + xmax * xmax + qn[b]) : ev;
        flags[b] = (last_r >= 0 && !(tk >= last + e)) ? 1 : 0;
    }
}

// ------------------------------------------------------------------ int8 first pass
// Any storage, k <= 16 (backends/cuda/planner.py, int8.py). Rows and queries are quantised to int8
// with one scale each (x^ = sr t, t = rint(x / sr) in [-127, 127], sr = max|x_i| / 127), kept
// beside the stored rows; cuBLAS multiplies them exactly (int32, |t_q . t_x| <= 127^2 dp8 < 2^31).
// For q = q^ + dq and x = x^ + dx:  q.x = sq sr (t_q . t_x) + q^.dx + dq.x, so with e >= |dx| per
// row and |x| <= xmax for every row, |q.x - a| <= |q^| e + |dq| xmax, a = sq sr (t_q . t_x).
// u = a + |q^| e + |dq| xmax is then an upper bound of each row's score (for l2: 2 u - |x|^2 -
// |q|^2). Four launches after the GEMM: the row of highest u in each of P slices; their float32
// scores, whose kk-th L is a lower bound of the query's kk-th best, so only rows with u >= L can
// be in the answer; every such row collected (the 1-2 per 10^4 of random 768-dim rows); the collected rows
// rescored in float32 and sorted. So the answer is the float32 top-kk of the stored rows by
// construction; a query that collects more than cap rows (near-ties, degenerate data) is flagged
// and redone on the float32 GEMM path.

// Quantise m rows (rows idx[i], or r0 + i when idx is null) into R8 [.][dp8] (zero past dpad) and
// rq[r] = {sr, e}: e bounds |x - sr t| (one rounding per residual element, a float32 sum over
// dp8 terms, an absolute allowance for squares that underflow). One warp per row.
extern "C" __global__ void kalos_i8_rows(const store_t* __restrict__ X, int dpad,
                                         const i64* __restrict__ idx, i64 r0, int m,
                                         signed char* __restrict__ R8, int dp8,
                                         float2* __restrict__ rq) {
    const int i = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= m) return;  // warp-uniform
    const i64 r = idx != nullptr ? idx[i] : r0 + i;
    const store_t* x = X + r * dpad;
    float mx = 0.0f;
    for (int j = lane; j < dpad; j += 32) mx = fmaxf(mx, fabsf(from_store(x[j])));
    mx = warp_max(mx);
    const float sr = mx * (1.0f / 127.0f);
    float e = 0.0f;
    signed char* dst = R8 + r * dp8;
    for (int j = lane; j < dp8; j += 32) {
        const float v = j < dpad ? from_store(x[j]) : 0.0f;
        const float t = sr > 0.0f ? fminf(fmaxf(rintf(v / sr), -127.0f), 127.0f) : 0.0f;
        dst[j] = (signed char)(int)t;
        const float d = fmaf(-sr, t, v);
        e = fmaf(d, d, e);
    }
    e = warp_sum(e);
    if (lane == 0)
        rq[r] = make_float2(sr, sqrtf(e) * (1.0f + (float)dp8 * ldexpf(1.0f, -22)) +
                                    sqrtf((float)dp8) * 1e-18f);
}

// Queries: Q8 [Bp][dp8] (rows >= B zero) and qi[b] = {sq, |q^| bound, |dq| xmax bound, |q|^2}.
// One warp per query row.
extern "C" __global__ void kalos_i8_queries(const float* __restrict__ q32, int B, int Bp,
                                            int dpad, int dp8, float xmax,
                                            signed char* __restrict__ Q8,
                                            float4* __restrict__ qi) {
    const int b = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (b >= Bp) return;  // warp-uniform
    signed char* dst = Q8 + (i64)b * dp8;
    if (b >= B) {
        for (int j = lane; j < dp8; j += 32) dst[j] = 0;
        if (lane == 0) qi[b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return;
    }
    const float* q = q32 + (i64)b * dpad;
    const float2 nm = warp_norm2_absmax(q, dpad, lane);
    const float a = nm.x, mx = nm.y;
    const float sq = mx * (1.0f / 127.0f);
    float e = 0.0f, h = 0.0f;
    for (int j = lane; j < dp8; j += 32) {
        const float v = j < dpad ? q[j] : 0.0f;
        const float t = sq > 0.0f ? fminf(fmaxf(rintf(v / sq), -127.0f), 127.0f) : 0.0f;
        dst[j] = (signed char)(int)t;
        const float d = fmaf(-sq, t, v);
        e = fmaf(d, d, e);
        const float p = sq * t;
        h = fmaf(p, p, h);
    }
    e = warp_sum(e);
    h = warp_sum(h);
    if (lane == 0) {
        const float grow = 1.0f + (float)dp8 * ldexpf(1.0f, -22);
        const float dq = sqrtf(e) * grow + sqrtf((float)dp8) * 1e-18f;
        qi[b] = make_float4(sq, sqrtf(h) * grow, dq * xmax * (1.0f + ldexpf(1.0f, -20)), a);
    }
}

// The upper bound u of row c's score for query w (see above; rq[c] = {sr, e}).
__device__ __forceinline__ float i8_bound(int prod, float2 r, float4 w, const float* sqn, i64 c,
                                          int l2) {
    const float u = fmaf(w.x * r.x, (float)prod, fmaf(w.y, r.y, w.z));
    return l2 ? 2.0f * u - sqn[c] - w.w : u;
}

// Float32 score of stored row r against the float32 query q (one warp; lane 0 has the sum).
__device__ __forceinline__ float row_dot(const store_t* __restrict__ X, int dpad, i64 r,
                                         const float* __restrict__ q, int lane) {
    const store_t* x = X + r * dpad;
    float a = 0.0f;
    for (int j = lane * VEC; j < dpad; j += 32 * VEC) {
        float f[VEC];
        widen(*reinterpret_cast<const uint4*>(x + j), f);
#pragma unroll
        for (int t = 0; t < VEC; ++t) a = fmaf(q[j + t], f[t], a);
    }
    return warp_sum(a);
}

// Step 1: per query, the row of highest u in each of P slices of the rows c < n of the int32
// products S[b][c] (row stride ld): P "champions" (-inf, -1 for an empty slice). Grid (P, B).
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_i8_champions(
    const int* __restrict__ S, int ld, int n, const float2* __restrict__ rq,
    const float4* __restrict__ qi, const float* __restrict__ sqn, int l2, int P,
    float* __restrict__ champ_s, int* __restrict__ champ_r) {
    __shared__ float ws[KALOS_BLOCK / 32];
    __shared__ int wr[KALOS_BLOCK / 32];
    const int b = blockIdx.y, px = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int cb = (int)((i64)n * px / P), ce = (int)((i64)n * (px + 1) / P);
    const int* Sb = S + (i64)b * ld;
    const float4 w = qi[b];
    float best = neg_inf();
    int br = -1;
    constexpr int UN = 4;
    for (int c0 = cb + tid; c0 < ce; c0 += UN * KALOS_BLOCK) {
        int p[UN];
        float2 r[UN];
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            const int c = c0 + u * KALOS_BLOCK;
            if (c < ce) {
                p[u] = Sb[c];
                r[u] = rq[c];
            }
        }
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            const int c = c0 + u * KALOS_BLOCK;
            if (c < ce) {
                const float v = i8_bound(p[u], r[u], w, sqn, c, l2);
                if (v > best) {
                    best = v;
                    br = c;
                }
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, off);
        const int orr = __shfl_xor_sync(FULL_MASK, br, off);
        if (ov > best || (ov == best && (unsigned)orr < (unsigned)br)) {
            best = ov;
            br = orr;
        }
    }
    if (lane == 0) {
        ws[warp] = best;
        wr[warp] = br;
    }
    __syncthreads();
    if (tid == 0) {
        for (int i = 1; i < KALOS_BLOCK / 32; ++i)
            if (ws[i] > best || (ws[i] == best && (unsigned)wr[i] < (unsigned)br)) {
                best = ws[i];
                br = wr[i];
            }
        champ_s[(i64)b * P + px] = best;
        champ_r[(i64)b * P + px] = best > neg_inf() ? br : -1;
    }
}

// Step 2: rescore the P champions in float32; their kk-th score L is at most the query's true
// kk-th (they are P distinct rows), so a row that can beat it has u >= L (less the rounding of u
// and of float32 scores): thr[b] is that threshold (-inf with fewer than kk champions: every row
// is collected), cnt[b] is reset for step 3. Grid (B), KALOS_I8_THREADS threads, P <= 256.
extern "C" __global__ void kalos_i8_threshold(
    const store_t* __restrict__ X, const float* __restrict__ sqn, int dpad,
    const float* __restrict__ q32, const float4* __restrict__ qi, int l2, float xmax, int kk,
    int P, const int* __restrict__ champ_r, float* thr, int* cnt) {
    __shared__ float es[256];
    const int b = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
    const float* q = q32 + (i64)b * dpad;
    const float4 w = qi[b];
    for (int c = warp; c < 256; c += W) {
        const int r = c < P ? champ_r[(i64)b * P + c] : -1;  // warp-uniform
        const float a = r >= 0 ? row_dot(X, dpad, r, q, lane) : 0.0f;
        if (lane == 0) es[c] = r >= 0 ? (l2 ? 2.0f * a - sqn[r] - w.w : a) : neg_inf();
    }
    for (int size = 2; size <= 256; size <<= 1)  // block bitonic sort, best first
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = tid; t < 128; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const float si = es[i], sj = es[j];
                if (((i & size) == 0) ? sj > si : si > sj) {
                    es[i] = sj;
                    es[j] = si;
                }
            }
        }
    __syncthreads();
    if (tid == 0) {
        const float tk = es[kk - 1];
        const float qx = sqrtf(w.w) * xmax;  // bounds |q||x| and |q.x| for every stored row
        // u's own rounding (a few float32 operations on terms below 1.25 |q^| xmax + |dq| xmax)
        // and the float32 accumulations of two scores over dpad terms (dpad 2^-24 |q||x| each).
        const float ev = ldexpf(1.0f, -20) * (1.25f * w.y * xmax + w.z) +
                         1.25f * qx * (float)dpad * ldexpf(1.0f, -23);
        // l2 scores are 2 q.x - |x|^2 - |q|^2: twice that, plus the rounding of the sum.
        const float e = l2 ? 2.0f * ev + ldexpf(1.0f, -21) * (2.0f * qx + xmax * xmax + w.w) : ev;
        thr[b] = tk - e;
        cnt[b] = 0;
    }
}

// Step 3: every row c < n with u > thr[b] into col[b][cap] (cnt[b] counts them all, also those
// past cap). Grid (blocks, B).
extern "C" __global__ void __launch_bounds__(KALOS_BLOCK) kalos_i8_collect(
    const int* __restrict__ S, int ld, int n, const float2* __restrict__ rq,
    const float4* __restrict__ qi, const float* __restrict__ sqn, int l2,
    const float* __restrict__ thr, int* cnt, int* col, int cap) {
    const int b = blockIdx.y;
    const int* Sb = S + (i64)b * ld;
    const float4 w = qi[b];
    const float t = thr[b];
    const int step = gridDim.x * blockDim.x;
    for (int c0 = blockIdx.x * blockDim.x + threadIdx.x; c0 < n; c0 += 4 * step) {
        int p[4];
        float2 r[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = c0 + u * step;
            if (c < n) {
                p[u] = Sb[c];
                r[u] = rq[c];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int c = c0 + u * step;
            if (c < n && i8_bound(p[u], r[u], w, sqn, c, l2) > t) {
                const int pos = atomicAdd(cnt + b, 1);
                if (pos < cap) col[(i64)b * cap + pos] = c;
            }
        }
    }
}

// Step 4: rescore the collected rows in float32, sort them and write the best kk to
// out_s/out_r[b][kk] (pinned host memory); flags[b] = 1 (the host redoes the query) when more
// than cap rows were collected. Grid (B), dynamic shared memory: cap floats and cap ints (cap a
// power of two); one warp per row at a time.
extern "C" __global__ void kalos_i8_final(const store_t* __restrict__ X,
                                          const float* __restrict__ sqn, int dpad,
                                          const float* __restrict__ q32,
                                          const float4* __restrict__ qi, int l2, int kk,
                                          const int* __restrict__ cnt,
                                          const int* __restrict__ col, int cap, float* out_s,
                                          int* out_r, int* flags) {
    float* es = reinterpret_cast<float*>(kalos_smem);
    int* er = reinterpret_cast<int*>(es + cap);
    const int b = blockIdx.x, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
    const int c = cnt[b];
    if (c > cap) {  // block-uniform
        for (int t = tid; t < kk; t += blockDim.x) {
            out_s[(i64)b * kk + t] = neg_inf();
            out_r[(i64)b * kk + t] = -1;
        }
        if (tid == 0) flags[b] = 1;
        return;
    }
    int m = 1;
    while (m < c) m <<= 1;
    const float* q = q32 + (i64)b * dpad;
    const float wq = qi[b].w;
    for (int i = warp; i < c; i += W) {
        const int r = col[(i64)b * cap + i];  // warp-uniform
        const float a = row_dot(X, dpad, r, q, lane);
        if (lane == 0) {
            es[i] = l2 ? 2.0f * a - sqn[r] - wq : a;
            er[i] = r;
        }
    }
    for (int i = c + tid; i < m; i += blockDim.x) {
        es[i] = neg_inf();
        er[i] = 0x7fffffff;
    }
    // Block bitonic sort of the m entries, best first; ties by row so the order is total.
    for (int size = 2; size <= m; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = tid; t < m / 2; t += blockDim.x) {
                const int i = 2 * t - (t & (stride - 1));
                const int j = i + stride;
                const bool desc = (i & size) == 0;
                const float si = es[i], sj = es[j];
                const int ri = er[i], rj = er[j];
                const bool j_better = sj > si || (sj == si && rj < ri);
                const bool i_better = si > sj || (si == sj && ri < rj);
                if (desc ? j_better : i_better) {
                    es[i] = sj;
                    er[i] = rj;
                    es[j] = si;
                    er[j] = ri;
                }
            }
        }
    }
    __syncthreads();
    for (int t = tid; t < kk; t += blockDim.x) {
        out_s[(i64)b * kk + t] = t < c ? es[t] : neg_inf();
        out_r[(i64)b * kk + t] = t < c ? er[t] : -1;
    }
    if (tid == 0) flags[b] = 0;
}

// ------------------------------------------------------------------ queries and rows
// GEMM path: queries into the storage format (qs may be null for float32) and |q|^2 in float32.
// One warp per query.
extern "C" __global__ void kalos_prep_queries(const float* __restrict__ q32, store_t* qs,
                                              float* __restrict__ qn, int B, int dpad) {
    const int b = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (b >= B) return;  // warp-uniform
    float a = 0.0f;
    for (int j = lane; j < dpad; j += 32) {
        const float v = q32[(i64)b * dpad + j];
        a = fmaf(v, v, a);
        if (qs != nullptr) qs[(i64)b * dpad + j] = to_store(v);
    }
    a = warp_sum(a);
    if (lane == 0) qn[b] = a;
}

// Store m float32 vectors (m, d) at rows[i], zero-padded to dpad; sqn of the stored values.
extern "C" __global__ void kalos_write_rows(store_t* __restrict__ X, float* __restrict__ sqn,
                                            int dpad, const i64* __restrict__ rows,
                                            const float* __restrict__ vecs, int m, int d) {
    const int i = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= m) return;  // warp-uniform
    const i64 r = rows[i];
    const float* v = vecs + (i64)i * d;
    store_t* dst = X + r * dpad;
    float a = 0.0f;
    for (int j = lane; j < dpad; j += 32) {
        const store_t s = to_store(j < d ? v[j] : 0.0f);
        dst[j] = s;
        const float x = from_store(s);
        a = fmaf(x, x, a);
    }
    a = warp_sum(a);
    if (lane == 0) sqn[r] = a;
}

// Copy rows src[i] onto dst[i] (the two sets are disjoint, so one launch has no hazards).
extern "C" __global__ void kalos_move_rows(store_t* __restrict__ X, float* __restrict__ sqn,
                                           int dpad, const i64* __restrict__ src,
                                           const i64* __restrict__ dst, int m) {
    const int i = (int)(((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (i >= m) return;
    const i64 s = src[i], t = dst[i];
    for (int j = lane; j < dpad; j += 32) X[t * dpad + j] = X[s * dpad + j];
    if (lane == 0) sqn[t] = sqn[s];
}
