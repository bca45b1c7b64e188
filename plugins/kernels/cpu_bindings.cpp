// The Python module of the cpu-paged library: every function the other files define.
// pybind11 with torch's casters for tensors: <torch/extension.h> adds torch's whole C++
// frontend on top, 10 more seconds of this file's 27 to compile.
#include <torch/csrc/utils/pybind.h>

#include "cpu_kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_cache", &write_cache, "store new K/V rows at their cache slots");
  m.def("attend", &attend, "paged attention for the given sequences' query rows");
  m.def("tiles_prompts", &tiles_prompts, "whether prompt rows take the tiled path for this head dim");

  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x, then x = RMSNorm(residual), in place");
  m.def("rotary_", &rotary_, "rotary embedding of the leading heads of each row, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2I] gate_up projection");
  m.def("draw_from_logits", &draw_from_logits, "one token per row by inverse transform of softmax(logits / T)");

  m.def("panel_width", &panel_width, "output columns per packed panel (0: no vectorised linear here)");
  m.def("panel_dtypes", &panel_dtypes, "the weight dtypes pack_panels takes on this CPU");
  m.def("pack_panels", &pack_panels, "pack a [N, K] weight into panels for panel_linear");
  m.def("panel_linear", &panel_linear, "x W^T + b with W packed by pack_panels");

  pybind11::class_<PanelExperts>(m, "PanelExperts")
      .def("num_experts", &PanelExperts::num_experts)
      // No Python object is touched inside: other Python threads run meanwhile.
      .def("forward", &PanelExperts::forward, pybind11::arg("x"), pybind11::arg("weights"), pybind11::arg("ids"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("panel_experts",
        [](const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, int64_t hidden,
           int64_t intermediate) { return std::make_unique<PanelExperts>(gate_up, down, hidden, intermediate); },
        "a sparse MoE block's routed experts over their panel-packed gate_up and down weights, run in one call",
        pybind11::arg("gate_up"), pybind11::arg("down"), pybind11::arg("hidden"), pybind11::arg("intermediate"));

  m.def("quant_path", &quant_path, "the path quant_linear takes here: avx512, avx2 or scalar");
  m.def("quant_int_path", &quant_int_path, "the integer path int8 activations take here: avx512-vnni, avx2 or scalar");
  m.def("quant_group_columns", []() { return int64_t{16}; },
        "output columns a group of interleaved blocks holds (servelab.model.quantized_linear.interleave_blocks)");
  m.def("quant_linear", &quant_linear,
        "x W^T + b with W as GGML blocks (q8_0, q4_0, q4_1; +16: int8 activations; +32 more: interleaved)",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("format"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("scalar") = false, pybind11::arg("out_features") = -1);

  m.def("lora_add_", &lora_add_,
        "y[t] += each row's LoRA update (its adapter slot's, every part), packed as lora_layers.PackedUpdates; in place");

  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<const std::vector<std::vector<std::optional<at::Tensor>>>&,
                          const std::vector<std::vector<int64_t>>&, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          double, double, int64_t, int64_t, int64_t, int64_t>())
      // No Python object is touched inside: other Python threads run meanwhile.
      .def("forward", &Decoder::forward, pybind11::arg("input_ids"), pybind11::arg("positions"), pybind11::arg("caches"),
           pybind11::arg("block_tables"), pybind11::arg("query_start"), pybind11::arg("context_lens"),
           pybind11::arg("slot_mapping"), pybind11::arg("sequences"), pybind11::arg("logits_indices"),
           pybind11::arg("row_slots") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("set_lora", &Decoder::set_lora, "LoRA updates for one linear of one layer (all None: none)");
}
