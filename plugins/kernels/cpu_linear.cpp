// y = x W^T + b in float32 for the decoder's linear layers, W packed once into panels.
//
// A panel is kPanelVectors vectors of output columns over the whole reduction: [K][width]
// floats, contiguous, so one panel streams from memory in order and then stays in L2 for
// every block of rows. Each block of rows keeps its sums of one panel in registers (rows x
// 4 vectors) and reads each weight once per block. The threads split the panels; a thread
// working through many blocks of rows asks for its next panel while it computes this one.
//
// Against oneDNN on the same machine this mostly saves the per-call work around its kernel,
// which at the decode batch sizes (1-64 rows) is a large part of a small matmul, and the
// stalls on weights that come from memory rather than cache (docs/performance.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cpu_simd.h"

namespace {

using servelab_simd::Native;

constexpr int kPanelVectors = 4;
constexpr int kPanelWidth = servelab_simd::kHasVectorUnit ? kPanelVectors * Native::kWidth : 0;
// Rows a block keeps in registers: rows x 4 sums, 4 weight vectors and a broadcast fit the
// 32 AVX-512 registers at 6 rows; AVX2's 16 take 3 with the weights read from L1 as operands.
constexpr int kMaxRows = Native::kWidth == 16 ? 6 : 3;
// A thread asks for its next panel only when it has this many blocks of rows to spread the
// requests over; with fewer, the hardware prefetcher keeps up and the requests only compete.
constexpr int64_t kPrefetchFromBlocks = 4;

#if defined(__AVX2__)
// One block of rows times one panel. `columns` below the panel's width: the last panel of
// a layer whose width is not a multiple, padded with zeros; only the real columns are stored.
template <int kRows>
inline void block(const float* x, int64_t x_stride, const float* panel, int64_t k_size, const float* bias,
                  int columns, float* y, int64_t y_stride, const char* prefetch, int64_t prefetch_every) {
  using S = Native;
  constexpr int W = S::kWidth;
  typename S::V sums[kRows][kPanelVectors];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kPanelVectors; ++j) sums[r][j] = S::zero();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* w = panel + k * kPanelWidth;
    const typename S::V w0 = S::loadu(w), w1 = S::loadu(w + W), w2 = S::loadu(w + 2 * W), w3 = S::loadu(w + 3 * W);
    if (prefetch != nullptr && k % prefetch_every == 0) _mm_prefetch(prefetch + (k / prefetch_every) * 64, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const typename S::V a = S::set1(x[r * x_stride + k]);
      sums[r][0] = S::fmadd(a, w0, sums[r][0]);
      sums[r][1] = S::fmadd(a, w1, sums[r][1]);
      sums[r][2] = S::fmadd(a, w2, sums[r][2]);
      sums[r][3] = S::fmadd(a, w3, sums[r][3]);
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

template <int kRows>
void block_of(int rows, const float* x, int64_t x_stride, const float* panel, int64_t k_size, const float* bias,
              int columns, float* y, int64_t y_stride, const char* prefetch, int64_t prefetch_every) {
  if constexpr (kRows > 1) {
    if (rows < kRows)
      return block_of<kRows - 1>(rows, x, x_stride, panel, k_size, bias, columns, y, y_stride, prefetch,
                                 prefetch_every);
  }
  block<kRows>(x, x_stride, panel, k_size, bias, columns, y, y_stride, prefetch, prefetch_every);
}
#endif

}  // namespace

// Output columns per panel; 0 where the library has no vector path (the linears then stay
// on oneDNN).
int64_t panel_width() { return kPanelWidth; }

// W [N, K] float32 -> panels [ceil(N / width), K, width], the last one padded with zeros.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(kPanelWidth > 0, "this build has no vectorised linear kernel");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "weight must be a 2-D float32 tensor");
  const int64_t n = weight.size(0), k = weight.size(1), num_panels = (n + kPanelWidth - 1) / kPanelWidth;
  at::Tensor padded = weight;
  if (num_panels * kPanelWidth != n) {
    padded = at::zeros({num_panels * kPanelWidth, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
  }
  return padded.reshape({num_panels, kPanelWidth, k}).permute({0, 2, 1}).contiguous();
}

// x [..., K] float32 -> x W^T + b [..., out_features] with W as pack_panels made it.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  TORCH_CHECK(kPanelWidth > 0, "this build has no vectorised linear kernel");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelWidth && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat,
              "panels must come from pack_panels");
  const int64_t k_size = panels.size(1), num_panels = panels.size(0), n = out_features;
  TORCH_CHECK(n > (num_panels - 1) * kPanelWidth && n <= num_panels * kPanelWidth, "out_features ", n,
              " does not match ", num_panels, " panels of ", kPanelWidth);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k_size, "x must be float32 with ", k_size,
              " features, got ", x.scalar_type(), " with ", x.size(-1));
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous()),
              "bias must be a contiguous float32 tensor of ", n, " values");
  at::Tensor rows = x.reshape({-1, k_size});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor out = at::empty(out_shape, x.options());
  if (m == 0) return out;
#if defined(__AVX2__)
  const float* x_data = rows.data_ptr<float>();
  const int64_t x_stride = rows.stride(0);
  const float* w_data = panels.data_ptr<float>();
  const float* b_data = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* y_data = out.data_ptr<float>();
  const int64_t panel_floats = k_size * kPanelWidth;
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  // The next panel's lines spread over this panel's blocks x K steps: one line every
  // `every` steps, each block taking its share.
  const int64_t lines = panel_floats * static_cast<int64_t>(sizeof(float)) / 64;
  const int64_t every = std::max<int64_t>(1, blocks * k_size / lines);
  const int64_t lines_per_block = (k_size + every - 1) / every;
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const float* panel = w_data + p * panel_floats;
      const int columns = static_cast<int>(std::min<int64_t>(kPanelWidth, n - p * kPanelWidth));
      const bool ask_next = blocks >= kPrefetchFromBlocks && p + 1 < last;
      const char* next = reinterpret_cast<const char*>(panel + panel_floats);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t row = b * kMaxRows;
        const char* prefetch = ask_next && b * lines_per_block < lines ? next + b * lines_per_block * 64 : nullptr;
        block_of<kMaxRows>(static_cast<int>(std::min<int64_t>(kMaxRows, m - row)), x_data + row * x_stride, x_stride,
                           panel, k_size, b_data == nullptr ? nullptr : b_data + p * kPanelWidth, columns,
                           y_data + row * n + p * kPanelWidth, n, prefetch, every);
      }
    }
  });
#endif
  return out;
}

void register_linear(pybind11::module& m) {
  m.def("panel_width", &panel_width, "output columns per packed panel (0: no vectorised linear here)");
  m.def("pack_panels", &pack_panels, "pack a float32 [N, K] weight into panels for panel_linear");
  m.def("panel_linear", &panel_linear, "x W^T + b in float32 with W packed by pack_panels");
}
