"""Objective checks: tiny situations in which a policy must make the choice its idea is
for. The contracts check that a policy is safe; an objective pins what it is meant to do,
so that an idea that silently does nothing (an EDF scheduler ignoring deadlines, a victim
whose cost is the same for everyone, a cost-aware eviction whose aging cancels out)
fails here instead of reading as "no difference" in a benchmark.

A contract takes them in one line:

    from servelab.testing import SchedulerContract, objectives

    class TestEDF(SchedulerContract):
        plugin_name = "edf"
        objectives = (objectives.earliest_deadline_first(),)

and runs each in its `test_objectives` (skipped when there are none). A missed objective
fails with "objective not met: <name>: <what the policy chose instead>".

Ready-made, by kind: schedulers `earliest_deadline_first`, `shortest_job_first`,
`first_come_first_served`; victims `frees_most_blocks_per_lost_token`; evictors
`hot_prefix_survives_a_scan`; routers `longest_cached_prefix_wins`. Your own is an
`Objective(kind, name, scenario)`: `scenario(contract)` builds the situation with the
contract's own helpers (a scheduler contract's `harness(...)`, any contract's
`make(context)`) and calls `meets(condition, name, detail)`.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import pytest

from servelab.interfaces import (AllocatorContext, EvictionContext, PrefixSummary, ReplicaSnapshot, RouteRequest,
                                 Sequence, SequenceStatus, prefix_block_hashes)
from servelab.sampling_params import SamplingParams
from servelab.testing.contract import ContractViolation


class ObjectiveMissed(ContractViolation):
    """A policy kept every invariant but did not make the choice its objective asks for;
    the message starts "objective not met: <name>"."""


def meets(condition: Any, name: str, detail: str | Callable[[], str] = "") -> None:
    """Raise ObjectiveMissed naming objective `name` unless `condition` holds."""
    if condition:
        return
    text = detail() if callable(detail) else detail
    raise ObjectiveMissed(f"objective not met: {name}" + (f": {text}" if text else ""))


@attrs.frozen
class Objective:
    """What a policy of `kind` must choose in the situation `scenario(contract)` builds."""

    kind: str  # the contract's kind: "schedulers", "victims", "evictors", "routers"
    name: str
    scenario: Callable[[Any], None]


class ObjectiveChecks:
    """The `objectives` a contract subclass declares, run by `test_objectives`."""

    kind = ""
    objectives: tuple = ()

    def test_objectives(self):
        if not self.objectives:
            pytest.skip("no objectives declared (objectives = (...), servelab.testing.objectives)")
        for objective in self.objectives:
            if objective.kind != self.kind:
                raise ObjectiveMissed(f"objective not met: {objective.name}: it judges {objective.kind}, and this "
                                      f"contract tests {self.kind}")
            objective.scenario(self)


# ---------------------------------------------------------------- schedulers


def _admission_order(contract: Any, requests: list[tuple[str, int, SamplingParams, float]]) -> list[str]:
    """One slot held by a blocker while `requests` (id, prompt length, params, seconds
    after the blocker) arrive; the order they are first scheduled in once it is done."""
    harness = contract.harness(max_num_seqs=1, num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
    harness.add(4, params=SamplingParams(max_tokens=4), request_id="blocker")
    harness.step()
    start = harness.now
    for request_id, prompt, params, offset in requests:
        harness.add(prompt, params=params, request_id=request_id, arrival_time=start + offset)
    harness.run()
    return [request_id for request_id in harness.first_scheduled if request_id != "blocker"]


def earliest_deadline_first() -> Objective:
    """Waiting requests are admitted in the order of their absolute deadlines (arrival +
    SamplingParams.deadline), not of their arrivals."""
    name = "earliest deadline admitted first"

    def scenario(contract: Any) -> None:
        requests = [("patient", 4, SamplingParams(max_tokens=2, deadline=30.0), 0.0),
                    ("urgent", 4, SamplingParams(max_tokens=2, deadline=2.0), 0.5),
                    ("soon", 4, SamplingParams(max_tokens=2, deadline=8.0), 0.25)]
        order = _admission_order(contract, requests)
        meets(order == ["urgent", "soon", "patient"], name,
              f"admitted {order} while one slot was busy; due 30 s after arriving first (patient), 8 s after "
              "arriving 0.25 s later (soon), 2 s after arriving 0.5 s later (urgent)")

    return Objective("schedulers", name, scenario)


def shortest_job_first() -> Objective:
    """Waiting requests are admitted shortest (prompt + max_tokens) first."""
    name = "shortest job admitted first"

    def scenario(contract: Any) -> None:
        requests = [("long", 20, SamplingParams(max_tokens=10), 0.0), ("short", 2, SamplingParams(max_tokens=1), 0.0),
                    ("medium", 8, SamplingParams(max_tokens=4), 0.0)]
        order = _admission_order(contract, requests)
        meets(order == ["short", "medium", "long"], name,
              f"admitted {order}; jobs of 3 (short), 12 (medium) and 30 (long) tokens waited together")

    return Objective("schedulers", name, scenario)


def first_come_first_served() -> Objective:
    """Waiting requests are admitted in arrival order, whatever their sizes or deadlines."""
    name = "first come, first served"

    def scenario(contract: Any) -> None:
        requests = [("first", 20, SamplingParams(max_tokens=10, deadline=60.0), 0.0),
                    ("second", 2, SamplingParams(max_tokens=1, deadline=1.0), 0.25),
                    ("third", 8, SamplingParams(max_tokens=4), 0.5)]
        order = _admission_order(contract, requests)
        meets(order == ["first", "second", "third"], name, f"admitted {order}; they arrived first, second, third")

    return Objective("schedulers", name, scenario)


# ---------------------------------------------------------------- victims


def frees_most_blocks_per_lost_token() -> Objective:
    """The victim is the running sequence whose preemption frees the most KV blocks per
    computed token it throws away."""
    name = "the victim frees the most blocks per lost token"

    def scenario(contract: Any) -> None:
        from servelab.testing.scheduler_workloads import make_allocator

        allocator = make_allocator("paged", 64, 4, 64)
        running = []
        # (id, tokens allocated, tokens computed): blocks freed per token lost 0.25, 1.5, 1.0, 0.25
        for index, (request_id, allocated, computed) in enumerate(
                (("long-done", 16, 16), ("mid-prefill", 12, 2), ("tiny", 4, 1), ("newest", 8, 8))):
            seq = Sequence(request_id, [5] * allocated, SamplingParams(max_tokens=4), float(index))
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = computed
            allocator.allocate(request_id, allocated)
            running.append(seq)
        victim = contract.choose_victim(list(running), allocator)
        meets(victim is running[1], name,
              f"chose {victim.request_id if isinstance(victim, Sequence) else victim!r}; freeing mid-prefill's 3 blocks loses 2 computed "
              "tokens (1.5 blocks a token), long-done 4 for 16, tiny 1 for 1, newest 2 for 8")

    return Objective("victims", name, scenario)


# ---------------------------------------------------------------- evictors


def _serve(allocator: Any, request_id: str, prompt: list[int]) -> int:
    """Admit `prompt` after its prefix-cache hit, compute it, cache it, free it; the hit."""
    seq = Sequence(request_id, list(prompt), SamplingParams(max_tokens=1), 0.0)
    seq.num_computed_tokens = hit = allocator.match_prefix(seq)
    if not allocator.allocate(request_id, seq.num_tokens):
        allocator.free(request_id)
        return hit
    seq.num_computed_tokens = seq.num_tokens
    allocator.cache_blocks(seq)
    allocator.free(request_id)
    return hit


def hot_prefix_survives_a_scan() -> Objective:
    """A prefix reused many times stays cached while a scan of one-off prompts, larger
    than the pool, passes through (in the `radix` and `hash` caches alike)."""
    name = "the hot prefix survives a scan"

    def scenario(contract: Any) -> None:
        from servelab.testing.contract import installed_factory

        hot = [50] * 8 + [1]  # two full blocks, cached, and a token to compute
        for cache in ("radix", "hash"):
            factory, options_class = installed_factory("allocators", cache)
            policy = contract.make(EvictionContext(num_blocks=12, block_size=4))
            allocator = factory(options_class(), AllocatorContext(num_blocks=12, block_size=4, max_model_len=32,
                                                                  eviction=policy))
            for index in range(4):
                _serve(allocator, f"hot-{index}", hot)
            for index in range(10):
                _serve(allocator, f"scan-{index}", [100 + index] * 8 + [1])
            hit = _serve(allocator, "hot-again", hot)
            meets(hit == 8, name, f"{cache}: the prefix served four times kept {hit} of its 8 tokens cached "
                                  "after ten one-off prompts passed through a 12-block pool")

    return Objective("evictors", name, scenario)


# ---------------------------------------------------------------- routers


def longest_cached_prefix_wins() -> Objective:
    """Among equally loaded replicas reporting their caches, the one holding the longest
    prefix of the prompt gets it (chosen by replica_id, which is not the list position)."""
    name = "the longest cached prefix wins"

    def scenario(contract: Any) -> None:
        prompt = list(range(10, 26))  # four blocks of 4
        hashes = prefix_block_hashes(prompt, 4)
        replicas = [ReplicaSnapshot(replica_id=rid, num_kv_blocks=64, block_size=4,
                                    prefix_summary=PrefixSummary(4, hashes[:held]))
                    for rid, held in ((3, 0), (8, 2), (5, 3))]
        router = contract.make(contract.context(num_replicas=9))
        choice = router.route(RouteRequest("probe", prompt, max_tokens=4), replicas)
        meets(choice == 5, name, f"chose {choice!r}; replica 5 holds 12 of the prompt's 16 tokens, replica 8 "
                                 "holds 8, replica 3 none, and their loads are equal")

    return Objective("routers", name, scenario)


__all__ = ["Objective", "ObjectiveChecks", "ObjectiveMissed", "earliest_deadline_first",
           "first_come_first_served", "frees_most_blocks_per_lost_token", "hot_prefix_survives_a_scan",
           "longest_cached_prefix_wins", "meets", "shortest_job_first"]
