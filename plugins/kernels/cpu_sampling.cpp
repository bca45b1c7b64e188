// A random row's token by inverse transform, straight from its logits: the draw
// servelab.sampler.draw makes from softmax(logits / T), without materialising the
// probabilities or their cumulative sums. Each row is read twice: once for its maximum,
// once for the sum of its weights e^((x - max) / T) (kept per block of one vector), and the
// block holding the target u * sum is then searched token by token. Blocks sum their
// weights in order, so the search and the total agree.
//
// The weights are this file's own exponential (servelab_simd::exp, relative error below
// 1e-7), so a draw equals torch's except where u * sum falls within rounding of the
// boundary between two tokens. Every row is independent of the others (a seeded row draws
// the same token in any batch), and a token of weight zero is never drawn: the search ends
// on the last token of positive weight up to the target.
#include "cpu_kernels.h"

#include <cmath>
#include <vector>

#include "cpu_simd.h"

namespace {

#ifdef __AVX2__
using S = servelab_simd::Native;
constexpr int64_t kVectors = 4;  // a block is four vectors: one horizontal sum per 64 tokens (AVX2: 32)
constexpr int64_t kBlock = kVectors * S::kWidth;
#else
constexpr int64_t kBlock = 16;
#endif

// Below this exponent a weight is zero (e^-87 is near float32's smallest normal number, where
// servelab_simd::exp stops): a token masked to -inf (a grammar's, a banned word) is never drawn.
constexpr float kLowest = -87.f;

// The weights e^((x - peak) / T) of one block of a row, into `weights` (the block's tokens
// past the vocabulary's end get none); every weight of a row is computed here, so the
// search below meets exactly the weights the sums were made of.
inline int64_t block_weights(const float* row, int64_t vocab, int64_t block, float peak, float inverse_temperature,
                             float* weights) {
  const int64_t first = block * kBlock, count = std::min(kBlock, vocab - first);
#ifdef __AVX2__
  if (count == kBlock) {
    const S::V shift = S::set1(peak), scale = S::set1(inverse_temperature);
    for (int64_t v = 0; v < kVectors; ++v) {
      const S::V exponent = S::mul(S::sub(S::loadu(row + first + v * S::kWidth), shift), scale);
      S::storeu(weights + v * S::kWidth, S::fill_below(servelab_simd::exp<S>(exponent), exponent, kLowest, 0.f));
    }
    return count;
  }
#endif
  for (int64_t j = 0; j < count; ++j) {
    const float exponent = (row[first + j] - peak) * inverse_temperature;
    weights[j] = exponent < kLowest ? 0.f : std::exp(exponent);
  }
  return count;
}

int64_t draw_row(const float* row, int64_t vocab, float inverse_temperature, float uniform, std::vector<float>& sums) {
  float peak = -INFINITY;
  int64_t i = 0;
#ifdef __AVX2__
  S::V peaks = S::set1(-INFINITY);
  for (; i + S::kWidth <= vocab; i += S::kWidth) peaks = S::max(peaks, S::loadu(row + i));
  peak = S::reduce_max(peaks);
#endif
  for (; i < vocab; ++i) peak = std::max(peak, row[i]);

  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  sums.resize(blocks);
  float weights[kBlock];
  float total = 0.f;
  for (int64_t block = 0; block < blocks; ++block) {
    const int64_t count = block_weights(row, vocab, block, peak, inverse_temperature, weights);
    float sum = 0.f;
    int64_t j = 0;
#ifdef __AVX2__
    if (count == kBlock) {
      S::V lanes = S::loadu(weights);
      for (int64_t v = 1; v < kVectors; ++v) lanes = S::add(lanes, S::loadu(weights + v * S::kWidth));
      sum = S::reduce_add(lanes);
      j = count;
    }
#endif
    for (; j < count; ++j) sum += weights[j];
    sums[block] = sum;
    total += sum;
  }

  const float target = uniform * total;
  float before = 0.f;
  int64_t block = 0;
  for (; block < blocks - 1 && before + sums[block] <= target; ++block) before += sums[block];
  // Token by token inside the block; rounding may leave the target past its last token,
  // and then the last token of positive weight up to here is the draw.
  for (; block >= 0; --block) {
    const int64_t count = block_weights(row, vocab, block, peak, inverse_temperature, weights);
    int64_t last_positive = -1;
    for (int64_t j = 0; j < count; ++j) {
      if (weights[j] <= 0.f) continue;
      last_positive = j;
      before += weights[j];
      if (before > target) return block * kBlock + j;
    }
    if (last_positive >= 0) return block * kBlock + last_positive;
    before = -INFINITY;  // an all-zero block (an underflowed tail): take the nearest positive weight before it
  }
  return 0;
}

}  // namespace

at::Tensor draw_from_logits(const at::Tensor& logits, const at::Tensor& inverse_temperature,
                            const at::Tensor& uniform) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "logits must be a 2-D float32 CPU tensor with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "logits must have at least one column");
  TORCH_CHECK(inverse_temperature.scalar_type() == at::kFloat && inverse_temperature.numel() == rows &&
                  inverse_temperature.is_contiguous() && uniform.scalar_type() == at::kFloat &&
                  uniform.numel() == rows && uniform.is_contiguous(),
              "inverse_temperature and uniform must be contiguous float32 tensors of one value per row");
  at::Tensor tokens = at::empty({rows}, at::kLong);
  const float* data = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  const float* scale = inverse_temperature.data_ptr<float>();
  const float* draws = uniform.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums;
    for (int64_t r = begin; r < end; ++r) out[r] = draw_row(data + r * stride, vocab, scale[r], draws[r], sums);
  });
  return tokens;
}
