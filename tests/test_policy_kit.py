"""The policy kit's new seams: eviction policies (a kind of their own) and preemption
victims, their contracts, and the contracts catching a broken one with the invariant named."""

from __future__ import annotations

import pytest

from servelab import LLM, SamplingParams
from servelab.errors import PolicyViolation
from servelab.interfaces import AllocatorContext, EvictionCandidate, Sequence, SequenceStatus
from servelab.interfaces import Preemption
from servelab.kit import VICTIMS, KeyedEviction, KeyedVictim, LeastRecentlyUsed
from servelab.plugin_types import VictimPlugin
from servelab.plugins.allocators.hash_prefix import HashAllocator
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.eviction.policies import LeastFrequentlyUsed, SegmentedLRU, WaitingAware
from servelab.testing import ContractViolation, EvictionContract, VictimContract, make_allocator, objectives
from servelab.testing.drafter import decoding_sequence

class CheapestToRedo(KeyedVictim):
    """Most blocks freed per token to recompute; a shared block frees nothing."""

    def key(self, seq, allocator):
        table = allocator.block_table(seq.request_id)
        owned = sum(1 for block in table if allocator.ref_count(block) == 1)
        return owned / (1 + seq.num_computed_tokens)


# ---------------------------------------------------------------- the contracts, built-ins


class TestLRU(EvictionContract):
    plugin_name = "lru"


class TestLFU(EvictionContract):
    plugin_name = "lfu"
    objectives = (objectives.hot_prefix_survives_a_scan(),)


class TestSLRU(EvictionContract):
    plugin_name = "slru"
    objectives = (objectives.hot_prefix_survives_a_scan(),)


class TestWaitingAware(EvictionContract):
    plugin_name = "waiting-aware"


class TestNewest(VictimContract):
    plugin_name = "newest"


class TestFewestComputedTokens(VictimContract):
    plugin_name = "fewest-computed-tokens"


class TestMostKVBlocks(VictimContract):
    plugin_name = "most-kv-blocks"


class TestLowestPriorityThenNewest(VictimContract):
    plugin_name = "lowest-priority-then-newest"


class TestCheapestToRedo(VictimContract):
    """The cost-aware example of docs/schedulers.md, a few lines on the kit."""

    factory = CheapestToRedo


# ---------------------------------------------------------------- broken policies are caught


class EvictsLowestBlockIds(KeyedEviction):
    """The bug: evicts the lowest block ids of the whole pool, held or not."""

    def choose(self, candidates, num_blocks):
        return list(range(num_blocks))


def broken_eviction_contract() -> EvictionContract:
    contract = EvictionContract()
    contract._factory, contract._options = EvictsLowestBlockIds, None
    return contract


def test_the_eviction_contract_catches_a_policy_evicting_a_referenced_block():
    contract = broken_eviction_contract()
    with pytest.raises(ContractViolation, match="invariant violated: eviction never evicts a referenced block"):
        contract.test_choices_name_candidates_once_and_cover_the_need()
    with pytest.raises(ContractViolation, match="invariant violated: eviction never evicts a referenced block"):
        contract.test_caches_keep_held_blocks()


def test_a_cache_refuses_the_broken_choice_before_changing_anything():
    alloc = RadixAllocator(None, AllocatorContext(num_blocks=4, block_size=2, max_model_len=8,
                                                  eviction=EvictsLowestBlockIds()))
    held = admitted(alloc, "held", [1, 2, 3])  # block 0 cached and held
    admitted(alloc, "gone", [5, 6, 7])
    alloc.free("gone")  # its first block stays cached, evictable
    before = alloc.stats()
    with pytest.raises(PolicyViolation, match="eviction never evicts a referenced block: .*block 0"):
        alloc.allocate("new", 4)  # two blocks: the free one and one evicted
    assert alloc.stats() == before and alloc.block_table("held") == held


class CopiesTheVictim(KeyedVictim):
    """The bug: returns an equal copy of the newest, not the running sequence itself."""

    def choose(self, running, allocator):
        newest = running[-1]
        return Sequence(newest.request_id, list(newest.prompt_token_ids), newest.params, newest.arrival_time)


class Flips(KeyedVictim):
    """The bug: alternates between the first and the last (not deterministic)."""

    calls = 0

    def choose(self, running, allocator):
        Flips.calls += 1
        return running[Flips.calls % 2 - 1]


class SwapsMaybe(KeyedVictim):
    """The bug: a swap decision that is not a bool."""

    def choose(self, running, allocator):
        return Preemption(running[-1], swap="yes")


@pytest.mark.parametrize("faulty, invariant", [
    (CopiesTheVictim, "the preemption victim is a running sequence"),
    (Flips, "the victim policy is deterministic"),
    (SwapsMaybe, "a Preemption's swap is True, False or None"),
])
def test_the_victim_contract_catches_each_seeded_faulty_victim(faulty, invariant):
    contract = VictimContract()
    contract._factory, contract._options = faulty, None
    with pytest.raises(ContractViolation, match=f"invariant violated: {invariant}"):
        contract.test_victim_is_running()


def test_the_victim_contract_catches_a_victim_that_is_not_running():
    contract = VictimContract()
    contract.victim = lambda running, allocator: Sequence("ghost", [1], SamplingParams(), 0.0)
    with pytest.raises(ContractViolation, match="invariant violated: the preemption victim is a running sequence: "
                                                "chose ghost \\(waiting\\)"):
        contract.test_victim_is_running()
    with pytest.raises(ContractViolation, match="the preemption victim is a running sequence"):
        contract.test_scheduler_invariants_hold_under_preemption()


# ---------------------------------------------------------------- what each policy does


def admitted(alloc, seq_id, prompt):
    seq = decoding_sequence(seq_id, prompt, [])
    seq.num_computed_tokens = alloc.match_prefix(seq)
    assert alloc.allocate(seq_id, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    alloc.cache_blocks(seq)
    return list(alloc.block_table(seq_id))


def candidate(block, last_access, hits=0, demand=0):
    return EvictionCandidate(block=block, last_access=last_access, inserted=block, hits=hits, demand=demand)


def test_each_policy_orders_by_what_it_reads():
    popular_old = candidate(1, last_access=1, hits=5)
    once_new = candidate(2, last_access=9, hits=1)
    never_mid = candidate(3, last_access=5, hits=0, demand=2)
    fresh = candidate(4, last_access=7, hits=0)
    pool = [popular_old, once_new, never_mid, fresh]
    assert LeastRecentlyUsed().choose(pool, 4) == [1, 3, 4, 2]
    assert LeastFrequentlyUsed().choose(pool, 4) == [3, 4, 2, 1]
    assert SegmentedLRU().choose(pool, 4) == [3, 4, 1, 2]  # probation (never hit) first
    assert WaitingAware().choose(pool, 4) == [1, 4, 2, 3]  # the prefix two waiting requests need goes last
    assert LeastRecentlyUsed().choose(pool, 2) == [1, 3]


@pytest.mark.parametrize("cls", [RadixAllocator, HashAllocator])
def test_lfu_keeps_a_reused_prefix_that_lru_evicts(cls):
    def run(policy):
        alloc = cls(None, AllocatorContext(num_blocks=6, block_size=2, max_model_len=12, eviction=policy))
        for i in range(3):  # the system prompt [9, 9] is reused three times
            admitted(alloc, f"sys{i}", [9, 9, 20 + i])
            alloc.free(f"sys{i}")
        admitted(alloc, "scan", [1, 1, 2, 2, 3])  # a one-off scan, used after the system prompt
        alloc.free("scan")
        admitted(alloc, "new", [4, 4, 5, 5, 6, 6, 7])  # needs four blocks: evicts
        probe = decoding_sequence("probe", [9, 9, 30], [])
        hit = alloc.match_prefix(probe)
        alloc.free("probe")
        return hit

    assert run(LeastRecentlyUsed()) == 0
    assert run(LeastFrequentlyUsed()) == 2


@pytest.mark.parametrize("cls", [RadixAllocator, HashAllocator])
def test_waiting_aware_spares_the_prefix_a_queued_request_will_hit(cls):
    def run(policy):
        alloc = cls(None, AllocatorContext(num_blocks=5, block_size=2, max_model_len=10, eviction=policy))
        admitted(alloc, "a", [1, 1, 2])
        alloc.free("a")  # [1, 1] cached, least recently used
        admitted(alloc, "b", [3, 3, 4])
        alloc.free("b")
        waiting = decoding_sequence("w", [1, 1, 8], [])
        alloc.anticipate([waiting])
        admitted(alloc, "c", [5, 5, 6, 6, 7, 7, 0])  # four blocks: one cached block must go
        return alloc.match_prefix(waiting)

    assert run(LeastRecentlyUsed()) == 0
    assert run(WaitingAware()) == 2


def running(*specs):
    seqs = []
    for index, (priority, arrival, computed) in enumerate(specs):
        seq = Sequence(f"s{index}", [1] * 8, SamplingParams(), arrival, priority=priority)
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, computed
        seqs.append(seq)
    return seqs


def test_victim_policies_choose_as_documented():
    alloc = make_allocator("paged", 32, 4, 32)
    batch = running((0, 0.0, 8), (1, 1.0, 2), (0, 2.0, 5))  # rank order as a scheduler keeps it
    for seq, tokens in zip(batch, (8, 20, 5)):
        alloc.allocate(seq.request_id, tokens)
    chosen = {name: VICTIMS[name]().choose(batch, alloc).request_id for name in VICTIMS}
    assert chosen == {"newest": "s2", "fewest-computed-tokens": "s1", "most-kv-blocks": "s1",
                      "lowest-priority-then-newest": "s1"}


def test_policies_are_selected_by_name(servelab_tiny_checkpoint):
    llm = LLM(servelab_tiny_checkpoint, max_model_len=64, **{"allocator.name": "radix", "eviction.name": "slru",
                                                             "scheduler.preemption": "most-kv-blocks"})
    assert isinstance(llm.engine.allocator.eviction, SegmentedLRU)
    assert type(llm.engine.scheduler._victim_policy) is VICTIMS["most-kv-blocks"]
    assert LLM(servelab_tiny_checkpoint, max_model_len=64, **{"allocator.name": "hash"}).engine.allocator.eviction \
        .__class__ is LeastRecentlyUsed


class SwapsTheLongest(KeyedVictim):
    """The victim with the most computed tokens; its KV is swapped when its prompt is of
    even length, recomputed otherwise (a stand-in for a cost model)."""

    def choose(self, running, allocator):
        victim = super().choose(running, allocator)
        return Preemption(victim, swap=len(victim.prompt_token_ids) % 2 == 0)

    def key(self, seq, allocator):
        return seq.num_computed_tokens


def test_a_third_party_victim_is_selected_by_name_and_decides_swap(servelab_tiny_checkpoint):
    """`[scheduler] preemption` resolves through the registry, and the victim's swap choice
    overrides preemption_mode ("recompute") where the host tier is on; tokens unchanged."""
    import servelab
    from servelab import PluginRegistry

    class Plugin:
        @staticmethod
        @servelab.hookimpl
        def servelab_register_victims():
            return [VictimPlugin(name="swaps-the-longest", factory=SwapsTheLongest, contract_version=1)]

    registry = PluginRegistry.from_entry_points()
    registry.register(Plugin, distribution="research")
    prompts = [[3 + (7 * i + j) % 200 for j in range(10 + i)] for i in range(5)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    reference = [o.token_ids for o in LLM(servelab_tiny_checkpoint, max_model_len=32).generate(prompts, params)]
    llm = LLM(servelab_tiny_checkpoint, registry=registry, max_model_len=32, block_size=4, num_kv_blocks=8,
              max_num_seqs=5, max_num_batched_tokens=64,
              **{"scheduler.preemption": "research:swaps-the-longest", "kv_offload.host_blocks": 24})
    assert isinstance(llm.engine.scheduler._victim_policy, SwapsTheLongest)
    assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    tier = llm.engine.host_tier.stats()
    assert llm.engine.scheduler.num_preemptions > tier.num_swap_outs > 0  # some swapped, some recomputed
    assert llm.engine.scheduler.num_discarded_tokens > 0


# ---------------------------------------------------------------- options composed explicitly


def _context():
    from servelab.interfaces import SchedulerContext

    return SchedulerContext(allocator=make_allocator("paged", 16, 4, 32), max_num_seqs=4,
                            max_num_batched_tokens=64, max_model_len=32, clock=lambda: 0.0)


def test_an_options_class_of_its_own_gets_the_kits_one_default_per_option():
    import attrs

    from servelab.kit import ContinuousOptions, ContinuousScheduler, QueueOptions

    @attrs.frozen
    class Unrelated:
        depth: int = 3

    scheduler = ContinuousScheduler(Unrelated(), _context())
    assert scheduler.options == Unrelated() and scheduler.queue_options == ContinuousOptions()
    assert scheduler.queue_options.priority_aging_s == attrs.fields(QueueOptions).priority_aging_s.default == 10.0


def test_an_options_class_repeating_a_kit_option_without_extending_it_is_refused():
    import attrs

    from servelab import ConfigError
    from servelab.kit import ContinuousScheduler

    @attrs.frozen
    class Repeats:
        priority_aging_s: float = 0.0

    with pytest.raises(ConfigError, match=r"Repeats declares priority_aging_s without extending "
                                          r"servelab.kit.ContinuousOptions.*class Repeats\(ContinuousOptions\)"):
        ContinuousScheduler(Repeats(), _context())


def test_the_sjf_example_ages_priorities_with_the_kits_default():
    from servelab_sjf.sjf import SJFOptions, SJFScheduler

    scheduler = SJFScheduler(None, _context())
    assert scheduler.options.priority_aging_s == 10.0
    urgent_late = Sequence("urgent", [1] * 4, SamplingParams(max_tokens=4), 100.0, priority=0)
    low_early = Sequence("low", [1] * 4, SamplingParams(max_tokens=4), 0.0, priority=1)
    assert scheduler.rank(low_early) < scheduler.rank(urgent_late)  # 100 s of waiting outweighs one level
    strict = SJFScheduler(SJFOptions(priority_aging_s=0.0), _context())
    assert strict.rank(urgent_late) < strict.rank(low_early)


def test_option_or_still_reads_an_option_for_plugins_written_against_earlier_kits():
    import attrs

    from servelab.kit import ContinuousOptions, option_or

    @attrs.define
    class OwnOptions:
        max_rank: int = 3

    with pytest.warns(DeprecationWarning, match="kit_options"):
        assert option_or(ContinuousOptions(priority_aging_s=4.0), "priority_aging_s", 0.0) == 4.0
    with pytest.warns(DeprecationWarning):
        assert option_or(OwnOptions(), "priority_aging_s", 10.0) == 10.0
