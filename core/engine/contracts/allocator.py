"""The allocator contract (kind `allocators`, `[allocator]`): what an allocator
factory receives (`AllocatorContext`), the Protocol it builds (`KVAllocator`), the stats
record it returns, and its optional capabilities. Changes by version:
docs/contract-versions.md ("allocators"); the version is `KINDS["allocators"].version`.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence as Seq, runtime_checkable

import attrs

from servelab.sequence import Sequence, SequenceStatus

__all__ = [
    "Sequence",
    "SequenceStatus",
    "AllocatorContext",
    "AllocatorStats",
    "KVAllocator",
    "ForkingAllocator",
    "PrefixCachingAllocator",
    "ResettablePrefixCache",
    "AnticipatingPrefixCache",
    "ContiguousAllocator",
]


@attrs.frozen
class AllocatorContext:
    """What the engine tells an allocator factory about the KV cache it manages."""

    num_blocks: int  # physical blocks in the runner's cache
    block_size: int  # token slots per block
    max_model_len: int  # longest sequence the engine admits
    # The eviction policy a prefix cache orders its evictable blocks by (`[eviction]`, an
    # EvictionPolicy); None: the cache's own default (least recently used first).
    eviction: Any = None
    # The KV tier below the device pool (`[kv_offload]`, a servelab.kit.HostTier), or
    # None: a prefix cache offers the blocks it evicts to it and looks misses up in it.
    host_tier: Any = None


@attrs.frozen
class AllocatorStats:
    """The same numbers from every allocator, in blocks and token slots.

    Blocks: num_used_blocks + num_free_blocks + num_cached_blocks == num_blocks.
    Slots of used blocks: num_token_slots_used + num_token_slots_reserved_empty ==
    num_used_blocks * block_size. Wasted KV = reserved-but-empty (internal) plus
    free-but-unusable (external fragmentation).
    """

    num_blocks: int
    num_used_blocks: int  # held by at least one sequence (or reserved for one)
    num_free_blocks: int  # on the free list: allocatable without evicting anything
    num_cached_blocks: int = 0  # held by no sequence, kept for prefix reuse; evictable
    num_token_slots_used: int = 0  # slots of used blocks holding a token's K/V
    num_token_slots_reserved_empty: int = 0  # in used blocks, no token yet (internal waste)
    num_free_slots_unusable: int = 0  # free, but no new sequence could use them (external fragmentation)
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefix_lookup_tokens: int = 0  # tokens of the sequences looked up in the prefix cache
    num_prefix_lookups: int = 0  # sequences looked up (one per admission)
    block_size: int = 0  # slots per block

    @property
    def num_wasted_slots(self) -> int:
        """Reserved-but-empty plus free-but-unusable slots."""
        return self.num_token_slots_reserved_empty + self.num_free_slots_unusable

    @property
    def waste_fraction(self) -> float:
        """Wasted slots as a fraction of the whole pool."""
        total = self.num_blocks * self.block_size
        return self.num_wasted_slots / total if total else 0.0


@runtime_checkable
class KVAllocator(Protocol):
    """Bookkeeping of physical KV block ids per sequence. The runner owns the tensors.

    Every allocation is a block table: the logical block i of a sequence lives in
    physical block `block_table(seq_id)[i]`, so one attention path reads any allocator.
    """

    def allocate(self, seq_id: str, num_tokens: int) -> bool:
        """Make room for token positions [0, num_tokens) of `seq_id`.

        Returns False, changing nothing, when there is not enough free memory.
        """

    def free(self, seq_id: str) -> None:
        """Release everything `seq_id` holds; unknown ids are a no-op."""

    def block_table(self, seq_id: str) -> Seq[int]:
        """Physical block ids of `seq_id`, in logical order."""

    def stats(self) -> AllocatorStats:
        """Current usage."""


@runtime_checkable
class ForkingAllocator(Protocol):
    """Capability: sequences share blocks (fork), copy-on-write, and roll back.

    A write into a block another holder can read is preceded by a copy of that block
    into a fresh one: `allocate` performs the bookkeeping and queues (source,
    destination) block pairs, which the engine drains with `take_block_copies` and the
    runner performs, in order, before the step's forward pass.
    """

    def fork(self, parent_id: str, child_id: str) -> bool:
        """Give `child_id` (holding nothing) the KV of all of `parent_id`'s tokens.

        Returns False, changing nothing, when there is not enough free memory.
        """

    def rollback(self, seq_id: str, num_slots: int) -> None:
        """Forget the last `num_slots` token slots of `seq_id` (rejected drafts)."""

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(source, destination) block copies queued since the last call, in order."""

    def ref_count(self, block_id: int) -> int:
        """How many sequences' block tables hold `block_id`."""


@runtime_checkable
class PrefixCachingAllocator(Protocol):
    """Capability: blocks of already computed token prefixes are reused.

    Only full blocks of verified tokens (prompt and accepted output, never drafts)
    are cached, so a sequence never writes into a cached block without copy-on-write.
    """

    def match_prefix(self, seq: Sequence) -> int:
        """Give `seq` (holding nothing) the cached blocks of its longest cached prefix.

        Returns the number of tokens they hold: a multiple of the block size, and
        below seq.num_tokens so at least one token is computed to yield logits. The
        scheduler sets num_computed_tokens to it; `free` undoes the match. Schedulers do
        not look up sequences whose params ask for prompt_logprobs: every prompt position
        of those must be computed to be scored.
        """

    def cache_blocks(self, seq: Sequence) -> None:
        """Make `seq`'s full blocks of computed tokens reusable by later sequences."""


@runtime_checkable
class ResettablePrefixCache(Protocol):
    """Capability (allocator contract version 2): a prefix cache that can be emptied.

    Version 1 of the allocator contract had no such member; a prefix cache written
    against it is still a PrefixCachingAllocator and keeps caching."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached block no sequence holds: later lookups miss them, and they
        count as free. Blocks sequences hold stay; the prefix statistics keep counting."""


@runtime_checkable
class AnticipatingPrefixCache(Protocol):
    """Capability: a prefix cache told which waiting sequences come next, so an eviction
    policy can spare the prefixes they are about to hit."""

    def anticipate(self, seqs: Seq[Sequence]) -> None:
        """The sequences the scheduler expects to admit next, best first (replaces the
        previous ones). They hold no KV; the cache must not change them."""


@runtime_checkable
class ContiguousAllocator(Protocol):
    """Capability: every block table is one run of consecutive physical blocks
    (table[i] == table[0] + i) for as long as its sequence holds them.

    An allocator declares it with the class attribute `contiguous_block_tables = True`.
    An attention backend that reads a sequence's K/V as one slice of the cache declares
    `requires_contiguous_block_tables = True`; the engine refuses, at start, to pair it
    with an allocator that does not declare this capability.
    """

    contiguous_block_tables: bool
