// LoRA updates of a mixed-adapter batch, added in place to one layer's output in one call
// (Punica's SGMV: every adapter's segment of rows in the same pass, each at its own rank,
// none padded to the batch's largest).
//
// A layer's output columns are split into parts (a fused qkv projection: q, k, v), and each
// adapter slot may carry an update for each part: y[t, part] += scale * B (A x[t]), with
// A [r, K] and B [cols, r]. The updates of every slot and part come packed (lora_layers.py,
// PackedUpdates): `a_t` [S, W / 16, K, 16] holds each slot's A matrices transposed side by
// side (part after part, its columns past the last part zero up to a multiple of 16), in
// tiles of 16 columns stored one after another (a tile streams contiguously), `bt` each one's
// B transposed ([r, cols]), `table` [S, P, 5] says where: (first column of the slot's `a_t`,
// rank, offset in bt, first column of y, end column), rank 0 for none. Both products are
// then sweeps over contiguous columns: the shrink x[t] A^T broadcasts each x[t, k] against
// a row of `a_t`, the expand broadcasts each shrunk value against a row of B^T, with no
// horizontal sums.
//
// Rows of one slot go in blocks of up to 4 that read each row of `a_t` and of B^T once (a
// prompt's rows share their adapter). Each row's result depends on that row alone (its
// adapter, its x), never on which other rows share the step, its block or how the threads
// split the work: batches stay invariant. The shrink is split across threads by column
// tile, the expand by column chunk, so a single row of a decode step still uses every
// thread. Sums are float32; a bfloat16 layer gets its update rounded to bfloat16 and then
// added, as torch's index_add_ of a bfloat16 delta does.
#include "cpu_kernels.h"

// Fused multiply-adds here (the library is built with -ffp-contract=off so that the layer
// ops round as torch's do): the updates are compared with the reference within float
// rounding, and every row still takes the same instructions however it is batched.
#pragma GCC optimize("fp-contract=fast")

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kColumnChunk = 64;  // columns of one expand item: 4 rows' sums stay in registers
constexpr int kBlock = 4;             // rows of one slot that share each weight load
constexpr int kLanes = 16;
constexpr int kTileVectors = 4;       // vectors of shrunk columns one shrink item computes
constexpr int64_t kTableWidth = 5;  // a_t column, rank, bt_offset, col_start, col_end

// Sums live in vectors of kLanes floats (GCC's generic vectors: one zmm register on
// AVX-512, two ymm on AVX2), so a block's sums stay in registers across the whole loop.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// out[r][16 q + c] = sum over k < K of x[r][k] * tiles[q][k][c], for `vectors` tiles of 16
// columns ([K, 16] each, one after another), R rows at once, each row of a tile read once
// for all of them (the same per-row order whatever R is).
template <int R>
inline void shrink_rows(const float* const* x, const float* tiles, int64_t k_size, int vectors, float* const* out) {
  Lanes sums[R][kTileVectors] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    Lanes va[kTileVectors];
    for (int q = 0; q < kTileVectors; ++q)
      if (q < vectors) va[q] = load(tiles + (q * k_size + k) * kLanes);
    for (int r = 0; r < R; ++r) {
      const float v = x[r][k];
      for (int q = 0; q < kTileVectors; ++q)
        if (q < vectors) sums[r][q] += v * va[q];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < vectors; ++q) __builtin_memcpy(out[r] + q * kLanes, &sums[r][q], sizeof(Lanes));
}

// acc[r][c] = sum over j < rank of s[r][j] * b[j * cols + c], c < width, for R rows, each
// row of b read once for all of them (the same per-row order whatever R is).
template <int R>
inline void expand_rows(const float* const* s, const float* b, int64_t rank, int64_t cols, int64_t width,
                        float (*acc)[kColumnChunk]) {
  constexpr int kVectors = kColumnChunk / kLanes;
  const int64_t full = width / kLanes;  // whole vectors of columns; the rest one by one
  Lanes sums[R][kVectors] = {};
  for (int r = 0; r < R; ++r) std::fill(acc[r] + full * kLanes, acc[r] + width, 0.f);
  for (int64_t j = 0; j < rank; ++j) {
    const float* b_row = b + j * cols;
    Lanes vb[kVectors];
    for (int q = 0; q < kVectors; ++q)
      if (q < full) vb[q] = load(b_row + q * kLanes);
    for (int r = 0; r < R; ++r) {
      const float v = s[r][j];
      for (int q = 0; q < kVectors; ++q)
        if (q < full) sums[r][q] += v * vb[q];
      for (int64_t c = full * kLanes; c < width; ++c) acc[r][c] += v * b_row[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < full; ++q) __builtin_memcpy(acc[r] + q * kLanes, &sums[r][q], sizeof(Lanes));
}

template <typename F>
inline void with_rows(int count, const F& f) {
  switch (count) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

struct Block {  // up to kBlock active rows of one slot
  int64_t rows[kBlock];  // indices into the active rows
  int count;
  int64_t slot;
};

struct ShrinkItem {
  int64_t block;
  int64_t column;  // the tile's first column of the slot's `a_t` (and of each row's shrunk vector)
  int vectors;     // its width, in vectors of kLanes columns
};

struct ExpandItem {
  int64_t block;
  int64_t part;
  int64_t shrunk;  // where the part's r values start in each row's shrunk vector (its `a_t` column)
  int64_t col_begin, col_end;
};

template <typename scalar_t>
void add_updates(at::Tensor& y, const at::Tensor& x, const std::vector<int64_t>& active,
                 const std::vector<int64_t>& slot_of, const float* a_t, int64_t w, const float* bt, const int64_t* table,
                 const float* scales, int64_t num_parts) {
  const int64_t k = x.size(1), n_out = y.size(1), n = static_cast<int64_t>(active.size());
  const scalar_t* xs = x.data_ptr<scalar_t>();
  scalar_t* ys = y.data_ptr<scalar_t>();
  auto entry = [&](int64_t slot, int64_t part) { return table + (slot * num_parts + part) * kTableWidth; };

  // x's active rows in float32 (a bfloat16 layer converts them once, not once per A row)
  std::vector<float> converted;
  if constexpr (!std::is_same_v<scalar_t, float>) {
    converted.resize(n * k);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t c = 0; c < k; ++c) converted[i * k + c] = static_cast<float>(xs[active[i] * k + c]);
    });
  }
  auto x_row = [&](int64_t i) -> const float* {
    if constexpr (std::is_same_v<scalar_t, float>) return xs + active[i] * k;
    else return converted.data() + i * k;
  };

  // the rows by slot, in blocks of up to kBlock; each row's shrunk vector is its slot's
  // columns of `a_t`
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t l, int64_t r) { return slot_of[l] < slot_of[r]; });
  std::vector<Block> blocks;
  for (int64_t i : order) {
    if (blocks.empty() || blocks.back().slot != slot_of[i] || blocks.back().count == kBlock)
      blocks.push_back({{0, 0, 0, 0}, 0, slot_of[i]});
    blocks.back().rows[blocks.back().count++] = i;
  }
  std::vector<ShrinkItem> shrink;
  std::vector<ExpandItem> expand;
  // A few blocks (a decode step) split their shrink one vector of columns an item, so the
  // threads share even one row's; a column's sum is the same whatever its tile.
  const int64_t tile = static_cast<int64_t>(blocks.size()) >= 4 * at::get_num_threads() ? kTileVectors : 1;
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    int64_t used = 0;  // the slot's columns of `a_t` its parts use
    for (int64_t part = 0; part < num_parts; ++part) {
      const int64_t* e = entry(blocks[b].slot, part);
      if (e[1] == 0) continue;
      for (int64_t c = e[3]; c < e[4]; c += kColumnChunk)
        expand.push_back({b, part, e[0], c, std::min(c + kColumnChunk, e[4])});
      used = std::max(used, e[0] + e[1]);
    }
    const int64_t vectors = (used + kLanes - 1) / kLanes;
    for (int64_t v = 0; v < vectors; v += tile)
      shrink.push_back({b, v * kLanes, static_cast<int>(std::min<int64_t>(tile, vectors - v))});
  }

  std::vector<float> shrunk(n * w);
  at::parallel_for(0, static_cast<int64_t>(shrink.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const ShrinkItem& item = shrink[index];
      const Block& block = blocks[item.block];
      const float* rows[kBlock];
      float* out[kBlock];
      for (int r = 0; r < block.count; ++r) {
        rows[r] = x_row(block.rows[r]);
        out[r] = shrunk.data() + block.rows[r] * w + item.column;
      }
      const float* tiles = a_t + (block.slot * w + item.column) * k;  // the item's first tile
      with_rows(block.count, [&](auto count) {
        shrink_rows<decltype(count)::value>(rows, tiles, k, item.vectors, out);
      });
    }
  });

  at::parallel_for(0, static_cast<int64_t>(expand.size()), 1, [&](int64_t begin, int64_t end) {
    float acc[kBlock][kColumnChunk];
    for (int64_t index = begin; index < end; ++index) {
      const ExpandItem& item = expand[index];
      const Block& block = blocks[item.block];
      const int64_t* e = entry(block.slot, item.part);
      const int64_t rank = e[1], cols = e[4] - e[3], chunk = item.col_end - item.col_begin;
      const float* b = bt + e[2] + (item.col_begin - e[3]);
      const float* s[kBlock];
      for (int r = 0; r < block.count; ++r) s[r] = shrunk.data() + block.rows[r] * w + item.shrunk;
      with_rows(block.count, [&](auto count) { expand_rows<decltype(count)::value>(s, b, rank, cols, chunk, acc); });
      const float scale = scales[block.slot * num_parts + item.part];
      for (int r = 0; r < block.count; ++r) {
        scalar_t* out = ys + active[block.rows[r]] * n_out + item.col_begin;
        for (int64_t c = 0; c < chunk; ++c) {
          const scalar_t delta = static_cast<scalar_t>(acc[r][c] * scale);
          out[c] = static_cast<scalar_t>(static_cast<float>(out[c]) + static_cast<float>(delta));
        }
      }
    }
  });
}

}  // namespace

void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slots, const at::Tensor& a_t,
               const at::Tensor& bt, const at::Tensor& table, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be contiguous float32 or bfloat16 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0),
              "y must be contiguous [T, N] of x's dtype and rows");
  TORCH_CHECK(row_slots.dim() == 1 && row_slots.scalar_type() == at::kLong && row_slots.is_contiguous() &&
                  row_slots.size(0) == x.size(0),
              "row_slots must be int64 [T], one per row of x");
  TORCH_CHECK(table.dim() == 3 && table.size(2) == kTableWidth && table.scalar_type() == at::kLong &&
                  table.is_contiguous(),
              "table must be int64 [slots, parts, 5]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == table.size(0) * table.size(1),
              "scales must be float32 [slots, parts]");
  TORCH_CHECK(a_t.dim() == 4 && a_t.scalar_type() == at::kFloat && a_t.is_contiguous() &&
                  a_t.size(0) == table.size(0) && a_t.size(2) == x.size(1) && a_t.size(3) == kLanes,
              "a_t must be contiguous float32 [slots, W / ", kLanes, ", K, ", kLanes, "] with x's K");
  TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.is_contiguous(), "bt must be contiguous float32");
  const int64_t num_slots = table.size(0), num_parts = table.size(1), w = a_t.size(1) * kLanes;
  const int64_t* t = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_slots * num_parts; ++i) {
    const int64_t* e = t + i * kTableWidth;
    if (e[1] == 0) continue;
    const int64_t cols = e[4] - e[3];
    TORCH_CHECK(e[1] > 0 && e[0] >= 0 && e[0] + e[1] <= w, "table entry ", i, ": A columns outside at");
    TORCH_CHECK(e[3] >= 0 && cols > 0 && e[4] <= y.size(1), "table entry ", i, ": columns outside y");
    TORCH_CHECK(e[2] >= 0 && e[2] + e[1] * cols <= bt.numel(), "table entry ", i, ": B outside bt");
  }
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  std::vector<int64_t> active, slot_of;
  for (int64_t row = 0; row < row_slots.size(0); ++row) {
    const int64_t slot = slots[row];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "row ", row, " names slot ", slot, " of ", num_slots);
    active.push_back(row);
    slot_of.push_back(slot);
  }
  if (active.empty()) return;
  const float *at_data = a_t.data_ptr<float>(), *bt_data = bt.data_ptr<float>(), *scale_data = scales.data_ptr<float>();
  if (x.scalar_type() == at::kFloat)
    add_updates<float>(y, x, active, slot_of, at_data, w, bt_data, t, scale_data, num_parts);
  else
    add_updates<c10::BFloat16>(y, x, active, slot_of, at_data, w, bt_data, t, scale_data, num_parts);
}
