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
// of x / d, as torch.round), with s = d * sum(q) kept for q4_1's minimum. A block's product is
// then an int32 sum of 32 byte products, scaled once by d_w * d_x:
//   q8_0, q4_0 (signed weights w, q - 8 for q4_0): d_w d_x sum(w x)
//   q4_1 (unsigned nibbles u):                    d_w d_x sum(u x) + m_w s_x
// The byte products: AVX2 `maddubs` (unsigned x signed pairs to int16) then `madd` to int32,
// with the sign trick (|w| times x carrying w's sign: |w| <= 128, |x| <= 127, so a pair never
// saturates int16); AVX-512 VNNI `dpbusd` (to int32 directly; 512 bits hold one weight block
// against two rows of x, and signed weights take x + 128 as the unsigned side, the 128 sum(w)
// it adds taken off exactly in int32 by starting the sum at -128 sum(w)).
// Tiles: a task is kTaskRows output rows, run against kIntRows rows of x at a time with its
// weights read in registers; with more rows of x than that, the task first decodes its rows'
// blocks into bytes and float scales (a panel that stays in L1) and runs every group of
// rows of a chunk of kRowChunk rows over it, so the weights come from memory and are
// unpacked once per chunk (once per call up to 64 rows), while the chunk of x stays in L2.

struct Activations {  // x's rows as int8 blocks
  std::vector<int8_t> q;  // [m][k_padded]
  std::vector<float> d, s;  // [m][blocks]: scale, scale * sum of the block's q
  int64_t k_padded = 0, blocks = 0;
};

void quantize_activations(const float* x, int64_t m, int64_t k_padded, Activations& out) {
  out.k_padded = k_padded;
  out.blocks = k_padded / kBlock;
  out.q.resize(m * k_padded);
  out.d.resize(m * out.blocks);
  out.s.resize(m * out.blocks);
  at::parallel_for(0, m * out.blocks, 64, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const float* xb = x + i * kBlock;  // block i of the [m][blocks] grid: rows are k_padded long
      float amax = 0.f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* q = out.q.data() + i * kBlock;
      for (int j = 0; j < kBlock; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(xb[j] * id));
        sum += q[j];
      }
      out.d[i] = d;
      out.s[i] = d * static_cast<float>(sum);
    }
  });
}

// One weight block as 32 bytes: w (q8_0), q - 8 (q4_0) or q (q4_1), in weight order.
template <int F>
inline void block_bytes_scalar(const uint8_t* block, int8_t* out) {
  if constexpr (F == kQ8_0) {
    std::memcpy(out, block + 2, kBlock);
  } else {
    const uint8_t* q = block + (F == kQ4_1 ? 4 : 2);
    const int offset = F == kQ4_0 ? 8 : 0;
    for (int j = 0; j < kBlock / 2; ++j) {
      out[j] = static_cast<int8_t>((q[j] & 15) - offset);
      out[j + kBlock / 2] = static_cast<int8_t>((q[j] >> 4) - offset);
    }
  }
}

// The integer path without a vector unit (and the reference the vector ones are tested
// against): int32 sums per block, float32 across blocks.
template <int F>
void scalar_int_linear(const uint8_t* w, int64_t w_stride, const Activations& a, int64_t m, const float* bias,
                       float* y, int64_t n) {
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    int8_t values[kBlock];
    for (int64_t j = first; j < last; ++j) {
      for (int64_t r = 0; r < m; ++r) {
        float sum = 0.f;
        for (int64_t b = 0; b < a.blocks; ++b) {
          const uint8_t* block = w + j * w_stride + b * kBlockBytes[F];
          block_bytes_scalar<F>(block, values);
          const int8_t* xq = a.q.data() + r * a.k_padded + b * kBlock;
          int32_t dot = 0;
          for (int i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(values[i]) * xq[i];
          sum += half_to_float(block) * a.d[r * a.blocks + b] * static_cast<float>(dot);
          if constexpr (F == kQ4_1) sum += half_to_float(block + 2) * a.s[r * a.blocks + b];
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

// A block's 32 weight bytes (block_bytes_scalar's values) in a 256-bit register.
template <int F>
inline __m256i block_bytes(const uint8_t* block) {
  if constexpr (F == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
    return F == kQ4_0 ? _mm256_sub_epi8(q, _mm256_set1_epi8(8)) : q;
  }
}

// Where a tile reads its weights: straight from the blocks, or from a decoded panel.
struct BlockSource {
  const uint8_t* w;
  int64_t w_stride;
  const uint8_t* rows[kTaskRows];
  template <int F>
  void get(int t, int64_t b, __m256i& values, float& d, float& min) const {
    const uint8_t* block = rows[t] + b * kBlockBytes[F];
    values = block_bytes<F>(block);
    d = half_to_float(block);
    if constexpr (F == kQ4_1) min = half_to_float(block + 2);
  }
};

struct PanelSource {
  const int8_t* values;  // [kTaskRows][k_padded]
  const float* d;  // [kTaskRows][blocks]
  const float* min;
  int64_t k_padded, blocks;
  template <int F>
  void get(int t, int64_t b, __m256i& v, float& scale, float& m) const {
    v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + t * k_padded + b * kBlock));
    scale = d[t * blocks + b];
    if constexpr (F == kQ4_1) m = min[t * blocks + b];
  }
};

inline __m256i dot256(__m256i u, __m256i s) {  // sum of 4 byte products u (unsigned) x s (signed) per int32 lane
#if defined(SERVELAB_VNNI)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// y[r0 + r][t] for R rows of x (256-bit: one row of x a register).
template <int F, int R, typename Source>
void int_tile256(const Source& source, int rows, const Activations& a, int64_t r0, const float* bias, float* y,
                 int64_t y_stride) {
  __m256 sums[kTaskRows][R];
  float mins[kTaskRows][R] = {};
  for (int t = 0; t < kTaskRows; ++t)
    for (int r = 0; r < R; ++r) sums[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m256i xs[R];
    float xd[R];
    for (int r = 0; r < R; ++r) {
      xs[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * a.k_padded + b * kBlock));
      xd[r] = a.d[(r0 + r) * a.blocks + b];
    }
    for (int t = 0; t < kTaskRows; ++t) {
      __m256i w;
      float wd, wm = 0.f;
      source.template get<F>(t, b, w, wd, wm);
      const __m256i magnitude = F == kQ4_1 ? w : _mm256_abs_epi8(w);  // -128 becomes 128, unsigned
      for (int r = 0; r < R; ++r) {
        const __m256i dot = dot256(magnitude, F == kQ4_1 ? xs[r] : _mm256_sign_epi8(xs[r], w));
        sums[t][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(wd * xd[r]), sums[t][r]);
        if constexpr (F == kQ4_1) mins[t][r] += wm * a.s[(r0 + r) * a.blocks + b];
      }
    }
  }
  for (int t = 0; t < rows; ++t)
    for (int r = 0; r < R; ++r)
      y[r * y_stride + t] = servelab_simd::Avx2::reduce_add(sums[t][r]) + mins[t][r] + (bias == nullptr ? 0.f : bias[t]);
}

#if defined(SERVELAB_VNNI)
// The same for 2P rows of x, two a 512-bit register (one in each half) against a weight block
// broadcast to both halves.
template <int F, int P, typename Source>
void int_tile512(const Source& source, int rows, const Activations& a, int64_t r0, const float* bias, float* y,
                 int64_t y_stride) {
  __m512 sums[kTaskRows][P];
  float mins[kTaskRows][2 * P] = {};
  for (int t = 0; t < kTaskRows; ++t)
    for (int p = 0; p < P; ++p) sums[t][p] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < a.blocks; ++b) {
    __m512i xs[P];
    __m512 xd[P];
    for (int p = 0; p < P; ++p) {
      const int8_t* row = a.q.data() + (r0 + 2 * p) * a.k_padded + b * kBlock;
      const __m512i pair = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + a.k_padded)), 1);
      xs[p] = F == kQ4_1 ? pair : _mm512_xor_si512(pair, flip);  // signed weights: x + 128, unsigned
      xd[p] = _mm512_insertf32x8(_mm512_set1_ps(a.d[(r0 + 2 * p) * a.blocks + b]),
                                 _mm256_set1_ps(a.d[(r0 + 2 * p + 1) * a.blocks + b]), 1);
    }
    for (int t = 0; t < kTaskRows; ++t) {
      __m256i w256;
      float wd, wm = 0.f;
      source.template get<F>(t, b, w256, wd, wm);
      const __m512i w = _mm512_broadcast_i64x4(w256);
      // signed weights: (x + 128) w summed from -128 sum(w) is exactly x w
      const __m512i start = F == kQ4_1 ? _mm512_setzero_si512()
                                       : _mm512_slli_epi32(_mm512_sub_epi32(_mm512_setzero_si512(),
                                                                            _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w)), 7);
      const __m512 wd_v = _mm512_set1_ps(wd);
      for (int p = 0; p < P; ++p) {
        const __m512i dot = F == kQ4_1 ? _mm512_dpbusd_epi32(start, w, xs[p]) : _mm512_dpbusd_epi32(start, xs[p], w);
        sums[t][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(wd_v, xd[p]), sums[t][p]);
        if constexpr (F == kQ4_1) {
          mins[t][2 * p] += wm * a.s[(r0 + 2 * p) * a.blocks + b];
          mins[t][2 * p + 1] += wm * a.s[(r0 + 2 * p + 1) * a.blocks + b];
        }
      }
    }
  }
  for (int t = 0; t < rows; ++t)
    for (int p = 0; p < P; ++p)
      for (int half = 0; half < 2; ++half) {
        const __m256 part = half == 0 ? _mm512_castps512_ps256(sums[t][p]) : _mm512_extractf32x8_ps(sums[t][p], 1);
        const int r = 2 * p + half;
        y[r * y_stride + t] = servelab_simd::Avx2::reduce_add(part) + mins[t][r] + (bias == nullptr ? 0.f : bias[t]);
      }
}
constexpr int kIntRows = 4;  // rows of x a tile runs: two pairs
#else
constexpr int kIntRows = 2;
#endif
constexpr int64_t kRowChunk = 64;  // rows of x a work item runs over one task's weights (64 x K bytes: L2)

// Rows r0 .. r0 + count of x against a task's weights, in tiles of at most kIntRows.
template <int F, typename Source>
void int_rows(const Source& source, int rows, const Activations& a, int64_t r0, int64_t count, const float* bias,
              float* y, int64_t n) {
  for (int64_t r = r0; r < r0 + count;) {
    const int64_t left = r0 + count - r;
#if defined(SERVELAB_VNNI)
    if (left >= 4) {
      int_tile512<F, 2>(source, rows, a, r, bias, y + r * n, n);
      r += 4;
      continue;
    }
    if (left >= 2) {
      int_tile512<F, 1>(source, rows, a, r, bias, y + r * n, n);
      r += 2;
      continue;
    }
    int_tile256<F, 1>(source, rows, a, r, bias, y + r * n, n);
    r += 1;
#else
    if (left >= 2) {
      int_tile256<F, 2>(source, rows, a, r, bias, y + r * n, n);
      r += 2;
    } else {
      int_tile256<F, 1>(source, rows, a, r, bias, y + r * n, n);
      r += 1;
    }
#endif
  }
}

template <int F>
void vector_int_linear(const uint8_t* w, int64_t w_stride, const Activations& a, int64_t m, const float* bias,
                       float* y, int64_t n) {
  const int64_t tasks = (n + kTaskRows - 1) / kTaskRows, k_padded = a.k_padded, blocks = a.blocks;
  const int64_t chunks = (m + kRowChunk - 1) / kRowChunk;
  const bool panel = m > kIntRows;
  // Work items chunk-major: a thread's run of items shares one chunk of x (kept in L2) and
  // moves across the weights; a task's panel is decoded again for each chunk (1/kRowChunk of
  // its dot products' work).
  at::parallel_for(0, chunks * tasks, std::max<int64_t>(1, 64 / kTaskRows), [&](int64_t first, int64_t last) {
    std::vector<int8_t> values(panel ? kTaskRows * k_padded : 0);
    std::vector<float> scales(panel ? 2 * kTaskRows * blocks : 0);
    for (int64_t item = first; item < last; ++item) {
      const int64_t task = item % tasks, r0 = item / tasks * kRowChunk, count = std::min(kRowChunk, m - r0);
      const int64_t n0 = task * kTaskRows;
      const int rows = static_cast<int>(std::min<int64_t>(kTaskRows, n - n0));
      const float* bt = bias == nullptr ? nullptr : bias + n0;
      BlockSource direct{w, w_stride, {}};
      for (int t = 0; t < kTaskRows; ++t) direct.rows[t] = w + (n0 + (t < rows ? t : 0)) * w_stride;
      if (!panel) {
        int_rows<F>(direct, rows, a, r0, count, bt, y + n0, n);
        continue;
      }
      PanelSource decoded{values.data(), scales.data(), scales.data() + kTaskRows * blocks, k_padded, blocks};
      for (int t = 0; t < kTaskRows; ++t)
        for (int64_t b = 0; b < blocks; ++b) {
          __m256i v;
          float d, min = 0.f;
          direct.get<F>(t, b, v, d, min);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(values.data() + t * k_padded + b * kBlock), v);
          scales[t * blocks + b] = d;
          scales[(kTaskRows + t) * blocks + b] = min;
        }
      int_rows<F>(decoded, rows, a, r0, count, bt, y + n0, n);
    }
  });
}
#endif  // __AVX2__

template <int F>
void run_int_linear(bool vectorised, const uint8_t* w, int64_t w_stride, const float* x, int64_t m, int64_t k_padded,
                    const float* bias, float* y, int64_t n) {
  Activations a;
  quantize_activations(x, m, k_padded, a);
#if defined(__AVX2__)
  if (vectorised) return vector_int_linear<F>(w, w_stride, a, m, bias, y, n);
#endif
  scalar_int_linear<F>(w, w_stride, a, m, bias, y, n);
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
// products, see above): uint8 [out_features, ceil(K / 32) * block bytes]. `scalar`
// forces the scalar loops (the reference the vector paths are tested against).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                        const std::optional<at::Tensor>& bias, bool scalar) {
  const bool int8_activations = (format & kInt8Activations) != 0;
  const int64_t given_format = format;
  format &= ~kInt8Activations;
  TORCH_CHECK(format >= kQ8_0 && format <= kQ4_1,
              "format must be 0 (q8_0), 1 (q4_0) or 2 (q4_1), plus 16 for int8 activations, got ", given_format);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor [out_features, blocks * bytes]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "x must be a float32 tensor, got ", x.scalar_type());
  const int64_t n = blocks.size(0), k = x.size(-1), num_blocks = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(blocks.size(1) == num_blocks * kBlockBytes[format], "x has ", k, " features, which take ", num_blocks,
              " blocks of ", kBlockBytes[format], " bytes a row; the weight has ", blocks.size(1), " bytes a row");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "bias must be a contiguous float32 tensor of ", n, " values");
  at::Tensor rows = x.reshape({-1, k});
  const int64_t m = rows.size(0), k_padded = num_blocks * kBlock;
  if (k_padded != k || !rows.is_contiguous()) {  // zeros past K: the padded weights then add nothing
    at::Tensor padded = at::zeros({m, k_padded}, rows.options());
    padded.narrow(1, 0, k).copy_(rows);
    rows = padded;
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0 || n == 0) return out;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t w_stride = blocks.size(1);
  float* y = out.data_ptr<float>();
  const float* xs = rows.data_ptr<float>();
  if (int8_activations) {
    switch (format) {
      case kQ8_0: run_int_linear<kQ8_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
      case kQ4_0: run_int_linear<kQ4_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
      default: run_int_linear<kQ4_1>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    }
    return out;
  }
  switch (format) {
    case kQ8_0: run_linear<kQ8_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    case kQ4_0: run_linear<kQ4_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    default: run_linear<kQ4_1>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
  }
  return out;
}
