"""The engine bounds oneDNN's caches of compiled kernels (servelab.model.onednn_caches):
one entry per linear shape and row count, so without a bound a serving engine's memory
grows with every batch size it sees. Each case runs in a fresh process: the caches read
their capacity once, when a process first uses oneDNN."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from servelab.model.onednn_caches import CAPACITY_VARIABLES
from servelab.model.packed_linear import can_prepack

needs_onednn = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN linear")

ENGINE = """
import json, os
from servelab import LLM
LLM("builtin:tiny-random", max_model_len=64, **{"engine.onednn_cache_capacity": 7, "attention.name": "torch-paged"})
print(json.dumps({name: os.environ.get(name) for name in %r}))
""" % (CAPACITY_VARIABLES,)

# Growth of the process's resident memory over 40 row counts of one packed linear.
GROWTH = """
import json, os, sys, torch
from servelab.model.onednn_caches import limit_onednn_caches
limit_onednn_caches(int(sys.argv[1]))
def resident_mib(): return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(512, 512))
torch.ops.mkldnn._linear_pointwise(torch.randn(1, 512), weight, None, "none", [], "")
before = resident_mib()
for rows in range(2, 42):
    torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 512), weight, None, "none", [], "")
print(json.dumps(resident_mib() - before))
"""


def run(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES} | (env or {})
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                            env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_engine_sets_the_configured_capacity():
    assert json.loads(run(ENGINE)) == {name: "7" for name in CAPACITY_VARIABLES}


def test_a_capacity_in_the_environment_wins():
    preset = {name: "3" for name in CAPACITY_VARIABLES}
    assert json.loads(run(ENGINE, env=preset)) == preset


@needs_onednn
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_bounded_cache_stops_growing_with_new_row_counts():
    unbounded = float(run(GROWTH, "1024"))
    if unbounded < 8:  # AVX-512 here: ~0.5 MiB of generated code per row count
        pytest.skip(f"oneDNN kept {unbounded:.1f} MiB for 40 row counts on this CPU: no per-row-count kernels to bound")
    assert float(run(GROWTH, "2")) < unbounded / 2
