"""The host KV tier: blocks of host memory below the device pool (`[kv_offload]`).

Bookkeeping only, like an allocator: the runner owns the host tensors (`TieredRunner`)
and performs the moves this tier records (`KVMove`, drained into `StepPlan.kv_moves`).
Two kinds of resident:

- cached prefix blocks, named by their chained block hash (`chained_block_hash`): a
  device prefix cache offers each block it evicts (`offload`), and looks a device miss up
  here (`lookup`, then `load` into a fresh device block). The tier is exclusive: a block
  brought back leaves the host, so each cached prefix lives in one tier. When the host
  is full its cached blocks are evicted by the `[eviction]` policy kind.
- swapped sequences (`swap_out`, `swap_in`): swap preemption's blocks, never evicted.

Moves are recorded in the order they happen and performed in that order before the
step's forward, so a device block freed after its offload, or a host block freed after
its load, may be reused by a later move of the same step. Copy-on-write copies queued
before a move are drained into the same list first (`copy_source`), so the runner's
order is the order the bookkeeping happened in.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import attrs

from servelab.interfaces import EvictionCandidate, EvictionContext, KVMove, TierStats
from servelab.kit.eviction import LeastRecentlyUsed, checked_choice


@attrs.define
class HostEntry:
    """A cached prefix block in the host tier."""

    slot: int
    parent: int  # chained hash of the prefix before it
    tokens: tuple[int, ...]
    inserted: int
    last_access: int
    depth: int


class HostTier:
    """`num_blocks` host blocks of `block_bytes` each: cached prefix blocks and swapped
    sequences, with eviction of cached ones by `eviction` (an EvictionPolicy; None: LRU)."""

    def __init__(self, num_blocks: int, block_size: int, eviction: Any = None, block_bytes: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.eviction = eviction if eviction is not None else LeastRecentlyUsed(
            None, EvictionContext(num_blocks, block_size))
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() takes the lowest
        self._cached: dict[int, HostEntry] = {}  # chained hash -> entry
        self._key_of_slot: dict[int, int] = {}  # slot -> chained hash of its cached entry
        self._swapped: dict[str, list[int]] = {}  # sequence id -> its slots, in table order
        self._moves: list[KVMove] = []
        self._tick = 0
        self.copy_source: Callable[[], Iterable[tuple[int, int]]] | None = None
        self._totals = dict(num_offloads=0, num_loads=0, num_swap_outs=0, num_swap_ins=0, host_hit_blocks=0,
                            num_host_evictions=0)
        self._last_step = (0, 0)

    # ------------------------------------------------------------ prefix blocks

    def offload(self, key: int, parent: int, tokens: tuple[int, ...], depth: int, device_block: int) -> bool:
        """A device prefix cache evicts `device_block`, the block named `key`: keep a copy
        here. False when it is already here (nothing moves) or no host block can be had."""
        entry = self._cached.get(key)
        if entry is not None:
            entry.last_access = self._next_tick()
            return False
        if not self._room(1):
            return False
        slot = self._free.pop()
        tick = self._next_tick()
        self._cached[key] = HostEntry(slot, parent, tokens, tick, tick, depth)
        self._key_of_slot[slot] = key
        self._record(KVMove("offload", device_block, slot))
        self._totals["num_offloads"] += 1
        return True

    def lookup(self, key: int, parent: int, tokens: tuple[int, ...]) -> bool:
        """Is the block named `key` here (its parent hash and tokens confirmed)?"""
        entry = self._cached.get(key)
        return entry is not None and entry.parent == parent and entry.tokens == tokens

    def load(self, key: int, device_block: int) -> None:
        """Bring the cached block named `key` back into `device_block`; it leaves the host."""
        entry = self._cached.pop(key)
        del self._key_of_slot[entry.slot]
        self._record(KVMove("load", entry.slot, device_block))
        self._free.append(entry.slot)
        self._totals["num_loads"] += 1
        self._totals["host_hit_blocks"] += 1

    def reset_cached(self) -> None:
        """Drop every cached prefix block (swapped sequences stay)."""
        for entry in self._cached.values():
            self._free.append(entry.slot)
        self._cached.clear()
        self._key_of_slot.clear()

    # ------------------------------------------------------------ swapped sequences

    def can_swap_out(self, num_blocks: int) -> bool:
        return len(self._free) + len(self._cached) >= num_blocks

    def swap_out(self, seq_id: str, device_blocks: list[int]) -> bool:
        """Copy a preempted sequence's blocks here (evicting cached blocks for room).
        False, changing nothing, when the tier cannot hold them."""
        if seq_id in self._swapped:
            raise ValueError(f"swap_out: {seq_id!r} is already swapped out")
        if not self.can_swap_out(len(device_blocks)) or not self._room(len(device_blocks)):
            return False
        slots = [self._free.pop() for _ in device_blocks]
        for block, slot in zip(device_blocks, slots):
            self._record(KVMove("offload", block, slot))
        self._swapped[seq_id] = slots
        self._totals["num_offloads"] += len(slots)
        self._totals["num_swap_outs"] += 1
        return True

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def num_swapped_blocks(self, seq_id: str) -> int:
        return len(self._swapped.get(seq_id, ()))

    def swap_in(self, seq_id: str, device_blocks: list[int]) -> None:
        """Bring a swapped sequence's blocks back into `device_blocks` (its new table's
        first blocks); its host blocks are free after."""
        slots = self._swapped.pop(seq_id)
        if len(device_blocks) != len(slots):
            raise ValueError(f"swap_in: {seq_id!r} has {len(slots)} blocks swapped out, got {len(device_blocks)}")
        for slot, block in zip(slots, device_blocks):
            self._record(KVMove("load", slot, block))
            self._free.append(slot)
        self._totals["num_loads"] += len(slots)
        self._totals["num_swap_ins"] += 1

    def discard(self, seq_id: str) -> None:
        """A swapped sequence finished or was aborted: free its host blocks."""
        self._free.extend(self._swapped.pop(seq_id, ()))

    # ------------------------------------------------------------ the engine's side

    def take_moves(self) -> list[KVMove]:
        """The moves recorded since the last call, in order (the engine puts them in the plan)."""
        moves, self._moves = self._moves, []
        num_tier_moves = sum(move.kind != "copy" for move in moves)
        self._last_step = (num_tier_moves, num_tier_moves * self.block_bytes)
        return moves

    def stats(self) -> TierStats:
        num_swapped = sum(map(len, self._swapped.values()))
        return TierStats(num_host_blocks=self.num_blocks, num_host_free=len(self._free),
                         num_host_cached=len(self._cached), num_host_swapped=num_swapped,
                         block_bytes=self.block_bytes, moves_last_step=self._last_step[0],
                         bytes_last_step=self._last_step[1], **self._totals)

    def slots(self) -> dict[str, list[int]]:
        """Where every host block is (free, cached, swapped), for invariant checks."""
        return {"free": list(self._free), "cached": [e.slot for e in self._cached.values()],
                "swapped": [slot for slots in self._swapped.values() for slot in slots]}

    # ------------------------------------------------------------ internals

    def _record(self, move: KVMove) -> None:
        if self.copy_source is not None:
            self._moves.extend(KVMove("copy", src, dst) for src, dst in self.copy_source())
        self._moves.append(move)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    def _room(self, count: int) -> bool:
        """At least `count` free host blocks, evicting cached ones by the policy."""
        while len(self._free) < count and self._cached:
            candidates = [EvictionCandidate(block=e.slot, last_access=e.last_access, inserted=e.inserted,
                                            depth=e.depth) for e in self._cached.values()]
            for slot in checked_choice(self.eviction, candidates, count - len(self._free)):
                key = self._key_of_slot.pop(slot)
                del self._cached[key]
                self._free.append(slot)
                self._totals["num_host_evictions"] += 1
                if len(self._free) >= count:
                    break
        return len(self._free) >= count
