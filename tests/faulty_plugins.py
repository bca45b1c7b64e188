"""Deliberately broken policies: each is a working built-in with one realistic bug, so
the conformance suite must find the bug, not a crash. test_conformance_suite.py copies
this module into pytester runs and checks that each fails its contract with a message
naming the invariant it breaks."""

from __future__ import annotations

from typing import Any

import attrs

from servelab.interfaces import DrafterContext, RouterContext, SchedulerContext
from servelab.kit import PrefixCachingPagedAllocator
from servelab.plugins.allocators.hash_prefix import CachedBlock, HashIndex
from servelab.kit import PagedAllocator, SeqBlocks
from servelab.plugins.allocators.radix import RadixAllocator
from servelab.plugins.kernels.torch_paged import TorchPagedAttention
from servelab.plugins.routers.least_loaded import LeastLoadedRouter, least_loaded
from servelab.plugins.routers.prefix_affinity import PrefixAffinityRouter
from servelab.kit import ContinuousScheduler
from servelab.kit import PlanBuilder


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


class RefusalKeepsBlocksAllocator(PagedAllocator):
    """Refuses a new sequence that does not fit, but keeps the blocks it had taken for it
    until `free()` (a partial reservation not undone)."""

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        if super().allocate(seq_id, num_tokens):
            return True
        if seq_id not in self._seqs and self._free_blocks:
            taken = self._take_blocks(len(self._free_blocks))
            for block in taken:
                self._hold(block)
            self._seqs[seq_id] = SeqBlocks(taken, 0)
        return False


class PerHolderSlotsAllocator(PagedAllocator):
    """Counts a forked child's slots again, as if each holder of a block filled it."""

    def fork(self, parent_id: str, child_id: str) -> bool:
        forked = super().fork(parent_id, child_id)
        if parent_id in self._seqs:
            self._num_slots_used += self._seqs[parent_id].num_tokens
        return forked

    def free(self, seq_id: str) -> None:
        if seq_id in self._seqs and any(self._ref_counts[b] > 1 for b in self._seqs[seq_id].table):
            self._num_slots_used -= self._seqs[seq_id].num_tokens  # so it returns to 0 once all is freed
        super().free(seq_id)


class CountsEveryLookupAllocator(RadixAllocator):
    """Counts a prefix lookup when it is made, so refused admissions count too."""

    def match_prefix(self, seq) -> int:
        hit = super().match_prefix(seq)
        self.lookups.admitted(seq.request_id)
        return hit


class StrictFreeAllocator(PagedAllocator):
    """Raises KeyError when freeing a sequence it does not know."""

    def free(self, seq_id: str) -> None:
        self._seqs[seq_id]  # noqa: B018 - the bug: unknown ids must be a no-op
        super().free(seq_id)


class PositionalHashIndex(HashIndex):
    """Keys each block by (its index, its tokens) instead of chaining the parent block's hash."""

    def peek(self, chunks):
        blocks = []
        for index, chunk in enumerate(chunks):
            block = self.block_of.get(hash((index, chunk)))
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, parent, chunk, block):
        index = self.cached[parent].depth if parent is not None else 0
        key = hash((index, chunk))
        if key not in self.block_of and block not in self.cached:
            self.block_of[key] = block
            self.cached[block] = CachedBlock(key, index, chunk, index + 1)
            self.hits[block] = 0
            self.last_access[block] = 0
        return block


class PositionalHashAllocator(PrefixCachingPagedAllocator):
    """A hash prefix cache keying each block by (its index, its tokens): block 1 of
    "X0 X1" is reused for "Y0 X1"."""

    def __init__(self, options, context):
        super().__init__(options, context, PositionalHashIndex())


class OverBudgetScheduler(ContinuousScheduler):
    """Plans against twice the token budget it was given."""

    def __init__(self, options: Any, context: SchedulerContext) -> None:
        super().__init__(options, context)
        self.context = attrs.evolve(context, max_num_batched_tokens=2 * context.max_num_batched_tokens)


class UnchargedDecodeScheduler(ContinuousScheduler):
    """Does not charge running sequences' decode tokens to the token budget."""

    def schedule(self):
        builder = PlanBuilder(self.context.max_num_batched_tokens)
        self._shed_overflow(builder)
        ready = self._claim_running(builder)
        if not builder.preempted:
            self._admit_waiting(builder, whole=True)
        for seq, num_new in ready:
            builder.scheduled[seq] = num_new  # the bug: builder.budget is not lowered
        return self._plan(builder)


class CrashingScheduler(ContinuousScheduler):
    """Raises IndexError once a sequence has decoded three tokens (an off-by-one in
    code that looks at recent output)."""

    def schedule(self):
        for seq in self.running:
            if len(seq.output_token_ids) == 3:
                seq.output_token_ids[5]  # noqa: B018 - the bug
        return super().schedule()


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


class LongLookupDrafter(PaddingLookupDrafter):
    """Prompt lookup without a bound: proposes everything that followed the last
    occurrence, and declares no num_speculative_tokens anywhere."""

    def __init__(self, options: Any, context: DrafterContext) -> None:
        self.k = 10_000
        self.max_model_len = context.max_model_len

    def propose(self, seqs):
        drafts = {}
        for seq in seqs:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == tokens[-1]]
            draft = tokens[earlier[-1] + 1:] if earlier else []
            drafts[seq.request_id] = draft[: max(0, self.max_model_len - len(tokens))]
        return drafts


class StashingDrafter(PaddingLookupDrafter):
    """Stores each proposal in the sequence's draft_token_ids (the engine's field)."""

    def propose(self, seqs):
        drafts = {r: [t for t in d if t >= 0] for r, d in super().propose(seqs).items()}
        for seq in seqs:
            seq.draft_token_ids = list(drafts[seq.request_id])
        return drafts


class StaleCacheDrafter(PaddingLookupDrafter):
    """Remembers each request's first draft and proposes it again; release() forgets nothing."""

    def __init__(self, options: Any, context: DrafterContext) -> None:
        super().__init__(options, context)
        self.first_drafts: dict[str, list[int]] = {}

    def propose(self, seqs):
        fresh = {r: [t for t in d if t >= 0] for r, d in super().propose(seqs).items()}
        return {seq.request_id: self.first_drafts.setdefault(seq.request_id, fresh[seq.request_id])
                for seq in seqs}

    def release(self, request_id: str) -> None:
        pass


class ProposedOnlyFinishDrafter(PaddingLookupDrafter):
    """Learns from finished sequences, but only from those it proposed for: finished() of
    any other (one that never decoded) raises KeyError."""

    def __init__(self, options: Any, context: DrafterContext) -> None:
        super().__init__(options, context)
        self.proposed: set[str] = set()

    def propose(self, seqs):
        self.proposed |= {seq.request_id for seq in seqs}
        return {r: [t for t in d if t >= 0] for r, d in super().propose(seqs).items()}

    def finished(self, seq) -> None:
        self.proposed.remove(seq.request_id)

    def release(self, request_id: str) -> None:
        self.proposed.discard(request_id)


class SortedBlocksAttention(TorchPagedAttention):
    """Reads each sequence's blocks in ascending block id order instead of table order
    (right for a fresh pool, which hands out ascending blocks)."""

    def prepare(self, metadata):
        tables = metadata.block_tables.clone()
        block_size = self.context.block_size
        for row, context_len in enumerate(metadata.context_lens_list):
            num_blocks = -(-context_len // block_size)
            tables[row, :num_blocks] = tables[row, :num_blocks].sort().values
        return super().prepare(attrs.evolve(metadata, block_tables=tables))


class WrongScaleAttention(TorchPagedAttention):
    """Scales scores by 1 / head_dim instead of the scale it is given."""

    def forward(self, query, key, value, key_cache, value_cache, prepared, scale):
        return super().forward(query, key, value, key_cache, value_cache, prepared, 1.0 / query.shape[-1])


class FixedCycleRouter:
    """Round robin over the replica ids the fleet started with, whether or not they are
    still there."""

    def __init__(self, options: Any, context: RouterContext) -> None:
        self.num_replicas = context.num_replicas
        self.count = -1

    def route(self, request, replicas):
        self.count += 1
        return self.count % self.num_replicas


class ListPositionRouter(LeastLoadedRouter):
    """Least loaded, but returns the replica's position in the list instead of its id
    (the same thing until a replica leaves)."""

    def route(self, request, replicas):
        return list(replicas).index(least_loaded(replicas))


class SheddingRouter(LeastLoadedRouter):
    """Sheds load by returning None when even the least-loaded replica is busy with two
    or more requests."""

    def route(self, request, replicas):
        lightest = least_loaded(replicas)
        return None if lightest.num_running + lightest.num_waiting >= 2 else lightest.replica_id


class HedgingRouter(PrefixAffinityRouter):
    """Hedges long prompts: sends them to the best-cached replica and to the least-loaded one."""

    def route(self, request, replicas):
        chosen = super().route(request, replicas)
        lightest = least_loaded(replicas).replica_id
        return (chosen, lightest) if len(request.prompt_token_ids) > 12 and chosen != lightest else chosen


class UnseededTwoChoicesRouter:
    """Power of two choices: the lighter of two random replicas, from an unseeded generator."""

    def __init__(self, options: Any, context: RouterContext) -> None:
        import random

        self.rng = random.Random()

    def route(self, request, replicas):
        first, second = self.rng.choice(replicas), self.rng.choice(replicas)
        return min(first, second, key=lambda r: (r.load_tokens, r.replica_id)).replica_id
