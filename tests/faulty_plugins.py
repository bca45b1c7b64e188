"""Deliberately broken policies: each is a working built-in with one realistic bug, so
the conformance suite must find the bug, not a crash. test_conformance_suite.py copies
this module into pytester runs and checks that each fails its contract with a message
naming the invariant it breaks."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.interfaces import DrafterContext, SchedulerContext
from servelab.plugins.allocators.paged import PagedAllocator
from servelab.plugins.kernels.torch_paged import TorchPagedAttention
from servelab.plugins.schedulers.continuous import ContinuousScheduler


class LeakyAllocator(PagedAllocator):
    """Forgets to release the last block of a sequence longer than one block."""

    def free(self, seq_id: str) -> None:
        table = self._seqs[seq_id].table if seq_id in self._seqs else []
        if len(table) > 1:
            table.pop()  # dropped from the table, never returned to the free list
        super().free(seq_id)


class NoCopyOnWriteAllocator(PagedAllocator):
    """Shares blocks on fork but writes into a shared block in place."""

    def _is_shared(self, block: int) -> bool:
        return False


class OverBudgetScheduler(ContinuousScheduler):
    """Plans against twice the token budget it was given."""

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        super().__init__(options, context)
        self.context = attrs.evolve(context, max_num_batched_tokens=2 * context.max_num_batched_tokens)


class DroppingScheduler(ContinuousScheduler):
    """Loses every third request it is given."""

    def add(self, seq) -> None:
        self.num_added = getattr(self, "num_added", 0) + 1
        if self.num_added % 3:
            super().add(seq)


class PaddingLookupDrafter:
    """Prompt lookup (propose what followed the last occurrence of the last token), but
    pads short drafts to k with -1."""

    def __init__(self, options: Any, context: DrafterContext) -> None:
        self.k = 3

    def propose(self, seqs):
        drafts = {}
        for seq in seqs:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            last = tokens[-1]
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == last]
            draft = tokens[earlier[-1] + 1: earlier[-1] + 1 + self.k] if earlier else []
            drafts[seq.request_id] = draft + [-1] * (self.k - len(draft))
        return drafts


class WrongScaleAttention(TorchPagedAttention):
    """Scales scores by 1 / head_dim instead of the scale it is given."""

    def forward(self, query, key, value, key_cache, value_cache, prepared, scale):
        return super().forward(query, key, value, key_cache, value_cache, prepared, 1.0 / query.shape[-1])
