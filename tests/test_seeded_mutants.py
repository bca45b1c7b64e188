"""Seeded mutants: plausible one-edit bugs in one policy per kind (tests/seeded_mutants.py),
and which of them the project catches where:

| policy | bug | caught by |
|---|---|---|
| EDF scheduler | ignores the request's deadline (its option stands in) | objective `earliest_deadline_first`; bench `identical` to FCFS |
| EDF scheduler | latest deadline first | contract: no request starves (the long job arrives strictly first); objective |
| victim (blocks per lost token) | `max` for `min` | objective `frees_most_blocks_per_lost_token` |
| victim | inverted ref-count test: every cost infinite | objective; bench `identical` to `newest` |
| victim | keeps preempting a sequence no longer running | contract: the victim is a running sequence |
| GDSF eviction | key reads the live clock | contract: eviction keys are pure functions of the candidate (and, in the caches, the queue refuses the keys that moved) |
| GDSF eviction | no unique tie-break | contract: eviction keys differ between candidates |
| GDSF eviction | value's sign flipped | objective `hot_prefix_survives_a_scan` |
| GDSF eviction | evicts "the block before" too | contract: eviction never evicts a referenced block |
| bigram tree drafter | depth bounded by the room left, not nodes | contract: drafts never run past max_model_len (near-full histories that branch) |
| bigram tree drafter | parents counted from 1 | contract: token trees are well formed |
| longest-cached-prefix router | tie-break forgets the load | bench `lopsided` only (the objective and every invariant hold) |
| longest-cached-prefix router | returns a list position | contract: routed to a live replica |
| longest-cached-prefix router | sticky home after its replica left | contract: routed to a live replica |

The correct policy of each kind passes its contract and its objective, and the bench
does not flag it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# Imported out here, as in test_conformance_suite: inner pytester runs unload what they import.
import servelab.engine  # noqa: F401
import servelab.testing.e2e  # noqa: F401
import torch  # noqa: F401

from servelab.bench.comparison import comparison_warnings
from servelab.bench.driver import StepRecorder, run_workload
from servelab.bench.metrics import SLO, summarize
from servelab.bench.sim.fleet import SimFleet, fleet_metrics, run_fleet
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.registry import PluginRegistry
from servelab.workload import build_workload

import seeded_mutants

pytest_plugins = ["pytester"]

MUTANTS = (Path(__file__).parent / "seeded_mutants.py").read_text()


def caught(pytester: pytest.Pytester, body: str, *args: str) -> dict[str, dict[str, str]]:
    """Run the contract classes in `body`; {class: {failed test: its failure's message line}}."""
    pytester.makepyfile(seeded_mutants=MUTANTS)
    pytester.makepyfile(test_mutants=body)
    pytester.makeconftest("""
        from hypothesis import Phase, settings
        settings.register_profile("mutants", derandomize=True, phases=[Phase.explicit, Phase.generate])
    """)
    pytester.syspathinsert()
    recorder = pytester.inline_run("-p", "no:cacheprovider", "--hypothesis-profile=mutants",
                                   "--servelab-max-examples=10", *args)
    found: dict[str, dict[str, str]] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        cls, test = report.nodeid.split("::")[1:3]
        found.setdefault(cls, {})
        if report.failed:
            text = str(report.longrepr)
            line = next((ln for ln in text.splitlines() if ln.startswith("E ") and (
                "invariant violated" in ln or "objective not met" in ln)), text.splitlines()[-1])
            found[cls][test.split("[")[0]] = line
    return found


def assert_caught(found: dict[str, str], expected: dict[str, str]) -> None:
    """Exactly the `expected` tests failed, each naming what it expected."""
    assert set(found) == set(expected), found
    for test, text in expected.items():
        assert text in found[test], (test, found[test])


def test_scheduler_mutants(pytester):
    found = caught(pytester, """
        from seeded_mutants import EDF, EDFIgnoringDeadlines, LatestDeadlineFirst
        from servelab.testing import SchedulerContract, objectives

        class TestEDF(SchedulerContract):
            factory = EDF
            objectives = (objectives.earliest_deadline_first(),)

        class TestEDFIgnoringDeadlines(TestEDF):
            factory = EDFIgnoringDeadlines

        class TestLatestDeadlineFirst(TestEDF):
            factory = LatestDeadlineFirst
    """, "-k", "not greedy")
    assert_caught(found["TestEDF"], {})
    assert_caught(found["TestEDFIgnoringDeadlines"],
                  {"test_objectives": "objective not met: earliest deadline admitted first"})
    assert_caught(found["TestLatestDeadlineFirst"],
                  {"test_no_request_starves": "invariant violated: no request starves",
                   "test_objectives": "objective not met: earliest deadline admitted first"})


def test_victim_mutants(pytester):
    found = caught(pytester, """
        from seeded_mutants import StickyVictim, blocks_per_lost_token, inverted_ref_count, most_tokens_per_block
        from servelab.testing import VictimContract, objectives

        class TestBlocksPerLostToken(VictimContract):
            victim = staticmethod(blocks_per_lost_token)
            objectives = (objectives.frees_most_blocks_per_lost_token(),)

        class TestMaxForMin(TestBlocksPerLostToken):
            victim = staticmethod(most_tokens_per_block)

        class TestInvertedRefCount(TestBlocksPerLostToken):
            victim = staticmethod(inverted_ref_count)

        class TestSticky(TestBlocksPerLostToken):
            victim = StickyVictim()
    """)
    objective = {"test_objectives": "objective not met: the victim frees the most blocks per lost token"}
    assert_caught(found["TestBlocksPerLostToken"], {})
    assert_caught(found["TestMaxForMin"], objective)
    assert_caught(found["TestInvertedRefCount"], objective)
    assert "invariant violated: the preemption victim is a running sequence" in found["TestSticky"][
        "test_victim_is_running"]


def test_eviction_mutants(pytester):
    found = caught(pytester, """
        from seeded_mutants import GDSF, GDSFLiveClock, GDSFMostValuableFirst, GDSFNoTieBreak, GDSFWithItsParent
        from servelab.testing import EvictionContract, objectives

        class TestGDSF(EvictionContract):
            factory = GDSF
            objectives = (objectives.hot_prefix_survives_a_scan(),)

        class TestLiveClock(TestGDSF):
            factory = GDSFLiveClock

        class TestNoTieBreak(TestGDSF):
            factory = GDSFNoTieBreak

        class TestMostValuableFirst(TestGDSF):
            factory = GDSFMostValuableFirst

        class TestWithItsParent(TestGDSF):
            factory = GDSFWithItsParent
    """)
    assert_caught(found["TestGDSF"], {})
    assert "invariant violated: eviction keys are pure functions of the candidate" in found["TestLiveClock"][
        "test_keys_are_unique_and_pure"]
    assert "invariant violated: eviction keys differ between candidates" in found["TestNoTieBreak"][
        "test_keys_are_unique_and_pure"]
    assert_caught(found["TestMostValuableFirst"], {"test_objectives": "objective not met: the hot prefix survives"})
    assert "invariant violated: eviction never evicts a referenced block" in found["TestWithItsParent"][
        "test_choices_name_candidates_once_and_cover_the_need"]


def test_drafter_mutants(pytester):
    found = caught(pytester, """
        from seeded_mutants import BigramTree, BigramTreeOffByOne, BigramTreePastMaxModelLen, TreeOptions
        from servelab.testing import DrafterContract

        class TestBigramTree(DrafterContract):
            factory = BigramTree
            options = TreeOptions()

        class TestPastMaxModelLen(TestBigramTree):
            factory = BigramTreePastMaxModelLen

        class TestOffByOne(TestBigramTree):
            factory = BigramTreeOffByOne
    """, "-k", "not replays")
    assert_caught(found["TestBigramTree"], {})
    assert "invariant violated: drafts never run past max_model_len" in found["TestPastMaxModelLen"][
        "test_nearly_full_sequences_that_branch"]
    assert "invariant violated: token trees are well formed" in found["TestOffByOne"]["test_repetitive_sequences"]


def test_router_mutants(pytester):
    found = caught(pytester, """
        from seeded_mutants import (LongestCachedPrefix, LongestCachedPrefixAllOnZero, LongestCachedPrefixByPosition,
                                    LongestCachedPrefixStickyHome)
        from servelab.testing import RouterContract, objectives

        class TestLongestCachedPrefix(RouterContract):
            factory = LongestCachedPrefix
            objectives = (objectives.longest_cached_prefix_wins(),)

        class TestAllOnZero(TestLongestCachedPrefix):
            factory = LongestCachedPrefixAllOnZero

        class TestByPosition(TestLongestCachedPrefix):
            factory = LongestCachedPrefixByPosition

        class TestStickyHome(TestLongestCachedPrefix):
            factory = LongestCachedPrefixStickyHome
    """, "-k", "not greedy")
    assert_caught(found["TestLongestCachedPrefix"], {})
    assert_caught(found["TestAllOnZero"], {})  # only the bench sees it (test_the_bench_flags_...)
    assert "invariant violated: routed to a live replica" in found["TestByPosition"]["test_replicas_leaving_and_joining"]
    assert "invariant violated: routed to a live replica" in found["TestStickyHome"][
        "test_replicas_leaving_and_joining"]


# ---------------------------------------------------------------- what only the bench sees


def _simulated_run(scheduler: str, workload, **engine):
    """One simulated run of `workload` with the named scheduler (built-in or seeded)."""
    from servelab.engine import LLMEngine

    clock = VirtualClock()
    source = SimSource.named("llama-3-8b", "h100", clock)
    registry = PluginRegistry.from_entry_points()
    registry.register(seeded_mutants.SchedulersUnderTest())
    recorder = StepRecorder(clock)
    registry.register(recorder)
    config = EngineConfig.from_dict({"engine": {"max_model_len": 1024} | engine, "scheduler": {"name": scheduler}})
    engine_ = LLMEngine(source.fit_config(config), registry, clock=clock, source=source)
    return run_workload(engine_, recorder, workload, scheduler)


def _warnings(names, records):
    return [(w["kind"], w["configs"]) for w in comparison_warnings(
        names, records, [summarize(r, SLO()) for r in records], simulated=True)]


def test_the_bench_flags_an_edf_that_ignores_deadlines_as_identical_to_fcfs():
    workload = build_workload("fixed:num_requests=24,prompt_len=64,output_len=16,arrival=poisson,rate=400,"
                              "deadline_s=2,urgent_fraction=0.5,urgent_deadline_s=0.2", 1000)
    records = [_simulated_run(name, workload, max_num_seqs=2)
               for name in ("continuous", "edf", "edf-ignoring-deadlines")]
    assert _warnings(["continuous", "edf", "edf-ignoring-deadlines"], records) == [
        ("identical", ["continuous", "edf-ignoring-deadlines"])]


def test_the_bench_flags_a_victim_whose_costs_all_tie_as_identical_to_newest():
    workload = build_workload("fixed:num_requests=16,prompt_len=64,output_len=160", 1000)
    records = [_simulated_run(name, workload, num_kv_blocks=48, block_size=16, max_num_seqs=16, max_model_len=256)
               for name in ("continuous", "victim-blocks-per-token", "victim-inverted-ref-count")]
    assert all(r.preemptions > 0 for r in records)
    assert _warnings(["continuous", "blocks-per-token", "inverted-ref-count"], records) == [
        ("identical", ["continuous", "inverted-ref-count"])]


def test_the_bench_flags_a_router_that_puts_everything_on_replica_zero():
    config = EngineConfig.from_dict({"engine": {"max_num_seqs": 8, "max_model_len": 1024},
                                     "allocator": {"name": "radix"}, "router": {"name": "round-robin"}})
    workload = build_workload("shared-prefix:num_groups=4,prefix_len=128,num_requests=48,tail_len=16,output_len=4,"
                              "shuffle=1,arrival=poisson,rate=300", 1000)
    names, records, metrics = [], [], []
    for name, router in (("longest-prefix", seeded_mutants.LongestCachedPrefix()),
                         ("all-on-zero", seeded_mutants.LongestCachedPrefixAllOnZero())):
        fleet = SimFleet(name, config, 4, "h100", "llama-3-8b")
        fleet.router = router
        record = run_fleet(fleet, workload)
        names.append(name)
        records.append(record.run)
        metrics.append(fleet_metrics(record, SLO(), 4, name))
    assert metrics[1]["fleet"]["requests_per_replica"][0] == 48
    assert [(w["kind"], w["configs"]) for w in comparison_warnings(names, records, metrics, True)] == [
        ("lopsided", ["all-on-zero"])]
