"""Preemption victims: which running sequence the kit's queue scheduler preempts (by
recompute) when the KV pool runs dry. Selected by name with `[scheduler] preemption`;
a scheduler of the kit may also override `QueueScheduler.victim`.

A victim policy is a callable `(running, allocator) -> Sequence` that returns one of
`running` (the running batch, best rank first; never empty). The kit refuses any other
answer with PolicyViolation naming the invariant, before it changes anything.

- `newest` (default): the last of the running batch in rank order: the lowest priority,
  and among equals the newest arrival. The best-ranked sequence is never preempted
  while another could be, so it always progresses.
- `fewest-computed-tokens`: the one whose recompute costs least (ties: the lower rank).
- `most-kv-blocks`: the one holding the most KV blocks, so one preemption frees the most
  (ties: the lower rank).
- `lowest-priority-then-newest`: the largest priority value, then the latest arrival,
  ignoring aging (with `priority_aging_s` = 0 this is `newest`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence as Seq

from servelab.errors import PolicyViolation
from servelab.interfaces import KVAllocator, Sequence

VICTIM_IS_RUNNING = "the preemption victim is a running sequence"

VictimPolicy = Callable[[Seq[Sequence], KVAllocator], Sequence]


def newest(running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
    return running[-1]


def _last_max(running: Seq[Sequence], key: Callable[[Sequence], Any]) -> Sequence:
    """The sequence with the largest key; among equals the one latest in rank order."""
    best = running[-1]
    best_key = key(best)
    for seq in reversed(running):
        value = key(seq)
        if value > best_key:
            best, best_key = seq, value
    return best


def fewest_computed_tokens(running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
    return _last_max(running, lambda seq: -seq.num_computed_tokens)


def most_kv_blocks(running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
    return _last_max(running, lambda seq: len(allocator.block_table(seq.request_id)))


def lowest_priority_then_newest(running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
    return _last_max(running, lambda seq: (seq.priority, seq.arrival_time))


VICTIMS: dict[str, VictimPolicy] = {
    "newest": newest,
    "fewest-computed-tokens": fewest_computed_tokens,
    "most-kv-blocks": most_kv_blocks,
    "lowest-priority-then-newest": lowest_priority_then_newest,
}


def check_victim(victim: Any, running: Seq[Sequence], chooser: str) -> Sequence:
    """`victim`, as `chooser` picked it, refused unless it is one of `running`."""
    if not any(victim is seq for seq in running):
        what = f"{victim.request_id} ({victim.status.value})" if isinstance(victim, Sequence) else repr(victim)
        raise PolicyViolation(VICTIM_IS_RUNNING, f"{chooser} chose {what}; running: "
                                                 f"{[seq.request_id for seq in running]}")
    return victim


def checked_victim(policy: VictimPolicy, running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
    """`policy(running, allocator)`, refused unless it is one of `running`."""
    name = policy.__name__ if inspect.isfunction(policy) else type(policy).__name__
    return check_victim(policy(running, allocator), running, name)
