"""Decode attention bandwidth of cupy-paged on one GPU, against the device's copy
bandwidth and torch SDPA over contiguous K/V of the same size.

Batch 64 decodes, context 4,096, head size 128, 64 query / 8 KV heads (GQA 8:1), bf16,
block size 16, block tables in shuffled physical order. The same K/V sit in the paged
cache and in contiguous [batch, kv_heads, context, head_dim] tensors, so the two outputs
are compared too. Achieved bandwidth = bytes of K, V and Q read / kernel time; the copy
bandwidth counts bytes read plus bytes written, as `cudaMemcpy` benchmarks do.

    python examples/gpu_bench_attention.py [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from servelab.interfaces import AttentionContext
from servelab.plugins.kernels.cupy_paged import CupyPagedAttention
from servelab.plugins.kernels.options import CupyPagedOptions
from servelab.testing.attention_batch import metadata_for


def cuda_time_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    """Median milliseconds of fn() over iters runs (CUDA events around each)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--partition-size", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    B, C, H, KVH, D, BS = args.batch, args.context, args.heads, args.kv_heads, args.head_dim, args.block_size
    torch.manual_seed(0)

    # --- the device's copy bandwidth (bytes read + written per second)
    copy_bytes = 2 << 30
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = cuda_time_ms(lambda: dst.copy_(src))
    copy_bw = 2 * copy_bytes / (copy_ms * 1e-3)
    del src, dst

    # --- the same K/V, contiguous and paged (shuffled blocks)
    blocks_per_seq = math.ceil(C / BS)
    num_blocks = B * blocks_per_seq
    keys = torch.randn((B, KVH, C, D), device=device, dtype=dtype)
    values = torch.randn((B, KVH, C, D), device=device, dtype=dtype)
    query = torch.randn((B, H, D), device=device, dtype=dtype)
    physical = torch.randperm(num_blocks, device=device)
    tables = physical.view(B, blocks_per_seq)
    context = AttentionContext(num_heads=H, num_kv_heads=KVH, head_dim=D, block_size=BS, num_blocks=num_blocks,
                               dtype=dtype, device=device)
    backend = CupyPagedAttention(CupyPagedOptions(partition_size=args.partition_size), context)
    shape = backend.kv_cache_shape()
    key_cache = torch.empty(shape, device=device, dtype=dtype)
    value_cache = torch.empty(shape, device=device, dtype=dtype)
    padded = blocks_per_seq * BS
    for cache, source in ((key_cache, keys), (value_cache, values)):
        if padded > C:
            source = F.pad(source, (0, 0, 0, padded - C))
        # [B, KVH, nblk*BS, D] -> [KVH, B*nblk, BS, D], then block i of sequence b goes to tables[b, i]
        cache[:, tables.flatten()] = source.permute(1, 0, 2, 3).reshape(KVH, B * blocks_per_seq, BS, D)
    metadata = metadata_for(tables.tolist(), [1] * B, [C] * B, BS, device)
    prepared = backend.prepare(metadata)
    scale = D ** -0.5
    new_key, new_value = keys[:, :, C - 1].contiguous(), values[:, :, C - 1].contiguous()  # rewritten in place

    def paged():
        return backend.forward(query, new_key, new_value, key_cache, value_cache, prepared, scale)

    q4 = query.view(B, H, 1, D)

    def sdpa():
        return F.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)

    got = paged().float()
    expected = sdpa().view(B, H, D).float()
    max_error = (got - expected).abs().max().item()

    paged_ms = cuda_time_ms(paged)
    sdpa_ms = cuda_time_ms(sdpa)
    bytes_read = 2 * B * KVH * C * D * dtype.itemsize + B * H * D * dtype.itemsize
    paged_bw = bytes_read / (paged_ms * 1e-3)
    sdpa_bw = bytes_read / (sdpa_ms * 1e-3)
    result = {
        "device": torch.cuda.get_device_name(),
        "shape": {"batch": B, "context": C, "heads": H, "kv_heads": KVH, "head_dim": D, "block_size": BS,
                  "dtype": "bfloat16", "partitions": prepared.plan.num_partitions},
        "bytes_read": bytes_read,
        "copy_ms": copy_ms, "copy_bandwidth_GBps": copy_bw / 1e9,
        "cupy_paged_ms": paged_ms, "cupy_paged_bandwidth_GBps": paged_bw / 1e9,
        "sdpa_contiguous_ms": sdpa_ms, "sdpa_contiguous_bandwidth_GBps": sdpa_bw / 1e9,
        "fraction_of_copy_bandwidth": paged_bw / copy_bw,
        "speed_vs_sdpa": sdpa_ms / paged_ms,
        "max_abs_error_vs_sdpa": max_error,
        "target_70pct_of_copy": paged_bw >= 0.7 * copy_bw,
        "target_not_slower_than_sdpa": paged_ms <= sdpa_ms,
        "correct": max_error < 2e-2,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
