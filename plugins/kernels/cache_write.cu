// cupy-paged: write a step's new K/V into the paged cache through the slot mapping.
//
// Compiled once per (dtype, head size) with -D defines (NVRTC through CuPy at run time,
// nvcc --ptx in the test suite):
//   SL_DTYPE      0 = float, 1 = __half, 2 = __nv_bfloat16
//   SL_HEAD_DIM   elements per head
//
// Layout (the backend's kv_cache_shape()): [num_kv_heads, num_blocks, block_size, head_dim].
// Slot s = block * block_size + offset, so element (head h, slot s, dim d) lives at
// (h * slots_per_head + s) * head_dim + d, with slots_per_head = num_blocks * block_size.

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
