// Paged attention on the CPU for every row of a step (decodes, verified drafts, chunks,
// prompts), and the K/V cache write, for the `cpu-paged` attention backend.
//
// Cache layout (as torch-paged): [num_kv_heads, num_blocks, block_size, head_dim], so one
// (KV head, block) is a contiguous block_size x head_dim tile. Keys and values are read
// straight from the cache through each sequence's block table (nothing is gathered),
// scores and softmax in float32 with the causal limit of each query token. A row of a few
// query tokens is one work item per (sequence, KV head): its query heads' rows (every
// query token x the query heads of that KV head) are scored against all of the sequence's
// keys, then the value rows are summed. A row of many query tokens is cut into tiles of
// query tokens attended flash-style (see attend_query_tile).
//
// Quantized caches (`[engine] kv_cache_dtype`: int8, fp8 e4m3, fp8 e5m2) keep the layout with
// a longer last dimension: each (token, KV head) row is head_dim one-byte values, zero
// padding to a multiple of 4, then the row's float32 scale (kv_quant.py is the reference).
// The kernel reads the bytes and dequantizes one block at a time into a float32 tile in L1
// (value * scale, widened in registers), so memory traffic is the one-byte rows.
#include "cpu_kernels.h"
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace {

template <typename scalar_t>
inline void load_row(const scalar_t* source, float* target, int64_t n) {
  for (int64_t i = 0; i < n; ++i) target[i] = static_cast<float>(source[i]);
}

#ifdef __AVX2__
template <>
inline void load_row<float>(const float* source, float* target, int64_t n) {
  std::memcpy(target, source, n * sizeof(float));
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* source, float* target, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // bfloat16 is the high half of a float32
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + i));
    _mm256_storeu_ps(target + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
  for (; i < n; ++i) target[i] = static_cast<float>(source[i]);
}

#ifdef __AVX512F__
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
    sum1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), sum1);
  }
  for (; i + 16 <= n; i += 16) sum0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), sum0);
  float total = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m512 scale = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(scale, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
    sum1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), sum1);
  }
  for (; i + 8 <= n; i += 8) sum0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), sum0);
  const __m256 sum = _mm256_add_ps(sum0, sum1);
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float total = _mm_cvtss_f32(half);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  const __m256 scale = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#endif  // __AVX512F__
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
#endif

// A cache row as float32: read in place when it is float32 already, else converted into `buffer`.
template <typename scalar_t>
inline const float* as_floats(const scalar_t* source, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return source;
  } else {
    load_row(source, buffer, n);
    return buffer;
  }
}

// ---------------------------------------------------------------- quantized cache rows

template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> ||
                            std::is_same_v<T, c10::Float8_e5m2>;

// The largest magnitude each element type holds (servelab.interfaces.QUANTIZED_KV_MAX).
template <typename T>
constexpr float kQuantizedMax = std::is_same_v<T, int8_t> ? 127.f : std::is_same_v<T, c10::Float8_e4m3fn> ? 448.f : 57344.f;

// Where a row's float32 scale starts: after head_dim bytes, rounded up to 4.
inline int64_t scale_offset(int64_t head_dim) { return (head_dim + 3) / 4 * 4; }

inline float row_scale(const void* row, int64_t head_dim) {
  float scale;
  std::memcpy(&scale, static_cast<const char*>(row) + scale_offset(head_dim), sizeof(float));
  return scale;
}

#ifdef __AVX2__
// Widening of 8 (AVX2) or 16 (AVX-512) one-byte elements to float32, in registers. fp8 goes
// through float16: an e5m2 byte is the high byte of a float16; an e4m3 byte's sign, exponent
// and mantissa land on a float16's with its exponent 8 lower (subnormals included), so the
// float16 holds the value times 2^-8, which the caller's scale makes up for (kWiden).
template <typename T> constexpr float kWiden = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;

inline __m128i fp8_to_half_bits(__m128i bytes_as_u16, bool e4m3) {  // 8 lanes of u16 holding one byte each
  if (!e4m3) return _mm_slli_epi16(bytes_as_u16, 8);
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(bytes_as_u16, _mm_set1_epi16(0x80)), 8),
                      _mm_slli_epi16(_mm_and_si128(bytes_as_u16, _mm_set1_epi16(0x7F)), 7));
}

template <typename T>
inline __m256 widen8(const T* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, int8_t>) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
  else return _mm256_cvtph_ps(fp8_to_half_bits(_mm_cvtepu8_epi16(raw), std::is_same_v<T, c10::Float8_e4m3fn>));
}

#ifdef __AVX512F__
template <typename T>
inline __m512 widen16(const T* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  } else {
    const __m256i wide = _mm256_cvtepu8_epi16(raw);
    __m256i half;
    if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>)
      half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8),
                             _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7));
    else
      half = _mm256_slli_epi16(wide, 8);
    return _mm512_cvtph_ps(half);
  }
}
#endif  // __AVX512F__
#endif  // __AVX2__

// One quantized row as float32 values (value * scale) into `target`.
template <typename T>
inline void dequantize_row(const T* row, float* target, int64_t head_dim) {
  const float scale = row_scale(row, head_dim);
  int64_t i = 0;
#ifdef __AVX2__
  const float widened_scale = scale * kWiden<T>;
#ifdef __AVX512F__
  const __m512 scale16 = _mm512_set1_ps(widened_scale);
  for (; i + 16 <= head_dim; i += 16) _mm512_storeu_ps(target + i, _mm512_mul_ps(widen16(row + i), scale16));
#endif
  const __m256 scale8 = _mm256_set1_ps(widened_scale);
  for (; i + 8 <= head_dim; i += 8) _mm256_storeu_ps(target + i, _mm256_mul_ps(widen8(row + i), scale8));
#endif
  for (; i < head_dim; ++i) target[i] = static_cast<float>(row[i]) * scale;
}

// `count` rows of one block (rows `row_stride` elements apart) as float32, `head_dim` apart.
template <typename T>
inline const float* dequantize_block(const T* tile, int64_t count, int64_t head_dim, int64_t row_stride,
                                     std::vector<float>& buffer) {
  buffer.resize(count * head_dim);
  for (int64_t r = 0; r < count; ++r) dequantize_row(tile + r * row_stride, buffer.data() + r * head_dim, head_dim);
  return buffer.data();
}

// A cache row as float32: in place (float32), widened (16-bit) or dequantized into `buffer`.
template <typename cache_t>
inline const float* cache_row_as_floats(const cache_t* source, float* buffer, int64_t head_dim) {
  if constexpr (kQuantized<cache_t>) {
    dequantize_row(source, buffer, head_dim);
    return buffer;
  } else {
    return as_floats(source, buffer, head_dim);
  }
}

// One (token, KV head) row quantized: scale = max|x| / max, values x / scale rounded (int8:
// half to even; fp8: the format's own rounding) and clamped, then the scale's bytes.
template <typename scalar_t, typename T>
inline void quantize_row(const scalar_t* source, T* row, int64_t head_dim) {
  float peak = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) peak = std::max(peak, std::fabs(static_cast<float>(source[i])));
  const float limit = kQuantizedMax<T>;
  const float scale = peak / limit;
  const float inverse = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float x = std::min(std::max(static_cast<float>(source[i]) * inverse, -limit), limit);
    if constexpr (std::is_same_v<T, int8_t>) row[i] = static_cast<int8_t>(std::nearbyint(x));
    else row[i] = T(x);
  }
  char* bytes = reinterpret_cast<char*>(row);
  std::memset(bytes + head_dim, 0, scale_offset(head_dim) - head_dim);
  std::memcpy(bytes + scale_offset(head_dim), &scale, sizeof(float));
}

// Blocks sit anywhere in the cache, out of reach of the hardware prefetchers, so the
// kernel requests the tiles it will read next itself. A decode work item reads one stream
// of tiles: its keys' blocks, its values' blocks, then the next item's keys' blocks. While
// it computes on one tile, the tile kPrefetchBytes further along the stream is requested a
// key's worth at a time, spread over the computation (a whole tile requested at once
// stalls the loads that compute needs). Measured from DRAM with blocks in random order,
// against a whole tile requested four blocks ahead: fp32 1.2-1.3x, bf16 1.3-1.6x faster.
// The requests fill L2, not L1 (locality 2: prefetcht1 on x86): requests into L1 hold
// the few line-fill buffers that the loads of the tile being computed on need too. 30
// layers of decode attention at 48 sequences of 73-323 tokens, AMD Zen 4, 2 threads, blocks
// in random order: bf16 16.3-16.5 -> 12.1-12.4 ms, fp32 27.1-28.6 -> 18.1-18.3 ms; blocks
// in order, bf16 12.9-13.3 -> 9.6-9.7 ms (the tiles stream at 24.5 GB/s, a plain read ~27).
constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch_bytes(const void* start, int64_t bytes) {
  const char* first = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset, 0, 2);
}

template <typename scalar_t>
inline void prefetch_tile(const scalar_t* tile, int64_t elements) {
  if (tile != nullptr) prefetch_bytes(tile, elements * static_cast<int64_t>(sizeof(scalar_t)));
}

// Prefetch the tiles of blocks [first, last) of one head's cache, clamped to `used` blocks.
template <typename scalar_t, typename index_t>
inline void prefetch_blocks(const scalar_t* head, const index_t* table, int64_t first, int64_t last, int64_t used,
                            int64_t tile) {
  for (int64_t blk = first; blk < std::min(last, used); ++blk) prefetch_tile(head + table[blk] * tile, tile);
}

#ifdef __AVX2__
// The vectorised path (AVX-512: 16 floats a vector, AVX2: 8), for head dims that are a
// multiple of the vector width: a vector's worth of keys is scored at once (their products
// summed by one transposing reduction instead of one horizontal sum each), the softmax's
// exponentials are vectorised, and each row's output accumulates in registers across a
// block's values. Half-precision rows are widened in registers, never copied.
using servelab_simd::Native;
constexpr int kMaxChunks = 16;  // head_dim / width: 256 with AVX-512, 128 with AVX2

// Up to W keys' scores for kRows rows, for a head dim of kChunks vectors: the chunk loop
// unrolled and kKeys keys scored at once, so kRows * kKeys independent sums keep the FMA
// units busy (one key at a time, each sum waited on every FMA's latency: 1.45-1.5x slower
// from L2). Each sum adds the chunks in order, as the generic loop does: same results.
template <typename S, typename scalar_t, int kChunks, int kRows>
inline void score_rows(const float* q_rows, const scalar_t* keys, int n, float* scores, int64_t stride,
                       const scalar_t* ahead) {
  constexpr int W = S::kWidth, kKeys = 4;
  constexpr int64_t head_dim = kChunks * W;
  typename S::V q[kRows][kChunks];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kChunks; ++c) q[r][c] = S::loadu(q_rows + r * head_dim + c * W);
  typename S::V products[kRows][W];
  for (int first = 0; first < W; first += kKeys) {
    typename S::V sums[kRows][kKeys];
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < kKeys; ++i) sums[r][i] = S::zero();
    const int keys_here = std::max(0, std::min(kKeys, n - first));
    if (keys_here == kKeys) {
      for (int c = 0; c < kChunks; ++c)
        for (int i = 0; i < kKeys; ++i) {
          const typename S::V k = S::load(keys + (first + i) * head_dim + c * W);
          for (int r = 0; r < kRows; ++r) sums[r][i] = S::fmadd(q[r][c], k, sums[r][i]);
        }
    } else {
      for (int i = 0; i < keys_here; ++i)
        for (int c = 0; c < kChunks; ++c) {
          const typename S::V k = S::load(keys + (first + i) * head_dim + c * W);
          for (int r = 0; r < kRows; ++r) sums[r][i] = S::fmadd(q[r][c], k, sums[r][i]);
        }
    }
    if (ahead != nullptr)
      for (int i = 0; i < keys_here; ++i) prefetch_bytes(ahead + (first + i) * head_dim, head_dim * sizeof(scalar_t));
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < kKeys; ++i) products[r][first + i] = sums[r][i];
  }
  for (int r = 0; r < kRows; ++r) S::store_first(scores + r * stride, S::sum_each(products[r]), n);
}

template <typename S, typename scalar_t, int kChunks>
inline void score_block_unrolled(const float* q_rows, int64_t num_rows, const scalar_t* keys, int64_t count,
                                 float* scores, int64_t stride, const scalar_t* ahead) {
  constexpr int W = S::kWidth;
  constexpr int64_t head_dim = kChunks * W;
  for (int64_t first = 0; first < count; first += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, count - first));
    const scalar_t* block_ahead = ahead == nullptr ? nullptr : ahead + first * head_dim;
    int64_t r = 0;
    for (; r + 2 <= num_rows; r += 2)
      score_rows<S, scalar_t, kChunks, 2>(q_rows + r * head_dim, keys + first * head_dim, n, scores + r * stride + first,
                                          stride, r == 0 ? block_ahead : nullptr);
    if (r < num_rows)
      score_rows<S, scalar_t, kChunks, 1>(q_rows + r * head_dim, keys + first * head_dim, n, scores + r * stride + first,
                                          stride, r == 0 ? block_ahead : nullptr);
  }
}

// scores[r * stride + j] = q_rows[r] . keys[j] for the `count` keys of one block; the tile
// `ahead` (if any) is requested meanwhile, a key's worth per key scored.
template <typename S, typename scalar_t>
inline void score_keys(const float* q_rows, int64_t num_rows, const scalar_t* keys, int64_t count,
                       int64_t head_dim, float* scores, int64_t stride, const scalar_t* ahead) {
  constexpr int W = S::kWidth;
  if (head_dim == 4 * W) return score_block_unrolled<S, scalar_t, 4>(q_rows, num_rows, keys, count, scores, stride, ahead);
  if (head_dim == 8 * W) return score_block_unrolled<S, scalar_t, 8>(q_rows, num_rows, keys, count, scores, stride, ahead);
  const int64_t chunks = head_dim / W;
  for (int64_t first = 0; first < count; first += W) {
    const int n = static_cast<int>(std::min<int64_t>(W, count - first));
    for (int64_t r = 0; r < num_rows; ++r) {
      const float* q = q_rows + r * head_dim;
      typename S::V products[W];
      for (int j = 0; j < W; ++j) {
        typename S::V sum = S::zero();
        if (j < n) {
          const scalar_t* key = keys + (first + j) * head_dim;
          if (r == 0 && ahead != nullptr) prefetch_bytes(ahead + (first + j) * head_dim, head_dim * sizeof(scalar_t));
          for (int64_t c = 0; c < chunks; ++c) sum = S::fmadd(S::loadu(q + c * W), S::load(key + c * W), sum);
        }
        products[j] = sum;
      }
      S::store_first(scores + r * stride + first, S::sum_each(products), n);
    }
  }
}

// In place: s[i] = e^(s[i] - max) for i < visible, 0 beyond; returns the sum.
template <typename S>
inline float softmax_numerators(float* s, int64_t visible, int64_t length) {
  constexpr int W = S::kWidth;
  typename S::V peak = S::set1(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= visible; i += W) peak = S::max(peak, S::loadu(s + i));
  float top = S::reduce_max(peak);
  for (; i < visible; ++i) top = std::max(top, s[i]);
  const typename S::V top_v = S::set1(top);
  typename S::V total = S::zero();
  for (i = 0; i + W <= visible; i += W) {
    const typename S::V e = servelab_simd::exp<S>(S::sub(S::loadu(s + i), top_v));
    S::storeu(s + i, e);
    total = S::add(total, e);
  }
  if (i < visible) {
    const int n = static_cast<int>(visible - i);
    // Lanes past the row are e^(0 - top): zero them before they join the sum.
    const typename S::V e = servelab_simd::exp<S>(S::sub(S::load_first(s + i, n), top_v));
    S::store_first(s + i, e, n);
    float tail[W];
    S::storeu(tail, e);
    for (int l = n; l < W; ++l) tail[l] = 0.f;
    total = S::add(total, S::loadu(tail));
  }
  for (i = visible; i < length; ++i) s[i] = 0.f;
  return S::reduce_add(total);
}

// acc[r] += sum_j weights[r * stride + j] * values[j] over the `count` values of one block;
// the tile `ahead` (if any) is requested meanwhile, as in score_keys.
template <typename S, typename scalar_t, int kChunks>
inline void accumulate_values(const float* weights, int64_t stride, int64_t num_rows, const scalar_t* values,
                              int64_t count, int64_t head_dim, float* acc, const scalar_t* ahead) {
  constexpr int W = S::kWidth;
  const int64_t chunks = kChunks > 0 ? kChunks : head_dim / W;
  int64_t r = 0;
  if constexpr (kChunks > 0) {  // two rows at a time: each value loaded once, 2 * kChunks independent sums
    for (; r + 2 <= num_rows; r += 2) {
      typename S::V sums0[kChunks], sums1[kChunks];
      float* target0 = acc + r * head_dim;
      float* target1 = target0 + head_dim;
      for (int c = 0; c < kChunks; ++c) {
        sums0[c] = S::loadu(target0 + c * W);
        sums1[c] = S::loadu(target1 + c * W);
      }
      const float* w0 = weights + r * stride;
      const float* w1 = w0 + stride;
      for (int64_t j = 0; j < count; ++j) {
        const typename S::V weight0 = S::set1(w0[j]), weight1 = S::set1(w1[j]);
        const scalar_t* value = values + j * head_dim;
        if (r == 0 && ahead != nullptr) prefetch_bytes(ahead + j * head_dim, head_dim * sizeof(scalar_t));
        for (int c = 0; c < kChunks; ++c) {
          const typename S::V v = S::load(value + c * W);
          sums0[c] = S::fmadd(weight0, v, sums0[c]);
          sums1[c] = S::fmadd(weight1, v, sums1[c]);
        }
      }
      for (int c = 0; c < kChunks; ++c) {
        S::storeu(target0 + c * W, sums0[c]);
        S::storeu(target1 + c * W, sums1[c]);
      }
    }
  }
  for (; r < num_rows; ++r) {
    typename S::V sums[kMaxChunks];
    float* target = acc + r * head_dim;
    for (int64_t c = 0; c < chunks; ++c) sums[c] = S::loadu(target + c * W);
    const float* w = weights + r * stride;
    for (int64_t j = 0; j < count; ++j) {
      const typename S::V weight = S::set1(w[j]);
      const scalar_t* value = values + j * head_dim;
      if (r == 0 && ahead != nullptr) prefetch_bytes(ahead + j * head_dim, head_dim * sizeof(scalar_t));
      for (int64_t c = 0; c < chunks; ++c) sums[c] = S::fmadd(weight, S::load(value + c * W), sums[c]);
    }
    for (int64_t c = 0; c < chunks; ++c) S::storeu(target + c * W, sums[c]);
  }
}

template <typename S, typename scalar_t>
inline void accumulate_block(const float* weights, int64_t stride, int64_t num_rows, const scalar_t* values,
                             int64_t count, int64_t head_dim, float* acc, const scalar_t* ahead) {
  if (head_dim == 4 * S::kWidth)  // unrolled for the common head dims
    accumulate_values<S, scalar_t, 4>(weights, stride, num_rows, values, count, head_dim, acc, ahead);
  else if (head_dim == 8 * S::kWidth)
    accumulate_values<S, scalar_t, 8>(weights, stride, num_rows, values, count, head_dim, acc, ahead);
  else
    accumulate_values<S, scalar_t, 0>(weights, stride, num_rows, values, count, head_dim, acc, ahead);
}

// Rows with many query tokens (prompts, long chunks) take a tiled, flash-style path: one
// work item is (sequence, KV head, tile of query tokens). The tile's rows are transposed
// into the lanes of vectors, so one key's scores against W rows are one vector: the
// running maxima and sums of the softmax are lane-wise (no horizontal reductions), a key
// past a row's causal limit is hidden lane by lane, and keys past the tile's last token are
// never read. Key and value elements are broadcast straight from the cache tile (float32)
// or from one block widened into a buffer (half precision).

struct TileBuffers {
  std::vector<float> queries;    // [head_dim][padded rows], pre-scaled
  std::vector<float> output;     // [head_dim][padded rows], unnormalised
  std::vector<float> weights;    // [block_size][padded rows]: one block's scores, then its weights
  std::vector<float> positions;  // [padded rows]: each row's query position (padding sees everything)
  std::vector<float> maxima, sums, rescale;  // [padded rows]
  std::vector<float> keys, values;  // one block widened to float32
};

template <typename scalar_t>
inline const float* block_as_floats(const scalar_t* tile, int64_t elements, std::vector<float>& buffer) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return tile;
  } else {
    buffer.resize(elements);
    load_row(tile, buffer.data(), elements);
    return buffer.data();
  }
}

// The three stages of a block are kept out of line: inlined into the work loop, the
// compiler's register allocation made the tiled path 1.4x slower (measured, one thread).
template <typename S>
__attribute__((noinline)) void score_tile_block(const float* queries, int64_t padded, const float* keys,
                                                int64_t count, int64_t head_dim, float* scores) {
  constexpr int W = S::kWidth;
  constexpr int kKeysAtOnce = W;  // keys scored per pass over the head dim: W accumulators and the query in registers
  for (int64_t lane = 0; lane < padded; lane += W) {
    for (int64_t first = 0; first < count; first += kKeysAtOnce) {
      const int n = static_cast<int>(std::min<int64_t>(kKeysAtOnce, count - first));
      const float* key = keys + first * head_dim;
      typename S::V acc[kKeysAtOnce];
      for (int i = 0; i < kKeysAtOnce; ++i) acc[i] = S::zero();
      if (n == kKeysAtOnce) {
        for (int64_t c = 0; c < head_dim; ++c) {
          const typename S::V q = S::loadu(queries + c * padded + lane);
          for (int i = 0; i < kKeysAtOnce; ++i) acc[i] = S::fmadd(S::set1(key[i * head_dim + c]), q, acc[i]);
        }
      } else {
        for (int64_t c = 0; c < head_dim; ++c) {
          const typename S::V q = S::loadu(queries + c * padded + lane);
          for (int i = 0; i < n; ++i) acc[i] = S::fmadd(S::set1(key[i * head_dim + c]), q, acc[i]);
        }
      }
      for (int i = 0; i < n; ++i) S::storeu(scores + (first + i) * padded + lane, acc[i]);
    }
  }
}

template <typename S>
__attribute__((noinline)) void softmax_tile_block(float* scores, int64_t padded, int64_t count,
                                                  int64_t block_start, float first_row_position, TileBuffers& buf) {
  constexpr int W = S::kWidth;
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t lane = 0; lane < padded; lane += W) {
    const typename S::V positions = S::loadu(&buf.positions[lane]);
    const typename S::V previous = S::loadu(&buf.maxima[lane]);
    typename S::V peak = previous;
    for (int64_t k = 0; k < count; ++k) {
      const float position = static_cast<float>(block_start + k);
      typename S::V s = S::loadu(scores + k * padded + lane);
      if (position > first_row_position) s = S::fill_below(s, positions, position, hidden);
      peak = S::max(peak, s);
    }
    typename S::V total = S::zero();
    for (int64_t k = 0; k < count; ++k) {
      const float position = static_cast<float>(block_start + k);
      typename S::V p = servelab_simd::exp<S>(S::sub(S::loadu(scores + k * padded + lane), peak));
      if (position > first_row_position) p = S::fill_below(p, positions, position, 0.f);
      S::storeu(scores + k * padded + lane, p);
      total = S::add(total, p);
    }
    // The first block holds key 0, which every row sees: no lane's maximum stays -inf.
    const typename S::V factor = servelab_simd::exp<S>(S::sub(previous, peak));
    S::storeu(&buf.rescale[lane], factor);
    S::storeu(&buf.sums[lane], S::fmadd(S::loadu(&buf.sums[lane]), factor, total));
    S::storeu(&buf.maxima[lane], peak);
  }
}

template <typename S>
__attribute__((noinline)) void accumulate_tile_block(const float* weights, int64_t padded, const float* values,
                                                     int64_t count, int64_t head_dim, TileBuffers& buf) {
  constexpr int W = S::kWidth;
  constexpr int kDims = W;  // output rows held in registers: 16 of 32 with AVX-512, 8 of 16 with AVX2
  float* output = buf.output.data();
  for (int64_t lane = 0; lane < padded; lane += W) {
    const typename S::V factor = S::loadu(&buf.rescale[lane]);
    for (int64_t dim = 0; dim < head_dim; dim += kDims) {
      typename S::V acc[kDims];
      for (int i = 0; i < kDims; ++i) acc[i] = S::mul(S::loadu(output + (dim + i) * padded + lane), factor);
      for (int64_t k = 0; k < count; ++k) {
        const typename S::V p = S::loadu(weights + k * padded + lane);
        const float* value = values + k * head_dim + dim;
        for (int i = 0; i < kDims; ++i) acc[i] = S::fmadd(S::set1(value[i]), p, acc[i]);
      }
      for (int i = 0; i < kDims; ++i) S::storeu(output + (dim + i) * padded + lane, acc[i]);
    }
  }
}

// One block of the cache as float32 for the tiled path.
template <typename cache_t>
inline const float* cache_block_as_floats(const cache_t* tile, int64_t count, int64_t head_dim, int64_t row_stride,
                                          std::vector<float>& buffer) {
  if constexpr (kQuantized<cache_t>) return dequantize_block(tile, count, head_dim, row_stride, buffer);
  else return block_as_floats(tile, count * head_dim, buffer);
}

// Attends query tokens [tile_start, tile_start + tile_len) of one sequence for one KV head.
template <typename S, typename scalar_t, typename cache_t, typename index_t>
void attend_query_tile(const scalar_t* q_data, int64_t q_token_stride, int64_t q_head_stride, const cache_t* k_head,
                       const cache_t* v_head, const index_t* table, int64_t block_size, int64_t head_dim,
                       int64_t row_stride,
                       int64_t num_heads, int64_t group, int64_t kv_head, int64_t first, int64_t num_queries,
                       int64_t context, int64_t tile_start, int64_t tile_len, float scale, TileBuffers& buf,
                       scalar_t* o_data) {
  constexpr int W = S::kWidth;
  const int64_t rows = tile_len * group;  // row r = token r / group, head r % group
  const int64_t padded = (rows + W - 1) / W * W;
  const int64_t first_position = context - num_queries + tile_start;
  buf.queries.assign(head_dim * padded, 0.f);
  buf.output.assign(head_dim * padded, 0.f);
  buf.weights.resize(block_size * padded);
  buf.positions.assign(padded, std::numeric_limits<float>::max());
  buf.maxima.assign(padded, -std::numeric_limits<float>::infinity());
  buf.sums.assign(padded, 0.f);
  buf.rescale.resize(padded);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / group, j = r % group;
    const scalar_t* source = q_data + (first + tile_start + t) * q_token_stride + (kv_head * group + j) * q_head_stride;
    for (int64_t c = 0; c < head_dim; ++c) buf.queries[c * padded + r] = static_cast<float>(source[c]) * scale;
    buf.positions[r] = static_cast<float>(first_position + t);
  }
  const int64_t keys = first_position + tile_len;  // the tile's last token sees keys [0, keys)
  const int64_t tile = block_size * row_stride;
  const int64_t used_blocks = (keys + block_size - 1) / block_size;
  for (int64_t blk = 0; blk < used_blocks; ++blk) {
    prefetch_blocks(k_head, table, blk + 1, blk + 2, used_blocks, tile);
    prefetch_blocks(v_head, table, blk + 1, blk + 2, used_blocks, tile);
    const int64_t count = std::min(block_size, keys - blk * block_size);
    const float* k = cache_block_as_floats(k_head + table[blk] * tile, count, head_dim, row_stride, buf.keys);
    const float* v = cache_block_as_floats(v_head + table[blk] * tile, count, head_dim, row_stride, buf.values);
    score_tile_block<S>(buf.queries.data(), padded, k, count, head_dim, buf.weights.data());
    softmax_tile_block<S>(buf.weights.data(), padded, count, blk * block_size, static_cast<float>(first_position), buf);
    accumulate_tile_block<S>(buf.weights.data(), padded, v, count, head_dim, buf);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / group, j = r % group;
    scalar_t* target = o_data + ((first + tile_start + t) * num_heads + kv_head * group + j) * head_dim;
    const float inverse = 1.f / buf.sums[r];
    for (int64_t c = 0; c < head_dim; ++c) target[c] = static_cast<scalar_t>(buf.output[c * padded + r] * inverse);
  }
}
#endif  // __AVX2__

// Whether this build has the vectorised paths (the decode path and the prompt tiles) for
// this head dim; without them every row is attended row by row by the generic loops.
bool vectorised(int64_t head_dim) {
#ifdef __AVX2__
  return head_dim % Native::kWidth == 0 && head_dim / Native::kWidth <= kMaxChunks;
#else
  return false;
#endif
}

template <typename scalar_t, typename cache_t, typename index_t>
void attend_kernel(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
                   const at::Tensor& sequences, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = key_cache.size(0), num_blocks = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t row_stride = key_cache.size(3);  // head_dim, or a quantized row's bytes
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_width = block_tables.size(1);
  const scalar_t* q_data = query.data_ptr<scalar_t>();
  const int64_t q_token_stride = query.stride(0), q_head_stride = query.stride(1);
  const cache_t* k_data = static_cast<const cache_t*>(key_cache.data_ptr());
  const cache_t* v_data = static_cast<const cache_t*>(value_cache.data_ptr());
  const index_t* tables = block_tables.data_ptr<index_t>();
  const int64_t* starts = query_start.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t* seqs = sequences.data_ptr<int64_t>();
  scalar_t* o_data = out.data_ptr<scalar_t>();
  const float softmax_scale = static_cast<float>(scale);
#ifdef __AVX2__
  constexpr int kWidth = Native::kWidth;
#endif
  const bool fast = vectorised(head_dim);

  // Work items: tiles of the sequences with many query tokens (costliest first), then one
  // (sequence, KV head) each for the rest, handed out one at a time to whichever thread is
  // free, so one long prompt does not leave a thread idle.
  struct Item {
    int64_t seq, kv_head, tile_start, tile_len;  // tile_len 0: all of the sequence's query tokens, row by row
  };
  std::vector<Item> items;
  items.reserve(sequences.size(0) * num_kv_heads);
#ifdef __AVX2__
  const int64_t tile_len = std::max<int64_t>(1, 4 * kWidth / group);
  for (int64_t i = 0; i < sequences.size(0); ++i) {
    const int64_t b = seqs[i], num_queries = starts[b + 1] - starts[b];
    if (!fast || num_queries * group < kWidth) continue;
    for (int64_t tile_start = 0; tile_start < num_queries; tile_start += tile_len)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        items.push_back({b, h, tile_start, std::min(tile_len, num_queries - tile_start)});
  }
  std::sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {  // by keys read
    return contexts[x.seq] - (starts[x.seq + 1] - starts[x.seq]) + x.tile_start >
           contexts[y.seq] - (starts[y.seq + 1] - starts[y.seq]) + y.tile_start;
  });
#endif
  const size_t num_tiles = items.size();
  for (int64_t i = 0; i < sequences.size(0); ++i) {
    const int64_t b = seqs[i];
#ifdef __AVX2__
    if (fast && (starts[b + 1] - starts[b]) * group >= kWidth) continue;
#endif
    for (int64_t h = 0; h < num_kv_heads; ++h) items.push_back({b, h, 0, 0});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};
  const int64_t tile = block_size * row_stride;  // elements of one (KV head, block) tile
  // How far ahead a decode item requests its tiles, in tiles (see kPrefetchBytes).
  const int64_t distance = std::max<int64_t>(1, kPrefetchBytes / (tile * static_cast<int64_t>(sizeof(cache_t))));

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> q_rows, scores, acc, row, denominators, dequantized;
#ifdef __AVX2__
    TileBuffers tile_buffers;
#endif
    row.resize(head_dim);
    // A thread claims its next item before it starts on one, so it can request the next
    // item's first keys while it reads the current item's last values.
    int64_t claimed = next_item++;
    for (int64_t index = claimed; index < num_items; index = claimed) {
      claimed = next_item++;
      const Item& work = items[index];
      const int64_t b = work.seq, kv_head = work.kv_head;
      const int64_t first = starts[b], num_queries = starts[b + 1] - first, context = contexts[b];
      const index_t* table = tables + b * table_width;
      const cache_t* k_head = k_data + kv_head * num_blocks * tile;
      const cache_t* v_head = v_data + kv_head * num_blocks * tile;
#ifdef __AVX2__
      if (static_cast<size_t>(index) < num_tiles) {
        attend_query_tile<Native>(q_data, q_token_stride, q_head_stride, k_head, v_head, table, block_size, head_dim,
                                  row_stride, num_heads, group, kv_head, first, num_queries, context, work.tile_start,
                                  work.tile_len, softmax_scale, tile_buffers, o_data);
        continue;
      }
#endif
      const int64_t num_rows = num_queries * group;  // row r = token t * group + head j
      q_rows.resize(num_rows * head_dim);
      scores.resize(num_rows * context);
      acc.assign(num_rows * head_dim, 0.f);
      for (int64_t t = 0; t < num_queries; ++t)
        for (int64_t j = 0; j < group; ++j) {
          float* target = &q_rows[(t * group + j) * head_dim];
          load_row(q_data + (first + t) * q_token_stride + (kv_head * group + j) * q_head_stride, target, head_dim);
          for (int64_t i = 0; i < head_dim; ++i) target[i] *= softmax_scale;
        }
      // Scores: each key is converted once and dotted with every row.
      const int64_t used_blocks = (context + block_size - 1) / block_size;
      // The tile `distance` tiles after stream position `position` (this item's key blocks,
      // then its value blocks, then the next item's key blocks), or null past the stream.
      const bool has_next = claimed < num_items;
      const int64_t next_blocks = has_next ? (contexts[items[claimed].seq] + block_size - 1) / block_size : 0;
      const index_t* next_table = has_next ? tables + items[claimed].seq * table_width : nullptr;
      const cache_t* next_k_head = has_next ? k_data + items[claimed].kv_head * num_blocks * tile : nullptr;
      auto ahead = [&](int64_t position) -> const cache_t* {
        position += distance;
        if (position < used_blocks) return k_head + table[position] * tile;
        position -= used_blocks;
        if (position < used_blocks) return v_head + table[position] * tile;
        position -= used_blocks;
        return position < next_blocks ? next_k_head + next_table[position] * tile : nullptr;
      };
      for (int64_t blk = 0; blk < used_blocks; ++blk) {
        const cache_t* keys = k_head + table[blk] * tile;
        const int64_t count = std::min(block_size, context - blk * block_size);
#ifdef __AVX2__
        if (fast) {
          if constexpr (kQuantized<cache_t>) {  // the block dequantized into L1, then scored as float32
            prefetch_tile(ahead(blk), tile);
            const float* block = dequantize_block(keys, count, head_dim, row_stride, dequantized);
            score_keys<Native>(q_rows.data(), num_rows, block, count, head_dim, &scores[blk * block_size], context,
                               static_cast<const float*>(nullptr));
          } else {
            score_keys<Native>(q_rows.data(), num_rows, keys, count, head_dim, &scores[blk * block_size], context,
                               ahead(blk));
          }
          continue;
        }
#endif
        prefetch_tile(ahead(blk), tile);
        for (int64_t s = 0; s < count; ++s) {
          const float* key = cache_row_as_floats(keys + s * row_stride, row.data(), head_dim);
          const int64_t position = blk * block_size + s;
          for (int64_t r = 0; r < num_rows; ++r) scores[r * context + position] = dot(&q_rows[r * head_dim], key, head_dim);
        }
      }
      // Softmax of each row over the keys its query token may see (causal: the last
      // query token sees the whole context, each earlier one a key less).
      denominators.resize(num_rows);
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t visible = context - num_queries + r / group + 1;
        float* s = &scores[r * context];
#ifdef __AVX2__
        if (fast) {
          denominators[r] = softmax_numerators<Native>(s, visible, context);
          continue;
        }
#endif
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < visible; ++i) peak = std::max(peak, s[i]);
        float total = 0.f;
        for (int64_t i = 0; i < visible; ++i) {
          s[i] = std::exp(s[i] - peak);
          total += s[i];
        }
        for (int64_t i = visible; i < context; ++i) s[i] = 0.f;
        denominators[r] = total;
      }
      for (int64_t blk = 0; blk < used_blocks; ++blk) {
        const cache_t* values = v_head + table[blk] * tile;
        const int64_t count = std::min(block_size, context - blk * block_size);
#ifdef __AVX2__
        if (fast) {
          if constexpr (kQuantized<cache_t>) {
            prefetch_tile(ahead(used_blocks + blk), tile);
            const float* block = dequantize_block(values, count, head_dim, row_stride, dequantized);
            accumulate_block<Native>(&scores[blk * block_size], context, num_rows, block, count, head_dim, acc.data(),
                                     static_cast<const float*>(nullptr));
          } else {
            accumulate_block<Native>(&scores[blk * block_size], context, num_rows, values, count, head_dim,
                                     acc.data(), ahead(used_blocks + blk));
          }
          continue;
        }
#endif
        prefetch_tile(ahead(used_blocks + blk), tile);
        for (int64_t s = 0; s < count; ++s) {
          const float* value = cache_row_as_floats(values + s * row_stride, row.data(), head_dim);
          const int64_t position = blk * block_size + s;
          for (int64_t r = 0; r < num_rows; ++r) {
            const float weight = scores[r * context + position];
            if (weight != 0.f) axpy(weight, value, &acc[r * head_dim], head_dim);
          }
        }
      }
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t t = r / group, j = r % group;
        scalar_t* target = o_data + ((first + t) * num_heads + kv_head * group + j) * head_dim;
        const float inverse = 1.f / denominators[r];
        for (int64_t i = 0; i < head_dim; ++i) target[i] = static_cast<scalar_t>(acc[r * head_dim + i] * inverse);
      }
    }
  });
}

template <typename scalar_t, typename cache_t>
void write_kernel(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                  const at::Tensor& slot_mapping) {
  const int64_t num_tokens = key.size(0), num_kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t num_slots = key_cache.size(1) * key_cache.size(2), row_stride = key_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  cache_t* kc = static_cast<cache_t*>(key_cache.data_ptr());
  cache_t* vc = static_cast<cache_t*>(value_cache.data_ptr());
  at::parallel_for(0, num_tokens * num_kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / num_kv_heads, head = item % num_kv_heads;
      const int64_t target = (head * num_slots + slots[t]) * row_stride;
      const scalar_t* k_row = k + t * key.stride(0) + head * key.stride(1);
      const scalar_t* v_row = v + t * value.stride(0) + head * value.stride(1);
      if constexpr (kQuantized<cache_t>) {
        quantize_row(k_row, kc + target, head_dim);
        quantize_row(v_row, vc + target, head_dim);
      } else {
        std::copy(k_row, k_row + head_dim, kc + target);
        std::copy(v_row, v_row + head_dim, vc + target);
      }
    }
  });
}

template <typename T>
struct CacheType {
  using type = T;
};

// Calls body(CacheType<cache_t>{}) for the caches' element type: the query's own dtype, or
// one of the quantized ones (whose rows must be scale_offset(head_dim) + 4 long).
template <typename scalar_t, typename Body>
void dispatch_cache(const at::Tensor& key_cache, const at::Tensor& value_cache, int64_t head_dim, Body&& body) {
  const at::ScalarType type = key_cache.scalar_type();
  TORCH_CHECK(value_cache.scalar_type() == type, "key and value caches must share a dtype");
  const bool quantized = type == at::kChar || type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2;
  if (!quantized) {
    TORCH_CHECK(type == c10::CppTypeToScalarType<scalar_t>::value, "query and caches must share a dtype");
    TORCH_CHECK(key_cache.size(3) == head_dim, "cache rows must be head_dim long");
    body(CacheType<scalar_t>{});
    return;
  }
  TORCH_CHECK(key_cache.size(3) == scale_offset(head_dim) + 4, "a quantized cache's rows must be head_dim bytes, "
              "padding to a multiple of 4 and a float32 scale");
  if (type == at::kChar) body(CacheType<int8_t>{});
  else if (type == at::kFloat8_e4m3fn) body(CacheType<c10::Float8_e4m3fn>{});
  else body(CacheType<c10::Float8_e5m2>{});
}

void check_inputs(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(query.device().is_cpu() && key_cache.device().is_cpu(), "cpu-paged runs on CPU tensors");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "cpu-paged needs contiguous query rows and caches");
  TORCH_CHECK(query.size(1) % key_cache.size(0) == 0, "query heads must be a multiple of KV heads");
}

}  // namespace

void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                 const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, "cpu-paged needs contiguous new K/V rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "cpu-paged needs contiguous caches");
  DISPATCH_MODEL_TYPES(key.scalar_type(), "write_cache", [&] {
    dispatch_cache<scalar_t>(key_cache, value_cache, key.size(2), [&](auto tag) {
      using cache_t = typename decltype(tag)::type;
      write_kernel<scalar_t, cache_t>(key, value, key_cache, value_cache, slot_mapping);
    });
  });
}

void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
            const at::Tensor& sequences, double scale, at::Tensor& out) {
  check_inputs(query, key_cache, value_cache);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous and shaped like query");
  TORCH_CHECK(query_start.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              sequences.scalar_type() == at::kLong, "query_start, context_lens and sequences must be int64");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong, "block_tables must be int64");
  DISPATCH_MODEL_TYPES(query.scalar_type(), "attend", [&] {
    dispatch_cache<scalar_t>(key_cache, value_cache, query.size(2), [&](auto tag) {
      using cache_t = typename decltype(tag)::type;
      attend_kernel<scalar_t, cache_t, int64_t>(query, key_cache, value_cache, block_tables, query_start,
                                                context_lens, sequences, scale, out);
    });
  });
}

// Whether rows of many query tokens take the tiled path for this head dim (else the row
// by row one, which is slow for prompts: the backend then sends them to SDPA).
bool tiles_prompts(int64_t head_dim) { return vectorised(head_dim); }
