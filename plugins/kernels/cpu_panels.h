// The panel matmul's inner block, shared by the linear layers' matmul (cpu_linear.cpp) and
// the grouped experts of a sparse MoE block (cpu_moe.cpp): both run exactly this code, so a
// row's sums accumulate in the same order, and round the same, whichever calls it.
//
// A panel is a few vectors of output columns over the whole reduction, contiguous (see
// cpu_linear.cpp for the layout); a block keeps one block of rows' sums of one panel in
// registers and reads each weight once per block.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"

namespace servelab_panels {

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
// A block that streams its panel from memory (kLookahead below) asks for the lines this far
// ahead of the step it is at.
constexpr int64_t kLookaheadBytes = 2048;

// Where a block's look-ahead requests put the panel's lines, if it makes any.
enum class Lookahead { kNone, kIntoL1, kIntoL2 };
template <Lookahead kLookahead>
using LookaheadMode = std::integral_constant<Lookahead, kLookahead>;

#if defined(__AVX2__)
// With a look-ahead, a block asks for the panel's lines kLookaheadBytes ahead as it goes: a
// block of a few rows does too little arithmetic per step for the out-of-order core to keep
// enough of a panel's loads from memory in flight by itself. Into L1 for a grouped-experts
// call (cpu_moe.cpp, at a few rows per expert: ~1.25x with the weights in memory); into L2
// for a linear of one or two rows (cpu_linear.cpp), where requests into L1 would hold the
// line-fill buffers its own loads need. Requests only, never loads: the sums are the same.
template <Lookahead kLookahead, typename TW>
inline void look_ahead(const TW* step, int64_t step_bytes) {
  if constexpr (kLookahead != Lookahead::kNone) {
    const char* ahead = reinterpret_cast<const char*>(step) + kLookaheadBytes;
    for (int64_t line = 0; line < step_bytes; line += 64)
      _mm_prefetch(ahead + line, kLookahead == Lookahead::kIntoL1 ? _MM_HINT_T0 : _MM_HINT_T1);
  }
}
#endif

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
template <int kRows, Lookahead kLookahead = Lookahead::kNone, typename TW>
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
    look_ahead<kLookahead>(w, kPanelWidth * static_cast<int64_t>(sizeof(TW)));
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
template <int kRows, Lookahead kLookahead = Lookahead::kNone>
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
    look_ahead<kLookahead>(w, 2 * kPanelWidth * static_cast<int64_t>(sizeof(c10::BFloat16)));
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

inline bool has_bf16_dot_product() {
#if defined(__AVX512F__)
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

}  // namespace servelab_panels
