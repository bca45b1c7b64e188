"""The preemption-victim contract (kind `victims`, selected by `[scheduler] preemption`):
what a victim policy factory receives (`VictimContext`), the running batch it chooses
from, what it returns (a `Sequence`, or a `Preemption` that also decides swap or
recompute), and the Protocol. Changes by version: docs/contract-versions.md ("victims").
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.contracts.allocator import KVAllocator
from servelab.sequence import Sequence, SequenceStatus

__all__ = [
    "KVAllocator",
    "Sequence",
    "SequenceStatus",
    "VictimContext",
    "Preemption",
    "VictimPolicy",
]


@attrs.frozen
class VictimContext:
    """What a victim policy factory receives."""

    block_size: int  # token slots per KV block
    max_num_seqs: int
    # A host KV tier (`[kv_offload]`) is on: a victim's KV may be swapped to it instead of
    # being freed and recomputed (`Preemption.swap`). False: every preemption recomputes.
    can_swap: bool = False


@attrs.frozen
class Preemption:
    """A victim, with what happens to its KV: `swap` True copies it to the host tier and
    back on resumption, False frees it (its tokens are computed again), None leaves it to
    the scheduler's `preemption_mode`. Where the host tier is off, or cannot hold the
    victim's blocks, the scheduler recomputes whatever the policy asked."""

    victim: Sequence
    swap: bool | None = None


@runtime_checkable
class VictimPolicy(Protocol):
    """Chooses which running sequence a scheduler preempts when the KV pool runs dry (or
    a fork overfills the batch).

    `choose` gets the running batch in the scheduler's rank order (best first; never
    empty) and the allocator (read only: block tables, stats), and returns one of
    `running`, or a `Preemption` naming one of them. The same batch must give the same
    choice. The scheduler refuses any other answer (PolicyViolation naming the invariant)
    before it changes anything, and asks again while the pool is still dry.
    """

    def choose(self, running: Seq[Sequence], allocator: KVAllocator) -> "Sequence | Preemption":
        """The running sequence to preempt (or a Preemption of it)."""
