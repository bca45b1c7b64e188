// y = x W^T + b with W kept as blocks of 32 quantized weights, in GGML's own block layouts
// (what a GGUF file holds). Two paths: x quantized per block to int8 and integer dot products
// (`format` + kInt8Activations; llama.cpp's way, below "int8 activations"), or float32 x with
// the blocks dequantized in registers as they are read (float32 products and sums).
//
//   q8_0: 34 bytes a block: scale d (float16), 32 int8 q; w = d * q
//   q4_0: 18 bytes: d (float16), 16 bytes of nibbles; w = d * (q - 8)
//   q4_1: 20 bytes: d, m (float16), 16 bytes of nibbles; w = d * q + m
// Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
// A weight [N, K] is N rows of ceil(K / 32) blocks: a uint8 tensor [N, blocks * bytes].
//
// Decode (a few rows of x) is bandwidth-bound: the weights stream from memory once per call,
// 1.06 (q8_0), 0.56 (q4_0) or 0.63 (q4_1) bytes a weight against float32's 4. Float path:
// each task is 4 output rows; their blocks are widened to float32 in registers and multiplied
// into the sums of every row of x at once (up to 4 rows, AVX2 2). With more rows, a task
// widens its 4 weight rows once into a float32 scratch row (L1/L2) and runs blocks of rows of
// x over it, so the widening is paid once per call, not once per row. The threads split the tasks.
#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cpu_simd.h"

namespace {

constexpr int kBlock = 32;
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };
constexpr int64_t kBlockBytes[] = {34, 18, 20};
constexpr int kTaskRows = 4;  // output rows a task computes
// Added to `format`: x is quantized to int8 blocks and multiplied with integer dot products.
constexpr int64_t kInt8Activations = 16;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One block's 32 weights as float32, scalar: the reference every vector path must equal.
template <int F>
inline void widen_scalar(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  if constexpr (F == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlock; ++j) out[j] = d * static_cast<float>(q[j]);
  } else {
    const uint8_t* q = block + (F == kQ4_1 ? 4 : 2);
    const float m = F == kQ4_1 ? half_to_float(block + 2) : -8.f * d;
    for (int j = 0; j < kBlock / 2; ++j) {
      out[j] = d * static_cast<float>(q[j] & 15) + m;
      out[j + kBlock / 2] = d * static_cast<float>(q[j] >> 4) + m;
    }
  }
}

#if defined(__AVX2__)
using servelab_simd::Native;
using V = Native::V;
constexpr int kW = Native::kWidth;
constexpr int kPer = kBlock / kW;  // vectors per block
// Rows of x a task multiplies in registers: 4 x 4 sums and a block of weights fit AVX-512's
// 32 registers, 4 x 2 AVX2's 16. The scratch path keeps 4 x kScratchRows sums and the rows of x.
constexpr int kDirectRows = kW == 16 ? 4 : 2;
constexpr int kScratchRows = kW == 16 ? 6 : 3;

// One block's 32 weights as kPer float32 vectors; d * q + m is one FMA per vector, the same
// rounding as widen_scalar's d * q + m (with -ffp-contract=off the scalar one rounds twice
// where this rounds once; the tests allow for that).
template <int F>
inline void widen(const uint8_t* block, V* out) {
  const V d = Native::set1(half_to_float(block));
#if defined(__AVX512F__)
  if constexpr (F == kQ8_0) {
    for (int i = 0; i < kPer; ++i)
      out[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * i)))));
  } else {
    const V m = F == kQ4_1 ? Native::set1(half_to_float(block + 2)) : Native::mul(d, Native::set1(-8.f));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    out[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)), m);
    out[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)), m);
  }
#else
  if constexpr (F == kQ8_0) {
    for (int i = 0; i < kPer; ++i)
      out[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i)))));
  } else {
    const V m = F == kQ4_1 ? Native::set1(half_to_float(block + 2)) : Native::mul(d, Native::set1(-8.f));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(raw, mask), high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; ++i) out[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), m);
  }
#endif
}

// y[r][n0 + t] for R rows of x and the task's rows (t < rows; the others repeat row 0 and are
// not stored), every block widened once in registers.
template <int F, int R>
void direct_task(const uint8_t* w, int64_t w_stride, int rows, const float* x, int64_t x_stride, int64_t blocks,
                 const float* bias, float* y, int64_t y_stride) {
  const uint8_t* row[kTaskRows];
  for (int t = 0; t < kTaskRows; ++t) row[t] = w + (t < rows ? t : 0) * w_stride;
  V sums[kTaskRows][R];
  for (int t = 0; t < kTaskRows; ++t)
    for (int r = 0; r < R; ++r) sums[t][r] = Native::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    for (int t = 0; t < kTaskRows; ++t) {
      V weights[kPer];
      widen<F>(row[t] + b * kBlockBytes[F], weights);
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < kPer; ++i)
          sums[t][r] = Native::fmadd(weights[i], Native::loadu(xb + r * x_stride + i * kW), sums[t][r]);
    }
  }
  for (int t = 0; t < rows; ++t)
    for (int r = 0; r < R; ++r)
      y[r * y_stride + t] = Native::reduce_add(sums[t][r]) + (bias == nullptr ? 0.f : bias[t]);
}

// The same from weights already widened into `scratch` [kTaskRows][k_padded].
template <int R>
void scratch_task(const float* scratch, int64_t k_padded, int rows, const float* x, int64_t x_stride,
                  const float* bias, float* y, int64_t y_stride) {
  V sums[kTaskRows][R];
  for (int t = 0; t < kTaskRows; ++t)
    for (int r = 0; r < R; ++r) sums[t][r] = Native::zero();
  for (int64_t k = 0; k < k_padded; k += kW) {
    V xs[R];
    for (int r = 0; r < R; ++r) xs[r] = Native::loadu(x + r * x_stride + k);
    for (int t = 0; t < kTaskRows; ++t) {
      const V weights = Native::loadu(scratch + t * k_padded + k);
      for (int r = 0; r < R; ++r) sums[t][r] = Native::fmadd(weights, xs[r], sums[t][r]);
    }
  }
  for (int t = 0; t < rows; ++t)
    for (int r = 0; r < R; ++r)
      y[r * y_stride + t] = Native::reduce_add(sums[t][r]) + (bias == nullptr ? 0.f : bias[t]);
}

template <int kMax, typename G>
void with_count(int count, const G& g) {
  if constexpr (kMax > 1) {
    if (count < kMax) return with_count<kMax - 1>(count, g);
  }
  g(std::integral_constant<int, kMax>{});
}

template <int F>
void vector_linear(const uint8_t* w, int64_t w_stride, const float* x, int64_t m, int64_t k_padded,
                   const float* bias, float* y, int64_t n) {
  const int64_t blocks = k_padded / kBlock, tasks = (n + kTaskRows - 1) / kTaskRows;
  const int64_t grain = std::max<int64_t>(1, 64 / kTaskRows);
  at::parallel_for(0, tasks, grain, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(m > kDirectRows ? kTaskRows * k_padded : 0);
    for (int64_t task = first; task < last; ++task) {
      const int64_t n0 = task * kTaskRows;
      const int rows = static_cast<int>(std::min<int64_t>(kTaskRows, n - n0));
      const uint8_t* wt = w + n0 * w_stride;
      const float* bt = bias == nullptr ? nullptr : bias + n0;
      if (m <= kDirectRows) {
        with_count<kDirectRows>(static_cast<int>(m), [&](auto count) {
          direct_task<F, decltype(count)::value>(wt, w_stride, rows, x, k_padded, blocks, bt, y + n0, n);
        });
        continue;
      }
      for (int t = 0; t < kTaskRows; ++t) {
        const uint8_t* row = wt + (t < rows ? t : 0) * w_stride;
        for (int64_t b = 0; b < blocks; ++b) {
          V weights[kPer];
          widen<F>(row + b * kBlockBytes[F], weights);
          for (int i = 0; i < kPer; ++i) Native::storeu(scratch.data() + t * k_padded + b * kBlock + i * kW, weights[i]);
        }
      }
      for (int64_t r0 = 0; r0 < m; r0 += kScratchRows) {
        with_count<kScratchRows>(static_cast<int>(std::min<int64_t>(kScratchRows, m - r0)), [&](auto count) {
          scratch_task<decltype(count)::value>(scratch.data(), k_padded, rows, x + r0 * k_padded, k_padded, bt,
                                               y + r0 * n + n0, n);
        });
      }
    }
  });
}
#endif  // __AVX2__

// Without a vector unit: one weight row widened at a time, then plain dot products.
template <int F>
void scalar_linear(const uint8_t* w, int64_t w_stride, const float* x, int64_t m, int64_t k_padded,
                   const float* bias, float* y, int64_t n) {
  const int64_t blocks = k_padded / kBlock;
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<float> row(k_padded);
    for (int64_t j = first; j < last; ++j) {
      for (int64_t b = 0; b < blocks; ++b) widen_scalar<F>(w + j * w_stride + b * kBlockBytes[F], row.data() + b * kBlock);
      for (int64_t r = 0; r < m; ++r) {
        float sum = 0.f;
        for (int64_t k = 0; k < k_padded; ++k) sum += row[k] * x[r * k_padded + k];
        y[r * n + j] = sum + (bias == nullptr ? 0.f : bias[j]);
      }
    }
  });
}

template <int F>
void run_linear(bool vectorised, const uint8_t* w, int64_t w_stride, const float* x, int64_t m, int64_t k_padded,
                const float* bias, float* y, int64_t n) {
#if defined(__AVX2__)
  if (vectorised) return vector_linear<F>(w, w_stride, x, m, k_padded, bias, y, n);
#endif
  scalar_linear<F>(w, w_stride, x, m, k_padded, bias, y, n);
}

// ---- int8 activations: integer dot products (llama.cpp's q8_0 x q8_0, q4_0 x q8_0, q4_1 x q8_1) ----
//
// x's rows are quantized once per call to blocks of 32 int8 (d = amax / 127, q = round-half-even
// of x / d, as torch.round), keeping sum(q) and s = d * sum(q) for q4_1's minimum. Every path
// computes each output the one way the scalar reference writes it, so the vector kernels
// equal it bit for bit and a row's result never depends on the rows beside it:
//   sum = 0; for each block: sum = fma(float(dot), d_w * d_x, sum)  [q4_1: sum = fma(m_w, s_x, sum)]
//   y = sum + bias
// where dot is the block's exact int32 sum of w * q (w: q8_0's int8, q4_0's q - 8, q4_1's q).
//
// The vector kernels read the weights interleaved (`kInterleaved`, made at load by
// servelab.model.quantized_linear.interleave_blocks, the same bytes moved, never
// re-quantized): 16 output columns a group, and per group and block of 32 inputs one record
//   d_w of the 16 columns (16 float16) [q4_1: m_w, 16 float16] then the weights, 4 bytes of
//   each column in turn: q4: 4 steps x 16 columns x 4 nibble bytes (byte j of a column holds
//   weights j and j + 16, as GGML's), q8_0: 8 steps x 16 columns x 4 bytes of w ^ 0x80.
// So a 512-bit register holds 4 weights (8 for q4: low and high nibbles) of 16 columns, and
// one `dpbusd` against 4 bytes of a row of x broadcast adds 64 products into 16 column
// sums, no horizontal sums. The weights are unsigned bytes u (q4_1: q; q4_0: q = w + 8;
// q8_0: w + 128), so a block's int sum starts at -c sum(x) (c = 0, 8, 128): exactly sum(w x).
// Without VNNI the products are `maddubs` (u x s to int16 pairs) then `madd` to int32; q8_0's
// u up to 255 would saturate a pair, so there its weights take the sign trick instead.
// A task is a group of columns against a chunk of up to kRowChunk rows of x (L2), run kIntRows
// rows at a time with the block's weights unpacked once for all of them.

constexpr int64_t kInterleaved = 32;  // added to `format`: the blocks are interleaved (above)
constexpr int kGroupCols = 16;

constexpr int64_t kReusedRows = 64;  // calls of up to this many rows keep their buffers (below)

struct Activations {  // x's rows as int8 blocks
  std::vector<int8_t> q;  // [m][k_padded]
  std::vector<float> d, s;  // [m][blocks]: scale, scale * sum of the block's q
  std::vector<int32_t> sum;  // [m][blocks]: sum of the block's q
  int64_t k_padded = 0, blocks = 0;
};

// Block i of x's [m][blocks] grid (rows are k_padded long) quantized as above, one value at a time.
inline void quantize_block_scalar(const float* xb, int8_t* q, float& d_out, float& s_out, int32_t& sum_out) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < kBlock; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
    sum += q[j];
  }
  d_out = d;
  s_out = d * static_cast<float>(sum);
  sum_out = sum;
}

#if defined(__AVX2__)
// The same in vector registers, equal to it bit for bit: the largest magnitude is exact in
// any order, each x * id is the same single product, and the conversion rounds half to even
// as nearbyint does in the default rounding mode.
inline void quantize_block_vector(const float* xb, int8_t* q, float& d_out, float& s_out, int32_t& sum_out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m512 scale = _mm512_set1_ps(id);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 parts[4];
  __m256 peak = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    parts[i] = _mm256_loadu_ps(xb + 8 * i);
    peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, parts[i]));
  }
  __m128 half = _mm_max_ps(_mm256_castps256_ps128(peak), _mm256_extractf128_ps(peak, 1));
  half = _mm_max_ps(half, _mm_movehl_ps(half, half));
  half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
  const float amax = _mm_cvtss_f32(half);
  const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
  const __m256 scale = _mm256_set1_ps(id);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(parts[i], scale));
  // int32 -> int16 -> int8 with saturation (the values are within +-127), then undo the lane interleave
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  __m128i folded = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(1, 0, 3, 2)));
  folded = _mm_add_epi32(folded, _mm_shuffle_epi32(folded, _MM_SHUFFLE(2, 3, 0, 1)));
  const int32_t sum = _mm_cvtsi128_si32(folded);
#endif
  d_out = d;
  s_out = d * static_cast<float>(sum);
  sum_out = sum;
}
#endif  // __AVX2__

void quantize_activations(const float* x, int64_t m, int64_t k_padded, bool vectorised, Activations& out) {
  out.k_padded = k_padded;
  out.blocks = k_padded / kBlock;
  out.q.resize(m * k_padded);
  out.d.resize(m * out.blocks);
  out.s.resize(m * out.blocks);
  out.sum.resize(m * out.blocks);
  at::parallel_for(0, m * out.blocks, 64, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
#if defined(__AVX2__)
      if (vectorised) {
        quantize_block_vector(x + i * kBlock, out.q.data() + i * kBlock, out.d[i], out.s[i], out.sum[i]);
        continue;
      }
#endif
      quantize_block_scalar(x + i * kBlock, out.q.data() + i * kBlock, out.d[i], out.s[i], out.sum[i]);
    }
  });
}

constexpr int64_t record_bytes(int F) { return kGroupCols * kBlockBytes[F]; }
constexpr int64_t weights_offset(int F) { return F == kQ4_1 ? 64 : 32; }  // past the scales

// Column j's block b as 32 signed weights w and its d_w, m_w, from either layout.
template <int F>
inline void column_block(const uint8_t* w, int64_t w_stride, bool interleaved, int64_t j, int64_t b,
                         int8_t* out, float& d, float& m) {
  if (!interleaved) {
    const uint8_t* block = w + j * w_stride + b * kBlockBytes[F];
    d = half_to_float(block);
    m = F == kQ4_1 ? half_to_float(block + 2) : 0.f;
    if constexpr (F == kQ8_0) {
      std::memcpy(out, block + 2, kBlock);
    } else {
      const uint8_t* q = block + (F == kQ4_1 ? 4 : 2);
      const int offset = F == kQ4_0 ? 8 : 0;
      for (int i = 0; i < kBlock / 2; ++i) {
        out[i] = static_cast<int8_t>((q[i] & 15) - offset);
        out[i + kBlock / 2] = static_cast<int8_t>((q[i] >> 4) - offset);
      }
    }
    return;
  }
  const int64_t group = j / kGroupCols, c = j % kGroupCols;
  const uint8_t* record = w + group * kGroupCols * w_stride + b * record_bytes(F);
  d = half_to_float(record + 2 * c);
  m = F == kQ4_1 ? half_to_float(record + 32 + 2 * c) : 0.f;
  const uint8_t* values = record + weights_offset(F);
  if constexpr (F == kQ8_0) {
    for (int step = 0; step < 8; ++step)
      for (int i = 0; i < 4; ++i)
        out[4 * step + i] = static_cast<int8_t>(values[(step * kGroupCols + c) * 4 + i] ^ 0x80);
  } else {
    const int offset = F == kQ4_0 ? 8 : 0;
    for (int step = 0; step < 4; ++step)
      for (int i = 0; i < 4; ++i) {
        const uint8_t byte = values[(step * kGroupCols + c) * 4 + i];
        out[4 * step + i] = static_cast<int8_t>((byte & 15) - offset);
        out[16 + 4 * step + i] = static_cast<int8_t>((byte >> 4) - offset);
      }
  }
}

// The reference every vector path equals bit for bit (and the path without a vector unit).
template <int F>
void scalar_int_linear(const uint8_t* w, int64_t w_stride, bool interleaved, const Activations& a, int64_t m,
                       const float* bias, float* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    std::vector<int8_t> values(a.blocks * kBlock);
    std::vector<float> d(a.blocks), mins(a.blocks);
    for (int64_t j = first; j < last; ++j) {
      for (int64_t b = 0; b < a.blocks; ++b)
        column_block<F>(w, w_stride, interleaved, j, b, values.data() + b * kBlock, d[b], mins[b]);
      for (int64_t r = 0; r < m; ++r) {
        float sum = 0.f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          const int8_t* xq = a.q.data() + r * a.k_padded + b * kBlock;
          const int8_t* wq = values.data() + b * kBlock;
          int32_t dot = 0;
          for (int i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(wq[i]) * xq[i];
          sum = std::fma(static_cast<float>(dot), d[b] * a.d[r * a.blocks + b], sum);
          if constexpr (F == kQ4_1) sum = std::fma(mins[b], a.s[r * a.blocks + b], sum);
        }
        y[r * n + j] = sum + (bias == nullptr ? 0.f : bias[j]);
      }
    }
  });
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define SERVELAB_VNNI 1
#endif

#if defined(SERVELAB_VNNI)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 columns in one register.
struct IntLanes {
  static constexpr int kRegs = 1;
  using I = __m512i;
  using Fv = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  static I high_nibbles(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I add_int(I a, I b) { return _mm512_add_epi32(a, b); }
  static I dot(I acc, I u, I s) {  // acc + per lane the sum of 4 byte products u (unsigned) x s (signed)
#if defined(SERVELAB_VNNI)
    return _mm512_dpbusd_epi32(acc, u, s);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
  }
  static I signed_dot(I acc, I flipped, I s) {  // the same for signed weights stored as w ^ 0x80
    const I w = _mm512_xor_si512(flipped, _mm512_set1_epi8(static_cast<char>(0x80)));
    const __mmask64 negative = _mm512_movepi8_mask(w);
    const I sx = _mm512_mask_sub_epi8(s, negative, _mm512_setzero_si512(), s);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), sx),
                                                   _mm512_set1_epi16(1)));
  }
  static Fv halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Fv zero() { return _mm512_setzero_ps(); }
  static Fv set1f(float v) { return _mm512_set1_ps(v); }
  static Fv cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static Fv mul(Fv a, Fv b) { return _mm512_mul_ps(a, b); }
  static Fv fmadd(Fv a, Fv b, Fv c) { return _mm512_fmadd_ps(a, b, c); }
  static Fv add(Fv a, Fv b) { return _mm512_add_ps(a, b); }
  static Fv load_first(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static void store_first(float* p, Fv v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
};
#else
// 16 columns in two registers of 8.
struct IntLanes {
  static constexpr int kRegs = 2;
  using I = __m256i;
  using Fv = __m256;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  static I high_nibbles(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I add_int(I a, I b) { return _mm256_add_epi32(a, b); }
  static I dot(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I signed_dot(I acc, I flipped, I s) {
    const I w = _mm256_xor_si256(flipped, _mm256_set1_epi8(static_cast<char>(0x80)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(s, w)),
                                                   _mm256_set1_epi16(1)));
  }
  static Fv halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static Fv zero() { return _mm256_setzero_ps(); }
  static Fv set1f(float v) { return _mm256_set1_ps(v); }
  static Fv cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static Fv mul(Fv a, Fv b) { return _mm256_mul_ps(a, b); }
  static Fv fmadd(Fv a, Fv b, Fv c) { return _mm256_fmadd_ps(a, b, c); }
  static Fv add(Fv a, Fv b) { return _mm256_add_ps(a, b); }
  static Fv load_first(const float* p, int n) {
    alignas(32) float buffer[8] = {};
    for (int i = 0; i < n; ++i) buffer[i] = p[i];
    return _mm256_load_ps(buffer);
  }
  static void store_first(float* p, Fv v, int n) {
    alignas(32) float buffer[8];
    _mm256_store_ps(buffer, v);
    for (int i = 0; i < n; ++i) p[i] = buffer[i];
  }
};
#endif

constexpr int kLaneCols = kGroupCols / IntLanes::kRegs;  // columns a register holds
// Rows of x a tile runs: their int and float sums stay in registers (AVX-512's 32, AVX2's 16).
constexpr int kIntRows = IntLanes::kRegs == 1 ? 8 : 2;
// Decode asks for the records this far ahead (6.9-13 KB): the prefetchers alone left a single
// row at 15 GB/s, 8 records ahead a model's linears 5% slower on two threads than 24
// (examples/measurements/linear_sweep.py). The requests are non-temporal: a token's weights
// are read once, and a step's ~100 MB would otherwise push the engine's code and data and
// the layer's activations out of the caches between forwards (int4 SmolLM2 batch-1 TPOT
// 0.98-1.10x over seven alternating pairs, median 1.06x: docs/performance.md).
constexpr int64_t kPrefetchRecords = 24;

// y[r0 + r][the group's columns] for R rows of x; `cols` of the group's 16 are stored.
template <int F, int R>
void group_tile(const uint8_t* group, const Activations& a, int64_t r0, const float* bias, float* y,
                int64_t y_stride, int cols) {
  using L = IntLanes;
  constexpr int kRegs = L::kRegs;
  constexpr int32_t kOffset = F == kQ4_0 ? 8 : 0;  // q4_0's u = w + 8 (q8_0 on VNNI: 128, below)
  // q8_0's stored u = w + 128 taken as they are (VNNI's int32 sums), or un-flipped (`maddubs`)
  constexpr bool kFlippedQ8 = F == kQ8_0 && kVnni;
  constexpr int kChains = R == 1 ? 4 : R <= 3 ? 2 : 1;
  typename L::Fv sums[R][kRegs];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < kRegs; ++g) sums[r][g] = L::zero();
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = a.q.data() + (r0 + r) * a.k_padded;
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* record = group + b * record_bytes(F);
    const uint8_t* values = record + weights_offset(F);
    if constexpr (R <= 2) {  // decode streams the weights: ask for the records ahead early
      for (int64_t line = 0; line < record_bytes(F); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(record + kPrefetchRecords * record_bytes(F) + line), _MM_HINT_NTA);
    }
    // A few rows leave the cores waiting on each dot product's latency: their sums run in
    // kChains independent chains, added at the block's end (exact integers either way).
    typename L::I dots[R][kRegs][kChains];
    for (int r = 0; r < R; ++r) {
      const int32_t start = F == kQ4_0 ? -kOffset * a.sum[(r0 + r) * a.blocks + b]
                                       : kFlippedQ8 ? -128 * a.sum[(r0 + r) * a.blocks + b] : 0;
      for (int g = 0; g < kRegs; ++g)
        for (int c = 0; c < kChains; ++c) dots[r][g][c] = L::set1(c == 0 ? start : 0);
    }
    const int8_t* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = xrow[r] + b * kBlock;
    if constexpr (F == kQ8_0) {
      for (int step = 0; step < 8; ++step)
        for (int g = 0; g < kRegs; ++g) {
          const typename L::I w = L::load(values + (step * kGroupCols + g * kLaneCols) * 4);
          for (int r = 0; r < R; ++r) {
            const typename L::I x = L::set1(load_i32(xb[r] + 4 * step));
            typename L::I& dot = dots[r][g][step % kChains];
            dot = kFlippedQ8 ? L::dot(dot, w, x) : L::signed_dot(dot, w, x);
          }
        }
    } else {
      for (int step = 0; step < 4; ++step)
        for (int g = 0; g < kRegs; ++g) {
          const typename L::I raw = L::load(values + (step * kGroupCols + g * kLaneCols) * 4);
          const typename L::I low = L::low_nibbles(raw), high = L::high_nibbles(raw);
          for (int r = 0; r < R; ++r) {
            typename L::I& first = dots[r][g][(2 * step) % kChains];
            first = L::dot(first, low, L::set1(load_i32(xb[r] + 4 * step)));
            typename L::I& second = dots[r][g][(2 * step + 1) % kChains];
            second = L::dot(second, high, L::set1(load_i32(xb[r] + 16 + 4 * step)));
          }
        }
    }
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < kRegs; ++g)
        for (int c = 1; c < kChains; ++c) dots[r][g][0] = L::add_int(dots[r][g][0], dots[r][g][c]);
    for (int g = 0; g < kRegs; ++g) {
      const typename L::Fv dw = L::halves(record + 2 * g * kLaneCols);
      typename L::Fv mw = L::zero();
      if constexpr (F == kQ4_1) mw = L::halves(record + 32 + 2 * g * kLaneCols);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * a.blocks + b;
        sums[r][g] = L::fmadd(L::cvt(dots[r][g][0]), L::mul(dw, L::set1f(a.d[at])), sums[r][g]);
        if constexpr (F == kQ4_1) sums[r][g] = L::fmadd(mw, L::set1f(a.s[at]), sums[r][g]);
      }
    }
  }
  for (int g = 0; g < kRegs; ++g) {
    const int first = g * kLaneCols, count = std::max(0, std::min(kLaneCols, cols - first));
    if (count == 0) continue;
    const typename L::Fv bv = bias == nullptr ? L::zero() : L::load_first(bias + first, count);
    for (int r = 0; r < R; ++r) L::store_first(y + r * y_stride + first, L::add(sums[r][g], bv), count);
  }
}

constexpr int64_t kRowChunk = 64;  // rows of x a work item runs over one group's weights (64 x K bytes: L2)

template <int F>
void vector_int_linear(const uint8_t* w, int64_t w_stride, const Activations& a, int64_t m, const float* bias,
                       float* y, int64_t n) {
  const int64_t groups = (n + kGroupCols - 1) / kGroupCols, chunks = (m + kRowChunk - 1) / kRowChunk;
  // Work items chunk-major: a thread's run of items shares one chunk of x and moves across the weights.
  at::parallel_for(0, chunks * groups, 4, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t group = item % groups, r0 = item / groups * kRowChunk, end = std::min(m, r0 + kRowChunk);
      const int64_t n0 = group * kGroupCols;
      const int cols = static_cast<int>(std::min<int64_t>(kGroupCols, n - n0));
      const uint8_t* weights = w + n0 * w_stride;
      const float* bg = bias == nullptr ? nullptr : bias + n0;
      for (int64_t r = r0; r < end; r += kIntRows) {
        with_count<kIntRows>(static_cast<int>(std::min<int64_t>(kIntRows, end - r)), [&](auto rows) {
          group_tile<F, decltype(rows)::value>(weights, a, r, bg, y + r * n + n0, n, cols);
        });
      }
    }
  });
}
#endif  // __AVX2__

template <int F>
void run_int_linear(bool vectorised, bool interleaved, const uint8_t* w, int64_t w_stride, const float* x, int64_t m,
                    int64_t k_padded, const float* bias, float* y, int64_t n) {
  // A decode-sized call reuses its thread's buffers (four allocations a call otherwise);
  // a prompt's are freed with the call.
  thread_local Activations reused;
  Activations fresh;
  Activations& a = m <= kReusedRows ? reused : fresh;
  quantize_activations(x, m, k_padded, vectorised, a);
#if defined(__AVX2__)
  if (vectorised) {
    TORCH_CHECK(interleaved, "the vector kernels multiply int8 activations by interleaved blocks "
                "(servelab.model.quantized_linear.interleave_blocks, format + 32)");
    return vector_int_linear<F>(w, w_stride, a, m, bias, y, n);
  }
#endif
  scalar_int_linear<F>(w, w_stride, interleaved, a, m, bias, y, n);
}

}  // namespace

// The integer path int8 activations take on this build: "avx512-vnni", "avx2" or "scalar".
std::string quant_int_path() {
#if defined(SERVELAB_VNNI)
  return "avx512-vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}


// The path quant_linear takes on this build: "avx512", "avx2" or "scalar".
std::string quant_path() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// x [..., K] float32 -> x W^T + b [..., out_features] float32, W as blocks of `format`
// (0 q8_0, 1 q4_0, 2 q4_1; plus 16: x quantized per block of 32 to int8 and integer dot
// products, see above; plus 32 more: the blocks interleaved for them): uint8
// [out_features, ceil(K / 32) * block bytes], interleaved ones [out_features rounded up to
// 16, the same] (`out_features` then says how many columns are real; -1: every row).
// `scalar` forces the scalar loops (the reference the vector paths are tested against).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                        const std::optional<at::Tensor>& bias, bool scalar, int64_t out_features) {
  TORCH_CHECK(x.dim() >= 1, "x must be a float32 tensor, got ", x.scalar_type());
  TORCH_CHECK(blocks.dim() == 2, "blocks must be a contiguous 2-D uint8 tensor [out_features, blocks * bytes]");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = out_features >= 0 ? out_features : blocks.size(0);
  at::Tensor out = at::empty(out_shape, x.options());
  quant_linear_out(x, blocks, format, bias, scalar, out_features, out);
  return out;
}

void quant_linear_out(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                      const std::optional<at::Tensor>& bias, bool scalar, int64_t out_features, at::Tensor& out) {
  const bool int8_activations = (format & kInt8Activations) != 0, interleaved = (format & kInterleaved) != 0;
  const int64_t given_format = format;
  format &= ~(kInt8Activations | kInterleaved);
  TORCH_CHECK(format >= kQ8_0 && format <= kQ4_1 && (int8_activations || !interleaved),
              "format must be 0 (q8_0), 1 (q4_0) or 2 (q4_1), plus 16 for int8 activations (plus 32 more for "
              "interleaved blocks), got ", given_format);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor [out_features, blocks * bytes]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be a float32 tensor, got ", x.scalar_type());
  const int64_t n = out_features >= 0 ? out_features : blocks.size(0), k = x.size(-1);
  const int64_t num_blocks = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(interleaved ? blocks.size(0) == (n + kGroupCols - 1) / kGroupCols * kGroupCols : blocks.size(0) == n,
              "out_features ", n, " does not match the ", blocks.size(0), " rows of ",
              interleaved ? "interleaved blocks (a multiple of 16 columns)" : "blocks");
  TORCH_CHECK(blocks.size(1) == num_blocks * kBlockBytes[format], "x has ", k, " features, which take ", num_blocks,
              " blocks of ", kBlockBytes[format], " bytes a row; the weight has ", blocks.size(1), " bytes a row");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "bias must be a contiguous float32 tensor of ", n, " values");
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, k});
  const int64_t m = rows.size(0), k_padded = num_blocks * kBlock;
  if (k_padded != k || !rows.is_contiguous()) {  // zeros past K: the padded weights then add nothing
    at::Tensor padded = at::zeros({m, k_padded}, rows.options());
    padded.narrow(1, 0, k).copy_(rows);
    rows = padded;
  }
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == m * n && out.size(-1) == n,
              "out must be a contiguous float32 tensor of x's rows by ", n, " outputs");
  if (m == 0 || n == 0) return;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t w_stride = blocks.size(1);
  float* y = out.data_ptr<float>();
  const float* xs = rows.data_ptr<float>();
  if (int8_activations) {
    switch (format) {
      case kQ8_0: run_int_linear<kQ8_0>(!scalar, interleaved, w, w_stride, xs, m, k_padded, b, y, n); break;
      case kQ4_0: run_int_linear<kQ4_0>(!scalar, interleaved, w, w_stride, xs, m, k_padded, b, y, n); break;
      default: run_int_linear<kQ4_1>(!scalar, interleaved, w, w_stride, xs, m, k_padded, b, y, n); break;
    }
    return;
  }
  switch (format) {
    case kQ8_0: run_linear<kQ8_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    case kQ4_0: run_linear<kQ4_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    default: run_linear<kQ4_1>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
  }
}
