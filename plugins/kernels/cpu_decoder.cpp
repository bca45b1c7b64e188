// A Llama decoder's whole forward in one native call, for steps whose every row the
// `cpu-paged` kernel attends (decodes, verified drafts, short chunks).
//
// It issues exactly the ops of the model's fused Python path (servelab.model.llama,
// `_forward_fused`): the same linear kernels on the same packed weights, the same layer ops
// and the same attention kernel, in the same order, so its results are bit-identical to
// that path. What it removes is the Python between them: module calls, argument parsing
// and dispatch for ~13 ops a layer, which at small batches cost as much as the layer's
// arithmetic. With LoRA adapters served, each linear adds its rows' updates with the same
// kernel the Python path's LoRALinear calls (cpu_lora.cpp), over the same packed updates.
#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <optional>
#include <string_view>
#include <vector>

namespace {

using Optional = std::optional<at::Tensor>;

// y = x W^T + b through oneDNN with W pre-packed (servelab.model.packed_linear.PackedLinear).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed_weight, const Optional& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&, std::string_view,
                            c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(), std::string_view());
}

// Every adapter slot's LoRA updates of one linear, as lora_layers.PackedUpdates lays them out.
struct LoRAUpdates {
  at::Tensor a, bt, table, scales;
};

struct Linear {
  // packed for oneDNN (2-D), the panels of cpu_linear.cpp (3-D or 4-D), or quantized blocks
  // (uint8, `format` >= 0; servelab.model.quantized_linear, whose bias is float32)
  at::Tensor weight;
  Optional bias;
  int64_t out_features;
  int64_t format = -1;
  std::optional<LoRAUpdates> lora;
  // x W^T + b into `out` [rows, out_features] of x's dtype (contiguous), plus the rows' LoRA
  // updates. row_slots: each row's adapter slot (-1: the base model), or undefined for a step
  // without adapters. Quantized blocks with float32 x and panels write into `out` directly;
  // the other paths make their result, copied into `out`.
  void into(const at::Tensor& x, const at::Tensor& row_slots, at::Tensor& out) const {
    if (format >= 0 && x.scalar_type() == at::kFloat)
      quant_linear_out(x, weight, format, bias, false, out_features, out);
    else if (format < 0 && weight.dim() > 2)
      panel_linear_out(x, weight, bias, out_features, out);
    else
      out.copy_(base(x));
    if (lora && row_slots.defined()) lora_add_(out, x, row_slots, lora->a, lora->bt, lora->table, lora->scales);
  }

 private:
  at::Tensor base(const at::Tensor& x) const {
    if (format >= 0) {  // as QuantizedLinear.forward: float32 in and out, then the input's dtype
      if (x.scalar_type() == at::kFloat) return quant_linear(x, weight, format, bias, false, out_features);
      return quant_linear(x.to(at::kFloat), weight, format, bias, false, out_features).to(x.scalar_type());
    }
    return weight.dim() > 2 ? panel_linear(x, weight, bias, out_features) : packed_linear(x, weight, bias);
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm;
  Linear qkv, o, gate_up, down;
};

class Model {
 public:
  // layers[i] = [input norm, post-attention norm, qkv, qkv bias, o, o bias, gate_up, gate_up bias,
  // down, down bias] with None for an absent bias; the linears' weights are packed.
  // out_features[i] = the output widths of layer i's qkv, o, gate_up and down, optionally
  // followed by each one's quantized block format (-1: a float weight).
  // mlp_rows_at_once: the MLP runs on at most this many rows at once, as the Python path does
  // (servelab.model.llama.MLP.by_row_chunks).
  Model(const std::vector<std::vector<Optional>>& layers, const std::vector<std::vector<int64_t>>& out_features,
          at::Tensor embedding, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, double eps, double scale,
          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t mlp_rows_at_once)
      : embedding_(std::move(embedding)), final_norm_(std::move(final_norm)), cos_(std::move(cos)),
        sin_(std::move(sin)), eps_(eps), scale_(scale), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        head_dim_(head_dim), mlp_rows_at_once_(mlp_rows_at_once) {
    TORCH_CHECK(mlp_rows_at_once > 0, "mlp_rows_at_once must be positive");
    TORCH_CHECK(out_features.size() == layers.size(), "one list of output widths per layer");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      const auto& widths = out_features[i];
      TORCH_CHECK(t.size() == 10, "a layer is 10 tensors (norms, then each linear's weight and bias)");
      TORCH_CHECK(widths.size() == 4 || widths.size() == 8,
                  "a layer has 4 linears' output widths (and optionally their block formats)");
      for (int j : {0, 1, 2, 4, 6, 8}) TORCH_CHECK(t[j].has_value(), "layer tensor ", j, " is missing");
      auto format = [&](int j) { return widths.size() == 8 ? widths[4 + j] : int64_t{-1}; };
      layers_.push_back(Layer{*t[0], *t[1], {*t[2], t[3], widths[0], format(0)}, {*t[4], t[5], widths[1], format(1)},
                              {*t[6], t[7], widths[2], format(2)}, {*t[8], t[9], widths[3], format(3)}});
    }
    TORCH_CHECK(!layers_.empty(), "a decoder has at least one layer");
  }

  // Linear `linear` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer` adds these LoRA updates
  // from now on (none: it adds none).
  void set_lora(int64_t layer, int64_t linear, std::optional<LoRAUpdates> updates) {
    TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && linear >= 0 && linear < 4,
                "no linear ", linear, " in layer ", layer);
    Layer& l = layers_[layer];
    Linear* linears[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    linears[linear]->lora = std::move(updates);
  }

  // The final-normed hidden states of the rows in logits_indices. caches: per layer, key then value.
  // row_slots: each row's LoRA adapter slot, or undefined for a step of the base model alone.
  // Every layer writes its outputs into buffers made once per call, whose q/k/v views are made
  // once too: making ~17 tensors a layer instead was about a tenth of an int4 model's token at
  // one row (docs/performance.md).
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const std::vector<at::Tensor>& caches,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
                     const at::Tensor& slot_mapping, const at::Tensor& sequences, const at::Tensor& logits_indices,
                     at::Tensor row_slots) const {
    TORCH_CHECK(caches.size() == 2 * layers_.size(), "one key and one value cache per layer");
    const int64_t tokens = input_ids.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const auto options = embedding_.options();
    at::Tensor qkv = at::empty({tokens, q_size + 2 * kv_size}, options);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads_, head_dim_});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads_, head_dim_});
    at::Tensor attended = at::empty({tokens, num_heads_, head_dim_}, options);
    const at::Tensor attended_rows = attended.view({tokens, q_size});
    at::Tensor hidden = at::empty({tokens, embedding_.size(1)}, options);  // o's output, then the MLP's
    const int64_t mlp_rows = std::min(tokens, mlp_rows_at_once_), intermediate = layers_[0].gate_up.out_features / 2;
    at::Tensor gate_up = at::empty({mlp_rows, 2 * intermediate}, options);
    at::Tensor activated = at::empty({mlp_rows, intermediate}, options);
    at::Tensor residual = embedding_.index_select(0, input_ids);
    const at::Tensor normed = rms_norm(residual, layers_[0].input_norm, eps_);
    // As the Python path: past the last layer's attention, only the rows whose logits are wanted.
    const bool keep_some = logits_indices.size(0) < tokens;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i > 0) add_rms_norm_(hidden, residual, layer.input_norm, eps_);
      layer.qkv.into(i == 0 ? normed : hidden, row_slots, qkv);
      rotary_(qkv, positions, cos_, sin_, num_heads_ + num_kv_heads_, head_dim_);
      at::Tensor key_cache = caches[2 * i], value_cache = caches[2 * i + 1];
      write_cache(k, v, key_cache, value_cache, slot_mapping);
      attend(q, key_cache, value_cache, block_tables, query_start, context_lens, sequences, scale_, attended);
      at::Tensor rows = attended_rows;
      if (keep_some && i + 1 == layers_.size()) {
        rows = rows.index_select(0, logits_indices);
        residual = residual.index_select(0, logits_indices);
        if (row_slots.defined()) row_slots = row_slots.index_select(0, logits_indices);
        hidden = hidden.narrow(0, 0, rows.size(0));
      }
      layer.o.into(rows, row_slots, hidden);
      add_rms_norm_(hidden, residual, layer.post_attention_norm, eps_);
      mlp_(layer, hidden, row_slots, gate_up, activated);
    }
    at::Tensor selected = keep_some ? hidden + residual
                                    : hidden.index_select(0, logits_indices) + residual.index_select(0, logits_indices);
    return rms_norm(selected, final_norm_, eps_);
  }

 private:
  // x = down(silu(gate) * up) of x, in place, at most mlp_rows_at_once_ rows at a time as the
  // Python path does (each chunk of x is read whole by gate_up before down writes over it),
  // through the buffers gate_up and activated (as many rows as a chunk).
  void mlp_(const Layer& layer, at::Tensor& x, const at::Tensor& row_slots, at::Tensor& gate_up,
            at::Tensor& activated) const {
    const int64_t rows = x.size(0), chunk = gate_up.size(0);
    for (int64_t start = 0; start < rows; start += chunk) {
      const int64_t count = std::min(chunk, rows - start);
      const at::Tensor slots = row_slots.defined() ? row_slots.narrow(0, start, count) : row_slots;
      at::Tensor part = count == rows ? x : x.narrow(0, start, count);
      at::Tensor gate_up_part = count == chunk ? gate_up : gate_up.narrow(0, 0, count);
      at::Tensor activated_part = count == chunk ? activated : activated.narrow(0, 0, count);
      layer.gate_up.into(part, slots, gate_up_part);
      silu_and_mul_out(gate_up_part, activated_part);
      layer.down.into(activated_part, slots, part);
    }
  }

  std::vector<Layer> layers_;
  at::Tensor embedding_, final_norm_, cos_, sin_;
  double eps_, scale_;
  int64_t num_heads_, num_kv_heads_, head_dim_, mlp_rows_at_once_;
};

}  // namespace

struct Decoder::State {
  Model model;
};

Decoder::Decoder(const std::vector<std::vector<std::optional<at::Tensor>>>& layers,
                 const std::vector<std::vector<int64_t>>& out_features, at::Tensor embedding, at::Tensor final_norm,
                 at::Tensor cos, at::Tensor sin, double eps, double scale, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t mlp_rows_at_once)
    : state_(new State{Model(layers, out_features, std::move(embedding), std::move(final_norm), std::move(cos),
                             std::move(sin), eps, scale, num_heads, num_kv_heads, head_dim, mlp_rows_at_once)}) {}

Decoder::~Decoder() = default;

void Decoder::set_lora(int64_t layer, int64_t linear, const std::optional<at::Tensor>& a,
                       const std::optional<at::Tensor>& bt, const std::optional<at::Tensor>& table,
                       const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(a.has_value() == bt.has_value() && a.has_value() == table.has_value() &&
                  a.has_value() == scales.has_value(),
              "a LoRA update is all four tensors or none");
  state_->model.set_lora(layer, linear, a ? std::optional<LoRAUpdates>(LoRAUpdates{*a, *bt, *table, *scales})
                                          : std::nullopt);
}

at::Tensor Decoder::forward(const at::Tensor& input_ids, const at::Tensor& positions,
                            const std::vector<at::Tensor>& caches, const at::Tensor& block_tables,
                            const at::Tensor& query_start, const at::Tensor& context_lens,
                            const at::Tensor& slot_mapping, const at::Tensor& sequences,
                            const at::Tensor& logits_indices, const std::optional<at::Tensor>& row_slots) const {
  return state_->model.forward(input_ids, positions, caches, block_tables, query_start, context_lens, slot_mapping,
                               sequences, logits_indices, row_slots ? *row_slots : at::Tensor());
}
