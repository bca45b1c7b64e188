"""Quantized KV cache rows in torch: the reference every backend's cache writes and reads match.

A row is one (token, KV head) of K or V: its head_dim values x are stored as
q = x / scale with scale = max|x| / QUANTIZED_KV_MAX[kind] (int8: rounded half to even and
clamped to +-127; fp8: rounded to nearest even by the cast, clamped to the format's largest
finite value), followed by the scale as four float32 bytes (layout: servelab.interfaces.
QuantizedKVBackend). A row of zeros has scale 0. The arithmetic is the C++ kernels' own
(cpu_paged.cpp) and the CUDA kernels' (kv_quant.cuh), so all write the same bytes, and it
is the same on the CPU and on CUDA (the scale is a true division on both).
"""

from __future__ import annotations

import torch

from servelab.interfaces import QUANTIZED_KV_MAX, QUANTIZED_KV_TORCH_DTYPE, kv_row_elements, kv_scale_offset


def storage_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch dtype a quantized cache is allocated in."""
    return getattr(torch, QUANTIZED_KV_TORCH_DTYPE[kv_cache_dtype])


def quantize_rows(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """[..., head_dim] values -> [..., kv_row_elements] bytes (uint8) of their quantized rows."""
    head_dim = x.shape[-1]
    limit = QUANTIZED_KV_MAX[kv_cache_dtype]
    values = x.float()
    # Divided by a tensor on the same device, not a Python number: torch on CUDA turns
    # division by a host scalar into multiplication by its reciprocal, which differs in
    # the last bit for some rows, and the reference must quantize alike on every device.
    peak = values.abs().amax(dim=-1, keepdim=True)
    scale = peak / peak.new_tensor(limit)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    scaled = (values * inverse).clamp_(-limit, limit)
    if kv_cache_dtype == "int8":
        elements = torch.round(scaled).to(torch.int8)
    else:
        elements = scaled.to(storage_dtype(kv_cache_dtype))
    rows = x.new_zeros((*x.shape[:-1], kv_row_elements(head_dim, kv_cache_dtype)), dtype=torch.uint8)
    rows[..., :head_dim] = elements.view(torch.uint8)
    offset = kv_scale_offset(head_dim)
    rows[..., offset:] = scale.contiguous().view(torch.uint8)
    return rows


def dequantize_rows(rows: torch.Tensor, head_dim: int, kv_cache_dtype: str,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., kv_row_elements] cache rows (any one-byte dtype) -> [..., head_dim] values in `dtype`."""
    raw = rows.view(torch.uint8)
    offset = kv_scale_offset(head_dim)
    scale = raw[..., offset:offset + 4].contiguous().view(torch.float32)
    elements = raw[..., :head_dim].contiguous().view(storage_dtype(kv_cache_dtype))
    return (elements.float() * scale).to(dtype)


def write_rows(cache: torch.Tensor, slot_mapping: torch.Tensor, new: torch.Tensor, kv_cache_dtype: str) -> None:
    """Quantize `new` ([T, kv_heads, head_dim]) into `cache` ([kv_heads, blocks, block_size, row]) at the slots."""
    num_kv_heads, row = cache.shape[0], cache.shape[3]
    rows = quantize_rows(new, kv_cache_dtype)  # [T, kvh, row]
    cache.view(torch.uint8).view(num_kv_heads, -1, row).index_copy_(1, slot_mapping, rows.transpose(0, 1))
