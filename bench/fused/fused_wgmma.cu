// Fused scoring + exact top-k, wgmma (sm_90a) main loop (issue 14, item 1; second version).
//
// Built by fused_wgmma.py as ONE translation unit: fused_topk.cu (with FT_NO_MMA_SYNC=1: its
// helpers, ft_prep, ft_merge and ft_exact, unchanged) + the generated fw_mma() (the wgmma
// instruction for N = FW_BQ, whose accumulator count is a compile-time list of asm operands) +
// this file. nvcc -gencode=arch=compute_90a,code=sm_90a (wgmma exists only on sm_90a).
//
// fw_fused: grid = P row parts x QY query tiles, one CTA per SM (one wave), 3 warpgroups:
//   warpgroup 0 (producer): cp.async 16-byte copies of the next (row tile, k-slice) step into a
//     FW_STAGES-deep ring of shared-memory stages, written in the 128-byte-swizzled K-major layout
//     wgmma reads (16-byte chunk c of row r at chunk c ^ (r % 8) of its 128-byte line; every stage
//     1024-byte aligned). A stage = FW_BM = 128 rows x 64 halves + FW_BQ queries x 64 halves. The
//     producer waits for its own copies FW_LAG steps later (cp.async.wait_group), makes them
//     visible to the async proxy (fence.proxy.async) and arrives on the stage's "full" mbarrier.
//   warpgroups 1, 2 (consumers): rows 0-63 / 64-127 of each tile: 4 x
//     wgmma.mma_async.m64n{BQ}k16 per stage (A = rows, B = queries, both from shared memory, f32
//     accumulators in registers, FW_BQ / 2 per thread), one stage in flight (wait_group 1), the
//     stage before it released to the producer through its "empty" mbarrier. After a row tile's
//     last k-slice the accumulators hold its 128 x BQ scores and go through the same gated
//     selection as ft_fused (per-query sorted lists of KC, staging areas of 32, lazy merges,
//     global gate by atomicMax), with named barrier 1 over the 256 consumer threads instead of
//     __syncthreads. The producer keeps filling stages meanwhile.
// Accumulator layout (m64nNk16, f32; checked by the FW_DUMP build against numpy): thread t of the
// warpgroup, warp w = t / 32, lane l: acc[4 j + e] is row 16 w + l / 4 + 8 (e >> 1), query
// 8 j + 2 (l % 4) + (e & 1).
// The exactness argument is ft_fused's (fused_topk.cu header): the candidates, the rescore and the
// proof in ft_merge are shared; only the approximate scores come from another instruction with
// the same inputs (float16 x float16 products, float32 accumulation).

#ifndef FW_BQ
#define FW_BQ 64  // queries per CTA (wgmma N), 16..128, multiple of 16
#endif
#ifndef FW_STAGES
#define FW_STAGES 4
#endif
#ifndef FW_DUMP
#define FW_DUMP 0  // test only: write the raw accumulators to dump[row][query] instead of selecting
#endif
#ifndef FW_NOEPI
#define FW_NOEPI 0  // diagnostic only: skip the selection (answers are wrong) to time the main loop
#endif
#ifndef FW_DIAG
#define FW_DIAG 0  // 1: count tiles / push rounds / pushes / merges into dump (as u64[4]);
                   // 2: selection fast path only (gate compare + one vote; answers are wrong)
#endif
#define FW_BM 128  // rows per tile (2 consumer warpgroups x 64)
#define FW_BK 64   // halves per stage: one 128-byte swizzle line per row
#define FW_THREADS 384
#define FW_CTHREADS 256
#define FW_NACC (FW_BQ / 2)
#define FW_LAG (FW_STAGES - 2)  // producer waits for the copies of step i - LAG (LAG <= S - 2: see below)
#define FW_A_BYTES (FW_BM * 128)
#define FW_B_BYTES (FW_BQ * 128)
#define FW_STAGE_BYTES (FW_A_BYTES + FW_B_BYTES)

static_assert(FW_BQ >= 16 && FW_BQ <= 128 && FW_BQ % 16 == 0, "FW_BQ: 16..128, multiple of 16");
static_assert(FW_STAGES >= 3, "at least 3 stages");
static_assert(FW_NACC <= 64, "one pending bit per accumulator");
static_assert(FW_STAGE_BYTES % 1024 == 0, "stages must stay 1024-byte aligned");

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
    fw_fused(const unsigned short* __restrict__ X, int N, int D,
             const unsigned short* __restrict__ Qh, int B, int QY, int P,
             unsigned* __restrict__ gate, float* __restrict__ cand_s, int* __restrict__ cand_r,
             float* __restrict__ dump) {
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
#if FW_DIAG == 1
        unsigned st_tiles = 0, st_rounds = 0, st_push = 0, st_merge = 0;
#endif
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
#if FW_DUMP
            {
                const int ldq = QY * FW_BQ;
#pragma unroll
                for (int j = 0; j < FW_BQ / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if ((e >> 1) * 8 < rleft)
                            dump[(rbase + (e >> 1) * 8) * ldq + qbase + qcol + j * 8 + (e & 1)] =
                                acc[j * 4 + e];
                continue;
            }
#endif
#if FW_NOEPI
            {
                float t = 0.0f;
#pragma unroll
                for (int i = 0; i < FW_NACC; ++i) t += acc[i];
                if (t == 1.2345e-30f) cand_s[0] = t;  // keeps the multiply alive
                continue;
            }
#endif
            cbar();  // the gate updates of the last tile are visible
#if FW_DIAG == 1
            if (ctid == 0) ++st_tiles;
#endif
            u64 pend = 0;
#pragma unroll
            for (int j = 0; j < FW_BQ / 8; ++j) {
                const float g0 = sgate[qcol + j * 8], g1 = sgate[qcol + j * 8 + 1];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if ((e >> 1) * 8 < rleft && acc[j * 4 + e] > ((e & 1) ? g1 : g0))
                        pend |= 1ull << (j * 4 + e);
            }
#if FW_DIAG == 2
            if (cbar_or(pend != 0)) cand_s[0] = 0.0f;
            continue;
#endif
            while (cbar_or(pend != 0)) {
#if FW_DIAG == 1
                if (ctid == 0) ++st_rounds;
#endif
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
#if FW_DIAG == 1
                                    ++st_push;
#endif
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
#if FW_DIAG == 1
                        st_merge += lane == 0;
#endif
                    }
            }
            if (ctid < FW_BQ && qbase + ctid < B) {
                sgate[ctid] = fmaxf(sgate[ctid], from_ord(gprev));  // read one tile ago
                gprev = *(volatile unsigned*)(gate + qbase + ctid);
            }
        }
#if FW_DIAG == 1
        unsigned long long* stc = reinterpret_cast<unsigned long long*>(dump);
        atomicAdd(stc + 0, (unsigned long long)st_tiles);
        atomicAdd(stc + 1, (unsigned long long)st_rounds);
        atomicAdd(stc + 2, (unsigned long long)st_push);
        atomicAdd(stc + 3, (unsigned long long)st_merge);
#endif
    }
    __syncthreads();
#if !FW_DUMP
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
#endif
}

// ------------------------------------------------------------------ sampled starting gate
// g[b] (scaled units, from fused_wgmma.py): the smallest of KC group maxima of float16-query scores
// of the first S rows (cuBLAS, float32 accumulation), so at least KC rows have such a score >= g[b].
// Each of those rows has a float32 score s >= g qscale - E and an approximate score (this kernel's
// accumulator) >= s - E, so the global KC-th best approximate score is >= g qscale - 2E: a valid
// starting gate (every row that can be a candidate still beats it). Written after ft_prep reset
// the gate to -inf; skipped where g is not finite (the gate then stays -inf).
// One block of 256 threads per query b: g = min over kc groups (S / kc consecutive rows each) of
// the group's maximum of sc[b][.], then the gate as above (one launch: the CuPy reductions it
// replaces cost ~0.25 ms of host launch time per search).
extern "C" __global__ void __launch_bounds__(256)
    fw_gate(const float* __restrict__ sc, int S, int kc, const float* __restrict__ qn,
            const float* __restrict__ qscale, float xmax, int D, int B,
            unsigned* __restrict__ gate) {
    __shared__ float wmin[8];
    const int b = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const float* row = sc + (i64)b * S;
    const int gs = S / kc;
    float mn = pos_inf();
    for (int grp = warp; grp < kc; grp += 8) {
        float mx = neg_inf();
        for (int i = lane; i < gs; i += 32) mx = fmaxf(mx, row[grp * gs + i]);
        mn = fminf(mn, warp_max(mx));
    }
    if (lane == 0) wmin[warp] = mn;
    __syncthreads();
    if (threadIdx.x != 0) return;
    float g = wmin[0];
#pragma unroll
    for (int w = 1; w < 8; ++w) g = fminf(g, wmin[w]);
    const float qs = qscale[b];
    const float qx = sqrtf(qn[b]) * xmax;
    const float ev = 1.25f * (qx * (ldexpf(1.0f, -10) + (float)D * ldexpf(1.0f, -23)) +
                              qs * ldexpf(1.0f, -25) * (sqrtf((float)D) * xmax + 1.0f));
    float v = g - 2.0f * ev / qs;
    v -= fabsf(v) * ldexpf(1.0f, -20) + ldexpf(1.0f, -126);  // rounding of the two lines above
    if (isfinite(v) && isfinite(ev)) gate[b] = ord_f(v);
}
