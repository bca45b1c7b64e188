"""Bounds on the caches of compiled oneDNN kernels, which CPU linears go through.

oneDNN generates machine code for each linear shape and row count it sees, and keeps it in
two caches: oneDNN's primitive cache and torch's (ideep's) cache of oneDNN computations,
which holds its primitives alive too. Each entry is ~0.4-1 MiB of code, and both caches
hold 1,024 entries by default: a serving engine sees a new row count at every batch size
and prompt-step size, so its memory grew with every one of them (bf16, 32 M parameters:
+160 MiB over one run of the speed workload, half its weights and KV pool). An evicted
entry is rebuilt in ~0.25 ms when its row count comes back.

Both caches read their capacity from the environment once, when the process first uses
oneDNN, so the engine sets it before it loads a model. A capacity already in the
environment (the user's) is kept, as is whatever a process that used oneDNN before
starting the engine got.
"""

from __future__ import annotations

import os

CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def limit_onednn_caches(capacity: int) -> None:
    """Ask both caches to hold at most `capacity` entries, unless the environment says otherwise."""
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
