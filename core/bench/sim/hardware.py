"""Accelerator profiles for the simulator: peak dense FLOP/s, memory bandwidth, memory,
and the efficiencies and overheads a serving engine reaches on them.

Peaks are public spec-sheet numbers (bf16 dense, no sparsity); memory is the device's
nominal GiB. The efficiencies and overheads of the H100, H200 and A100 profiles were
fitted to TensorRT-LLM's published Llama-3.1-8B measurements (offline throughput, v0.15,
and online serving latency under Poisson load, v0.14; see docs/bench.md, "Simulator
fidelity"), so each GPU profile stands for a TensorRT-LLM-like engine: fused kernels,
decode steps replayed from CUDA graphs, in-flight batching of prefills with decodes.
`NAME-eager` is the same device under an engine without CUDA graphs, launching every
kernel from PyTorch each step."""

from __future__ import annotations

import math
import random

import attrs

from servelab.errors import ConfigError

GIB = 2**30


STEP_FEATURES = ("step", "sequence", "prefill_gemm_flop", "decode_gemm_flop", "prefill_attention_flop",
                 "decode_kv_byte", "lm_head_flop")


@attrs.frozen
class StepTerms:
    """The additive step-time form `servelab bench --calibrate` fits to a machine: seconds
    per step, per sequence in the batch (the engine's Python work), per GEMM FLOP of
    prompt tokens and, separately, of decode tokens (small GEMMs run far below the
    large ones' rate), per FLOP of prefill attention (which grows with the context each
    chunk attends to), per KV byte decode attention reads (the context of each decoding
    sequence) and per LM-head FLOP (the rows sampled)."""

    step_s: float = 0.0
    sequence_s: float = 0.0
    prefill_gemm_flop_s: float = 0.0
    decode_gemm_flop_s: float = 0.0
    prefill_attention_flop_s: float = 0.0
    decode_kv_byte_s: float = 0.0
    lm_head_flop_s: float = 0.0

    def seconds(self, features: dict[str, float]) -> float:
        return sum(getattr(self, f"{name}_s") * features[name] for name in STEP_FEATURES)

    @classmethod
    def from_coefficients(cls, coefficients) -> "StepTerms":
        return cls(**{f"{name}_s": float(c) for name, c in zip(STEP_FEATURES, coefficients)})


@attrs.frozen
class Accelerator:
    name: str
    peak_flops: float  # dense FLOP/s at the simulated dtype
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    step_overhead_s: float  # host work every step pays (scheduling, sampling sync, bookkeeping)
    compute_efficiency: float = 0.7  # fraction of peak large GEMMs reach
    bandwidth_efficiency: float = 0.8  # fraction of peak bandwidth streaming kernels reach
    attention_efficiency: float | None = None  # fraction of peak prefill attention reaches (None: as GEMMs)
    kv_bandwidth_efficiency: float | None = None  # fraction of peak bandwidth decode attention reads KV at
    gemm_half_tokens: float = 0.0  # rows at which a GEMM reaches half its large-M efficiency (0: flat)
    kernel_launch_s: float = 0.0  # host time to launch one kernel when not replaying a CUDA graph
    cuda_graphs: bool = False  # decode-only steps replay a captured graph: no per-kernel launches
    terms: StepTerms | None = None  # a fitted additive form instead of per-kernel rooflines (`--calibrate`)
    reserved_bytes: float = 0.0  # device memory neither weights nor KV (runtime context, activations)
    behaves_like: str = ""  # which engine's behaviour the profile represents
    interconnect: str = "pcie4"  # how a machine of several of these links them (INTERCONNECTS)
    # The host KV tier ([kv_offload]): the link device <-> host memory (INTERCONNECTS) and
    # the host memory one device may use for it (0: the tier is not simulated on it).
    host_link: str = "pcie4"
    host_memory_bytes: float = 0.0
    threads: int = 0  # a CPU profile: the torch threads the engine ran with when it was fitted (0: not a CPU)
    # A served CPU profile (servelab.bench.sim.latency_check fits these): host seconds to admit one
    # request, charged to the step that starts its prompt; the measured residuals of served
    # steps around the fit (the machine's own stalls among them), one drawn per simulated step;
    # and what the first step after the engine waited for an arrival costs beyond the fit
    # (threads and caches waking: the median of those measured).
    admission_s: float = 0.0
    step_noise_s: tuple[float, ...] = ()
    wake_s: float = 0.0
    # The wake-up as a function of the wait before it, a + b ln(wait in seconds), where
    # fitted (wake_log = (a, b)); `wake_s` alone otherwise.
    wake_log: tuple[float, float] | None = None
    # Where fitted, the wake-ups' spread about that line: per group of waits (the fit's
    # groups), the group's longest wait and its wake-ups less the line, one drawn per
    # simulated wake-up in the group its wait falls in.
    wake_spread: tuple[tuple[float, tuple[float, ...]], ...] = ()
    # Reading one LoRA adapter from disk on the host (servelab.model.lora_adapter.load_adapter:
    # the safetensors file loaded, each tensor checked and converted), which stalls the loop
    # that admits requests: seconds a tensor plus bytes at a read bandwidth. Measured on the
    # 2-core CPU (tiny-random's bench adapters, 2.4-19 MB: 5-16 ms); taken to be the same
    # host work in front of a GPU.
    adapter_read_tensor_s: float = 40e-6
    adapter_read_bandwidth: float = 1.75e9

    def wake_after(self, wait_s: float, draws: random.Random | None = None) -> float:
        """What the first step after a wait of `wait_s` seconds costs beyond its work
        (with `draws`, one of the fitted spread's residuals added)."""
        if self.wake_log is None or wait_s <= 0:
            return self.wake_s
        a, b = self.wake_log
        seconds = a + b * math.log(wait_s)
        if draws is not None and self.wake_spread:
            residuals = next((group for longest, group in self.wake_spread if wait_s <= longest),
                             self.wake_spread[-1][1])
            seconds += draws.choice(residuals)
        return max(0.0, seconds)

    @property
    def per_kernel(self) -> bool:
        """Costed kernel class by kernel class (the GPU profiles), not by fitted terms."""
        return self.terms is None

    @property
    def kv_read_efficiency(self) -> float:
        return self.bandwidth_efficiency if self.kv_bandwidth_efficiency is None else self.kv_bandwidth_efficiency

    @property
    def prefill_attention_efficiency(self) -> float:
        return self.compute_efficiency if self.attention_efficiency is None else self.attention_efficiency


# `servelab bench --calibrate --set engine.max_model_len=512` on builtin:tiny, fp32, one
# thread, CPU time (run 3 of docs/bench.md's calibration table).
CPU_HERE_TERMS = StepTerms(step_s=1.48e-3, sequence_s=0.0, prefill_gemm_flop_s=8.68e-12,
                           decode_gemm_flop_s=1.22e-11, prefill_attention_flop_s=3.12e-12,
                           decode_kv_byte_s=1.18e-10, lm_head_flop_s=0.0)
_TRTLLM_LIKE = "TensorRT-LLM-like: fused kernels, CUDA graphs on decode steps, in-flight batching"
_EAGER_LIKE = "vLLM-like with enforce_eager: the same kernels launched from PyTorch every step, no CUDA graphs"

# Fitted by hand (examples/sim_fidelity.py prints every row) to TensorRT-LLM's published
# Llama-3.1-8B tables. Hopper: bandwidth efficiency and per-step host overhead from the
# light-load ITL on H100 (8 ms) and H200 (6 ms), whose two bandwidths separate the fixed
# part from the streamed weights; large-M GEMM efficiency from the offline 128/128 and
# 2048/128 rows and its fall-off at a few hundred rows from the light-load TTFT (one
# 467-token prompt a step); KV read efficiency from the decode-heavy offline rows
# (128/2048, 2048/2048, 1000/1000); prefill attention from 2048/128 and 5000/500.
# H200 shares the H100 fit (same compute; the online H200 rows check it). Ampere: the
# offline A100 rows alone, so its host overhead and bandwidth efficiency are Hopper's.
_HOPPER = dict(compute_efficiency=0.65, gemm_half_tokens=200, bandwidth_efficiency=0.78,
               kv_bandwidth_efficiency=0.9, attention_efficiency=0.5, step_overhead_s=1.5e-3)
_AMPERE = dict(compute_efficiency=0.78, gemm_half_tokens=64, bandwidth_efficiency=0.78,
               kv_bandwidth_efficiency=0.88, attention_efficiency=0.55, step_overhead_s=1.5e-3)
# Not fitted (no published L4 table here): Ampere's efficiencies.
_ADA = _AMPERE
# Estimates, not fits: a C++ runtime enqueues a kernel in a few microseconds, PyTorch
# eager spends some 20-30 us of Python and dispatch on each op (12 a decoder layer, so an
# 8B decode step needs ~10 ms of host time to launch); the CUDA context plus activation
# workspace hold about 2 GiB besides weights and KV.
_RUNTIME_LAUNCH_S, _EAGER_LAUNCH_S = 5e-6, 25e-6
_GPU = dict(kernel_launch_s=_RUNTIME_LAUNCH_S, cuda_graphs=True, reserved_bytes=2 * GIB, behaves_like=_TRTLLM_LIKE)

ACCELERATORS = {
    "h100": Accelerator("H100 SXM 80GB", 989e12, 3.35e12, 80 * GIB, **_HOPPER, **_GPU, interconnect="nvlink4", host_link="pcie5", host_memory_bytes=256 * GIB),
    "h200": Accelerator("H200 141GB", 989e12, 4.8e12, 140 * GIB, **_HOPPER, **_GPU, interconnect="nvlink4", host_link="pcie5", host_memory_bytes=256 * GIB),
    "a100": Accelerator("A100 SXM 80GB", 312e12, 2.04e12, 80 * GIB, **_AMPERE, **_GPU, interconnect="nvlink3", host_link="pcie4", host_memory_bytes=256 * GIB),
    "l4": Accelerator("L4", 121e12, 0.3e12, 22.5 * GIB, **_ADA, **_GPU, host_link="pcie4", host_memory_bytes=64 * GIB),  # no NVLink: PCIe 4
    # This project's 2-core machine in float32, one thread, as fitted by `servelab bench
    # --calibrate` on the embedded model (see docs/bench.md, "Calibration"); one process,
    # so no tensor parallelism.
    "cpu-here": Accelerator("2-core CPU (fp32, one thread, fitted)", 105e9, 3.2e9, 24e9, 0.0, 1.0, 1.0,
                            terms=CPU_HERE_TERMS, behaves_like="servelab on this CPU, additive fitted step terms",
                            host_link="host-dram", host_memory_bytes=8e9, threads=1),
}
EAGER_SUFFIX = "-eager"


def accelerator(name: str) -> Accelerator:
    """The named profile; `NAME-eager` turns CUDA graphs off (kernels launched every step)."""
    key = name.lower()
    eager = key.endswith(EAGER_SUFFIX) and key[: -len(EAGER_SUFFIX)] in ACCELERATORS
    base = ACCELERATORS.get(key[: -len(EAGER_SUFFIX)] if eager else key)
    if base is None or (eager and not base.per_kernel):
        choices = ", ".join([*ACCELERATORS, *(n + EAGER_SUFFIX for n, a in ACCELERATORS.items() if a.per_kernel)])
        raise ConfigError(f"unknown accelerator {name!r}; choose {choices}")
    if eager:
        return attrs.evolve(base, name=f"{base.name} (eager)", cuda_graphs=False, kernel_launch_s=_EAGER_LAUNCH_S,
                            behaves_like=_EAGER_LIKE)
    return base


@attrs.frozen
class Interconnect:
    """How the devices of one tensor-parallel group reach each other, for ring all-reduces:
    a ring over N devices moves 2 (N - 1) / N of the buffer through each device's link."""

    name: str
    bus_bandwidth: float  # bytes/s an all-reduce achieves per device (NCCL's "bus bandwidth")
    latency_s: float  # a small all-reduce's fixed cost

    def all_reduce_seconds(self, nbytes: float, size: int) -> float:
        if size <= 1:
            return 0.0
        return self.latency_s + 2.0 * (size - 1) / size * nbytes / self.bus_bandwidth

    def gather_seconds(self, nbytes_per_rank: float, size: int) -> float:
        """Every other rank's `nbytes_per_rank` into one device."""
        return 0.0 if size <= 1 else self.latency_s + (size - 1) * nbytes_per_rank / self.bus_bandwidth


# Host KV tier per device (Accelerator.host_link, host_memory_bytes), estimates: PCIe 5 x16
# on Hopper, PCIe 4 x16 elsewhere, at the same effective bandwidths as below (a large
# pinned cudaMemcpyAsync reaches about that); an 8-GPU node's 2 TiB of DRAM shared by its
# devices (256 GiB each), 64 GiB beside an L4.
# Estimates, not fits (no published multi-GPU table is reproduced here): the bus bandwidth
# NCCL's all_reduce_perf reaches on large buffers within one node, a little under the
# links' one-way peak (NVLink 4: 450 GB/s a direction on H100 SXM, NVLink 3: 300 GB/s on
# A100 SXM, PCIe 4/5 x16: 32/64 GB/s), and the few microseconds a small all-reduce takes.
INTERCONNECTS = {
    "nvlink4": Interconnect("NVLink 4 (H100/H200 SXM, NVSwitch)", 360e9, 8e-6),
    "nvlink3": Interconnect("NVLink 3 (A100 SXM, NVSwitch)", 230e9, 10e-6),
    "pcie5": Interconnect("PCIe 5.0 x16", 45e9, 20e-6),
    "pcie4": Interconnect("PCIe 4.0 x16", 22e9, 25e-6),
    # The host KV tier of a CPU: a copy within host DRAM (read and write), at about the
    # fitted KV read bandwidth of this machine's profile.
    "host-dram": Interconnect("host DRAM copy", 3e9, 1e-6),
}


def interconnect(name: str) -> Interconnect:
    try:
        return INTERCONNECTS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown interconnect {name!r}; choose {', '.join(INTERCONNECTS)}") from None
