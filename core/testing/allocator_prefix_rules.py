"""The allocator state machine's rules that aim at prefix caches: prompts reaching the
same block content through different parents, and resets of the cache. Mixed into
`AllocatorMachine`, whose `_admit`, `write`, `store` and `live` they use.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis.stateful import Bundle, multiple, precondition, rule

from servelab.testing.contract import check, exercising
from servelab.testing.kv_store import COPY_ON_WRITE

RESET = "reset_prefix_cache drops every cached block no sequence holds"
# Prompts of whole blocks drawn from three contents: equal blocks after different parents.
CHUNKS = st.lists(st.integers(0, 2), min_size=1, max_size=6)


class PrefixRules:
    seqs = Bundle("seqs")

    @rule(target=seqs, chunks=CHUNKS, tail=st.integers(0, 3))
    def allocate_chunks(self, chunks: list[int], tail: int) -> str:
        """A prompt of whole blocks of a few contents (plus a few tokens), computed at once
        as a prefill would be, so later prompts can hit its blocks."""
        seq_id = self._admit([10 + c for c in chunks for _ in range(self.block_size)] + [1] * tail)
        if seq_id in self.live:
            with exercising(COPY_ON_WRITE):
                self.store.step([self.live[seq_id]])
        return seq_id

    @precondition(lambda self: self.caching)
    @rule(target=seqs, contents=st.permutations([20, 21, 22, 23]), tail=st.integers(1, 3))
    def allocate_after_other_parents(self, contents: list[int], tail: int):
        """Compute "X0 X1" and "Y0 Z1", then look up "Y0 X1": its block 1 holds X1's
        tokens, whose K/V in the cache were computed after another parent."""
        x0, x1, y0, z1 = ([c] * self.block_size for c in contents)
        ids = []
        for tokens in (x0 + x1, y0 + z1, y0 + x1):
            ids.append(self._admit(tokens + [1] * tail))
            if ids[-1] in self.live:
                self.write()
        return multiple(*ids)

    @precondition(lambda self: self.resettable)
    @rule()
    def reset_prefix_cache(self) -> None:
        held = {seq_id: list(self.alloc.block_table(seq_id)) for seq_id in self.live}
        before = self.alloc.stats()
        with exercising(RESET):
            self.alloc.reset_prefix_cache()
        after = self.alloc.stats()
        check(after.num_cached_blocks == 0 and after.num_used_blocks == before.num_used_blocks, RESET,
              lambda: f"before the reset {before}, after it {after}")
        now = {seq_id: list(self.alloc.block_table(seq_id)) for seq_id in self.live}
        check(now == held, RESET, lambda: f"the reset changed block tables from {held} to {now}")
