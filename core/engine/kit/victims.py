"""Preemption victims: which running sequence the kit's queue scheduler preempts when the
KV pool runs dry. A victim policy is a kind of its own (`servelab.contracts.victim`,
registered through `servelab_register_victims`) selected by name with
`[scheduler] preemption`; most are one sort key (`KeyedVictim`), and may also decide
whether the victim's KV is swapped to the host tier or recomputed (`Preemption`).

The built-ins (registered by servelab.plugins.victims):

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

from typing import Any, Callable, Sequence as Seq

from servelab.contracts.victim import Preemption, VictimContext, VictimPolicy
from servelab.errors import ConfigError, PolicyViolation
from servelab.interfaces import KVAllocator, Sequence

VICTIM_IS_RUNNING = "the preemption victim is a running sequence"


class KeyedVictim:
    """A victim policy that is one sort key: the running sequence with the largest
    `key(seq, allocator)` goes; among equals the one latest in rank order."""

    def __init__(self, options: Any = None, context: VictimContext | None = None) -> None:
        self.options = options
        self.context = context

    def key(self, seq: Sequence, allocator: KVAllocator) -> Any:
        """Larger goes first (subclasses write this)."""
        return 0

    def choose(self, running: Seq[Sequence], allocator: KVAllocator) -> Sequence | Preemption:
        return last_max(running, lambda seq: self.key(seq, allocator))


def last_max(running: Seq[Sequence], key: Callable[[Sequence], Any]) -> Sequence:
    """The sequence with the largest key; among equals the one latest in rank order."""
    best = running[-1]
    best_key = key(best)
    for seq in reversed(running):
        value = key(seq)
        if value > best_key:
            best, best_key = seq, value
    return best


class Newest(KeyedVictim):
    def choose(self, running: Seq[Sequence], allocator: KVAllocator) -> Sequence:
        return running[-1]


class FewestComputedTokens(KeyedVictim):
    def key(self, seq: Sequence, allocator: KVAllocator) -> Any:
        return -seq.num_computed_tokens


class MostKVBlocks(KeyedVictim):
    def key(self, seq: Sequence, allocator: KVAllocator) -> Any:
        return len(allocator.block_table(seq.request_id))


class LowestPriorityThenNewest(KeyedVictim):
    def key(self, seq: Sequence, allocator: KVAllocator) -> Any:
        return seq.priority, seq.arrival_time


# The built-ins by name: a scheduler built outside an engine (no registry in its
# SchedulerContext) resolves `[scheduler] preemption` here.
VICTIMS: dict[str, type] = {
    "newest": Newest,
    "fewest-computed-tokens": FewestComputedTokens,
    "most-kv-blocks": MostKVBlocks,
    "lowest-priority-then-newest": LowestPriorityThenNewest,
}


def check_victim(victim: Any, running: Seq[Sequence], chooser: str) -> Sequence:
    """`victim`, as `chooser` picked it, refused unless it is one of `running`."""
    if not any(victim is seq for seq in running):
        what = f"{victim.request_id} ({victim.status.value})" if isinstance(victim, Sequence) else repr(victim)
        raise PolicyViolation(VICTIM_IS_RUNNING, f"{chooser} chose {what}; running: "
                                                 f"{[seq.request_id for seq in running]}")
    return victim


def as_preemption(choice: Any, running: Seq[Sequence], chooser: str) -> Preemption:
    """A policy's answer as a Preemption, refused unless it names one of `running`."""
    preemption = choice if isinstance(choice, Preemption) else Preemption(choice)
    check_victim(preemption.victim, running, chooser)
    return preemption


def checked_victim(policy: VictimPolicy, running: Seq[Sequence], allocator: KVAllocator) -> Preemption:
    """`policy.choose(running, allocator)` as a Preemption, refused unless it is one of `running`."""
    return as_preemption(policy.choose(running, allocator), running, type(policy).__name__)


def resolve_victim(name: str, context: Any) -> VictimPolicy:
    """The victim policy `name`: through the engine's registry where the SchedulerContext
    carries it (`victims`), else one of the built-ins."""
    if context.victims is not None:
        return context.victims(name)
    if name not in VICTIMS:
        raise ConfigError(f"[scheduler] preemption = {name!r}: outside an engine only the built-in victims "
                          f"resolve ({', '.join(VICTIMS)})")
    return VICTIMS[name](None, VictimContext(block_size=0, max_num_seqs=context.max_num_seqs,
                                             can_swap=context.host_tier is not None))
