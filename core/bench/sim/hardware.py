"""Accelerator profiles for the simulator: peak dense FLOP/s, memory bandwidth, memory."""

from __future__ import annotations

import attrs

from servelab.errors import ConfigError


@attrs.frozen
class Accelerator:
    name: str
    peak_flops: float  # dense FLOP/s at the simulated dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    step_overhead_s: float  # fixed cost per engine step (launches, host work)
    compute_efficiency: float = 0.7  # fraction of peak that GEMMs of serving sizes reach
    bandwidth_efficiency: float = 0.8


# Public spec-sheet numbers (bf16 dense, no sparsity); efficiencies are the usual
# fractions serving engines reach. "cpu-here" is this project's 2-core machine in
# float32 as fitted by `servelab bench --calibrate` on the embedded model: its
# "bandwidth" is an effective figure that absorbs MKL's poor small-batch GEMM
# efficiency, not the ~25 GB/s a large reduction reads at.
ACCELERATORS = {
    "h100": Accelerator("H100 SXM", 989e12, 3.35e12, 80e9, 4e-3),
    "h200": Accelerator("H200", 989e12, 4.8e12, 141e9, 4e-3),
    "a100": Accelerator("A100 80GB", 312e12, 2.04e12, 80e9, 5e-3),
    "l4": Accelerator("L4", 121e12, 0.3e12, 24e9, 5e-3),
    "cpu-here": Accelerator("2-core CPU (fp32, fitted)", 105e9, 3.2e9, 24e9, 0.0, 1.0, 1.0),
}


def accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown accelerator {name!r}; choose {', '.join(ACCELERATORS)}") from None
