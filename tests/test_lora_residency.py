"""Adapter residency: the built-in policies pass their contract, the contract catches seeded
faulty policies, and each built-in evicts in its own order."""

from __future__ import annotations

import pytest

from servelab.interfaces import ResidentAdapter
from servelab.kit import LeastRecentlyUsedAdapter
from servelab.plugins.residency.options import PinnedOptions
from servelab.plugins.residency.policies import LeastFrequentlyUsedAdapter, PinnedAdapters, QueueAware
from servelab.testing import AdapterResidencyContract

pytest_plugins = ["pytester"]


class TestLRU(AdapterResidencyContract):
    plugin_name = "lru"


class TestLFU(AdapterResidencyContract):
    plugin_name = "lfu"


class TestPinned(AdapterResidencyContract):
    factory = PinnedAdapters
    options = PinnedOptions(pinned=("adapter-3", "adapter-5"))


class TestPinnedInstalled(AdapterResidencyContract):
    plugin_name = "pinned"


class TestQueueAware(AdapterResidencyContract):
    plugin_name = "queue-aware"


def adapter(lora_id: int, last_used: int, uses: int = 1, num_waiting: int = 0) -> ResidentAdapter:
    return ResidentAdapter(lora_id=lora_id, name=f"a{lora_id}", loaded=0, last_used=last_used, uses=uses,
                           num_waiting=num_waiting, rank=4, nbytes=100)


CANDIDATES = [adapter(1, last_used=9, uses=1, num_waiting=0), adapter(2, last_used=3, uses=7, num_waiting=2),
              adapter(3, last_used=5, uses=2, num_waiting=0), adapter(4, last_used=1, uses=9, num_waiting=1)]


@pytest.mark.parametrize("policy, order", [
    (LeastRecentlyUsedAdapter(), [4, 2, 3, 1]),
    (LeastFrequentlyUsedAdapter(), [1, 3, 2, 4]),
    (QueueAware(), [3, 1, 4, 2]),
    (PinnedAdapters(PinnedOptions(pinned=("a4", "a2"))), [3, 1, 4, 2]),
])
def test_each_builtin_evicts_in_its_order(policy, order):
    assert [policy.choose(CANDIDATES, n) for n in (1, 4)] == [order[:1], order]


FAULTY = """
from servelab.kit import KeyedResidency, LeastRecentlyUsedAdapter
from servelab.testing import AdapterResidencyContract


class EvictsANeededAdapter:
    def __init__(self, options=None, context=None):
        pass

    def choose(self, candidates, num_slots):
        return [max(c.lora_id for c in candidates) + 1] + [c.lora_id for c in candidates][:num_slots - 1]


class EvictsTwice(LeastRecentlyUsedAdapter):
    def choose(self, candidates, num_slots):
        first = super().choose(candidates, 1)
        return first * num_slots


class EvictsTooFew(LeastRecentlyUsedAdapter):
    def choose(self, candidates, num_slots):
        return super().choose(candidates, num_slots)[:-1] if num_slots > 1 else []


class OrderDependent(KeyedResidency):
    def choose(self, candidates, num_slots):
        return [c.lora_id for c in candidates[:num_slots]]


class TestNeeded(AdapterResidencyContract):
    factory = EvictsANeededAdapter


class TestTwice(AdapterResidencyContract):
    factory = EvictsTwice


class TestTooFew(AdapterResidencyContract):
    factory = EvictsTooFew


class TestOrderDependent(AdapterResidencyContract):
    factory = OrderDependent
"""


def test_the_contract_catches_faulty_policies(pytester):
    pytester.makepyfile(test_faulty=FAULTY)
    recorder = pytester.inline_run("-p", "no:cacheprovider")
    failed: dict[str, set[str]] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        if report.failed:
            cls, test = report.nodeid.split("::")[1:3]
            failed.setdefault(cls, set()).add(f"{test}: " + next(
                line for line in str(report.longrepr).splitlines()
                if line.startswith("E ") and "invariant violated" in line))
    def caught(cls: str, test: str, words: str) -> bool:
        return any(entry.startswith(test) and words in entry for entry in failed.get(cls, ()))
    assert caught("TestNeeded", "test_choices_name_candidates_once", "evicts only candidates")
    assert caught("TestNeeded", "test_every_step_finds_its_adapters_resident", "evicts only candidates")
    assert caught("TestTwice", "test_choices_name_candidates_once", "names each candidate at most once")
    assert caught("TestTwice", "test_every_step_finds_its_adapters_resident", "at most once")
    assert caught("TestTooFew", "test_choices_name_candidates_once", "frees exactly the slots")
    assert caught("TestOrderDependent", "test_choices_are_deterministic_and_order_free", "order candidates come in")
    assert set(failed) == {"TestNeeded", "TestTwice", "TestTooFew", "TestOrderDependent"}
