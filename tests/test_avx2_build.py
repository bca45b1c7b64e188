"""The kernels' AVX2 build, what AVX2-only CPUs run, checked on an AVX-512 CPU: one pytest
run under ATEN_CPU_CAPABILITY=avx2 (torch then reports that capability, and the library it
loads is the 8-wide build) over the kernel checks of five files, on one build. The paths it
covers: paged attention and its tiles, the layer ops, the panel matmul in both dtypes
(bfloat16 weights are widened there, not dot-multiplied), the MoE grouped experts, the
quantized KV cache's widening, the native sampler's draws and the quantized-weight kernels.
(Four separate runs took 32 s against this one's 15: each started an interpreter and collected.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cache import HAS_COMPILER

# Each file's kernel checks, as a -k expression over that file's tests.
CHECKS = {
    "test_cpu_paged": "draft_rows or prompt_tiles or layer_ops or panel or transformers"
                      " or (TestCpuPaged and not Sdpa)",
    "test_moe_kernel": "not served and not native_experts_false",
    "test_kv_quant": "quantized_cpu_kernels and fp32",
    "test_native_sampling": "not engine",
    "test_quantized_weights": "kernel",
}


@pytest.mark.skipif(not HAS_COMPILER,
                    reason="no C++ compiler: cpu-paged serves on the torch path")
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or os.environ.get("ATEN_CPU_CAPABILITY"),
                    reason="the CPU has no AVX-512: the kernel files already run the AVX2 build")
def test_the_avx2_build_passes_the_kernel_checks():
    here = Path(__file__).parent
    expression = " or ".join(f"({module} and ({checks}))" for module, checks in CHECKS.items())
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *(str(here / f"{module}.py") for module in CHECKS), "-k", expression],
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = run.stdout.splitlines()[-1]
    assert " passed" in summary and " skipped" not in summary, run.stdout[-500:]
