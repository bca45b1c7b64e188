// cupy-paged: write a step's new K/V into the paged cache through the slot mapping.
//
// Compiled once per (dtype, head size) with -D defines (NVRTC through CuPy at run time,
// nvcc --ptx in the test suite):
//   SL_DTYPE      0 = float, 1 = __half, 2 = __nv_bfloat16
//   SL_HEAD_DIM   elements per head
//   SL_KV         the cache's elements: 0 = scalar_t ("auto"), 1 = int8, 2 = fp8 e4m3,
//                 3 = fp8 e5m2 (kv_quant.cuh: quantized on their way in, one warp per row)
//
// Layout (the backend's kv_cache_shape()): [num_kv_heads, num_blocks, block_size, head_dim].
// Slot s = block * block_size + offset, so element (head h, slot s, dim d) lives at
// (h * slots_per_head + s) * head_dim + d, with slots_per_head = num_blocks * block_size.
// A quantized cache's rows are sl_kv_row_bytes(head_dim) bytes instead of head_dim elements.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef SL_DTYPE
#define SL_DTYPE 2
#endif
#ifndef SL_HEAD_DIM
#define SL_HEAD_DIM 128
#endif

#if SL_DTYPE == 0
typedef float scalar_t;
#elif SL_DTYPE == 1
typedef __half scalar_t;
#elif SL_DTYPE == 2
typedef __nv_bfloat16 scalar_t;
#else
#error "SL_DTYPE must be 0 (float), 1 (half) or 2 (bfloat16)"
#endif

#include "kv_quant.cuh"

__device__ __forceinline__ float sl_to_float(float x) { return x; }
__device__ __forceinline__ float sl_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float sl_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

#if SL_KV == 0

// key, value: [num_tokens, num_kv_heads, SL_HEAD_DIM], contiguous.
// One thread per element, grid-stride; a negative slot (padding) is skipped.
extern "C" __global__ void sl_cache_write(
    const scalar_t* __restrict__ key,
    const scalar_t* __restrict__ value,
    scalar_t* __restrict__ key_cache,
    scalar_t* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    const int num_tokens,
    const int num_kv_heads,
    const long long slots_per_head)
{
    const long long total = (long long)num_tokens * num_kv_heads * SL_HEAD_DIM;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int d = (int)(i % SL_HEAD_DIM);
        const long long token_head = i / SL_HEAD_DIM;
        const int h = (int)(token_head % num_kv_heads);
        const long long t = token_head / num_kv_heads;
        const long long slot = slot_mapping[t];
        if (slot < 0) continue;
        const long long dst = ((long long)h * slots_per_head + slot) * SL_HEAD_DIM + d;
        key_cache[dst] = key[i];
        value_cache[dst] = value[i];
    }
}

#else  // a quantized cache

constexpr int SL_ROW = sl_kv_row_bytes(SL_HEAD_DIM);
constexpr int SL_SCALE_OFFSET = sl_kv_scale_offset(SL_HEAD_DIM);

// One (token, KV head) row of `source` quantized into `row` by the 32 lanes of a warp:
// the row's largest magnitude by a butterfly max (exact, so every lane holds the same
// scale), then each lane's elements, the padding and the scale's four bytes.
__device__ __forceinline__ void sl_quantize_row(const scalar_t* __restrict__ source, unsigned char* __restrict__ row,
                                                const int lane) {
    float x[(SL_HEAD_DIM + 31) / 32];
    float peak = 0.f;
#pragma unroll
    for (int i = 0; i < (SL_HEAD_DIM + 31) / 32; ++i) {
        const int d = lane + 32 * i;
        x[i] = d < SL_HEAD_DIM ? sl_to_float(source[d]) : 0.f;
        peak = fmaxf(peak, fabsf(x[i]));
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
    const float scale = sl_kv_scale<sl_kv_t>(peak);
    const float inverse = sl_kv_inverse(scale);
#pragma unroll
    for (int i = 0; i < (SL_HEAD_DIM + 31) / 32; ++i) {
        const int d = lane + 32 * i;
        if (d < SL_HEAD_DIM) row[d] = sl_kv_quantize<sl_kv_t>(x[i], inverse);
    }
    if (lane < SL_SCALE_OFFSET - SL_HEAD_DIM) row[SL_HEAD_DIM + lane] = 0;
    if (lane == 0) *reinterpret_cast<float*>(row + SL_SCALE_OFFSET) = scale;  // 4-aligned: rows are 4k bytes
}

// One warp per (token, KV head) row, grid-stride over rows; a negative slot is skipped.
// Launch with a multiple of 32 threads per block.
extern "C" __global__ void sl_cache_write(
    const scalar_t* __restrict__ key,
    const scalar_t* __restrict__ value,
    unsigned char* __restrict__ key_cache,
    unsigned char* __restrict__ value_cache,
    const long long* __restrict__ slot_mapping,  // [num_tokens]
    const int num_tokens,
    const int num_kv_heads,
    const long long slots_per_head)
{
    const int lane = threadIdx.x % 32;
    const long long rows = (long long)num_tokens * num_kv_heads;
    const long long warps = (long long)gridDim.x * blockDim.x / 32;
    for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < rows; r += warps) {
        const long long slot = slot_mapping[r / num_kv_heads];  // uniform across the warp
        if (slot < 0) continue;
        const int h = (int)(r % num_kv_heads);
        const long long dst = ((long long)h * slots_per_head + slot) * SL_ROW;
        sl_quantize_row(key + r * SL_HEAD_DIM, key_cache + dst, lane);
        sl_quantize_row(value + r * SL_HEAD_DIM, value_cache + dst, lane);
    }
}

#endif  // SL_KV
