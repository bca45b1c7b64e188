"""Linear layers whose weights stay quantized in memory: `[engine] weights = "int8" | "int4"`.

Decode reads every weight once a step, so its speed is the bytes a step reads. A weight
kept as GGML's blocks of 32 (the layouts a GGUF file holds) is 1.06 bytes a weight in
q8_0 and 0.63 in q4_1, against float32's 4. The blocks are multiplied by a native kernel
(plugins/kernels/cpu_quant.cpp, in the `cpu-paged` library). With `activations="int8"` (the
default, `[engine] quantized_activations`) each row of x is quantized per block of 32 to
int8 as llama.cpp's q8_0/q8_1 (`quantize_activations`) and the blocks are multiplied with
integer dot products (AVX-512 VNNI, AVX2, or scalar); with "float" the blocks are widened to
float32 in registers and multiplied by float32 x (the dequantized model's math). Until the
library is loaded, or where it cannot be built, a layer dequantizes its blocks with torch
for every call (same results to float rounding, slower than the float model: it reads and
writes the float weight too).

"int8" keeps the decoder's linear layers and the LM head as q8_0; "int4" keeps the
decoder's as q4_1 (a scale and a minimum per block: closer to the weights than q4_0's
scale alone) and the LM head as q8_0, as llama.cpp's 4-bit files keep their output tensor
at higher precision. The LM head keeps its float weight beside the blocks: the token
embedding (tied or not) and drafters read it as a plain tensor, but a step no longer does.

`QuantizedWeight.quantize` makes the blocks from a float weight (bit for bit as the
`gguf` package's reference quantizers); `QuantizedWeight.from_blocks` takes blocks made
elsewhere, such as a GGUF file's own (`quantize_linears(..., given=...)`).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import record_function

from servelab.logging_setup import get_logger
from servelab.model.memory import trim_heap

logger = get_logger(__name__)

BLOCK = 32
FORMAT_IDS = {"q8_0": 0, "q4_0": 1, "q4_1": 2}  # cpu_quant.cpp's `format` argument
INT8_ACTIVATIONS = 16  # added to a format id: x quantized to int8 blocks, integer dot products
INTERLEAVED = 32  # added as well: the blocks interleaved for them (interleave_blocks)
GROUP_COLUMNS = 16  # output columns an interleaved group holds
ACTIVATIONS = ("int8", "float")
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
# `[engine] weights` -> (decoder linears' format, LM head's format)
SCHEMES = {"int8": ("q8_0", "q8_0"), "int4": ("q4_1", "q8_0")}
_QUANTIZE_ROWS = 4096  # rows quantized at once: bounds the float temporaries of a large LM head


@attrs.frozen
class QuantizedWeight:
    """A [out_features, in_features] weight as rows of GGML blocks: `blocks` is uint8
    [out_features, ceil(in_features / 32) * BLOCK_BYTES[format]] (a row's last block padded
    past in_features; its padding is never multiplied)."""

    format: str
    blocks: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @classmethod
    def from_blocks(cls, format: str, blocks: torch.Tensor, in_features: int) -> "QuantizedWeight":
        """Blocks made elsewhere (a GGUF tensor's bytes, viewed as uint8 [rows, bytes a row])."""
        if format not in BLOCK_BYTES:
            raise ValueError(f"quantized weights take the block formats {', '.join(BLOCK_BYTES)}, got {format!r}")
        row_bytes = -(-in_features // BLOCK) * BLOCK_BYTES[format]
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
            raise ValueError(f"{format} blocks of a weight with {in_features} input features must be uint8 "
                             f"[rows, {row_bytes}], got {blocks.dtype} {list(blocks.shape)}")
        return cls(format, blocks.contiguous(), in_features)

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str) -> "QuantizedWeight":
        if format not in BLOCK_BYTES:
            raise ValueError(f"quantized weights take the block formats {', '.join(BLOCK_BYTES)}, got {format!r}")
        weight = weight.detach()
        rows = [_quantize_rows(weight[start:start + _QUANTIZE_ROWS], format)
                for start in range(0, weight.shape[0], _QUANTIZE_ROWS)]
        return cls(format, torch.cat(rows) if len(rows) > 1 else rows[0], weight.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features] the blocks stand for."""
        n = self.out_features
        blocks = self.blocks.view(n, -1, BLOCK_BYTES[self.format])
        d = _halves(blocks[..., 0:2])
        if self.format == "q8_0":
            values = d * blocks[..., 2:].view(torch.int8).float()
        else:
            nibbles = blocks[..., 4:] if self.format == "q4_1" else blocks[..., 2:]
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()
            values = d * q + (_halves(blocks[..., 2:4]) if self.format == "q4_1" else -8.0 * d)
        return values.reshape(n, -1)[:, :self.in_features]

    def concat(self, other: "QuantizedWeight") -> "QuantizedWeight":
        """This weight's rows followed by `other`'s (a fused projection of separate ones)."""
        if other.format != self.format or other.in_features != self.in_features:
            raise ValueError(f"cannot stack {other.format} rows of {other.in_features} features under "
                             f"{self.format} rows of {self.in_features}")
        return QuantizedWeight(self.format, torch.cat([self.blocks, other.blocks]), self.in_features)


def interleave_blocks(blocks: torch.Tensor, format: str) -> torch.Tensor:
    """GGML blocks [N, bytes a row] as the integer kernels read them (cpu_quant.cpp, "int8
    activations"): the same bytes moved, never re-quantized. Output columns in groups of 16
    (the last padded with zero rows), and per group and block of 32 inputs one record: the
    16 columns' d (float16) [q4_1: their m], then 4 bytes of each column in turn (q4: 4 steps
    of nibble bytes; q8_0: 8 steps of w ^ 0x80, the unsigned bytes a VNNI dot product takes).
    uint8 [N rounded up to 16, bytes a row]."""
    size = BLOCK_BYTES[format]
    n, row_bytes = blocks.shape
    per_row = row_bytes // size
    padded = F.pad(blocks, (0, 0, 0, -n % GROUP_COLUMNS))
    groups = padded.view(-1, GROUP_COLUMNS, per_row, size).transpose(1, 2)  # [group, block, column, bytes]
    scales = 4 if format == "q4_1" else 2
    parts = [groups[..., 0:2].flatten(-2)]
    if format == "q4_1":
        parts.append(groups[..., 2:4].flatten(-2))
    values = groups[..., scales:]
    if format == "q8_0":
        values = values ^ 0x80
    steps = values.shape[-1] // 4
    parts.append(values.unflatten(-1, (steps, 4)).transpose(2, 3).flatten(-3))  # [group, block, step, column, 4]
    return torch.cat(parts, dim=-1).reshape(padded.shape).contiguous()


def deinterleave_blocks(interleaved: torch.Tensor, format: str, out_features: int) -> torch.Tensor:
    """interleave_blocks undone: GGML blocks [out_features, bytes a row]."""
    size = BLOCK_BYTES[format]
    rows, row_bytes = interleaved.shape
    per_row = row_bytes // size
    records = interleaved.view(-1, per_row, GROUP_COLUMNS * size)  # [group, block, record]
    scales = 4 if format == "q4_1" else 2
    parts = [records[..., 0:32].unflatten(-1, (GROUP_COLUMNS, 2))]
    if format == "q4_1":
        parts.append(records[..., 32:64].unflatten(-1, (GROUP_COLUMNS, 2)))
    values = records[..., GROUP_COLUMNS * scales:]
    steps = (size - scales) // 4
    values = values.unflatten(-1, (steps, GROUP_COLUMNS, 4)).transpose(2, 3).flatten(-2)  # [group, block, column, bytes]
    if format == "q8_0":
        values = values ^ 0x80
    parts.append(values)
    blocks = torch.cat(parts, dim=-1).transpose(1, 2).reshape(rows, row_bytes)
    return blocks[:out_features].contiguous()


def _halves(raw: torch.Tensor) -> torch.Tensor:
    """float16 values stored as pairs of bytes, as float32 [..., 1]."""
    return raw.contiguous().view(torch.float16).float()


def _quantize_rows(weight: torch.Tensor, format: str) -> torch.Tensor:
    """gguf's reference quantizers (gguf.quants, as ggml-quants.c), in torch."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, -k % BLOCK))
    blocks = padded.view(n, -1, BLOCK)
    if format == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127
        scaled = blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d)
        # rounding half away from zero
        q = torch.sign(scaled) * (scaled.abs().floor() + (2 * (scaled.abs() - scaled.abs().floor())).floor())
        parts = [_half_bytes(d), q.to(torch.int8).view(torch.uint8)]
    elif format == "q4_0":
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = extreme / -8
        q = torch.trunc(blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d) + 8.5).clamp(0, 15).to(torch.uint8)
        parts = [_half_bytes(d), q[..., :16] | (q[..., 16:] << 4)]
    else:
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = (high - low) / 15
        q = torch.trunc((blocks - low) * torch.where(d == 0, torch.zeros_like(d), 1 / d) + 0.5)
        q = q.clamp(0, 15).to(torch.uint8)
        parts = [_half_bytes(d), _half_bytes(low), q[..., :16] | (q[..., 16:] << 4)]
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 as the int8 blocks the integer kernel multiplies stand for: per
    block of 32 along K (the last one padded with zeros), d = amax / 127 and q =
    round-half-even(x / d), returned as d * q (float32, x's shape). Bit for bit the kernel's
    quantization (the torch reference of its tests, and the torch path's)."""
    k = x.shape[-1]
    blocks = F.pad(x.float(), (0, -k % BLOCK)).unflatten(-1, (-1, BLOCK))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.round(blocks * torch.where(d == 0, torch.zeros_like(d), 1 / d))
    return (d * q).flatten(-2)[..., :k]


@runtime_checkable
class QuantKernels(Protocol):
    """A native library's matmul on quantized blocks (cpu_quant.cpp)."""

    def quant_linear(self, x: torch.Tensor, blocks: torch.Tensor, format: int,
                     bias: torch.Tensor | None = None, scalar: bool = False) -> torch.Tensor: ...

    def quant_path(self) -> str: ...


@runtime_checkable
class InterleavingQuantKernels(QuantKernels, Protocol):
    """A library whose int8-activation kernel reads the blocks interleaved (format id +
    INTERLEAVED, `interleave_blocks`) and takes `out_features=`; a layer handed one
    interleaves its blocks for it."""

    def quant_group_columns(self) -> int: ...


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held as a QuantizedWeight; float32 products and sums, the
    output in the input's dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 plain_weight: nn.Parameter | None = None, activations: str = "int8") -> None:
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantized weights multiply {' or '.join(ACTIVATIONS)} activations, got {activations!r}")
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.format = weight.format
        self.activations = activations
        self.format_id = FORMAT_IDS[weight.format] + (INT8_ACTIVATIONS if activations == "int8" else 0)
        self.register_buffer("blocks", weight.blocks, persistent=False)  # interleaved once handed kernels (int8)
        self.bias32 = None if bias is None else bias.detach().float().contiguous()
        if plain_weight is not None:  # the same Parameter: a tied embedding stays tied
            self.weight = plain_weight
        self.kernels: QuantKernels | None = None  # the library's kernel, once handed over (use_kernels)
        self._profile_name = "cpu_paged::quant_linear"

    @property
    def interleaved(self) -> bool:
        return bool(self.format_id & INTERLEAVED)

    @property
    def quantized_weight(self) -> QuantizedWeight:
        blocks = deinterleave_blocks(self.blocks, self.format, self.out_features) if self.interleaved else self.blocks
        return QuantizedWeight(self.format, blocks, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        if self.kernels is None:
            inputs = quantize_activations(x32) if self.activations == "int8" else x32
            y = F.linear(inputs, self.quantized_weight.dequantize(), self.bias32)
        elif torch.autograd._profiler_enabled():  # a library call is invisible to torch's profiler otherwise
            with record_function(self._profile_name):
                y = self._kernel(x32)
        else:
            y = self._kernel(x32)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def _kernel(self, x32: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            return self.kernels.quant_linear(x32, self.blocks, self.format_id, self.bias32,
                                             out_features=self.out_features)
        return self.kernels.quant_linear(x32, self.blocks, self.format_id, self.bias32)

    def use_kernels(self, kernels: QuantKernels, profile_name: str = "cpu_paged::quant_linear") -> None:
        """Multiply with the library's kernel from now on; with int8 activations and a
        library that reads them so, the blocks are interleaved for it first (the torch path
        reads them back through `quantized_weight`)."""
        if self.activations == "int8" and not self.interleaved and isinstance(kernels, InterleavingQuantKernels):
            self.blocks = interleave_blocks(self.blocks, self.format)
            self.format_id += INTERLEAVED
            trim_heap()  # the GGML copy just dropped
        self.kernels, self._profile_name = kernels, profile_name

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"activations={self.activations}")


def use_quant_kernels(root: nn.Module, kernels: Any) -> int:
    """Hand every QuantizedLinear under `root` the library's kernel; how many took it (none
    when the library has no such kernel)."""
    if not isinstance(kernels, QuantKernels):
        return 0
    moved = 0
    for name, module in root.named_modules():
        if isinstance(module, QuantizedLinear) and module.kernels is not kernels:
            module.use_kernels(kernels, "cpu_paged::quant_lm_head" if name.endswith("lm_head")
                               else "cpu_paged::quant_linear")
            moved += 1
    return moved


def quantize_linears(model: nn.Module, weights: str,
                     given: Mapping[str, QuantizedWeight] | None = None, activations: str = "int8") -> int:
    """Replace the decoder's linear layers and the LM head of a loaded model by
    QuantizedLinear layers as `weights` ("int8", "int4") says; returns how many.

    `given` maps a layer's name in the model (`layers.0.self_attn.qkv_proj`, `lm_head`) to
    blocks made elsewhere (a GGUF file's own, whose rows the caller has put in the model's
    order: a fused projection's parts stacked with QuantizedWeight.concat), used instead of
    quantizing that layer's float weight; their format may differ from the scheme's.
    `activations` ("int8", "float"): what the layers multiply their blocks by (QuantizedLinear).
    """
    if weights not in SCHEMES:
        raise ValueError(f"weights must be one of {', '.join(SCHEMES)} to quantize, got {weights!r}")
    decoder_format, head_format = SCHEMES[weights]
    given = dict(given or {})
    targets = [(parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name)
               for parent_name, parent in model.named_modules()
               for child_name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, child_name, name in targets:  # one layer at a time: each float weight is freed as it goes
        linear = getattr(parent, child_name)
        is_head = name == "lm_head"
        quantized = given.pop(name, None)
        if quantized is None:
            quantized = QuantizedWeight.quantize(linear.weight, head_format if is_head else decoder_format)
        elif (quantized.out_features, quantized.in_features) != (linear.out_features, linear.in_features):
            raise ValueError(f"blocks given for {name} are [{quantized.out_features}, {quantized.in_features}], "
                             f"the layer is [{linear.out_features}, {linear.in_features}]")
        setattr(parent, child_name, QuantizedLinear(quantized, linear.bias,
                                                    plain_weight=linear.weight if is_head else None,
                                                    activations=activations))
        trim_heap()  # the float weight just dropped
    if given:
        raise ValueError(f"blocks given for layers the model does not have: {', '.join(sorted(given))}")
    return len(targets)
