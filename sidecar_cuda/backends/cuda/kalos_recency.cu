// The recency part of a recency-weighted search (broker/clock.py decay_part: weight * 0.5 ** (age /
// half_life), age = max(0, now - t) in exact integer nanoseconds, then seconds in float64), added
// to a chunk of the GEMM path's float32 score matrix before its top-k kernel selects: the
// selection is then exact under similarity + recency, with the same part the answer reports
// (computed in float64, rounded once to float32).
//
// Compiled once per device by cupy.RawModule (sidecar_cuda/backends/cuda/recency.py); no -D
// options, no CUDA headers.
//
//   scores   float     [b][nc]     the chunk's scores as cuBLAS wrote them (query-major, ld = nc)
//   times    long long [capacity]  each stored row's time in ns (Matrix.set_times)
//   row0     first row of the chunk: scores[q][r] belongs to row row0 + r
//   weight   the weight, halved by the caller under l2 (the top-k kernel doubles the dot product)
extern "C" __global__ void kalos_recency_add(float* __restrict__ scores, int nc, int b,
                                             const long long* __restrict__ times, long long row0,
                                             long long now_ns, double half_life_s, double weight) {
    const long long total = (long long)nc * b;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        long long age_ns = now_ns - times[row0 + i % nc];
        if (age_ns < 0) age_ns = 0;
        const double age_s = (double)age_ns / 1e9;
        scores[i] += (float)(weight * exp2(-age_s / half_life_s));
    }
}
