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

#include "cpu_panels.h"

namespace {

using namespace servelab_panels;

// At most this many rows (one block, whose arithmetic per weight is least), a block asks for
// its panel's lines ahead into L2 as it goes (look_ahead in cpu_panels.h). SmolLM2's
// projections and LM head, 30 layers, 2 threads, AMD Zen 4, both ways alternating in one
// process: 1.05x at 1 and 2 rows in float32 and bfloat16; at 3-4 rows 0.97x (float32) to
// 1.02x (bfloat16), at 6 rows 0.80-0.89x, where the hardware's own prefetchers keep up.
constexpr int64_t kLookaheadRows = 2;

// y = x W^T + b over every block of rows and every panel, the threads splitting the panels:
// block_with(std::integral_constant<int, R>, lookahead, x, x stride, panel, K, bias, columns,
// y, y stride, prefetch, every) runs one block of R rows (lookahead: a LookaheadMode). `steps`
// is a block's loop length (K, or K's pairs), over which the blocks of a thread spread their
// requests for its next panel: a line every `every` steps, each block an equal share
// (prefetch: null for none).
//
// The blocks are of kMaxRows rows and a last one of the rest, or, where they spread those
// requests, as even as they can be (rows differing by at most one): a last block of one or
// two rows issued its share of the requests in a fraction of the others' time, and they
// bunched against its loads. SmolLM2's projections and LM head, 30 layers, 2 threads, AMD
// Zen 4, both ways alternating in one process: 19-20 rows 1.09-1.15x (6 + 6 + 6 + 1-2 rows
// against 5 + 5 + 5 + 4-5), 44 rows 1.03-1.04x, level at 22-64 otherwise, float32 and
// bfloat16. Without the requests the first block streams the panel from memory and the
// others reread it from L2, so a full first block is better there (8 rows as 4 + 4: 0.92x).
template <typename T, typename TW, typename BlockWith>
void for_each_block(const T* x, int64_t x_stride, const TW* weights, int64_t panel_values, int64_t k_size,
                    int64_t steps, const T* bias, T* y, int64_t m, int64_t n, int64_t num_panels,
                    const BlockWith& block_with) {
  const int64_t blocks = (m + kMaxRows - 1) / kMaxRows;
  const int64_t lines = panel_values * static_cast<int64_t>(sizeof(TW)) / 64;
  const int64_t every = std::max<int64_t>(1, blocks * steps / lines);
  const int64_t lines_per_block = (steps + every - 1) / every;
  const bool even_blocks = blocks >= kPrefetchFromBlocks;  // the blocks spread requests for the next panel
  at::parallel_for(0, num_panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      const TW* panel = weights + p * panel_values;
      const char* next = reinterpret_cast<const char*>(panel + panel_values);
      const int columns = static_cast<int>(std::min<int64_t>(kPanelWidth, n - p * kPanelWidth));
      const bool ask_next = even_blocks && p + 1 < last;
      int64_t row = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t rows = even_blocks ? (m - row + blocks - b - 1) / (blocks - b) : std::min<int64_t>(kMaxRows, m - row);
        const char* prefetch = ask_next && b * lines_per_block < lines ? next + b * lines_per_block * 64 : nullptr;
        with_rows<kMaxRows>(static_cast<int>(rows), [&](auto count) {
          const auto call = [&](auto lookahead) {
            block_with(count, lookahead, x + row * x_stride, x_stride, panel, k_size,
                       bias == nullptr ? nullptr : bias + p * kPanelWidth, columns, y + row * n + p * kPanelWidth, n,
                       prefetch, every);
          };
          if constexpr (decltype(count)::value <= kLookaheadRows) {
            if (m <= kLookaheadRows) return call(LookaheadMode<Lookahead::kIntoL2>{});
          }
          call(LookaheadMode<Lookahead::kNone>{});
        });
        row += rows;
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
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  TORCH_CHECK(!out_shape.empty(), "x must have a feature dimension");
  out_shape.back() = out_features;
  at::Tensor out = at::empty(out_shape, x.options());
  panel_linear_out(x, panels, bias, out_features, out);
  return out;
}

void panel_linear_out(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                      int64_t out_features, at::Tensor& out) {
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
  at::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, k_size});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  const int64_t m = rows.size(0);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() && out.numel() == m * n && out.size(-1) == n,
              "out must be a contiguous ", dtype, " tensor of x's rows by ", n, " outputs");
  if (m == 0) return;
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
                   [](auto count, auto lookahead, auto... args) {
                     block<decltype(count)::value, decltype(lookahead)::value>(args...);
                   });
    out.view({m, n}).copy_(out32);
#endif
    return;
  }
  const int64_t x_stride = rows.stride(0);
  if (!bf16) {
#if defined(__AVX2__)
    for_each_block(rows.data_ptr<float>(), x_stride, panels.data_ptr<float>(), k_size * kPanelWidth, k_size, k_size,
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), m, n, num_panels,
                   [](auto count, auto lookahead, auto... args) {
                     block<decltype(count)::value, decltype(lookahead)::value>(args...);
                   });
#endif
    return;
  }
#if defined(__AVX512F__)
  const int64_t k_pairs = panels.size(1);
  for_each_block(rows.data_ptr<c10::BFloat16>(), x_stride, panels.data_ptr<c10::BFloat16>(),
                 k_pairs * 2 * kPanelWidth, k_size, k_pairs,
                 bias.has_value() ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(), m, n,
                 num_panels,
                 [](auto count, auto lookahead, auto... args) {
                   block_bf16<decltype(count)::value, decltype(lookahead)::value>(args...);
                 });
#endif
}
