"""Expert placement over expert-parallel ranks: a documented seam
(`servelab.contracts.moe.ExpertPlacementPolicy`, conformance `servelab.testing.moe`),
selected by `[engine] expert_placement` and run by expert parallelism and the simulator.

- `linear`: rank r holds a contiguous run of experts (the first ranks one more where
  the count does not divide).
- `round_robin`: expert e on rank e mod ranks, so neighbouring experts (which routers
  often favour together) land on different ranks.
- `balanced`: in the spirit of DeepSeek's EPLB, from measured load: the hottest experts
  get `redundant_experts` extra replicas (each time to the expert with the most load per
  replica), then the replicas go, heaviest first, to the least-loaded rank with room
  that does not hold that expert yet. Without measured load it places as `linear`.

`reference_*` are the plain definitions (and a brute-force optimum) the contract checks
the policies against.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

from servelab.contracts.moe import PLACEMENT_CONTRACT_VERSION, ExpertPlacement


def capacity(num_experts: int, ep_size: int, redundant_experts: int = 0) -> int:
    """The most experts (replicas included) a rank holds."""
    return -(-(num_experts + redundant_experts) // ep_size)


def _check(num_experts: int, ep_size: int) -> None:
    if ep_size < 1 or num_experts < 1:
        raise ValueError(f"placing {num_experts} experts over {ep_size} ranks: both must be at least 1")
    if ep_size > num_experts:
        raise ValueError(f"expert parallelism over {ep_size} ranks needs at least as many experts "
                         f"(the model has {num_experts})")


class LinearPlacement:
    name = "linear"
    contract_version = PLACEMENT_CONTRACT_VERSION
    uses_load = False
    redundant_experts = 0

    def place(self, num_experts: int, ep_size: int, load: Sequence[float] | None = None) -> ExpertPlacement:
        _check(num_experts, ep_size)
        base, extra = divmod(num_experts, ep_size)
        ranks, start = [], 0
        for rank in range(ep_size):
            size = base + (rank < extra)
            ranks.append(tuple(range(start, start + size)))
            start += size
        return ExpertPlacement(num_experts, tuple(ranks))


class RoundRobinPlacement:
    name = "round_robin"
    contract_version = PLACEMENT_CONTRACT_VERSION
    uses_load = False
    redundant_experts = 0

    def place(self, num_experts: int, ep_size: int, load: Sequence[float] | None = None) -> ExpertPlacement:
        _check(num_experts, ep_size)
        return ExpertPlacement(num_experts, tuple(tuple(range(rank, num_experts, ep_size)) for rank in range(ep_size)))


class BalancedPlacement:
    name = "balanced"
    contract_version = PLACEMENT_CONTRACT_VERSION
    uses_load = True

    def __init__(self, redundant_experts: int = 0) -> None:
        if redundant_experts < 0:
            raise ValueError(f"redundant_experts must be at least 0, got {redundant_experts}")
        self.redundant_experts = redundant_experts

    def place(self, num_experts: int, ep_size: int, load: Sequence[float] | None = None) -> ExpertPlacement:
        _check(num_experts, ep_size)
        if load is None:
            return LinearPlacement().place(num_experts, ep_size)
        if len(load) != num_experts:
            raise ValueError(f"expert load has {len(load)} entries for {num_experts} experts")
        room = capacity(num_experts, ep_size, self.redundant_experts)
        copies = [1] * num_experts
        for _ in range(min(self.redundant_experts, room * ep_size - num_experts)):
            hottest = max((e for e in range(num_experts) if copies[e] < ep_size),
                          key=lambda e: (load[e] / copies[e], -e), default=None)
            if hottest is None:
                break
            copies[hottest] += 1
        # experts with more replicas first (they need distinct ranks), then heaviest replica first
        order = sorted(range(num_experts), key=lambda e: (-copies[e], -load[e] / copies[e], e))
        held: list[list[int]] = [[] for _ in range(ep_size)]
        rank_load = [0.0] * ep_size
        for expert in order:
            share = load[expert] / copies[expert]
            for _ in range(copies[expert]):
                open_ranks = [r for r in range(ep_size) if len(held[r]) < room and expert not in held[r]]
                if not open_ranks:
                    break  # a replica with no rank left: the expert keeps fewer
                rank = min(open_ranks, key=lambda r: (rank_load[r], len(held[r]), r))
                held[rank].append(expert)
                rank_load[rank] += share
        return ExpertPlacement(num_experts, tuple(tuple(sorted(h)) for h in held))


PLACEMENT_POLICIES: dict[str, Callable[[int], object]] = {
    "linear": lambda redundant_experts=0: LinearPlacement(),
    "round_robin": lambda redundant_experts=0: RoundRobinPlacement(),
    "balanced": lambda redundant_experts=0: BalancedPlacement(redundant_experts),
}


def placement_policy(name: str, redundant_experts: int = 0):
    if name not in PLACEMENT_POLICIES:
        raise ValueError(f"unknown expert placement {name!r}; known: {', '.join(PLACEMENT_POLICIES)}")
    return PLACEMENT_POLICIES[name](redundant_experts=redundant_experts)


def reference_linear(num_experts: int, ep_size: int) -> list[list[int]]:
    per_rank = [num_experts // ep_size + (r < num_experts % ep_size) for r in range(ep_size)]
    out, expert = [], 0
    for size in per_rank:
        out.append([expert + i for i in range(size)])
        expert += size
    return out


def reference_round_robin(num_experts: int, ep_size: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(ep_size)]
    for expert in range(num_experts):
        out[expert % ep_size].append(expert)
    return out


def optimal_max_load(load: Sequence[float], ep_size: int) -> float:
    """The least busiest-rank load of any placement without replicas that keeps each rank
    within capacity: brute force over every assignment (small instances only)."""
    room = capacity(len(load), ep_size)
    best = float("inf")
    for assignment in itertools.product(range(ep_size), repeat=len(load)):
        if max(assignment.count(r) for r in range(ep_size)) > room:
            continue
        totals = [0.0] * ep_size
        for expert, rank in enumerate(assignment):
            totals[rank] += load[expert]
        best = min(best, max(totals))
    return best
