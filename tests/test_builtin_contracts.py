"""The built-in policies pass the conformance suite (servelab.testing), exactly as a
third-party plugin would: each class names an installed policy and inherits every test.

Built-in-specific invariants ride on the contracts' hooks: the radix allocator's cached
blocks are the unheld blocks of its tree; naive tables are disjoint contiguous runs.
"""

from __future__ import annotations

from servelab.testing import AllocatorContract, SchedulerContract, check


class TestNaive(AllocatorContract):
    plugin_name = "naive"

    def check_allocator_state(self, allocator, tables):
        seen: set[int] = set()
        for seq_id, table in tables.items():
            check(not table or table == list(range(table[0], table[0] + len(table))), "naive: a table is one run",
                  f"{seq_id}: {table}")
            check(seen.isdisjoint(table), "naive: tables never share a block", f"{seq_id}: {table}")
            seen.update(table)


class TestPaged(AllocatorContract):
    plugin_name = "paged"


class TestRadix(AllocatorContract):
    plugin_name = "radix"

    def check_allocator_state(self, allocator, tables):
        unheld = [b for b in range(allocator.num_blocks) if b in allocator.tree and allocator.ref_count(b) == 0]
        check(allocator.stats().num_cached_blocks == len(unheld), "radix: cached blocks are the unheld tree blocks",
              f"{allocator.stats().num_cached_blocks} cached, {len(unheld)} unheld tree blocks")


class TestContinuous(SchedulerContract):
    plugin_name = "continuous"


class TestStatic(SchedulerContract):
    plugin_name = "static"


class TestChunkedPrefill(SchedulerContract):
    plugin_name = "chunked-prefill"
