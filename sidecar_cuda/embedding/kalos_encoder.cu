// The BERT encoder's elementwise and row-wise steps, fused (sidecar_cuda/embedding/fused.py): each
// kernel does in one launch what bert.py does in five to ten array operations, so a pass of a
// 6-layer model is ~80 launches instead of ~300. Products stay on cuBLAS (CuPy's matmul).
//
// Compiled once per process by cupy.RawModule; no -D options, no CUDA headers: float16 values are
// held as unsigned short and converted with cvt (round to nearest even), as kalos_topk.cu does.
// Every kernel is launched with 128 threads a block (ROW_THREADS) where it works on rows.

#define ROW_THREADS 128

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("{.reg .f16 t;\n\tmov.b16 t, %1;\n\tcvt.f32.f16 %0, t;}\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("{.reg .f16 t;\n\tcvt.rn.f16.f32 t, %1;\n\tmov.b16 %0, t;}\n" : "=h"(h) : "f"(f));
    return h;
}

// The sum of v over the block's ROW_THREADS threads, returned to every thread.
__device__ __forceinline__ float block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // (red is reused by the next call)
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < ROW_THREADS / 32; ++w) s += red[w];
    return s;
}

// Layer norm of the row y (already in xr, n values), written back to xr (float32) and hr (float16).
__device__ __forceinline__ void norm_row(float* xr, unsigned short* hr, const float* g, const float* b, int n,
                                         float eps, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) s += xr[i];
    const float mean = block_sum(s, red) / n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) {
        const float d = xr[i] - mean;
        ss += d * d;
    }
    const float inv = rsqrtf(block_sum(ss, red) / n + eps);
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) {
        const float y = (xr[i] - mean) * inv * g[i] + b[i];
        xr[i] = y;
        hr[i] = f2h(y);
    }
}

// One block per token: x = LayerNorm(word[id] + position[t] + token_type), t = the token's place.
extern "C" __global__ void kalos_embed_ln(const long long* __restrict__ ids, int T, const float* __restrict__ word,
                                          const float* __restrict__ pos, const float* __restrict__ type0,
                                          const float* __restrict__ g, const float* __restrict__ b, float* x,
                                          unsigned short* x16, int n, float eps) {
    __shared__ float red[ROW_THREADS / 32];
    const long long r = blockIdx.x;
    const long long id = ids[r];
    const int t = (int)(r % T);
    float* xr = x + r * n;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) xr[i] = word[id * n + i] + pos[(long long)t * n + i] + type0[i];
    norm_row(xr, x16 + r * n, g, b, n, eps, red);
}

// One block per token: x = LayerNorm(a + bias + x) (a: a product's float16 output; the residual
// x float32, updated in place), and its float16 copy for the next product.
extern "C" __global__ void kalos_add_ln(const unsigned short* __restrict__ a, const float* __restrict__ bias, float* x,
                                        unsigned short* x16, const float* __restrict__ g, const float* __restrict__ b,
                                        int n, float eps) {
    __shared__ float red[ROW_THREADS / 32];
    const long long r = blockIdx.x;
    float* xr = x + r * n;
    const unsigned short* ar = a + r * n;
    for (int i = threadIdx.x; i < n; i += ROW_THREADS) xr[i] = h2f(ar[i]) + bias[i] + xr[i];
    norm_row(xr, x16 + r * n, g, b, n, eps, red);
}

// The fused projection's output (B*T, 3h) plus its bias, into q (B,H,T,dh) scaled by 1/sqrt(dh),
// kt (B,H,dh,T) (keys transposed: scores = q @ kt) and v (B,H,T,dh), float16.
extern "C" __global__ void kalos_split_heads(const unsigned short* __restrict__ qkv, const float* __restrict__ bias,
                                             unsigned short* q, unsigned short* kt, unsigned short* v, int T, int H,
                                             int dh, float scale, long long total) {
    const int h = H * dh;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / (3 * h);
        const int c = (int)(i - r * 3 * h);
        const int which = c / h, cc = c - which * h, head = cc / dh, d = cc - head * dh;
        const long long bi = r / T;
        const int t = (int)(r - bi * T);
        const float val = h2f(qkv[i]) + bias[c];
        const long long bh = bi * H + head;
        if (which == 0) q[(bh * T + t) * dh + d] = f2h(val * scale);
        else if (which == 1) kt[(bh * dh + d) * T + t] = f2h(val);
        else v[(bh * T + t) * dh + d] = f2h(val);
    }
}

// One block per row of scores (B*H*T rows of T): softmax over the keys the mask keeps (mask
// (B,T), 1 a token, 0 padding; every row keeps at least one), in float32, in place.
extern "C" __global__ void kalos_softmax(unsigned short* s, const long long* __restrict__ mask, int T, int H) {
    __shared__ float red[ROW_THREADS / 32];
    const long long r = blockIdx.x;
    const long long bi = r / ((long long)H * T);
    unsigned short* row = s + r * T;
    const long long* m = mask + bi * T;
    float mx = -3.0e38f;
    for (int j = threadIdx.x; j < T; j += ROW_THREADS)
        if (m[j]) mx = fmaxf(mx, h2f(row[j]));
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    for (int w = 0; w < ROW_THREADS / 32; ++w) mx = fmaxf(mx, red[w]);
    float sum = 0.f;
    for (int j = threadIdx.x; j < T; j += ROW_THREADS)
        if (m[j]) sum += __expf(h2f(row[j]) - mx);
    sum = block_sum(sum, red);
    const float inv = 1.f / sum;
    for (int j = threadIdx.x; j < T; j += ROW_THREADS) row[j] = f2h(m[j] ? __expf(h2f(row[j]) - mx) * inv : 0.f);
}

// y = GELU(x + bias) over a (rows, cols) float16 matrix, in place; tanh_form: the tanh
// approximation ("gelu_new"), else the erf form (BERT's "gelu").
extern "C" __global__ void kalos_bias_gelu(unsigned short* x, const float* __restrict__ bias, int cols, long long total,
                                           int tanh_form) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const float u = h2f(x[i]) + bias[i % cols];
        const float y = tanh_form ? 0.5f * u * (1.f + tanhf(0.7978845608f * (u + 0.044715f * u * u * u)))
                                  : 0.5f * u * (1.f + erff(u * 0.70710678118f));
        x[i] = f2h(y);
    }
}
