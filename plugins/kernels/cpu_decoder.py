"""The model's whole decoder in one native call (cpu_decoder.cpp), for `cpu-paged` steps
whose every row the C++ attention kernel attends.

`native_decoder(kernels, model)` hands the C++ side the model's tensors once: the
embedding, each layer's norms and packed linear weights (the `packed_weight`, or the
`panels` once moved to the library's matmul, `bias` and `out_features` of
servelab.model.packed_linear.PackedLinear; for a QuantizedLinear of
servelab.model.quantized_linear (servelab.interfaces.QuantizedLinearLayer) its `blocks`, float32 `bias32` and block format), the
final norm, the rotary tables and how many rows the MLP takes at once. It answers None for
a model it cannot run (linears neither packed for oneDNN nor quantized with this library's
kernel, norms with different epsilons, weights and rotary tables of different dtypes),
which then keeps the Python path.

A model serving LoRA adapters (its linears wrapped, servelab.interfaces.LoRALinearLayer)
runs here too: the decoder holds each linear's base weights, and `NativeDecoder.forward`
hands it the layers' packed updates again whenever the adapter pool changed, then each
step's row slots.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from servelab.interfaces import LoRALinearLayer, LoRAServingModel, QuantizedLinearLayer


class NativeDecoder:
    """The library's Decoder for one model, and the adapter pool it last handed over."""

    def __init__(self, decoder: Any, model: torch.nn.Module) -> None:
        self.decoder = decoder
        self._lora_generation = -1
        self._linears = [_linears(layer) for layer in model.layers]
        self._serves_lora = isinstance(model, LoRAServingModel)  # a Protocol check: ~4 us, once, not each step

    def forward(self, model: torch.nn.Module, *args: Any) -> torch.Tensor:
        lora = model.lora if self._serves_lora else None
        if lora is None or lora.batch is None:
            return self.decoder.forward(*args)
        if self._lora_generation != lora.generation:
            for index, group in enumerate(self._linears):
                for position, linear in enumerate(group):
                    packed = linear.packed_updates() if isinstance(linear, LoRALinearLayer) else None
                    self.decoder.set_lora(index, position,
                                          *(attrs.astuple(packed, recurse=False) if packed else (None,) * 4))
            self._lora_generation = lora.generation
        return self.decoder.forward(*args, row_slots=lora.batch.token_slots)


def _linears(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _unwrapped(linear: torch.nn.Module) -> torch.nn.Module:
    return linear.base if isinstance(linear, LoRALinearLayer) else linear


def native_decoder(kernels: Any, model: torch.nn.Module) -> NativeDecoder | None:
    config = model.config
    norms = [model.norm] + [n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    linears = [tuple(_unwrapped(linear) for linear in _linears(layer)) for layer in model.layers]
    dtype = model.embed_tokens.weight.dtype
    if (model.embed_tokens.weight.device.type != "cpu"
            or any(not _runnable(linear, kernels) for group in linears for linear in group)
            or any(norm.eps != config.rms_norm_eps for norm in norms)
            or any(norm.weight.dtype != dtype for norm in norms)
            or model.rotary.cos.dtype != dtype):
        return None
    layers = [[layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
              + [tensor for linear in group for tensor in _weight_and_bias(linear)]
              for layer, group in zip(model.layers, linears)]
    attention = model.layers[0].self_attn
    # each layer: its 4 output widths, then each linear's block format (-1: a float weight)
    out_features = [[linear.out_features for linear in group] + [_format_id(linear) for linear in group]
                    for group in linears]
    return NativeDecoder(kernels.Decoder(layers, out_features, model.embed_tokens.weight.detach(),
                                         model.norm.weight.detach(), model.rotary.cos, model.rotary.sin,
                                         config.rms_norm_eps, attention.scale, attention.num_heads,
                                         attention.num_kv_heads, attention.head_dim, model.layers[0].mlp.rows_at_once),
                         model)


def _runnable(linear: torch.nn.Module, kernels: Any) -> bool:
    if isinstance(linear, QuantizedLinearLayer):
        return linear.kernels is kernels  # handed this library's kernel (before, the torch path)
    # on oneDNN's packing or the library's panels (not a layer still holding a plain weight)
    return hasattr(linear, "panels") and (linear.panels is not None or linear.packed_weight is not None)


def _weight_and_bias(linear: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(linear, QuantizedLinearLayer):
        return linear.blocks, linear.bias32
    return (linear.packed_weight if linear.panels is None else linear.panels), linear.bias


def _format_id(linear: torch.nn.Module) -> int:
    return linear.format_id if isinstance(linear, QuantizedLinearLayer) else -1
