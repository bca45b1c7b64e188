"""The mixture-of-experts seams: the router's top-k (`ExpertRouting`) and the placement
of experts over expert-parallel ranks (`ExpertPlacementPolicy`, returning an
`ExpertPlacement`). Documented seams, versioned (`contract_version` on each policy; the
changelog is docs/contract-versions.md, rows "expert routing" and "expert placement"),
with conformance contracts in `servelab.testing.moe`. Built-ins:
`servelab.model.expert_routing` and `servelab.expert_placement`.
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import attrs

ROUTING_CONTRACT_VERSION = 1
PLACEMENT_CONTRACT_VERSION = 1

__all__ = ["ExpertRouting", "ExpertPlacement", "ExpertPlacementPolicy", "ROUTING_CONTRACT_VERSION",
           "PLACEMENT_CONTRACT_VERSION"]


@runtime_checkable
class ExpertRouting(Protocol):
    """Chooses each token's experts from the router's logits [T, experts]: returns
    (weights [T, top_k] float32, expert ids [T, top_k] int64), each token's experts
    distinct and largest weight first; with `normalize` a token's weights sum to one,
    without it they are the softmax probabilities themselves. Deterministic."""

    name: str
    contract_version: int

    def select(self, logits, top_k: int, normalize: bool): ...


@attrs.frozen
class ExpertPlacement:
    """Which experts each expert-parallel rank holds: `ranks[r]` lists rank r's experts
    (logical ids; an expert on several ranks is a redundant replica of a hot one)."""

    num_experts: int
    ranks: tuple[tuple[int, ...], ...]

    @property
    def ep_size(self) -> int:
        return len(self.ranks)

    def replicas(self, expert: int) -> tuple[int, ...]:
        """The ranks holding `expert`, lowest first."""
        return tuple(rank for rank, held in enumerate(self.ranks) if expert in held)

    def rank_for(self, expert: int, token: int) -> int:
        """The rank that computes `expert` for the `token`-th row: its replicas take the
        rows in turn."""
        holders = self.replicas(expert)
        return holders[token % len(holders)]

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Each rank's share of `load` (per expert), an expert's load split evenly over its replicas."""
        counts = [len(self.replicas(e)) for e in range(self.num_experts)]
        return [sum(load[e] / counts[e] for e in held) for held in self.ranks]

    def imbalance(self, load: Sequence[float]) -> float:
        """The busiest rank's load over the mean rank's (1.0: perfectly balanced)."""
        loads = self.rank_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0


@runtime_checkable
class ExpertPlacementPolicy(Protocol):
    """Places `num_experts` experts over `ep_size` ranks. Every expert on at least one
    rank, no rank holding an expert twice, no rank holding more than
    ceil((num_experts + redundant_experts) / ep_size) experts; the same inputs give the
    same placement. `load` (per expert, measured: a block's `expert_load`) is None before
    any is measured; a policy with `uses_load` must then place by it, and balance it
    within the bound its contract checks."""

    name: str
    contract_version: int
    uses_load: bool
    redundant_experts: int

    def place(self, num_experts: int, ep_size: int, load: Sequence[float] | None = None) -> ExpertPlacement: ...


@runtime_checkable
class ExpertLoadSource(Protocol):
    """A runner (or an engine) of a mixture-of-experts model that reports its expert load."""

    def expert_load(self) -> dict[int, list[int]]:
        """Per sparse layer (its index), the (token, expert) assignments each expert has
        taken since the model loaded."""
