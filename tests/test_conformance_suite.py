"""The conformance suite as a plugin author meets it, run with pytester: the pytest11
plugin loads, `class TestMine(SomeContract)` collects and passes for a correct policy
(by factory, by installed name, or through a fixture), and each deliberately faulty
policy in faulty_plugins.py fails the specific tests that check the invariant it breaks,
with a message naming that invariant."""

from __future__ import annotations

from pathlib import Path

import pytest

# Inner runs are in-process, and pytester unloads every module an inner run imported.
# Imported out here: C extensions (torch, tokenizers, safetensors, via the engine) cannot
# be loaded twice, and servelab.testing's per-process caches (the tiny model, the
# reference tokens) must outlive each inner run.
import servelab.engine  # noqa: F401
import servelab.testing.allocator_machine  # noqa: F401
import servelab.testing.e2e  # noqa: F401
import torch  # noqa: F401

pytest_plugins = ["pytester"]

FAULTY = (Path(__file__).parent / "faulty_plugins.py").read_text()


def run_contract(pytester: pytest.Pytester, body: str, *args: str) -> dict[str, tuple[str, str]]:
    """Run a test module `body` (faulty_plugins importable); {test: (outcome, failure text)}."""
    pytester.makepyfile(faulty_plugins=FAULTY)
    pytester.makepyfile(test_mine=body)
    # Derandomized, so these tests do not depend on luck, and reporting the first failing
    # example unshrunk: shrinking a state machine takes seconds.
    pytester.makeconftest("""
        from hypothesis import Phase, settings
        settings.register_profile("faulty", derandomize=True, phases=[Phase.explicit, Phase.generate])
    """)
    pytester.syspathinsert()
    recorder = pytester.inline_run("-p", "no:cacheprovider", "--hypothesis-profile=faulty",
                                   "--servelab-max-examples=15", *args)
    results = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        if report.when == "call" or report.outcome != "passed":
            name = report.nodeid.split("::", 1)[1]
            results[name] = (report.outcome, str(report.longrepr) if report.failed else "")
    return results


def failures(results: dict[str, tuple[str, str]]) -> dict[str, str]:
    return {name: text for name, (outcome, text) in results.items() if outcome == "failed"}


# ---------------------------------------------------------------- the plugin itself


def test_plugin_is_registered_through_its_entry_point(pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--servelab-max-examples=N*"])
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["servelab conformance contracts: AllocatorContract, SchedulerContract*"])


def test_a_correct_policy_passes_by_factory_by_name_and_by_fixture(pytester):
    results = run_contract(pytester, """
        import pytest
        from servelab.kit import PagedAllocator
        from servelab.testing import AllocatorContract, SchedulerContract

        def make_paged(options, context):
            return PagedAllocator(options, context)

        class TestByFactory(AllocatorContract):
            factory = make_paged

        class TestByName(SchedulerContract):
            plugin_name = "continuous"

        class TestByFixture(AllocatorContract):
            @pytest.fixture
            def servelab_factory(self, tmp_path):
                return lambda options, context: PagedAllocator(options, context)
    """, "-k", "not greedy or roomy")
    assert failures(results) == {}
    assert "TestByFactory::test_random_operation_sequences" in results
    assert "TestByName::test_random_workloads" in results
    assert "TestByFixture::test_writes_after_a_fork_stay_private" in results
    assert results["TestByName::test_greedy_tokens_match_the_reference_policies[roomy]"][0] == "passed"


def test_a_contract_without_a_policy_says_how_to_name_one(pytester):
    results = run_contract(pytester, """
        from servelab.testing import AllocatorContract

        class TestNothing(AllocatorContract):
            pass
    """, "-k", "fresh_pool")
    [text] = failures(results).values()
    assert "set `factory = ...` or `plugin_name = ...`" in text


# ---------------------------------------------------------------- faulty policies


def test_leaking_allocator_fails_block_leaked_on_free(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import LeakyAllocator
        from servelab.testing import AllocatorContract

        class TestLeaky(AllocatorContract):
            factory = LeakyAllocator
    """)
    failed = failures(results)
    for test in ("test_free_returns_every_block", "test_random_operation_sequences"):
        assert "invariant violated: block leaked on free" in failed[f"TestLeaky::{test}"]
    assert "TestLeaky::test_fresh_pool_is_all_free" not in failed


def test_allocator_without_copy_on_write_fails_copy_on_write(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import NoCopyOnWriteAllocator
        from servelab.testing import AllocatorContract

        class TestNoCow(AllocatorContract):
            factory = NoCopyOnWriteAllocator
    """)
    failed = failures(results)
    for test in ("test_writes_after_a_fork_stay_private", "test_random_operation_sequences"):
        assert "invariant violated: copy-on-write" in failed[f"TestNoCow::{test}"]
    assert "TestNoCow::test_free_returns_every_block" not in failed


def test_scheduler_over_its_token_budget_fails_token_budget_exceeded(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import OverBudgetScheduler
        from servelab.testing import SchedulerContract

        class TestOverBudget(SchedulerContract):
            factory = OverBudgetScheduler
    """)
    failed = failures(results)
    for test in ("test_limits_hold_under_load", "test_random_workloads"):
        assert "invariant violated: token budget exceeded" in failed[f"TestOverBudget::{test}"]


def test_scheduler_that_drops_requests_fails_request_dropped(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import DroppingScheduler
        from servelab.testing import SchedulerContract

        class TestDropping(SchedulerContract):
            factory = DroppingScheduler
    """)
    failed = failures(results)
    for test in ("test_every_request_is_served_once", "test_limits_hold_under_load", "test_random_workloads"):
        assert "invariant violated: request dropped" in failed[f"TestDropping::{test}"]


def test_drafter_proposing_out_of_vocabulary_ids_fails_vocabulary(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import PaddingLookupDrafter
        from servelab.testing import DrafterContract

        class TestPadding(DrafterContract):
            factory = PaddingLookupDrafter
            num_speculative_tokens = 3
    """)
    failed = failures(results)
    for test in ("test_repetitive_sequences", "test_random_batches", "test_replays_a_greedy_generation"):
        assert "invariant violated: draft tokens are in the vocabulary" in failed[f"TestPadding::{test}"]
    assert "TestPadding::test_empty_batch_gets_no_proposals" not in failed


def test_kernel_with_a_wrong_scale_fails_dense_attention(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import WrongScaleAttention
        from servelab.testing import AttentionBackendContract

        class TestWrongScale(AttentionBackendContract):
            factory = WrongScaleAttention
    """)
    failed = failures(results)
    assert "invariant violated: attention output equals dense causal attention" in \
        failed["TestWrongScale::test_random_batches"]
    grid = [name for name in failed if "test_mixed_batch_matches_dense_attention" in name]
    assert len(grid) == 24, "every shape of the grid catches it"
    assert "invariant violated: tokens identical to the reference policies" in \
        failed["TestWrongScale::test_greedy_tokens_match_the_reference_policies[roomy]"]


# ---------------------------------------------------------------- faults the hardened contracts catch


def test_positional_hash_prefix_cache_fails_whole_prefix_kv(pytester):
    """Keyed by (block index, tokens): block 1 of "X0 X1" is handed to "Y0 X1"."""
    results = run_contract(pytester, """
        from faulty_plugins import PositionalHashAllocator
        from servelab.testing import AllocatorContract

        class TestPositional(AllocatorContract):
            factory = PositionalHashAllocator
    """, "-k", "not greedy")
    failed = failures(results)
    for test in ("test_equal_blocks_after_different_parents_never_hit", "test_random_operation_sequences"):
        assert "invariant violated: a prefix-cache hit holds the K/V of the whole matched prefix" in \
            failed[f"TestPositional::{test}"]
    assert "TestPositional::test_prefix_hits_reuse_computed_blocks" not in failed


def test_refused_allocate_that_keeps_blocks_fails_all_or_nothing(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import RefusalKeepsBlocksAllocator
        from servelab.testing import AllocatorContract

        class TestKeeps(AllocatorContract):
            factory = RefusalKeepsBlocksAllocator
    """, "-k", "not greedy")
    failed = failures(results)
    for test in ("test_allocate_is_all_or_nothing", "test_random_operation_sequences"):
        assert "invariant violated: allocate and fork are all-or-nothing" in failed[f"TestKeeps::{test}"]
    assert "TestKeeps::test_writes_after_a_fork_stay_private" not in failed


def test_slots_counted_per_holder_fail_stats_bounds(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import PerHolderSlotsAllocator
        from servelab.testing import AllocatorContract

        class TestPerHolder(AllocatorContract):
            factory = PerHolderSlotsAllocator
    """, "-k", "not greedy")
    failed = failures(results)
    for test in ("test_stats_stay_in_bounds_through_fork_cow_and_rollback", "test_writes_after_a_fork_stay_private"):
        assert "invariant violated: allocator stats within bounds" in failed[f"TestPerHolder::{test}"]
    assert "TestPerHolder::test_allocate_is_all_or_nothing" not in failed


def test_lookups_counted_before_admission_fail_prefix_statistics(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import CountsEveryLookupAllocator
        from servelab.testing import AllocatorContract

        class TestCountsLookups(AllocatorContract):
            factory = CountsEveryLookupAllocator
    """, "-k", "not greedy")
    failed = failures(results)
    for test in ("test_prefix_statistics_count_admissions", "test_random_operation_sequences"):
        assert "invariant violated: prefix statistics count one lookup per admission" in \
            failed[f"TestCountsLookups::{test}"]
    assert "TestCountsLookups::test_prefix_hits_reuse_computed_blocks" not in failed


def test_an_exception_from_the_policy_names_the_invariant_and_keeps_its_traceback(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import StrictFreeAllocator
        from servelab.testing import AllocatorContract

        class TestStrictFree(AllocatorContract):
            factory = StrictFreeAllocator
    """, "-k", "free_returns or random_operation")
    failed = failures(results)
    for test in ("test_free_returns_every_block", "test_random_operation_sequences"):
        text = failed[f"TestStrictFree::{test}"]
        assert "invariant violated: free of an unknown sequence is a no-op: the policy raised KeyError" in text
        assert "faulty_plugins.py" in text and "in free" in text, "the policy's traceback is in the report"


def test_scheduler_not_charging_decodes_fails_token_budget_on_every_run(pytester):
    """Derandomized by default: the pressing scenario and the random workloads catch it
    on every run, at the contract's default example count."""
    results = run_contract(pytester, """
        from faulty_plugins import UnchargedDecodeScheduler
        from servelab.testing import SchedulerContract

        class TestUncharged(SchedulerContract):
            factory = UnchargedDecodeScheduler
    """, "-k", "not greedy")
    failed = failures(results)
    for test in ("test_budget_holds_with_many_decodes_and_long_prompts", "test_random_workloads"):
        assert "invariant violated: token budget exceeded" in failed[f"TestUncharged::{test}"]
    assert "TestUncharged::test_every_request_is_served_once" not in failed


def test_drafter_without_a_declared_k_is_still_held_to_at_most_k(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import LongLookupDrafter
        from servelab.testing import DrafterContract

        class TestLong(DrafterContract):
            factory = LongLookupDrafter
    """, "-k", "repetitive or random_batches")
    failed = failures(results)
    for test in ("test_repetitive_sequences", "test_random_batches"):
        assert "invariant violated: at most num_speculative_tokens draft tokens per sequence" in \
            failed[f"TestLong::{test}"]


def test_drafter_writing_into_a_sequence_fails_immutable(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import StashingDrafter
        from servelab.testing import DrafterContract

        class TestStashing(DrafterContract):
            factory = StashingDrafter
            num_speculative_tokens = 3
    """, "-k", "repetitive or random_batches")
    failed = failures(results)
    for test in ("test_repetitive_sequences", "test_random_batches"):
        text = failed[f"TestStashing::{test}"]
        assert "invariant violated: propose never changes the sequences" in text and "draft_token_ids" in text


def test_drafter_keeping_state_past_release_fails_release(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import StaleCacheDrafter
        from servelab.testing import DrafterContract

        class TestStale(DrafterContract):
            factory = StaleCacheDrafter
            num_speculative_tokens = 3
    """, "-k", "release or empty_batch")
    failed = failures(results)
    assert "invariant violated: release forgets a sequence" in failed["TestStale::test_release_forgets_a_sequence"]
    assert "TestStale::test_empty_batch_gets_no_proposals" not in failed


def test_drafter_failing_on_a_finished_sequence_fails_finished(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import ProposedOnlyFinishDrafter
        from servelab.testing import DrafterContract

        class TestProposedOnly(DrafterContract):
            factory = ProposedOnlyFinishDrafter
            num_speculative_tokens = 3
    """, "-k", "finished or empty_batch")
    failed = failures(results)
    text = failed["TestProposedOnly::test_finished_sequences_feed_the_drafter"]
    assert "invariant violated: finished accepts any finished sequence" in text and "KeyError" in text
    assert "TestProposedOnly::test_empty_batch_gets_no_proposals" not in failed


def test_kernel_reading_blocks_in_sorted_order_fails_end_to_end(pytester):
    """The end-to-end pool is handed out in shuffled order, so block tables are not ascending."""
    results = run_contract(pytester, """
        from faulty_plugins import SortedBlocksAttention
        from servelab.testing import AttentionBackendContract

        class TestSorted(AttentionBackendContract):
            factory = SortedBlocksAttention
    """, "-k", "greedy and roomy")
    assert "invariant violated: tokens identical to the reference policies" in \
        failures(results)["TestSorted::test_greedy_tokens_match_the_reference_policies[roomy]"]


def test_positional_hash_prefix_cache_changes_tokens_end_to_end(pytester):
    """"Y0 X1" reuses X1's K/V computed after X0: the warm-cache run's tokens change."""
    results = run_contract(pytester, """
        from faulty_plugins import PositionalHashAllocator
        from servelab.testing import AllocatorContract

        class TestPositional(AllocatorContract):
            factory = PositionalHashAllocator
    """, "-k", "greedy and roomy")
    assert "invariant violated: tokens identical to the reference policies" in \
        failures(results)["TestPositional::test_greedy_tokens_match_the_reference_policies[roomy]"]


def test_allocator_without_copy_on_write_fails_parallel_sampling_end_to_end(pytester):
    """Seeded parallel samples write different tokens after the fork."""
    results = run_contract(pytester, """
        from faulty_plugins import NoCopyOnWriteAllocator
        from servelab.testing import AllocatorContract

        class TestNoCow(AllocatorContract):
            factory = NoCopyOnWriteAllocator
    """, "-k", "greedy and parallel")
    assert "invariant violated: tokens identical to the reference policies" in \
        failures(results)["TestNoCow::test_greedy_tokens_match_the_reference_policies[parallel]"]


def test_a_scheduler_exception_names_the_invariant_in_the_harness_and_end_to_end(pytester):
    results = run_contract(pytester, """
        from faulty_plugins import CrashingScheduler
        from servelab.testing import SchedulerContract

        class TestCrashing(SchedulerContract):
            factory = CrashingScheduler
    """, "-k", "every_request or (greedy and roomy)")
    failed = failures(results)
    for test, invariant in (("test_every_request_is_served_once", "schedule() plans a step within every limit"),
                            ("test_greedy_tokens_match_the_reference_policies[roomy]",
                             "tokens identical to the reference policies")):
        text = failed[f"TestCrashing::{test}"]
        assert f"invariant violated: {invariant}: the policy raised IndexError" in text
        assert "in schedule" in text and "faulty_plugins.py" in text, "the scheduler's traceback is in the report"


@pytest.mark.parametrize("router, options, invariant, tests", [
    ("FixedCycleRouter", None, "routed to a live replica", ("test_replicas_leaving_and_joining", "test_random_fleets")),
    ("ListPositionRouter", None, "routed to a live replica", ("test_replicas_leaving_and_joining", "test_random_fleets")),
    ("SheddingRouter", None, "request lost", ("test_one_replica_gets_every_request",)),
    ("HedgingRouter", "PrefixAffinityOptions()", "request duplicated",
     ("test_replicas_leaving_and_joining", "test_random_fleets")),
    ("UnseededTwoChoicesRouter", None, "deterministic", ("test_same_calls_same_choices", "test_random_fleets")),
])
def test_faulty_router_fails_its_invariant(pytester, router, options, invariant, tests):
    results = run_contract(pytester, f"""
        from faulty_plugins import {router}
        from servelab.plugins.routers.prefix_affinity import PrefixAffinityOptions
        from servelab.testing import RouterContract

        class TestFaulty(RouterContract):
            factory = {router}
            options = {options}
    """)
    failed = failures(results)
    for test in tests:
        assert f"invariant violated: {invariant}" in failed[f"TestFaulty::{test}"]
    assert "TestFaulty::test_implements_router" not in failed
