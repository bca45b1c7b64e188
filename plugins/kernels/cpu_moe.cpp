// The routed experts of a sparse mixture-of-experts block in one native call: for every
// token t, sum_k w[t, k] * down(silu(gate) * up)(x[t]) over its experts ids[t, k], each
// expert's fused gate_up and down weights in the panels of cpu_linear.cpp (float32, or
// bfloat16 dot-multiplied or widened as panel_linear takes them).
//
// It is servelab.model.moe.grouped_experts over panel-packed linears without the Python
// between the ops: the (token, k) pairs are sorted by expert (a stable counting sort, as the
// stable argsort there), the rows gathered, every expert's gate_up matmul run, SiLU-and-
// multiply, every expert's down matmul, and each token's rows scaled and summed into it in
// expert order. The matmuls run the panel block of cpu_panels.h, panel_linear's: each row's
// sums accumulate in the same order, so each row's output is panel_linear's to the bit. The
// SiLU is torch's own (at::silu_, the op F.silu calls, on each expert's rows, the shape F.silu
// gets there); the products round to the dtype as torch's multiplies do, and a token's rows
// add up as torch's index_add adds them (in float32, from zero, in expert order; a bfloat16
// sum rounded once). So the result equals grouped_experts over the same panels to the bit,
// in float32 and bfloat16 alike, and in float32 the per-expert loop's too.
//
// A matmul's work is cut into items (a tile of one expert's rows times one panel of its
// weight) and the threads take contiguous runs of items of about equal work, so both
// threads stay busy when each expert has a row or two (a decode step) and a thread's items
// share rows and weights while it works through them (a prompt). An item's first block of
// rows streams its panel in and asks for the lines ahead as it goes, which at a few rows per
// expert (too little arithmetic per weight to keep enough loads in flight) is worth ~1.25x.
// The rows go through in chunks of a few MB of intermediate projections, in a workspace the
// calling thread keeps.
#include "cpu_kernels.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_panels.h"

namespace {

using namespace servelab_panels;

// One work item of a matmul: rows [row, row + rows) of the sorted pairs, all of `expert`'s,
// times panel `panel` of that expert's weight.
struct Item {
  int64_t expert, panel, row, rows;
};

// A tile of an expert's rows has at least this many (the panel is read once per tile), and
// at most what holds about kTileBytes of input, which then stays in L2 beside the panel while
// the thread takes the tile through panel after panel.
constexpr int64_t kMinTileRows = 4 * kMaxRows;
constexpr int64_t kTileBytes = int64_t{512} << 10;
// An item's work, in rows: its rows plus what reading its panel costs besides (a row's work
// over the panel streams the same bytes the panel has once every few rows).
constexpr int64_t kItemOverheadRows = 2;
// One chunk of a call's rows (see forward) takes about this many bytes of intermediate
// buffers (its rows of x, their gate_up projection, activations and down projection), and at
// least this many rows: an expert cut into chunks is read once per chunk, and fewer rows would
// leave a wide expert (Mixtral's: 14,336 x 4,096) reading its weights more than computing.
constexpr int64_t kChunkBytes = int64_t{8} << 20;
constexpr int64_t kMinChunkRows = 256;

// The items of one matmul over every expert with rows (`offsets`: expert e's rows are
// [offsets[e], offsets[e + 1])): each panel of the expert's weight over a tile of its rows,
// tile after tile; the rows of a tile take up to kTileBytes (`row_bytes` each), and are fewer
// when there would be fewer than a few items per thread.
std::vector<Item> items_for(const std::vector<int64_t>& offsets, int64_t num_panels, int64_t row_bytes,
                            int threads) {
  const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
  int64_t whole = 0;
  for (int64_t e = 0; e < experts; ++e) whole += offsets[e + 1] > offsets[e] ? num_panels : 0;
  const int64_t wanted = 4 * static_cast<int64_t>(threads);
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = offsets[e + 1] - offsets[e];
    if (count == 0) continue;
    int64_t tiles = 1;
    if (whole < wanted) tiles = std::max<int64_t>(1, std::min((wanted + whole - 1) / whole, count / kMinTileRows));
    tiles = std::max(tiles, count / std::max(kMinTileRows, kTileBytes / row_bytes));
    int64_t tile = (count + tiles - 1) / tiles;
    tile = (tile + kMaxRows - 1) / kMaxRows * kMaxRows;
    for (int64_t start = 0; start < count; start += tile)
      for (int64_t p = 0; p < num_panels; ++p) items.push_back({e, p, offsets[e] + start, std::min(tile, count - start)});
  }
  return items;
}

// Where each thread's run of items begins: bounds[t] to bounds[t + 1] are thread t's, the
// runs of about equal work.
std::vector<int64_t> split(const std::vector<Item>& items, int threads) {
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(items.size()));
  bounds[0] = 0;
  int64_t total = 0;
  for (const Item& item : items) total += item.rows + kItemOverheadRows;
  int64_t done = 0, t = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()) && t < threads; ++i) {
    done += items[i].rows + kItemOverheadRows;
    while (t < threads && done * threads >= total * t) bounds[t++] = i + 1;
  }
  return bounds;
}

#if defined(__AVX2__)
// y[rows of each item, the item's panel's columns] = x[those rows] W_e^T for every item, the
// threads each taking their run: block_with(count, lookahead, ...) runs one block of rows as
// for_each_block's does (cpu_linear.cpp), and a thread asks for its next item's panel while
// it works through this one, as that one does, but however few blocks of rows it has: the
// experts' weights are many and each is read once a call, so they come from memory (L3 at
// best), where panel_linear's at decode sizes mostly sit in L3 or L2 (against asking only
// from 4 blocks on, with the weights out of cache: 1.06x at 1 row per expert, 1.08x at ~4,
// 1.14x at ~16). An item's first block also looks ahead in its own panel as it goes
// (cpu_panels.h); the others find the panel in L2.
template <typename T, typename TW, typename BlockWith>
void run_items(const std::vector<Item>& items, int threads, const T* x, int64_t x_stride,
               const std::vector<const TW*>& weights, int64_t panel_values, int64_t k_size, int64_t steps, T* y,
               int64_t y_stride, int64_t n, const BlockWith& block_with) {
  if (items.empty()) return;
  const std::vector<int64_t> bounds = split(items, threads);
  const int64_t lines = panel_values * static_cast<int64_t>(sizeof(TW)) / 64;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) {
        const Item& item = items[i];
        const TW* panel = weights[item.expert] + item.panel * panel_values;
        const TW* next_panel =
            i + 1 < bounds[t + 1] ? weights[items[i + 1].expert] + items[i + 1].panel * panel_values : nullptr;
        const char* next = next_panel == panel ? nullptr : reinterpret_cast<const char*>(next_panel);
        const int columns = static_cast<int>(std::min<int64_t>(kPanelWidth, n - item.panel * kPanelWidth));
        const int64_t blocks = (item.rows + kMaxRows - 1) / kMaxRows;
        const int64_t every = std::max<int64_t>(1, blocks * steps / std::max<int64_t>(1, lines));
        const int64_t lines_per_block = (steps + every - 1) / every;
        const bool ask_next = next != nullptr;  // even over one block: the weights come from memory
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t row = item.row + b * kMaxRows;
          const char* prefetch = ask_next && b * lines_per_block < lines ? next + b * lines_per_block * 64 : nullptr;
          with_rows<kMaxRows>(static_cast<int>(std::min<int64_t>(kMaxRows, item.row + item.rows - row)),
                              [&](auto count) {
                                const auto call = [&](auto lookahead) {
                                  block_with(count, lookahead, x + row * x_stride, x_stride, panel, k_size, nullptr,
                                             columns, y + row * y_stride + item.panel * kPanelWidth, y_stride,
                                             prefetch, every);
                                };
                                if (b == 0)
                                  call(LookaheadMode<Lookahead::kIntoL1>{});
                                else
                                  call(LookaheadMode<Lookahead::kNone>{});
                              });
        }
      }
    }
  });
}
#endif

// How the matmuls run: float32 weights on float32 rows; bfloat16 weights through the BF16
// dot product on bfloat16 rows; bfloat16 weights widened as they are loaded, on rows
// widened to float32, each output rounded to bfloat16 (what panel_linear does for each).
enum class Mode { kFloat32, kBFloat16Pairs, kBFloat16Widened };

// The checks of one expert's panels: an [out_features, in_features] weight packed by
// pack_panels in `mode`.
void check_panels(const at::Tensor& panels, Mode mode, int64_t out_features, int64_t in_features, const char* name) {
  const bool pairs = mode == Mode::kBFloat16Pairs;
  const int64_t width = std::max(kPanelWidth, 1), num_panels = (out_features + width - 1) / width;
  const int64_t steps = pairs ? (in_features + 1) / 2 : in_features;
  TORCH_CHECK(panels.dim() == (pairs ? 4 : 3) && panels.is_contiguous() &&
                  panels.scalar_type() == (mode == Mode::kFloat32 ? at::kFloat : at::kBFloat16) &&
                  panels.size(0) == num_panels && panels.size(1) == steps && panels.size(2) == kPanelWidth,
              name, " panels must come from pack_panels of an [", out_features, ", ", in_features,
              "] weight of the input's dtype, packed alike for every expert");
}

// This thread's workspace for a call's intermediate buffers, at least `bytes` long (64-byte
// aligned). Kept from call to call (kChunkBytes, or kMinChunkRows rows of the widest experts
// called: see forward), since buffers of a few
// MB allocated at every call come fresh from the kernel each time (glibc maps allocations that
// large), a page fault every 4 KB, 2 ms of a 6 ms call at 256 tokens of the measured block.
char* workspace(int64_t bytes) {
  thread_local std::vector<char> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes + 64) buffer.resize(bytes + 64);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - address % 64) % 64);
}

}  // namespace

struct PanelExperts::State {
  std::vector<at::Tensor> gate_up, down;  // held: the pointers below stay valid
  std::vector<const void*> gate_up_data, down_data;
  int64_t hidden, intermediate;
  Mode mode;
};

PanelExperts::PanelExperts(const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
                           int64_t hidden, int64_t intermediate)
    : state_(std::make_unique<State>()) {
  TORCH_CHECK(kPanelWidth > 0, "this build has no vectorised linear kernel");
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "one gate_up and one down weight per expert");
  TORCH_CHECK(hidden > 0 && intermediate > 0, "the experts' hidden and intermediate sizes must be positive");
  State& s = *state_;
  const at::Tensor& first = gate_up.front();
  const bool bf16 = first.scalar_type() == at::kBFloat16;
  s.mode = !bf16 ? Mode::kFloat32 : first.dim() == 4 ? Mode::kBFloat16Pairs : Mode::kBFloat16Widened;
  TORCH_CHECK(s.mode != Mode::kBFloat16Pairs || has_bf16_dot_product(), "panels must come from pack_panels");
  s.hidden = hidden;
  s.intermediate = intermediate;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    check_panels(gate_up[e], s.mode, 2 * intermediate, s.hidden, "gate_up");
    check_panels(down[e], s.mode, s.hidden, intermediate, "down");
    s.gate_up.push_back(gate_up[e]);
    s.down.push_back(down[e]);
    s.gate_up_data.push_back(gate_up[e].data_ptr());
    s.down_data.push_back(down[e].data_ptr());
  }
}

PanelExperts::~PanelExperts() = default;

int64_t PanelExperts::num_experts() const { return static_cast<int64_t>(state_->gate_up.size()); }

at::Tensor PanelExperts::forward(const at::Tensor& x_in, const at::Tensor& weights_in,
                                 const at::Tensor& ids_in) const {
  const State& s = *state_;
  const int64_t experts = num_experts(), inter = s.intermediate;
  TORCH_CHECK(x_in.dim() == 2 && x_in.device().is_cpu() &&
                  x_in.scalar_type() == (s.mode == Mode::kFloat32 ? at::kFloat : at::kBFloat16),
              "x must be a 2-D CPU tensor of the experts' dtype");
  const int64_t h = x_in.size(1);
  TORCH_CHECK(h == s.hidden, "x has ", h, " features, the experts take ", s.hidden);
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == x_in.size(0) && weights_in.sizes() == ids_in.sizes(),
              "weights and ids must both be [tokens, top_k]");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor weights = weights_in.to(at::kFloat).contiguous();  // exact: bfloat16 widens
  const int64_t tokens = x.size(0), top_k = ids.size(1), pairs = tokens * top_k;
  const bool bf16 = s.mode != Mode::kFloat32, widened = s.mode == Mode::kBFloat16Widened;
  // float32: the sums go straight into the output; bfloat16: into float32 sums, rounded at the end
  at::Tensor out = at::zeros({tokens, h}, x.options().dtype(at::kFloat));
  if (pairs == 0) return bf16 ? out.to(at::kBFloat16) : out;

  // The pairs sorted by expert, stably (each expert's pairs in token order): the rows of
  // expert e are [offsets[e], offsets[e + 1]); row r belongs to token token_of[r] with
  // weight weight_of[r]; token t's rows, ascending (its experts' order), are
  // rows_of[t * top_k, (t + 1) * top_k).
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> offsets(experts + 1, 0), rows_of(pairs), token_of(pairs);
  std::vector<float> weight_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "expert id ", id[p], " out of range for ", experts, " experts");
    ++offsets[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] += offsets[e];
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    const float* w = weights.data_ptr<float>();
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t row = next[id[p]]++;
      rows_of[p] = row;
      token_of[row] = p / top_k;
      weight_of[row] = w[p];
    }
    for (int64_t t = 0; t < tokens; ++t) std::sort(rows_of.begin() + t * top_k, rows_of.begin() + (t + 1) * top_k);
  }

#if defined(__AVX2__)
  const int threads = std::max(1, at::get_num_threads());
  using BF16 = c10::BFloat16;
  using S = servelab_simd::Native;
  constexpr int W = S::kWidth;
  const int64_t gu_width = 2 * inter;

  // The rows go through in chunks of whole experts (an expert with more rows than a chunk
  // holds, in pieces), so that the intermediate buffers stay a few MB, in this thread's
  // workspace: rows [chunk, H] of x (float32 where the matmul widens), gate_up [chunk, 2I] in
  // x's dtype (and its float32 sums where the matmul widens), activated [chunk, I] as rows,
  // down [chunk, H] (bfloat16 from the dot product, float32 sums otherwise).
  const int64_t row_size = widened ? 4 : x.element_size(), down_size = s.mode == Mode::kBFloat16Pairs ? 2 : 4;
  const auto aligned = [](int64_t bytes) { return (bytes + 63) / 64 * 64; };
  const int64_t row_bytes = h * row_size + gu_width * x.element_size() + (widened ? gu_width * 4 : 0) +
                            inter * row_size + h * down_size;
  const int64_t chunk_rows = std::min(pairs, std::max(kMinChunkRows, kChunkBytes / row_bytes));
  const int64_t sizes[5] = {aligned(chunk_rows * h * row_size), aligned(chunk_rows * gu_width * x.element_size()),
                            widened ? aligned(chunk_rows * gu_width * 4) : 0, aligned(chunk_rows * inter * row_size),
                            aligned(chunk_rows * h * down_size)};
  char* space = workspace(sizes[0] + sizes[1] + sizes[2] + sizes[3] + sizes[4]);
  const at::TensorOptions float_options = x.options().dtype(at::kFloat);
  const at::TensorOptions row_options = widened ? float_options : x.options();
  const at::Tensor rows = at::from_blob(space, {chunk_rows, h}, row_options);
  const at::Tensor gate_up = at::from_blob(space + sizes[0], {chunk_rows, gu_width}, x.options());
  const at::Tensor sums =
      widened ? at::from_blob(space + sizes[0] + sizes[1], {chunk_rows, gu_width}, float_options) : at::Tensor();
  const at::Tensor activated = at::from_blob(space + sizes[0] + sizes[1] + sizes[2], {chunk_rows, inter}, row_options);
  const at::Tensor down = at::from_blob(space + sizes[0] + sizes[1] + sizes[2] + sizes[3], {chunk_rows, h},
                                        s.mode == Mode::kBFloat16Pairs ? x.options() : float_options);
  const auto float_block = [](auto count, auto lookahead, auto... args) {
    block<decltype(count)::value, decltype(lookahead)::value>(args...);
  };
#if defined(__AVX512F__)
  const auto pair_block = [](auto count, auto lookahead, auto... args) {
    block_bf16<decltype(count)::value, decltype(lookahead)::value>(args...);
  };
#endif
  const auto panels_of = [](const std::vector<const void*>& data, auto* type) {
    std::vector<const std::remove_pointer_t<decltype(type)>*> panels;
    for (const void* p : data) panels.push_back(static_cast<const std::remove_pointer_t<decltype(type)>*>(p));
    return panels;
  };
  // One grouped projection of `input` [rows, k] by each expert's panels into `target` [rows,
  // out_width], in the call's mode: float32, float32 sums of bfloat16 panels (widened), or
  // bfloat16 pairs through the dot product.
  const auto project = [&](const std::vector<Item>& items, const at::Tensor& input, int64_t k,
                           const std::vector<const void*>& panels, const at::Tensor& target, int64_t out_width) {
    if (s.mode == Mode::kFloat32) {
      run_items(items, threads, input.data_ptr<float>(), k, panels_of(panels, (float*)nullptr), k * kPanelWidth, k,
                k, target.data_ptr<float>(), out_width, out_width, float_block);
    } else if (widened) {
      run_items(items, threads, input.data_ptr<float>(), k, panels_of(panels, (BF16*)nullptr), k * kPanelWidth, k,
                k, target.data_ptr<float>(), out_width, out_width, float_block);
    } else {
#if defined(__AVX512F__)
      const int64_t k_pairs = (k + 1) / 2;
      run_items(items, threads, input.data_ptr<BF16>(), k, panels_of(panels, (BF16*)nullptr),
                k_pairs * 2 * kPanelWidth, k, k_pairs, target.data_ptr<BF16>(), out_width, out_width, pair_block);
#endif
    }
  };
  const int64_t gu_panels = (gu_width + kPanelWidth - 1) / kPanelWidth, down_panels = (h + kPanelWidth - 1) / kPanelWidth;

  std::vector<int64_t> local(experts + 1);
  for (int64_t first = 0; first < pairs;) {
    // This chunk: rows [first, last), whole experts while they fit.
    int64_t last = std::min(pairs, first + chunk_rows);
    if (last < pairs) {
      const int64_t* boundary = std::upper_bound(offsets.data(), offsets.data() + experts + 1, last) - 1;
      if (*boundary > first) last = *boundary;
    }
    const int64_t count = last - first;
    for (int64_t e = 0; e <= experts; ++e) local[e] = std::clamp(offsets[e], first, last) - first;

    // 1. Each pair's row of x, gathered in sorted order (widened to float32 where the
    //    matmul widens its input).
    at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t token = token_of[first + r];
        if (s.mode == Mode::kFloat32) {
          std::memcpy(rows.data_ptr<float>() + r * h, x.data_ptr<float>() + token * h, h * sizeof(float));
        } else if (!widened) {
          std::memcpy(rows.data_ptr<BF16>() + r * h, x.data_ptr<BF16>() + token * h, h * sizeof(BF16));
        } else {
          const BF16* in = x.data_ptr<BF16>() + token * h;
          float* o = rows.data_ptr<float>() + r * h;
          for (int64_t i = 0; i < h; ++i) o[i] = static_cast<float>(in[i]);
        }
      }
    });

    // 2. gate_up = rows W_gu^T per expert, [count, 2I] in x's dtype (float32 sums rounded to
    //    bfloat16, where the matmul widens, as panel_linear rounds them).
    const std::vector<Item> gu_items = items_for(local, gu_panels, h * rows.element_size(), threads);
    project(gu_items, rows, h, s.gate_up_data, widened ? sums : gate_up, gu_width);
    if (widened) gate_up.narrow(0, 0, count).copy_(sums.narrow(0, 0, count));

    // 3. silu(gate), in place: torch's own SiLU, called on each expert's rows as
    //    grouped_experts calls F.silu on them (the same shape, so the same vector and scalar
    //    lanes); then times up into `activated` [count, I], contiguous for the down matmul,
    //    rounded to the dtype as torch's multiply rounds it (and widened to float32 where the
    //    matmul widens).
    for (int64_t e = 0; e < experts; ++e) {
      if (local[e + 1] == local[e]) continue;
      at::Tensor gate = gate_up.narrow(0, local[e], local[e + 1] - local[e]).narrow(1, 0, inter);
      at::silu_(gate);
    }
    at::parallel_for(0, count, std::max<int64_t>(1, 16384 / inter), [&](int64_t begin, int64_t end) {
      const auto multiply = [&](const auto* gate, auto* target, auto* dtype) {
        using T = std::remove_pointer_t<decltype(dtype)>;
        const auto* up = gate + inter;
        int64_t i = 0;
        for (; i + W <= inter; i += W) S::store(target + i, S::rounded(S::mul(S::load(gate + i), S::load(up + i)), dtype));
        for (; i < inter; ++i)
          target[i] = static_cast<float>(static_cast<T>(static_cast<float>(gate[i]) * static_cast<float>(up[i])));
      };
      for (int64_t r = begin; r < end; ++r) {
        if (s.mode == Mode::kFloat32)
          multiply(gate_up.data_ptr<float>() + r * gu_width, activated.data_ptr<float>() + r * inter, (float*)nullptr);
        else if (widened)
          multiply(gate_up.data_ptr<BF16>() + r * gu_width, activated.data_ptr<float>() + r * inter, (BF16*)nullptr);
        else
          multiply(gate_up.data_ptr<BF16>() + r * gu_width, activated.data_ptr<BF16>() + r * inter, (BF16*)nullptr);
      }
    });

    // 4. down = activated W_d^T per expert, [count, H]: float32 sums (rounded to bfloat16 in
    //    step 5 where the matmul widens), or bfloat16 from the dot product.
    const std::vector<Item> down_items = items_for(local, down_panels, inter * activated.element_size(), threads);
    project(down_items, activated, inter, s.down_data, down, h);

    // 5. Each row scaled by its weight and added into its token, a token's rows in sorted
    //    (expert) order, from zero: out = ((0 + w1 y1) + w2 y2) ..., as grouped_experts'
    //    multiply and index_add round them: each product rounded to the dtype, the sums in
    //    float32 (how torch's index_add adds bfloat16 rows too), rounded once at the end.
    at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / (h * top_k)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        float* o = out.data_ptr<float>() + t * h;
        for (int64_t j = 0; j < top_k; ++j) {
          const int64_t row = rows_of[t * top_k + j];
          if (row < first || row >= last) continue;
          const float weight = weight_of[row];
          const auto add = [&](const auto* d, auto* dtype) {  // d: the row's down output; dtype: x's
            using T = std::remove_pointer_t<decltype(dtype)>;
            int64_t i = 0;
            for (; i + W <= h; i += W) {
              const S::V value = S::rounded(S::load(d + i), dtype);  // the widened matmul's rounding
              S::storeu(o + i, S::add(S::loadu(o + i), S::rounded(S::mul(value, S::set1(weight)), dtype)));
            }
            for (; i < h; ++i) {
              const float value = static_cast<float>(static_cast<T>(static_cast<float>(d[i])));
              o[i] = o[i] + static_cast<float>(static_cast<T>(value * weight));
            }
          };
          if (s.mode == Mode::kFloat32)
            add(down.data_ptr<float>() + (row - first) * h, (float*)nullptr);
          else if (widened)
            add(down.data_ptr<float>() + (row - first) * h, (BF16*)nullptr);
          else
            add(down.data_ptr<BF16>() + (row - first) * h, (BF16*)nullptr);
        }
      }
    });
    first = last;
  }
#endif
  return bf16 ? out.to(at::kBFloat16) : out;
}
