"""What a prefill/decode handoff costs: the KV bytes it moves (from the model's layout and
KV dtype) and the time a link takes to move them.

Only the prompt's full blocks move (servelab.disagg: the last partial block is computed
again on the decode side with the first token), so the bytes are
`full blocks x block_size x kv_bytes_per_token`; a quantized KV cache (int8, FP8) moves
one byte an element plus a scale per (token, KV head) row. The link profiles are
nominal: a vendor's per-direction bandwidth derated to what a large transfer achieves,
and a fixed cost per handoff (driver, RDMA or TCP setup). Print the table with

    python -m servelab.bench.sim.handoff --sim-model llama-3-8b --prompt-len 1024
"""

from __future__ import annotations

import argparse
from typing import Sequence as Seq

import attrs

from servelab.errors import ConfigError
from servelab.kv_sizing import DTYPE_BYTES
from servelab.model.model_config import ModelConfig


@attrs.frozen
class HandoffLink:
    name: str
    bandwidth: float  # bytes/s one handoff achieves
    latency_s: float  # fixed cost of one handoff

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth if nbytes else 0.0


HANDOFF_LINKS = {
    "nvlink4": HandoffLink("NVLink 4, GPU to GPU in one node (450 GB/s a direction)", 360e9, 10e-6),
    "pcie5": HandoffLink("PCIe 5.0 x16 through host memory (64 GB/s)", 45e9, 25e-6),
    "pcie4": HandoffLink("PCIe 4.0 x16 through host memory (32 GB/s)", 22e9, 25e-6),
    "infiniband-ndr": HandoffLink("InfiniBand NDR 400 Gb/s, GPUDirect RDMA", 45e9, 20e-6),
    "infiniband-hdr": HandoffLink("InfiniBand HDR 200 Gb/s, GPUDirect RDMA", 22e9, 20e-6),
    "ethernet-100g": HandoffLink("Ethernet 100 Gb/s, TCP", 10e9, 60e-6),
    "ethernet-25g": HandoffLink("Ethernet 25 Gb/s, TCP", 2.5e9, 80e-6),
}


def handoff_link(name: str) -> HandoffLink:
    try:
        return HANDOFF_LINKS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown handoff link {name!r}; choose {', '.join(HANDOFF_LINKS)}") from None


def handoff_bytes(model: ModelConfig, prompt_tokens: int, block_size: int, dtype: str = "bfloat16",
                  kv_cache_dtype: str = "auto") -> int:
    """KV bytes one request's handoff moves: its prompt's full blocks."""
    full_tokens = (prompt_tokens // block_size) * block_size
    return full_tokens * model.kv_bytes_per_token(DTYPE_BYTES[dtype], kv_cache_dtype)


def handoff_rows(model: ModelConfig, prompt_tokens: int, block_size: int, links: Seq[str],
                 kv_cache_dtypes: Seq[str] = ("auto", "fp8_e4m3")) -> list[dict]:
    """Per KV dtype and link: bytes per token, bytes per handoff and milliseconds."""
    rows = []
    for kv_cache_dtype in kv_cache_dtypes:
        nbytes = handoff_bytes(model, prompt_tokens, block_size, kv_cache_dtype=kv_cache_dtype)
        per_token = model.kv_bytes_per_token(DTYPE_BYTES["bfloat16"], kv_cache_dtype)
        for name in links:
            rows.append({"kv_cache_dtype": kv_cache_dtype, "link": name, "bytes_per_token": per_token,
                         "bytes": nbytes, "ms": handoff_link(name).seconds(nbytes) * 1e3})
    return rows


def main(argv: Seq[str] | None = None) -> int:
    from servelab.bench.sim.shapes import model_shape

    parser = argparse.ArgumentParser(description="the cost of one prefill/decode KV handoff per link")
    parser.add_argument("--sim-model", default="llama-3-8b")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    rows = handoff_rows(model_shape(args.sim_model), args.prompt_len, args.block_size, list(HANDOFF_LINKS))
    print(f"| KV dtype | link | KiB/token | MiB/handoff | ms/handoff |\n|---|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['kv_cache_dtype']} | {row['link']} | {row['bytes_per_token'] / 1024:.0f} | "
              f"{row['bytes'] / 2**20:.1f} | {row['ms']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
