// cupy-paged: paged attention over a mixed batch (decodes, prompt chunks, draft
// verification), GQA-aware, with online softmax and split-K over long contexts.
//
// Compiled once per (dtype, head size, block size) with -D defines (NVRTC through CuPy
// at run time, nvcc --ptx in the test suite):
//   SL_DTYPE       0 = float, 1 = __half, 2 = __nv_bfloat16   (accumulation is float)
//   SL_HEAD_DIM    elements per head (any size up to 32 * 16 / sizeof(dtype) * SL_MAX_CHUNKS)
//   SL_BLOCK_SIZE  KV slots per cache block
//   SL_KV          the cache's elements: 0 = scalar_t ("auto"), 1 = int8, 2 = fp8 e4m3,
//                  3 = fp8 e5m2 (kv_quant.cuh)
//
// Cache layout: [num_kv_heads, num_blocks, SL_BLOCK_SIZE, ROW] with ROW = SL_HEAD_DIM
// elements, or for a quantized cache sl_kv_row_bytes(SL_HEAD_DIM) bytes: the one-byte
// elements, padding, the row's float32 scale. A quantized row is read as its raw elements
// (widened in registers) and its scale, which multiplies the row's score (K) or its
// softmax weight (V), so dequantization costs two multiplies per key and row.
//
// Work split. A CTA owns up to SL_ROWS query rows that share one KV head: a "tile" of a
// sequence's queries (queries_per_cta consecutive query tokens) times heads_per_cta query
// heads of one GQA group, so each K/V row it reads serves every row. Row r is query
// r / heads_per_cta of the tile and head r % heads_per_cta of the CTA's head chunk. A
// decode tile is one query token and (up to 8 of) its group's heads; a prompt tile with a
// GQA group of g heads holds 8 / g query tokens.
//
//   grid.x  tiles (host-built list of (sequence, first query of the tile))
//   grid.y  num_kv_heads * (group / heads_per_cta)
//   grid.z  split-K partitions of the key axis (1 = no split)
//
// Inside a CTA, lanes form groups of SL_TG lanes; a group owns one key token at a time
// and each lane holds VEC consecutive elements (one 16-byte load for 16-bit types and head
// sizes that are multiples of 8) of that token's K and V row, so a group's loads of a
// row are one coalesced segment. Each group walks its own keys with its own online-softmax
// state (max m, sum l, accumulator acc over the lane's elements); at the end the CTA's
// groups are merged in shared memory. Scores are kept in the log2 domain (the queries are
// pre-scaled by scale * log2(e)), so exp2f replaces expf.
//
// Causality: the tile's query i sits at absolute position ctx - qlen + q0 + i and sees
// keys 0 .. that position. The CTA reads keys [0, kend) with kend = the last query's
// position + 1, restricted to its partition, and masks per row.
//
// Split-K: with gridDim.z > 1 each partition writes its normalized partial output and its
// log2-sum-exp (-inf when it saw no visible key) to float scratch; sl_reduce_partitions
// merges them. Partition 0 always holds key 0, which every query sees, so each row has at
// least one finite partition. With gridDim.z == 1 the CTA writes the output directly.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef SL_DTYPE
#define SL_DTYPE 2
#endif
#ifndef SL_HEAD_DIM
#define SL_HEAD_DIM 128
#endif
#ifndef SL_BLOCK_SIZE
#define SL_BLOCK_SIZE 16
#endif

#define SL_ROWS 8        // query rows per CTA
#define SL_THREADS 128   // threads per CTA (4 warps)
#define SL_NTOK 2        // key tokens a group handles per iteration
#define SL_MAX_CHUNKS 4  // chunks of VEC elements per lane, at most

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
// A quantized element divided by its codec's kWiden (folded into the row's scale).
template <typename T> __device__ __forceinline__ float sl_to_float(T x) { return SlKV<T>::decode(x.bits); }

#if SL_KV == 0
typedef scalar_t cache_t;
constexpr bool QUANTIZED = false;
constexpr int ROW = SL_HEAD_DIM;                           // cache elements per (token, KV head) row
#else
typedef sl_kv_t cache_t;
constexpr bool QUANTIZED = true;
constexpr int ROW = sl_kv_row_bytes(SL_HEAD_DIM);
constexpr int SCALE_OFFSET = sl_kv_scale_offset(SL_HEAD_DIM);
#endif

__device__ __forceinline__ void sl_from_float(float& out, float x) { out = x; }
__device__ __forceinline__ void sl_from_float(__half& out, float x) { out = __float2half_rn(x); }
__device__ __forceinline__ void sl_from_float(__nv_bfloat16& out, float x) { out = __float2bfloat16_rn(x); }

// ---------------------------------------------------------------- compile-time geometry

// Elements per lane chunk: 16 bytes' worth, halved until it divides the head size.
constexpr int sl_pick_vec(int head_dim, int vec) {
    return (vec > 1 && head_dim % vec != 0) ? sl_pick_vec(head_dim, vec / 2) : vec;
}
constexpr int sl_pow2_at_least(int n, int p) { return p >= n ? p : sl_pow2_at_least(n, p * 2); }
constexpr int sl_min(int a, int b) { return a < b ? a : b; }
constexpr int sl_pow2_dividing(int n, int cap) { return (cap > 1 && n % cap != 0) ? sl_pow2_dividing(n, cap / 2) : cap; }

constexpr int VEC = sl_pick_vec(SL_HEAD_DIM, 16 / (int)sizeof(scalar_t));
constexpr int NUM_CHUNKS = SL_HEAD_DIM / VEC;                          // chunks in a row
constexpr int TG = sl_min(32, sl_pow2_at_least(NUM_CHUNKS, 1));         // lanes per group (power of 2)
constexpr int NCH = (NUM_CHUNKS + TG - 1) / TG;                        // chunks per lane
constexpr int ELEMS = NCH * VEC;                                        // row elements per lane
constexpr int GROUPS_PER_WARP = 32 / TG;
constexpr int NUM_WARPS = SL_THREADS / 32;
constexpr int NUM_GROUPS = NUM_WARPS * GROUPS_PER_WARP;
constexpr int WARP_TOKENS = GROUPS_PER_WARP * SL_NTOK;                  // keys a warp takes per iteration
constexpr int CHUNK_BYTES = VEC * (int)sizeof(scalar_t);
// A lane's chunk of a cache row: VEC elements, loaded in pieces as wide as the rows'
// alignment allows (a quantized row of 132 bytes starts on 4 bytes only; an "auto"
// cache's chunk is one load, as the query's).
constexpr int KV_CHUNK_BYTES = VEC * (int)sizeof(cache_t);
constexpr int KV_PIECE_BYTES = sl_min(KV_CHUNK_BYTES, sl_pow2_dividing(ROW * (int)sizeof(cache_t), 16));
constexpr int KV_PIECES = KV_CHUNK_BYTES / KV_PIECE_BYTES;

static_assert(NUM_CHUNKS * VEC == SL_HEAD_DIM, "VEC must divide the head size");
static_assert(NCH <= SL_MAX_CHUNKS, "head size too large for this kernel");
static_assert(32 % TG == 0, "lane groups must tile a warp");

template <int BYTES> struct SlRaw;
template <> struct SlRaw<16> { typedef uint4 type; };
template <> struct SlRaw<8> { typedef uint2 type; };
template <> struct SlRaw<4> { typedef unsigned int type; };
template <> struct SlRaw<2> { typedef unsigned short type; };
template <> struct SlRaw<1> { typedef unsigned char type; };
typedef SlRaw<CHUNK_BYTES>::type raw_t;
typedef SlRaw<KV_PIECE_BYTES>::type kv_piece_t;

// VEC elements at `src` (aligned to CHUNK_BYTES: the head size is a multiple of VEC and
// every row starts on a row boundary of a 256-byte-aligned allocation), as floats.
__device__ __forceinline__ void sl_load_chunk(const scalar_t* __restrict__ src, float* out) {
    const raw_t raw = *reinterpret_cast<const raw_t*>(src);
    const scalar_t* elems = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = sl_to_float(elems[e]);
}

// VEC elements of a cache row at `src` (aligned to KV_PIECE_BYTES), as floats.
__device__ __forceinline__ void sl_load_kv_chunk(const cache_t* __restrict__ src, float* out) {
    kv_piece_t raw[KV_PIECES];
#pragma unroll
    for (int p = 0; p < KV_PIECES; ++p) raw[p] = reinterpret_cast<const kv_piece_t*>(src)[p];
    const cache_t* elems = reinterpret_cast<const cache_t*>(raw);
#pragma unroll
    for (int e = 0; e < VEC; ++e) out[e] = sl_to_float(elems[e]);
}

// The factor a row's loaded elements are multiplied by: its scale times the codec's
// kWiden for a quantized row (every lane of a group reads the same four bytes), else 1.
__device__ __forceinline__ float sl_row_scale(const cache_t* __restrict__ row) {
#if SL_KV == 0
    return 1.f;
#else
    return *reinterpret_cast<const float*>(reinterpret_cast<const unsigned char*>(row) + SCALE_OFFSET) *
           SlKV<cache_t>::kWiden;
#endif
}

__device__ __forceinline__ float sl_neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------- attention

extern "C" __global__ void __launch_bounds__(SL_THREADS) sl_paged_attention(
    scalar_t* __restrict__ out,                      // [T, num_heads, D]      (gridDim.z == 1)
    float* __restrict__ part_out,                    // [T, num_heads, P, D]   (gridDim.z > 1)
    float* __restrict__ part_lse,                    // [T, num_heads, P]      (gridDim.z > 1)
    const scalar_t* __restrict__ query,              // [T, num_heads, D]
    const cache_t* __restrict__ key_cache,           // [num_kv_heads, num_blocks, BS, ROW]
    const cache_t* __restrict__ value_cache,         // [num_kv_heads, num_blocks, BS, ROW]
    const long long* __restrict__ block_tables,      // [B, max_blocks_per_seq]
    const int* __restrict__ tiles,                   // [num_tiles, 2]: sequence, first query
    const long long* __restrict__ query_start_loc,   // [B + 1]
    const long long* __restrict__ context_lens,      // [B]
    const int max_blocks_per_seq,
    const int num_heads,
    const int num_kv_heads,
    const int num_blocks,
    const int heads_per_cta,
    const int queries_per_cta,
    const int partition_size,                        // keys per partition (large when gridDim.z == 1)
    const float scale_log2)                          // softmax scale * log2(e)
{
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int group_in_warp = lane / TG;
    const int lane_in_group = lane % TG;
    const int group_id = warp * GROUPS_PER_WARP + group_in_warp;

    // ------------------------------------------------ which rows, which keys
    const int seq = tiles[2 * blockIdx.x];
    const int q0 = tiles[2 * blockIdx.x + 1];
    const int group_size = num_heads / num_kv_heads;
    const int chunks_per_kv_head = group_size / heads_per_cta;
    const int kv_head = blockIdx.y / chunks_per_kv_head;
    const int head0 = kv_head * group_size + (blockIdx.y % chunks_per_kv_head) * heads_per_cta;
    const int part = blockIdx.z;
    const int num_parts = gridDim.z;

    const long long q_start = query_start_loc[seq];
    const int q_len = (int)(query_start_loc[seq + 1] - q_start);
    const int ctx_len = (int)context_lens[seq];
    const int q_count = min(queries_per_cta, q_len - q0);
    const int num_rows = q_count * heads_per_cta;      // rows 0 .. num_rows-1 are real
    const int first_pos = ctx_len - q_len + q0;        // position of the tile's first query
    const int key_end = first_pos + q_count;           // keys [0, key_end) are visible to some row
    const int key_begin = part * partition_size;
    const int key_stop = min(key_begin + partition_size, key_end);

    // ------------------------------------------------ queries, pre-scaled, in registers
    float q[SL_ROWS][ELEMS];
#pragma unroll
    for (int r = 0; r < SL_ROWS; ++r) {
        const long long token = q_start + q0 + r / heads_per_cta;
        const int head = head0 + r % heads_per_cta;
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const int c = lane_in_group + TG * i;
            if (r < num_rows && c < NUM_CHUNKS) {
                sl_load_chunk(query + (token * num_heads + head) * SL_HEAD_DIM + c * VEC, &q[r][i * VEC]);
#pragma unroll
                for (int e = 0; e < VEC; ++e) q[r][i * VEC + e] *= scale_log2;
            } else {
#pragma unroll
                for (int e = 0; e < VEC; ++e) q[r][i * VEC + e] = 0.f;
            }
        }
    }

    float m[SL_ROWS], l[SL_ROWS], acc[SL_ROWS][ELEMS];
#pragma unroll
    for (int r = 0; r < SL_ROWS; ++r) {
        m[r] = sl_neg_inf();
        l[r] = 0.f;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) acc[r][e] = 0.f;
    }

    const long long head_offset = (long long)kv_head * num_blocks * SL_BLOCK_SIZE * ROW;
    const cache_t* __restrict__ k_head = key_cache + head_offset;
    const cache_t* __restrict__ v_head = value_cache + head_offset;
    const long long* __restrict__ table = block_tables + (long long)seq * max_blocks_per_seq;

    // ------------------------------------------------ the key loop (warp-uniform bounds)
    for (int warp_start = key_begin + warp * WARP_TOKENS; warp_start < key_stop;
         warp_start += NUM_WARPS * WARP_TOKENS) {
        const int tok0 = warp_start + group_in_warp * SL_NTOK;
        float k[SL_NTOK][ELEMS], v[SL_NTOK][ELEMS];
        float k_scale[SL_NTOK], v_scale[SL_NTOK];  // 1 unless the cache is quantized
        bool valid[SL_NTOK];
#pragma unroll
        for (int j = 0; j < SL_NTOK; ++j) {
            const int tok = tok0 + j;
            valid[j] = tok < key_stop;
            long long row = 0;
            if (valid[j]) {
                const long long block = table[tok / SL_BLOCK_SIZE];
                row = (block * SL_BLOCK_SIZE + tok % SL_BLOCK_SIZE) * ROW;
            }
            k_scale[j] = valid[j] ? sl_row_scale(k_head + row) : 0.f;
            v_scale[j] = valid[j] ? sl_row_scale(v_head + row) : 0.f;
#pragma unroll
            for (int i = 0; i < NCH; ++i) {
                const int c = lane_in_group + TG * i;
                if (valid[j] && c < NUM_CHUNKS) {
                    sl_load_kv_chunk(k_head + row + c * VEC, &k[j][i * VEC]);
                    sl_load_kv_chunk(v_head + row + c * VEC, &v[j][i * VEC]);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        k[j][i * VEC + e] = 0.f;
                        v[j][i * VEC + e] = 0.f;
                    }
                }
            }
        }

        // Scores: each lane's partial dot product, summed over the group's lanes. The xor
        // butterfly adds the same operands on every lane, so all lanes of a group hold
        // bitwise-identical scores (and so identical softmax state).
        float s[SL_ROWS][SL_NTOK];
#pragma unroll
        for (int r = 0; r < SL_ROWS; ++r) {
#pragma unroll
            for (int j = 0; j < SL_NTOK; ++j) {
                float dot = 0.f;
                if (r < num_rows) {  // CTA-uniform: rows past num_rows are padding
#pragma unroll
                    for (int e = 0; e < ELEMS; ++e) dot = fmaf(q[r][e], k[j][e], dot);
                }
                s[r][j] = dot;
            }
        }
#pragma unroll
        for (int offset = TG / 2; offset > 0; offset /= 2) {
#pragma unroll
            for (int r = 0; r < SL_ROWS; ++r) {
                if (r >= num_rows) continue;  // uniform across the warp, so every lane shuffles
#pragma unroll
                for (int j = 0; j < SL_NTOK; ++j) s[r][j] += __shfl_xor_sync(0xffffffffu, s[r][j], offset);
            }
        }
        if constexpr (QUANTIZED) {  // the keys' scales, after the sum: the same on every lane
#pragma unroll
            for (int r = 0; r < SL_ROWS; ++r) {
#pragma unroll
                for (int j = 0; j < SL_NTOK; ++j) s[r][j] *= k_scale[j];
            }
        }

        // Online softmax, per row.
#pragma unroll
        for (int r = 0; r < SL_ROWS; ++r) {
            if (r >= num_rows) continue;
            const int limit = first_pos + r / heads_per_cta;  // last key this row sees
            float new_max = m[r];
#pragma unroll
            for (int j = 0; j < SL_NTOK; ++j) {
                if (!valid[j] || tok0 + j > limit) s[r][j] = sl_neg_inf();
                new_max = fmaxf(new_max, s[r][j]);
            }
            if (new_max == sl_neg_inf()) continue;  // nothing visible to this row yet
            if (new_max > m[r]) {
                const float alpha = exp2f(m[r] - new_max);  // 0 when m[r] is -inf
                l[r] *= alpha;
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[r][e] *= alpha;
                m[r] = new_max;
            }
#pragma unroll
            for (int j = 0; j < SL_NTOK; ++j) {
                const float p = exp2f(s[r][j] - new_max);  // 0 for masked keys
                l[r] += p;
                const float pv = QUANTIZED ? p * v_scale[j] : p;
#pragma unroll
                for (int e = 0; e < ELEMS; ++e) acc[r][e] = fmaf(pv, v[j][e], acc[r][e]);
            }
        }
    }

    // ------------------------------------------------ merge the CTA's groups
    __shared__ float sm_max[NUM_GROUPS][SL_ROWS];
    __shared__ float sm_sum[NUM_GROUPS][SL_ROWS];
    __shared__ float sm_row_max[SL_ROWS];
    __shared__ float sm_row_sum[SL_ROWS];
    __shared__ float sm_acc[SL_ROWS][SL_HEAD_DIM];

    if (lane_in_group == 0) {
#pragma unroll
        for (int r = 0; r < SL_ROWS; ++r) {
            sm_max[group_id][r] = m[r];
            sm_sum[group_id][r] = l[r];
        }
    }
    for (int idx = tid; idx < SL_ROWS * SL_HEAD_DIM; idx += SL_THREADS) (&sm_acc[0][0])[idx] = 0.f;
    __syncthreads();

    if (tid < SL_ROWS) {
        float row_max = sl_neg_inf();
        for (int g = 0; g < NUM_GROUPS; ++g) row_max = fmaxf(row_max, sm_max[g][tid]);
        float row_sum = 0.f;
        if (row_max != sl_neg_inf()) {
            for (int g = 0; g < NUM_GROUPS; ++g) {
                const float gm = sm_max[g][tid];
                if (gm != sl_neg_inf()) row_sum += sm_sum[g][tid] * exp2f(gm - row_max);
            }
        }
        sm_row_max[tid] = row_max;
        sm_row_sum[tid] = row_sum;
    }
    __syncthreads();

#pragma unroll
    for (int r = 0; r < SL_ROWS; ++r) {
        if (r >= num_rows || m[r] == sl_neg_inf()) continue;  // this group saw nothing for r
        const float weight = exp2f(m[r] - sm_row_max[r]);
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const int c = lane_in_group + TG * i;
            if (c < NUM_CHUNKS) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) atomicAdd(&sm_acc[r][c * VEC + e], acc[r][i * VEC + e] * weight);
            }
        }
    }
    __syncthreads();

    // ------------------------------------------------ write
    for (int idx = tid; idx < num_rows * SL_HEAD_DIM; idx += SL_THREADS) {
        const int r = idx / SL_HEAD_DIM;
        const int d = idx % SL_HEAD_DIM;
        const long long token = q_start + q0 + r / heads_per_cta;
        const long long token_head = token * num_heads + head0 + r % heads_per_cta;
        const float row_sum = sm_row_sum[r];
        if (num_parts == 1) {
            // Key 0 is visible to every query, so row_sum > 0 here.
            sl_from_float(out[token_head * SL_HEAD_DIM + d], sm_acc[r][d] / row_sum);
        } else {
            const long long slot = token_head * num_parts + part;
            if (row_sum > 0.f) part_out[slot * SL_HEAD_DIM + d] = sm_acc[r][d] / row_sum;
            if (d == 0) part_lse[slot] = row_sum > 0.f ? sm_row_max[r] + log2f(row_sum) : sl_neg_inf();
        }
    }
}

// ---------------------------------------------------------------- split-K merge

// One CTA per (token, head): out = sum_p 2^(lse_p - M) o_p / sum_p 2^(lse_p - M), skipping
// partitions that saw no visible key (lse_p = -inf; their o_p was never written).
extern "C" __global__ void __launch_bounds__(SL_THREADS) sl_reduce_partitions(
    scalar_t* __restrict__ out,             // [T, num_heads, D]
    const float* __restrict__ part_out,     // [T, num_heads, P, D]
    const float* __restrict__ part_lse,     // [T, num_heads, P]
    const int num_parts)
{
    const long long token_head = blockIdx.x;
    const float* lse = part_lse + token_head * num_parts;
    float max_lse = sl_neg_inf();
    for (int p = 0; p < num_parts; ++p) max_lse = fmaxf(max_lse, lse[p]);
    float denom = 0.f;
    for (int p = 0; p < num_parts; ++p) {
        if (lse[p] != sl_neg_inf()) denom += exp2f(lse[p] - max_lse);
    }
    for (int d = threadIdx.x; d < SL_HEAD_DIM; d += SL_THREADS) {
        float num = 0.f;
        for (int p = 0; p < num_parts; ++p) {
            if (lse[p] != sl_neg_inf()) num += exp2f(lse[p] - max_lse) * part_out[(token_head * num_parts + p) * SL_HEAD_DIM + d];
        }
        sl_from_float(out[token_head * SL_HEAD_DIM + d], num / denom);
    }
}
