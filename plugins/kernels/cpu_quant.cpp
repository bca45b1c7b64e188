// y = x W^T + b with W kept as blocks of 32 quantized weights, in GGML's own block layouts
// (what a GGUF file holds), dequantized in registers as they are read; float32 activations,
// float32 products and sums.
//
//   q8_0: 34 bytes a block: scale d (float16), 32 int8 q; w = d * q
//   q4_0: 18 bytes: d (float16), 16 bytes of nibbles; w = d * (q - 8)
//   q4_1: 20 bytes: d, m (float16), 16 bytes of nibbles; w = d * q + m
// Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half.
// A weight [N, K] is N rows of ceil(K / 32) blocks: a uint8 tensor [N, blocks * bytes].
//
// Decode (a few rows of x) is bandwidth-bound: the weights stream from memory once per call,
// 1.06 (q8_0), 0.56 (q4_0) or 0.63 (q4_1) bytes a weight against float32's 4. Each task is
// 4 output rows; their blocks are widened to float32 in registers and multiplied into the
// sums of every row of x at once (up to 4 rows, AVX2 2). With more rows, a task widens its 4
// weight rows once into a float32 scratch row (L1/L2) and runs blocks of rows of x over it,
// so the widening is paid once per call, not once per row. The threads split the tasks.
#include "cpu_kernels.h"

#include <algorithm>
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

}  // namespace

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
// (0 q8_0, 1 q4_0, 2 q4_1): uint8 [out_features, ceil(K / 32) * block bytes]. `scalar`
// forces the scalar loops (the reference the vector paths are tested against).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                        const std::optional<at::Tensor>& bias, bool scalar) {
  TORCH_CHECK(format >= kQ8_0 && format <= kQ4_1, "format must be 0 (q8_0), 1 (q4_0) or 2 (q4_1), got ", format);
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
  switch (format) {
    case kQ8_0: run_linear<kQ8_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    case kQ4_0: run_linear<kQ4_0>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
    default: run_linear<kQ4_1>(!scalar, w, w_stride, xs, m, k_padded, b, y, n); break;
  }
  return out;
}
