"""The built-in policies pass the conformance suite (servelab.testing), exactly as a
third-party plugin would: each class names an installed policy and inherits every test,
with more hypothesis examples than the contracts' defaults.

The attention backend `torch-paged` runs its contract in test_torch_paged.py.
Built-in-specific invariants ride on the contracts' hooks: the radix allocator's cached
blocks are the unheld blocks of its tree, and the hash allocator's the unheld hashed ones; naive tables are disjoint contiguous runs; the
built-in schedulers keep their waiting queue in rank order (priority, then arrival; with
aging, arrival + priority * priority_aging_s) and admit only from its head.
"""

from __future__ import annotations

import pytest

from servelab import PluginRegistry
from servelab.kit import ContinuousOptions
from servelab.kit import QueueOptions
from servelab.testing import (AllocatorContract, AttentionBackendContract, DrafterContract, RouterContract,
                              SchedulerContract, TransportContract, VictimContract, check, objectives)

ALLOCATOR_EXAMPLES = 100
SCHEDULER_EXAMPLES = 150


class TestNaive(AllocatorContract):
    plugin_name = "naive"
    max_examples = ALLOCATOR_EXAMPLES

    def check_allocator_state(self, allocator, tables):
        seen: set[int] = set()
        for seq_id, table in tables.items():
            check(not table or table == list(range(table[0], table[0] + len(table))), "naive: a table is one run",
                  f"{seq_id}: {table}")
            check(seen.isdisjoint(table), "naive: tables never share a block", f"{seq_id}: {table}")
            seen.update(table)


class TestPaged(AllocatorContract):
    plugin_name = "paged"
    max_examples = ALLOCATOR_EXAMPLES


class TestRadix(AllocatorContract):
    plugin_name = "radix"
    max_examples = ALLOCATOR_EXAMPLES

    def check_allocator_state(self, allocator, tables):
        unheld = [b for b in range(allocator.num_blocks) if b in allocator.tree and allocator.ref_count(b) == 0]
        check(allocator.stats().num_cached_blocks == len(unheld), "radix: cached blocks are the unheld tree blocks",
              f"{allocator.stats().num_cached_blocks} cached, {len(unheld)} unheld tree blocks")


class TestHash(AllocatorContract):
    plugin_name = "hash"
    max_examples = ALLOCATOR_EXAMPLES

    def check_allocator_state(self, allocator, tables):
        index = allocator.index
        unheld = [b for b in range(allocator.num_blocks) if b in index and allocator.ref_count(b) == 0]
        check(allocator.stats().num_cached_blocks == len(unheld), "hash: cached blocks are the unheld hashed blocks",
              f"{allocator.stats().num_cached_blocks} cached, {len(unheld)} unheld hashed blocks")
        check(sorted(index.evictable) == unheld, "hash: the eviction candidates are the unheld hashed blocks",
              f"candidates {sorted(index.evictable)}, unheld {unheld}")
        for block, entry in index.cached.items():
            check(index.block_of.get(entry.block_hash) == block, "hash: every cached block is found by its hash",
                  f"block {block} cached as {entry}")


class TestSdpaContiguous(AttentionBackendContract):
    """Declares requires_contiguous_block_tables: the contract gives it contiguous tables
    and runs it end to end with the naive allocator."""

    plugin_name = "sdpa-contiguous"


class RankOrder:
    """The built-in schedulers' ordering invariants, checked around every harness step."""

    max_examples = SCHEDULER_EXAMPLES

    def before_step(self, harness):
        self._waiting = list(harness.scheduler.waiting)
        aging = harness.scheduler.options.priority_aging_s
        ranks = [s.arrival_time + s.priority * aging if aging else (s.priority, s.arrival_time) for s in self._waiting]
        check(ranks == sorted(ranks), "rank order: the waiting queue is sorted by rank",
              f"{[s.request_id for s in self._waiting]} ranked {ranks}")

    def after_step(self, harness, plan):
        left = [s for s in self._waiting if s not in harness.scheduler.waiting]
        check(left == self._waiting[: len(left)], "rank order: admission takes the head of the queue",
              f"admitted {[s.request_id for s in left]} from {[s.request_id for s in self._waiting]}")


class TestContinuous(RankOrder, SchedulerContract):
    plugin_name = "continuous"
    objectives = (objectives.first_come_first_served(),)
    options_variants = tuple(ContinuousOptions(policy=policy, priority_aging_s=aging)
                             for policy in ("prefill-first", "decode-first") for aging in (0.0, 3.0))


class TestStatic(RankOrder, SchedulerContract):
    plugin_name = "static"
    options_variants = (QueueOptions(priority_aging_s=0.0), QueueOptions(priority_aging_s=3.0))


class TestChunkedPrefill(RankOrder, SchedulerContract):
    plugin_name = "chunked-prefill"
    objectives = (objectives.first_come_first_served(),)
    options_variants = (QueueOptions(priority_aging_s=0.0), QueueOptions(priority_aging_s=3.0))


def test_every_builtin_policy_runs_its_contract():
    """A new built-in policy needs a contract class in one of the tests/ modules."""
    import importlib
    from pathlib import Path

    # Every test module, whichever of them this run collected.
    modules = [importlib.import_module(path.stem) for path in sorted(Path(__file__).parent.glob("test_*.py"))]
    tested = {(cls.kind, cls.plugin_name) for module in modules
              for cls in vars(module).values()
              if isinstance(cls, type) and issubclass(cls, (AllocatorContract, SchedulerContract, DrafterContract,
                                                            AttentionBackendContract, RouterContract, VictimContract,
                                                            TransportContract))
              and cls.plugin_name}
    registry = PluginRegistry.from_entry_points()
    builtins = {(kind, p.name) for kind in ("allocators", "schedulers", "drafters", "attention", "routers", "victims",
                                            "kv_transfers")
                for p in registry.policies(kind).values() if p.distribution == "servelab"}
    assert builtins - tested == set(), "built-in policies without a conformance contract class"
