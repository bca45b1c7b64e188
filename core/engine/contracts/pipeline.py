"""The pipeline-parallel chunk-sizing seam: how a long prompt is cut into the chunks
that travel down a pipeline one after another (`ChunkSizing`). A documented seam,
versioned (`contract_version`; changelog docs/contract-versions.md, row "chunk sizing"),
conformance `servelab.testing.pipeline`; built-ins in `servelab.pipeline_chunks`; run by
the simulator's pipeline pricing (servelab.bench.sim.parallel_cost)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

CHUNK_SIZING_CONTRACT_VERSION = 1

# seconds one stage takes for a chunk of `tokens` new tokens after `context` earlier ones
ChunkTime = Callable[[int, int], float]


@runtime_checkable
class ChunkSizing(Protocol):
    """Cuts a prompt of `prompt_len` tokens into chunk lengths: each at least 1 and at most
    `max_chunk`, summing to `prompt_len`, in prompt order; the same inputs give the same
    chunks. `chunk_time` prices a chunk (for policies that size by time)."""

    name: str
    contract_version: int

    def chunks(self, prompt_len: int, max_chunk: int, chunk_time: ChunkTime) -> list[int]: ...


@runtime_checkable
class PipelineStatsSource(Protocol):
    """A runner (or an engine) of a pipeline-parallel model that reports its stage times:
    an object with `steps`, `micro_batches`, `compute_s`, `wait_s`, `bubble_fraction` (rank
    0's), `stage_times` and `stage_bubble_fractions` (every stage's), `batches_in_flight`
    and `overlapped_batches` (servelab.distributed.pipeline_parallel.PipelineStats), or None."""

    def pipeline_stats(self) -> Any: ...
