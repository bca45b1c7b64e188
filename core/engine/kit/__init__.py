"""servelab.kit: the policy kit, the parts every built-in scheduler and allocator is
made of, public so a new policy is the few lines that make it different.

Scheduling (`servelab.kit.queues`, `servelab.kit.victims`):

- `QueueScheduler`: waiting queue and running batch in rank order, admission with
  prefix-cache hits, preemption by recompute, fork, abort, accounting. Seams: `rank(seq)`
  (queue order), `admissible(seq)` (admission filter), `victim(running)` (preemption
  victim), `schedule()` (the step, from `PlanBuilder` and the helpers).
- `ContinuousScheduler` (the `continuous` scheduler): a `QueueScheduler` whose step is
  continuous batching; a policy that only reorders overrides `rank` and is done.
- `ChunkedPrefillScheduler` (the `chunked-prefill` scheduler): a `QueueScheduler` whose
  step runs decodes first and splits prompts into chunks under the token budget; the
  same seams (`rank`, `admissible`, `victim`) make a policy of it.
- `QueueOptions` (`priority_aging_s`, `preemption`), `ContinuousOptions` (+ `policy`),
  `PlanBuilder`, `VICTIMS` (the built-in victim policies by name), `KeyedVictim` (a victim
  policy as one sort key), `check_whole_prompts_fit`,
  `kit_options` (the kit's options a scheduler runs with: its options class extends
  `QueueOptions` or `ContinuousOptions`, else the kit's defaults).

KV blocks (`servelab.kit.blocks`, `servelab.kit.prefix`, `servelab.kit.eviction`):

- `PagedAllocator`: the block pool: ref counts, fork, copy-on-write, rollback, stats.
  Seam: `free_list_type` (the order free blocks are handed out in).
- `PrefixCachingPagedAllocator(options, context, index)`: the pool plus a prefix cache
  over a `PrefixIndex` (match, insert, eviction candidates), evicting in the order of the
  context's eviction policy. `radix` and `hash` are this class over two indexes.
- `KeyedEviction`, `LeastRecentlyUsed`: eviction policies as one sort key; the cache
  keeps such a policy's order in an `EvictionQueue` when its index is an
  `IncrementalPrefixIndex` (reports its changes), instead of sorting at each eviction.
- `KeyedResidency`, `LeastRecentlyUsedAdapter` (`servelab.kit.residency`): LoRA adapter
  residency policies as one sort key; `checked_residency_choice` checks a policy's answer.
- `HostTier` (`servelab.kit.tier`): the host KV tier below the device pool
  (`[kv_offload]`): prefix blocks the cache evicts, swapped-out sequences, the moves
  the runner performs.

A plugin imports these from `servelab.kit` (part of the public surface, like
`servelab.interfaces`); the contracts of `servelab.testing` hold for what it builds.
"""

from servelab.kit.continuous import ContinuousOptions, ContinuousScheduler
from servelab.kit.chunked import ChunkedPrefillScheduler
from servelab.kit.blocks import FreeBlocks, PagedAllocator, SeqBlocks, blocks_for
from servelab.kit.eviction import EvictionQueue, KeyedEviction, LeastRecentlyUsed, checked_choice, orders_by_key
from servelab.kit.prefix import IncrementalPrefixIndex, PrefixCachingPagedAllocator, PrefixIndex, PrefixLookups
from servelab.kit.tier import HostTier
from servelab.kit.residency import KeyedResidency, LeastRecentlyUsedAdapter, checked_residency_choice
from servelab.kit.queues import PlanBuilder, QueueOptions, QueueScheduler, check_whole_prompts_fit, kit_options, option_or
from servelab.kit.victims import VICTIMS, KeyedVictim, as_preemption, check_victim, checked_victim, last_max

__all__ = [
    "ChunkedPrefillScheduler",
    "ContinuousOptions",
    "ContinuousScheduler",
    "EvictionQueue",
    "FreeBlocks",
    "HostTier",
    "IncrementalPrefixIndex",
    "KeyedEviction",
    "KeyedResidency",
    "LeastRecentlyUsedAdapter",
    "LeastRecentlyUsed",
    "PagedAllocator",
    "PlanBuilder",
    "PrefixCachingPagedAllocator",
    "PrefixIndex",
    "PrefixLookups",
    "QueueOptions",
    "QueueScheduler",
    "SeqBlocks",
    "VICTIMS",
    "KeyedVictim",
    "blocks_for",
    "check_whole_prompts_fit",
    "checked_choice",
    "checked_residency_choice",
    "as_preemption",
    "check_victim",
    "checked_victim",
    "last_max",
    "kit_options",
    "option_or",
    "orders_by_key",
]
