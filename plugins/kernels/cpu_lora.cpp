// LoRA shrink and expand over the rows of one adapter (Punica's SGMV, one segment): for
// each row r of `rows`, y[i] = scale * B (A x[rows[i]]), with x [T, K], A [R, K], B [N, R],
// all float32; y [len(rows), N] float32. The gather of x's rows happens here (no gathered
// copy of x), each row's R-wide intermediate stays in registers / L1, and the rank is the
// adapter's own: no padding to a batch's largest rank. The threads split the rows; one row
// of a decode step is split across its outputs instead, so a single row still uses them all.
// Sums are float32 in the order of the torch reference's matmuls to float rounding.
#include "cpu_kernels.h"

#include <cstdint>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t k = 0; k < n; ++k) sum += a[k] * b[k];
  return sum;
}

}  // namespace

at::Tensor lora_shrink_expand(const at::Tensor& x, const at::Tensor& rows, const at::Tensor& lora_a,
                              const at::Tensor& lora_b, double scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, K]");
  TORCH_CHECK(lora_a.dim() == 2 && lora_a.scalar_type() == at::kFloat && lora_a.is_contiguous() &&
                  lora_a.size(1) == x.size(1),
              "lora_a must be contiguous float32 [R, K] with x's K");
  TORCH_CHECK(lora_b.dim() == 2 && lora_b.scalar_type() == at::kFloat && lora_b.is_contiguous() &&
                  lora_b.size(1) == lora_a.size(0),
              "lora_b must be contiguous float32 [N, R] with lora_a's R");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64 [n]");
  const int64_t n = rows.size(0), num_x = x.size(0), k = x.size(1), r = lora_a.size(0), out = lora_b.size(0);
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(row[i] >= 0 && row[i] < num_x, "row ", row[i], " outside x");
  at::Tensor y = at::empty({n, out}, x.options());
  const float *xs = x.data_ptr<float>(), *a = lora_a.data_ptr<float>(), *b = lora_b.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const float s = static_cast<float>(scale);
  std::vector<float> shrunk(n * r);
  at::parallel_for(0, n * r, 64, [&](int64_t begin, int64_t end) {  // shrink: [n, R]
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / r, j = index % r;
      shrunk[index] = dot(xs + row[i] * k, a + j * k, k);
    }
  });
  at::parallel_for(0, n * out, 256, [&](int64_t begin, int64_t end) {  // expand: [n, N]
    for (int64_t index = begin; index < end; ++index) {
      const int64_t i = index / out, o = index % out;
      ys[index] = s * dot(shrunk.data() + i * r, b + o * r, r);
    }
  });
  return y;
}
