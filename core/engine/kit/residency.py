"""Adapter residency in the kit: the default policy (least recently used first), the
sort-key base the built-ins share, and the check every choice goes through.

A policy is any object with `choose(candidates, num_slots) -> lora_ids`
(`servelab.interfaces.AdapterResidencyPolicy`); most are one sort key:

    class FewestUses(KeyedResidency):
        def key(self, c):
            return (c.uses, c.last_used, c.lora_id)

The engine checks every choice before it evicts anything: an id that is not one of the
candidates (an adapter the step needs, or one not resident), one named twice, or the
wrong count fails the step with `PolicyViolation` naming the invariant.
"""

from __future__ import annotations

from typing import Any, Sequence as Seq

from servelab.contracts.adapter_residency import ResidencyContext, ResidentAdapter
from servelab.errors import PolicyViolation

EVICTS_ONLY_CANDIDATES = "adapter residency evicts only candidates (resident adapters the step does not need)"
EVICTS_EACH_ONCE = "adapter residency names each candidate at most once"
FREES_THE_SLOTS = "adapter residency frees exactly the slots asked for"


class KeyedResidency:
    """A policy that evicts in ascending order of `key(candidate)`. Keys should differ
    between candidates (end them with `lora_id`), so the order never depends on the order
    candidates come in."""

    def __init__(self, options: Any = None, context: ResidencyContext | None = None) -> None:
        self.options, self.context = options, context

    def key(self, candidate: ResidentAdapter) -> Any:
        raise NotImplementedError

    def choose(self, candidates: Seq[ResidentAdapter], num_slots: int) -> list[int]:
        return [c.lora_id for c in sorted(candidates, key=self.key)[:num_slots]]


class LeastRecentlyUsedAdapter(KeyedResidency):
    """The adapter whose last step is oldest goes first (`lru`, the default)."""

    def key(self, candidate: ResidentAdapter) -> Any:
        return (candidate.last_used, candidate.loaded, candidate.lora_id)


def checked_residency_choice(policy: Any, candidates: Seq[ResidentAdapter], num_slots: int) -> list[int]:
    """`policy.choose(...)`, or PolicyViolation naming the invariant it broke."""
    choice = list(policy.choose(list(candidates), num_slots))
    name = type(policy).__name__
    ids = {c.lora_id for c in candidates}
    strangers = [lora_id for lora_id in choice if lora_id not in ids]
    if strangers:
        raise PolicyViolation(EVICTS_ONLY_CANDIDATES, f"{name} chose {strangers}, candidates {sorted(ids)}")
    if len(set(choice)) != len(choice):
        raise PolicyViolation(EVICTS_EACH_ONCE, f"{name} chose {choice}")
    if len(choice) != num_slots:
        raise PolicyViolation(FREES_THE_SLOTS, f"{name} was asked for {num_slots}, chose {choice}")
    return choice
