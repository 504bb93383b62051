// The recency part of a recency-weighted search (broker/clock.py: weight * 0.5 ** (age / half_life),
// age = max(0, now - t) seconds), added to a chunk of the GEMM path's float32 score matrix before
// its top-k kernel selects: the selection is then exact under similarity + recency.
//
// Compiled once per device by cupy.RawModule (sidecar_cuda/backends/cuda/recency.py); no -D
// options, no CUDA headers.
//
//   scores   float  [b][nc]     the chunk's scores as cuBLAS wrote them (query-major, ld = nc)
//   times    double [capacity]  each stored row's time in seconds (Matrix.set_times)
//   row0     first row of the chunk: scores[q][r] belongs to row row0 + r
//   weight   the weight, halved by the caller under l2 (the top-k kernel doubles the dot product)
extern "C" __global__ void kalos_recency_add(float* __restrict__ scores, int nc, int b,
                                             const double* __restrict__ times, long long row0,
                                             double now, double neg_inv_half_life, float weight) {
    const long long total = (long long)nc * b;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        double age = now - times[row0 + i % nc];
        if (age < 0.0) age = 0.0;
        scores[i] += weight * (float)exp2(age * neg_inv_half_life);
    }
}
