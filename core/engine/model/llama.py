"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over a flattened batch.

The batch is one row per scheduled token (no padding); attention goes through the
configured backend, which reads and writes the paged KV cache.

When the backend offers fused layer ops (`backend.layer_ops`, see LayerOps), the decoder
runs on them instead of torch's element-wise ops: RMSNorm with the residual add folded in,
rotary embedding in place on the QKV projection, SiLU-and-multiply. Fewer, larger ops: less
Python dispatch per layer and fewer temporaries. The results agree to float rounding
(the norms' sums of squares accumulate in another order). Such a backend may also run the
same ops for the whole decoder in one native call (`backend.decoder_forward`), which
answers None for the steps it leaves to this module, and a matmul that the
oneDNN-packed linear layers move to (`backend.panel_kernels`, see
servelab.model.packed_linear.use_panel_linears), and a matmul on quantized weight blocks
that quantized linear layers take (`backend.quant_kernels`, see
servelab.model.quantized_linear).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional as F

from servelab.contracts.attention import (LayerOpsBackend, NativeDecoderBackend, PanelKernelsBackend,
                                         QuantKernelsBackend)
from servelab.model.model_config import ModelConfig
from servelab.model.packed_linear import use_panel_linears
from servelab.model.quantized_linear import use_quant_kernels
from servelab.model.rope import RotaryEmbedding, apply_rotary


class LayerOps(Protocol):
    """Fused element-wise ops an attention backend may offer the model as `layer_ops`."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """residual += x, then x = rms_norm(residual), both in place."""

    def rotary_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                num_heads: int, head_dim: int) -> None:
        """Rotate the first `num_heads` heads of each row of `qkv` in place by the angles of
        its position (cos and sin: [max_positions, head_dim // 2])."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a [T, 2 * I] projection."""


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op; in float32 it rounds exactly as the composite below.
            return torch.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32, as the reference implementation does, then cast back.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], backend: Any, prepared: Any,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over every row; the output projection of `keep_rows` only (all when None)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # Q and K sit side by side in the projection: one rotation covers both.
        qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], prepared, self.scale)
        return self.o_proj(_rows(out.reshape(num_tokens, self.q_size), keep_rows))

    def forward_fused(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], backend: Any, prepared: Any,
                      ops: LayerOps, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        ops.rotary_(qkv, positions, rotary.cos, rotary.sin, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        out = backend.forward(q.view(num_tokens, self.num_heads, self.head_dim),
                              k.view(num_tokens, self.num_kv_heads, self.head_dim),
                              v.view(num_tokens, self.num_kv_heads, self.head_dim),
                              kv_cache[0], kv_cache[1], prepared, self.scale)
        return self.o_proj(_rows(out.reshape(num_tokens, self.q_size), keep_rows))


def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


# The MLP runs on at most this many rows at once: its intermediate activations are the
# step's largest (2 x intermediate_size a row), and on a 2,048-token prompt step they (with
# the linear kernels' scratch space) were most of the peak memory above the weights and the
# KV pool. 512 rows already run the linears at full speed.
MLP_ROWS_AT_ONCE = 512


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.rows_at_once = MLP_ROWS_AT_ONCE
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.by_row_chunks(x, self._forward_rows)

    def forward_fused(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        return self.by_row_chunks(x, lambda rows: self.down_proj(ops.silu_and_mul(self.gate_up_proj(rows))))

    def _forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def by_row_chunks(self, x: torch.Tensor, forward) -> torch.Tensor:
        """forward(x) computed `rows_at_once` rows at a time (the native decoder cuts the
        same way, so the two paths stay bit-identical)."""
        if x.shape[0] <= self.rows_at_once:
            return forward(x)
        out = x.new_empty(x.shape)  # the MLP maps hidden_size back to hidden_size
        for start in range(0, x.shape[0], self.rows_at_once):
            out[start:start + self.rows_at_once] = forward(x[start:start + self.rows_at_once])
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], backend: Any, prepared: Any,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`keep_rows`: past attention, only these rows are computed and returned (the last
        layer of a step that wants logits for a few rows: a prompt's last token)."""
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, backend, prepared, keep_rows)
        hidden = _rows(hidden, keep_rows) + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_fused(self, hidden: torch.Tensor | None, residual: torch.Tensor, positions: torch.Tensor,
                      rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor], backend: Any,
                      prepared: Any, ops: LayerOps,
                      keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the layer's output, which the next layer (or the final norm) adds to the
        residual stream, and that stream, updated in place (with `keep_rows`, a new tensor of
        those rows, as is the output). `hidden` is None for the first layer."""
        norm = self.input_layernorm
        if hidden is None:
            hidden = ops.rms_norm(residual, norm.weight, norm.eps)
        else:
            ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn.forward_fused(hidden, positions, rotary, kv_cache, backend, prepared, ops, keep_rows)
        residual = _rows(residual, keep_rows)
        norm = self.post_attention_layernorm
        ops.add_rms_norm_(hidden, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(hidden, ops), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head. `forward` returns logits only for `logits_indices`."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.config = config
        # Given its weight, the embedding skips its random init, whose meta-device version
        # (the loader builds on "meta") imports torch._dynamo: 0.7 s of start and ~100 MB.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = rotary
        self._panel_kernels = None  # the backend library whose matmul the packed linears moved to
        self._quant_kernels = None  # the backend library whose kernel the quantized linears took
        self.lora = None  # the LoRA adapters' state (servelab.model.lora_layers.install_lora), when served

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        backend: Any,
        prepared: Any,
        logits_indices: torch.Tensor,  # [S] rows of the batch whose next-token logits are wanted
        features: dict[int, torch.Tensor | None] | None = None,  # layer -> filled with its output stream [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [S, vocab] float32, hidden [S, hidden]
        has_panels, has_ops, has_decoder, has_quant = _capabilities(backend)
        panel_kernels = backend.panel_kernels if has_panels else None
        if panel_kernels is not None and self._panel_kernels is not panel_kernels:
            use_panel_linears(self, panel_kernels)
            self._panel_kernels = panel_kernels
            self._linears_moved()
        quant_kernels = backend.quant_kernels if has_quant else None
        if quant_kernels is not None and self._quant_kernels is not quant_kernels:
            use_quant_kernels(self, quant_kernels)
            self._quant_kernels = quant_kernels
        ops = backend.layer_ops if has_ops else None
        if ops is not None and self._fusable(input_ids):
            selected = None
            # the native decoder keeps no layer's output
            if has_decoder and features is None:
                selected = backend.decoder_forward(self, input_ids, positions, kv_caches, prepared, logits_indices)
            if selected is None:
                selected = self._forward_fused(input_ids, positions, kv_caches, backend, prepared, logits_indices, ops,
                                               features)
        else:
            hidden = self.embed_tokens(input_ids)
            cos, sin = self.rotary.tables(positions)
            keep_rows = _kept_rows(input_ids, logits_indices)
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                hidden = layer(hidden, cos, sin, kv_cache, backend, prepared, keep_rows if i == last else None)
                if features is not None and i in features:
                    features[i] = hidden
            selected = self.norm(hidden if keep_rows is not None else hidden[logits_indices])
        return self.lm_head(selected).float(), selected

    def forward_with_features(self, input_ids: torch.Tensor, positions: torch.Tensor,
                              kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any, prepared: Any,
                              logits_indices: torch.Tensor,
                              layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits as `forward`, and the residual stream after each decoder layer in `layers`
        (0-based, none the last) at every row: features [T, len(layers) * hidden], the
        layers side by side in the order given (what an EAGLE-style drafter reads)."""
        if any(not 0 <= layer < len(self.layers) - 1 for layer in layers):
            raise ValueError(f"feature layers {layers} must lie in 0..{len(self.layers) - 2} (the last layer "
                             f"computes only the rows whose logits are wanted)")
        features: dict[int, torch.Tensor | None] = dict.fromkeys(layers)
        logits, _ = self.forward(input_ids, positions, kv_caches, backend, prepared, logits_indices, features)
        return logits, torch.cat([features[layer] for layer in layers], dim=-1)

    def _fusable(self, input_ids: torch.Tensor) -> bool:
        return input_ids.device.type == "cpu" and self.embed_tokens.weight.dtype == self.rotary.cos.dtype

    def _linears_moved(self) -> None:
        """Called after the linear layers moved onto a library's panels (use_panel_linears):
        a subclass takes up what runs on them (a MoE model's native expert call)."""

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]], backend: Any, prepared: Any,
                      logits_indices: torch.Tensor, ops: LayerOps,
                      features: dict[int, torch.Tensor | None] | None = None) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)
        hidden = None
        keep_rows = _kept_rows(input_ids, logits_indices)
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer.forward_fused(hidden, residual, positions, self.rotary, kv_cache, backend,
                                                   prepared, ops, keep_rows if i == last else None)
            if features is not None and i in features:  # the stream is split here: the MLP's output + the residual
                features[i] = hidden + residual
        selected = hidden + residual if keep_rows is not None else hidden[logits_indices] + residual[logits_indices]
        return ops.rms_norm(selected, self.norm.weight, self.norm.eps)


_CAPABILITIES: dict[type, tuple[bool, bool, bool, bool]] = {}


def _capabilities(backend: Any) -> tuple[bool, bool, bool, bool]:
    """What a backend offers the model (panel matmul, layer ops, native decoder, quantized
    matmul), once per class."""
    kind = type(backend)
    if kind not in _CAPABILITIES:
        _CAPABILITIES[kind] = (isinstance(backend, PanelKernelsBackend), isinstance(backend, LayerOpsBackend),
                               isinstance(backend, NativeDecoderBackend), isinstance(backend, QuantKernelsBackend))
    return _CAPABILITIES[kind]


def _kept_rows(input_ids: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor | None:
    """The rows the last layer computes past its attention: only those whose logits are
    wanted, when that is fewer than all. A prompt wants one row, so a prompt step skips
    most of the last layer's linear work (its output projection and MLP for every other
    row): a tenth of the step's for an 8-layer model."""
    return logits_indices if logits_indices.shape[0] < input_ids.shape[0] else None
