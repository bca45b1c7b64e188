"""The adapter residency contract (kind `adapter_residency`, `[adapter_residency]`): which
LoRA adapters stay in the fast pool (`[engine] max_loras` slots) when a step needs one
that is not there. What the engine tells a policy of each resident adapter, the policy's
factory context and the Protocol. Changes by version: docs/contract-versions.md
("adapter_residency").

Adapters live on three tiers: on disk (registered, not read), in host memory (read and
checked, at most `max_cpu_loras`) and in the fast pool (the slots the forward pass reads,
at most `max_loras`). A step's adapters must all be in the pool; the scheduler admits no
sequence whose adapter would take a batch past `max_loras` adapters, so there is always
room once the policy's victims are gone.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

import attrs

__all__ = [
    "ResidentAdapter",
    "ResidencyContext",
    "AdapterResidencyPolicy",
]


@attrs.frozen
class ResidentAdapter:
    """What the engine knows of one adapter in the fast pool that the step does not need
    (an eviction candidate). Ticks are the pool's own step counter: larger is more recent."""

    lora_id: int  # LoRARequest.lora_int_id, the id the policy names it by
    name: str  # LoRARequest.lora_name
    loaded: int  # tick it entered the pool
    last_used: int  # tick of the last step that ran it
    uses: int  # steps that ran it since it was first registered (loads do not reset it)
    num_waiting: int  # waiting sequences that run with it (what a queue-aware policy keeps)
    rank: int  # its largest LoRA rank
    nbytes: int  # its weights' size in the pool


@attrs.frozen
class ResidencyContext:
    """What an adapter residency policy factory receives."""

    max_loras: int  # fast-pool slots
    max_cpu_loras: int  # adapters kept in host memory (the fast pool's included)


@runtime_checkable
class AdapterResidencyPolicy(Protocol):
    """Chooses which fast-pool adapters make room for the ones a step needs.

    `choose` gets the resident adapters the step does not use (never empty) and how many
    slots must be freed (1 <= num_slots <= len(candidates)), and returns that many
    distinct `lora_id`s of `candidates`, first to go first. The same candidates must give
    the same choice. The engine refuses any other answer (PolicyViolation naming the
    invariant) before it evicts anything.
    """

    def choose(self, candidates: Seq[ResidentAdapter], num_slots: int) -> Seq[int]:
        """lora_ids of `candidates` to evict from the fast pool, first to go first."""
