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


def test_the_adapter_affinity_router_follows_resident_adapters():
    from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext
    from servelab.plugins.routers.adapter_affinity import AdapterAffinityOptions, AdapterAffinityRouter

    router = AdapterAffinityRouter(AdapterAffinityOptions(load_margin_tokens=100), RouterContext(num_replicas=3))
    replicas = [ReplicaSnapshot(0, num_queued_tokens=10), ReplicaSnapshot(1, num_queued_tokens=50,
                                                                          resident_adapters={"sql"}),
                ReplicaSnapshot(2, num_queued_tokens=500, resident_adapters={"chat", "sql"})]
    assert router.route(RouteRequest("r", [1, 2], adapter="sql"), replicas) == 1  # the lighter holder
    assert router.route(RouteRequest("r", [1, 2], adapter="chat"), replicas) == 0  # its holder is overloaded
    assert router.route(RouteRequest("r", [1, 2], adapter="other"), replicas) == 0  # held nowhere: by load
    assert router.route(RouteRequest("r", [1, 2]), replicas) == 0  # the base model: by load


def test_a_replica_snapshot_names_its_resident_adapters(tmp_path):
    pytest.importorskip("peft")
    from lora_adapters import build_adapter

    from servelab import LLM, LoRARequest, SamplingParams
    from servelab.routing import replica_snapshot
    from servelab.testing.tiny_model import tiny_checkpoint

    base = tiny_checkpoint("llama")
    llm = LLM(base, enable_lora=True, max_loras=2)
    assert replica_snapshot(llm.engine, 0).resident_adapters == frozenset()
    adapter = LoRARequest("sql", 1, build_adapter(base, tmp_path / "sql", r=2))
    llm.generate([[4, 5, 6]], SamplingParams(max_tokens=2), lora_request=adapter)
    assert replica_snapshot(llm.engine, 0).resident_adapters == {"sql"}


def test_host_memory_keeps_adapters_in_flight_and_rereads_the_others():
    """max_cpu_loras bounds host memory except for the pool's adapters and those with
    sequences in flight; an adapter dropped is read again when a request names it, on the
    request's side (never inside a step)."""
    from servelab import LoRARequest
    from servelab.lora_manager import LoRAManager
    from servelab.model.lora_layers import LoRAState
    from servelab.testing.adapter_residency import tiny_adapter
    from servelab.model.model_config import ModelConfig

    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "num_attention_heads": 2,
                                    "num_hidden_layers": 1, "intermediate_size": 8, "rms_norm_eps": 1e-5,
                                    "hidden_size": 24})
    reads: list[str] = []

    def loader(name, path, model_config, max_rank):
        reads.append(name)
        return tiny_adapter(name, path, model_config, max_rank)

    manager = LoRAManager(config, LoRAState(1), LeastRecentlyUsedAdapter(), max_cpu_loras=1, max_lora_rank=8,
                          loader=loader)
    requests = [LoRARequest(f"a{i}", i, f"/a{i}") for i in (1, 2, 3)]
    in_flight: set[int] = set()
    manager.demand = lambda: ({}, in_flight)
    manager.register(requests[0])
    assert manager.slots_for([1]) == [0]
    in_flight.add(2)
    manager.register(requests[1])
    manager.slots_for([1])  # a step: adapter 2 counts as in flight from now on
    manager.register(requests[2])  # host: 1 (in the pool), 2 (in flight), 3 (just read)
    assert sorted(manager.host) == [1, 2, 3]
    in_flight.clear()
    assert manager.slots_for([3]) == [0]  # 1 leaves the pool; nothing is in flight but 3
    assert sorted(manager.host) == [3]  # the rest dropped to fit max_cpu_loras
    assert manager.register(requests[0]) == 1 and reads == ["a1", "a2", "a3", "a1"]  # read again, at registration
    assert manager.slots_for([1]) == [0] and reads[-1] == "a1"  # the step reads no file
