// What the cpu-paged library's translation units offer each other and cpu_bindings.cpp,
// the one file that includes pybind11 and torch's Python headers (~8 s of compiling a file,
// the ATen headers below ~2 s).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// The models' dtypes (float32, bfloat16, float16) only: each one more is another set of
// kernels to compile, in every CPU build.
#define DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)              \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// cpu_paged.cpp
void write_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                 const at::Tensor& slot_mapping);
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
            const at::Tensor& sequences, double scale, at::Tensor& out);
bool tiles_prompts(int64_t head_dim);

// cpu_layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary_(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
             int64_t num_heads, int64_t head_dim);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
// The same into `out` [T, I] (contiguous, the input's dtype).
void silu_and_mul_out(const at::Tensor& gate_up, at::Tensor& out);

// cpu_sampling.cpp: one token per row of float32 logits, drawn by inverse transform from
// softmax(logits * inverse_temperature) with the row's uniform number in [0, 1).
at::Tensor draw_from_logits(const at::Tensor& logits, const at::Tensor& inverse_temperature, const at::Tensor& uniform);

// cpu_linear.cpp
int64_t panel_width();
std::vector<std::string> panel_dtypes();
at::Tensor pack_panels(const at::Tensor& weight);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t out_features);
// The same into `out` (x's dtype, contiguous, x's shape with out_features last).
void panel_linear_out(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                      int64_t out_features, at::Tensor& out);

// cpu_moe.cpp: a sparse MoE block's routed experts in one call, each expert's gate_up
// ([2 * intermediate, hidden]) and down ([hidden, intermediate]) weights as pack_panels made
// them, all of one dtype (see there).
class PanelExperts {
 public:
  PanelExperts(const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, int64_t hidden,
               int64_t intermediate);
  ~PanelExperts();
  int64_t num_experts() const;
  // sum_k weights[t, k] * expert ids[t, k] (x[t]) for every row t of x [T, hidden]: [T, hidden].
  at::Tensor forward(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// cpu_quant.cpp
std::string quant_path();
std::string quant_int_path();
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                        const std::optional<at::Tensor>& bias, bool scalar, int64_t out_features = -1);
// The same into `out` (float32, contiguous, x's shape with out_features last).
void quant_linear_out(const at::Tensor& x, const at::Tensor& blocks, int64_t format,
                      const std::optional<at::Tensor>& bias, bool scalar, int64_t out_features, at::Tensor& out);

// cpu_lora.cpp
void lora_add_(at::Tensor& y, const at::Tensor& x, const at::Tensor& row_slots, const at::Tensor& a_t,
               const at::Tensor& bt, const at::Tensor& table, const at::Tensor& scales);

// cpu_decoder.cpp: a Llama decoder's whole forward in one call (see there).
class Decoder {
 public:
  Decoder(const std::vector<std::vector<std::optional<at::Tensor>>>& layers,
          const std::vector<std::vector<int64_t>>& out_features, at::Tensor embedding, at::Tensor final_norm,
          at::Tensor cos, at::Tensor sin, double eps, double scale, int64_t num_heads, int64_t num_kv_heads,
          int64_t head_dim, int64_t mlp_rows_at_once);
  ~Decoder();
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const std::vector<at::Tensor>& caches,
                     const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& context_lens,
                     const at::Tensor& slot_mapping, const at::Tensor& sequences, const at::Tensor& logits_indices,
                     const std::optional<at::Tensor>& row_slots) const;
  // LoRA updates packed as lora_layers.PackedUpdates for linear `linear` (0 qkv, 1 o, 2 gate_up,
  // 3 down) of layer `layer`; all four None: none.
  void set_lora(int64_t layer, int64_t linear, const std::optional<at::Tensor>& a, const std::optional<at::Tensor>& bt,
                const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& scales);

 private:
  struct State;
  std::unique_ptr<State> state_;
};
