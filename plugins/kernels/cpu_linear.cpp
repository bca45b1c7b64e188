// y = x W^T + b for the decoder's linear layers, W packed once into panels, float32 or
// bfloat16 on every vectorised build: bfloat16 through AVX-512 BF16's dot product where the
// CPU has it, and elsewhere (AVX2, AVX-512 without BF16) widened to float32 in registers as
// each weight is loaded, with the input widened once per call and float32 sums, so that
// such a CPU still reads half the bytes of float32 weights.
//
// A panel is a few vectors of output columns over the whole reduction, contiguous, so one
// panel streams from memory in order and then stays in L2 for every block of rows:
// float32 [K][width]; bfloat16 [K/2][width][2], each pair of reduction steps side by side
// as the dot-product instruction takes them. Each block of rows keeps its sums of one
// panel in registers (rows x the panel's vectors, float32) and reads each weight once per block. The
// threads split the panels; a thread working through many blocks of rows asks for its
// next panel while it computes this one.
//
// Against oneDNN on the same machine this mostly saves the per-call work around its kernel,
// which at the decode batch sizes (1-64 rows) is a large part of a small matmul, and the
// stalls on weights that come from memory rather than cache (docs/performance.md).
#include "cpu_kernels.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_simd.h"

namespace {

using servelab_simd::Native;

// A panel is kPanelVectors vectors of output columns. A block keeps rows x kPanelVectors
// sums in registers with the panel's vectors and a broadcast beside them: 6 x 4 (+ 5) of
// AVX-512's 32 registers, 6 x 2 (+ 3) of AVX2's 16. On AVX2 the narrower panel halves the
// bytes a block streams from L2 per multiply-add against the 3 x 4 it replaced, which was
// bound by that stream: 1.8x at 64 rows (docs/performance.md).
constexpr int kPanelVectors = Native::kWidth == 16 ? 4 : 2;
constexpr int kPanelWidth = servelab_simd::kHasVectorUnit ? kPanelVectors * Native::kWidth : 0;
constexpr int kMaxRows = 6;
// A thread asks for its next panel only when it has this many blocks of rows to spread the
// requests over; with fewer, the hardware prefetcher keeps up and the requests only compete.
constexpr int64_t kPrefetchFromBlocks = 4;

// f(std::integral_constant<int, R>{}) with R = rows (1 to kRows): a block takes its row
// count as a template argument, so that its sums stay in registers.
template <int kRows, typename F>
void with_rows(int rows, const F& f) {
  if constexpr (kRows > 1) {
    if (rows < kRows) return with_rows<kRows - 1>(rows, f);
  }
  f(std::integral_constant<int, kRows>{});
}

#if defined(__AVX2__)
// The float32 block: one block of rows times one panel of float32 weights, or of bfloat16
// ones widened as they are loaded (TW). `columns` below the panel's width:
// the last panel of a layer whose width is not a multiple, padded with zeros; only the real
// columns are stored.
template <int kRows, typename TW>
inline void block(const float* x, int64_t x_stride, const TW* panel, int64_t k_size, const float* bias,
                  int columns, float* y, int64_t y_stride, const char* prefetch, int64_t prefetch_every) {
  using S = Native;
  constexpr int W = S::kWidth;
  typename S::V sums[kRows][kPanelVectors];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kPanelVectors; ++j) sums[r][j] = S::zero();
  for (int64_t k = 0; k < k_size; ++k) {
    const TW* w = panel + k * kPanelWidth;
    typename S::V weights[kPanelVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVectors; ++j) weights[j] = S::load(w + j * W);
    if (prefetch != nullptr && k % prefetch_every == 0) _mm_prefetch(prefetch + (k / prefetch_every) * 64, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const typename S::V a = S::set1(x[r * x_stride + k]);
#pragma GCC unroll 4
      for (int j = 0; j < kPanelVectors; ++j) sums[r][j] = S::fmadd(a, weights[j], sums[r][j]);
    }
  }
  if (columns == kPanelWidth) {
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kPanelVectors; ++j)
        S::storeu(y + r * y_stride + j * W, bias == nullptr ? sums[r][j] : S::add(sums[r][j], S::loadu(bias + j * W)));
    return;
  }
  float row[kPanelWidth];
  for (int r = 0; r < kRows; ++r) {
    for (int j = 0; j < kPanelVectors; ++j) S::storeu(row + j * W, sums[r][j]);
    for (int c = 0; c < columns; ++c) y[r * y_stride + c] = bias == nullptr ? row[c] : row[c] + bias[c];
  }
}

#endif

#if defined(__AVX512F__)
#define SERVELAB_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// The bfloat16 block: as the float32 one, over pairs of reduction steps (a vector of
// weights is 16 columns x 2 steps); an odd K's last step is the pair (x, 0) against the
// panel's zero padding.
template <int kRows>
SERVELAB_BF16_TARGET inline void block_bf16(const c10::BFloat16* x, int64_t x_stride, const c10::BFloat16* panel,
                                            int64_t k_size, const c10::BFloat16* bias, int columns,
                                            c10::BFloat16* y, int64_t y_stride, const char* prefetch,
                                            int64_t prefetch_every) {
  __m512 sums[kRows][kPanelVectors];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kPanelVectors; ++j) sums[r][j] = _mm512_setzero_ps();
  const int64_t whole_pairs = k_size / 2;
  for (int64_t kp = 0; kp < (k_size + 1) / 2; ++kp) {
    const c10::BFloat16* w = panel + kp * 2 * kPanelWidth;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32),
                   w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    if (prefetch != nullptr && kp % prefetch_every == 0)
      _mm_prefetch(prefetch + (kp / prefetch_every) * 64, _MM_HINT_T1);
    const bool whole = kp < whole_pairs;
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      int32_t pair = 0;
      if (whole)
        std::memcpy(&pair, x + r * x_stride + 2 * kp, 4);
      else
        std::memcpy(&pair, x + r * x_stride + 2 * kp, 2);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      sums[r][0] = _mm512_dpbf16_ps(sums[r][0], a, w0);
      sums[r][1] = _mm512_dpbf16_ps(sums[r][1], a, w1);
      sums[r][2] = _mm512_dpbf16_ps(sums[r][2], a, w2);
      sums[r][3] = _mm512_dpbf16_ps(sums[r][3], a, w3);
    }
  }
  // Sums to bfloat16 (rounded to nearest even) with the bias added in float32; a padded
  // panel's rows go through a buffer so only its real columns are stored.
  alignas(64) c10::BFloat16 row[kPanelWidth];
  for (int r = 0; r < kRows; ++r) {
    c10::BFloat16* target = columns == kPanelWidth ? y + r * y_stride : row;
    for (int j = 0; j < kPanelVectors; ++j) {
      __m512 out = sums[r][j];
      const int valid = std::min(16, columns - 16 * j);
      if (bias != nullptr && valid > 0) {
        const __m256i raw = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << valid) - 1), bias + 16 * j);
        out = _mm512_add_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(target + 16 * j), (__m256i)_mm512_cvtneps_pbh(out));
    }
    if (columns != kPanelWidth) std::memcpy(y + r * y_stride, row, sizeof(c10::BFloat16) * columns);
  }
}
#endif

bool has_bf16_dot_product() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// y = x W^T + b over every block of rows and every panel, the threads splitting the panels:
// block_with(std::integral_constant<int, R>, x, x stride, panel, K, bias, columns, y, y
// stride, prefetch, every) runs one block of R rows. `steps` is a block's loop length
// (K, or K's pairs), over which the blocks of a thread spread their requests for its next
// panel: a line every `every` steps, each block its share (prefetch: null for none).
template <typename T, typename TW, typename BlockWith>
void for_each_block(const T* x, int64_t x_stride, const TW* weights, int64_t panel_values, int64_t k_size,
                    int64_t steps, const T* bias, T* y, int64_t m, int64_t n, int64_t num_panels,
                    const BlockWith& block_with) {
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  const int64_t lines = panel_values * static_cast<int64_t>(sizeof(TW)) / 64;
  const int64_t every = std::max<int64_t>(1, blocks * steps / lines);
  const int64_t lines_per_block = (steps + every - 1) / every;
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const TW* panel = weights + p * panel_values;
      const char* next = reinterpret_cast<const char*>(panel + panel_values);
      const int columns = static_cast<int>(std::min<int64_t>(kPanelWidth, n - p * kPanelWidth));
      const bool ask_next = blocks >= kPrefetchFromBlocks && p + 1 < last;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t row = b * kMaxRows;
        const char* prefetch = ask_next && b * lines_per_block < lines ? next + b * lines_per_block * 64 : nullptr;
        with_rows<kMaxRows>(static_cast<int>(std::min<int64_t>(kMaxRows, m - row)), [&](auto count) {
          block_with(count, x + row * x_stride, x_stride, panel, k_size,
                     bias == nullptr ? nullptr : bias + p * kPanelWidth, columns, y + row * n + p * kPanelWidth, n,
                     prefetch, every);
        });
      }
    }
  });
}

}  // namespace

// Output columns per panel; 0 where the library has no vector path (the linears then stay
// on oneDNN).
int64_t panel_width() { return kPanelWidth; }

// The weight dtypes pack_panels takes on this CPU: float32 and bfloat16 with any vector path.
std::vector<std::string> panel_dtypes() {
  if (kPanelWidth == 0) return {};
  return {"float32", "bfloat16"};
}

// W [N, K] -> panels, the last one padded with zero columns: [ceil(N / width), K, width] in
// W's dtype; bfloat16 where the CPU has the BF16 dot product [ceil(N / width), ceil(K / 2),
// width, 2], an odd K padded with a zero step.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(kPanelWidth > 0, "this build has no vectorised linear kernel");
  const bool bf16 = weight.scalar_type() == at::kBFloat16, pairs = bf16 && has_bf16_dot_product();
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || bf16),
              "weight must be a 2-D float32 or bfloat16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + kPanelWidth - 1) / kPanelWidth;
  const int64_t k_padded = pairs ? (k + 1) / 2 * 2 : k;
  at::Tensor padded = weight;
  if (num_panels * kPanelWidth != n || k_padded != k) {
    padded = at::zeros({num_panels * kPanelWidth, k_padded}, weight.options());
    padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  }
  if (!pairs) return padded.reshape({num_panels, kPanelWidth, k}).permute({0, 2, 1}).contiguous();
  return padded.reshape({num_panels, kPanelWidth, k_padded / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [..., K] -> x W^T + b [..., out_features] in x's dtype, with W as pack_panels made it
// from a weight of that dtype.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(kPanelWidth > 0, "this build has no vectorised linear kernel");
  const bool bf16 = panels.scalar_type() == at::kBFloat16, pairs = bf16 && panels.dim() == 4;
  TORCH_CHECK(panels.dim() == (pairs ? 4 : 3) && panels.size(2) == kPanelWidth && panels.is_contiguous() &&
                  (panels.scalar_type() == at::kFloat || bf16) && (!pairs || has_bf16_dot_product()),
              "panels must come from pack_panels");
  const int64_t num_panels = panels.size(0), n = out_features;
  const int64_t k_size = x.size(-1);
  const bool k_fits = pairs ? (k_size + 1) / 2 == panels.size(1) : k_size == panels.size(1);
  TORCH_CHECK(n > (num_panels - 1) * kPanelWidth && n <= num_panels * kPanelWidth, "out_features ", n,
              " does not match ", num_panels, " panels of ", kPanelWidth);
  const char* dtype = bf16 ? "bfloat16" : "float32";
  TORCH_CHECK(x.scalar_type() == panels.scalar_type() && k_fits, "x must be ", dtype, " with ",
              pairs ? 2 * panels.size(1) : panels.size(1), pairs ? " (or one fewer)" : "", " features, got ",
              x.scalar_type(), " with ", k_size);
  TORCH_CHECK(!bias.has_value() ||
                  (bias->scalar_type() == panels.scalar_type() && bias->numel() == n && bias->is_contiguous()),
              "bias must be a contiguous ", dtype, " tensor of ", n, " values");
  at::Tensor rows = x.reshape({-1, k_size});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0) return out;
  if (bf16 && !pairs) {
#if defined(__AVX2__)
    // Widened: the input and bias once to float32, the weights as they are loaded, the
    // float32 sums rounded to bfloat16 (to nearest even) at the end.
    const at::Tensor rows32 = rows.to(at::kFloat).contiguous();
    const std::optional<at::Tensor> bias32 =
        bias.has_value() ? std::optional<at::Tensor>(bias->to(at::kFloat)) : std::nullopt;
    at::Tensor out32 = at::empty({m, n}, rows32.options());
    for_each_block(rows32.data_ptr<float>(), rows32.stride(0), panels.data_ptr<c10::BFloat16>(),
                   k_size * kPanelWidth, k_size, k_size, bias32.has_value() ? bias32->data_ptr<float>() : nullptr,
                   out32.data_ptr<float>(), m, n, num_panels,
                   [](auto count, auto... args) { block<decltype(count)::value>(args...); });
    out.view({m, n}).copy_(out32);
#endif
    return out;
  }
  const int64_t x_stride = rows.stride(0);
  if (!bf16) {
#if defined(__AVX2__)
    for_each_block(rows.data_ptr<float>(), x_stride, panels.data_ptr<float>(), k_size * kPanelWidth, k_size, k_size,
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, n, num_panels,
                   [](auto count, auto... args) { block<decltype(count)::value>(args...); });
#endif
    return out;
  }
#if defined(__AVX512F__)
  const int64_t k_pairs = panels.size(1);
  for_each_block(rows.data_ptr<c10::BFloat16>(), x_stride, panels.data_ptr<c10::BFloat16>(),
                 k_pairs * 2 * kPanelWidth, k_size, k_pairs,
                 bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(), m, n,
                 num_panels,
                 [](auto count, auto... args) { block_bf16<decltype(count)::value>(args...); });
#endif
  return out;
}
