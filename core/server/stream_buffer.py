"""A request's events between the engine and the client's reader, bounded.

The engine does not wait for a client: a step's tokens go out whether or not the reader
of a stream has taken the last ones. A reader that lags (a slow socket) would otherwise
leave one event per step and choice waiting, without bound. `StreamBuffer` has the part
of asyncio.Queue's interface the front end uses; once more than `limit` events wait, the
waiting events of each key (a sequence or a request) merge into one: token ids and
logprobs concatenated, text deltas of a choice joined into one delta. A lagging reader
then gets fewer, larger chunks carrying the same text, tokens and logprobs, and the
buffer holds about one event per key, however long the reader lags.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from servelab.outputs import RequestEvent, merge_events

STREAM_BUFFER_EVENTS = 64  # events waiting for a reader before they merge


class StreamBuffer:
    """(key, RequestEvent) pairs for one group of requests; merged past `limit` waiting."""

    def __init__(self, limit: int = STREAM_BUFFER_EVENTS) -> None:
        self.limit = limit
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._ready = asyncio.Event()

    def put_nowait(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        if len(self._items) > self.limit:
            self._merge()
        self._ready.set()

    async def get(self) -> tuple[str, Any]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def get_nowait(self) -> tuple[str, Any]:
        if not self._items:
            raise asyncio.QueueEmpty()
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def _merge(self) -> None:
        """One event per key, each where the key's last event was (so an event that ends a
        request still comes after everything queued before it)."""
        merged: dict[str, Any] = {}
        last: dict[str, int] = {}
        for position, (key, event) in enumerate(self._items):
            merged[key] = merge_buffered(merged[key], event) if key in merged else event
            last[key] = position
        self._items = collections.deque((key, merged[key]) for key in sorted(merged, key=last.__getitem__))
        self.limit = max(self.limit, 2 * len(merged))  # many keys: room to merge again later


def merge_buffered(earlier: RequestEvent, later: RequestEvent) -> RequestEvent:
    """Two RequestEvents of one key as one (`later` may end the request), each choice's
    text deltas joined."""
    merged = merge_events(earlier, later)
    merged.deltas = merge_deltas(merged.deltas)
    return merged


def merge_deltas(deltas: tuple[Any, ...]) -> tuple[Any, ...]:
    """Each choice's deltas joined in order (`delta.then(later)`), one per choice."""
    by_choice: dict[int, Any] = {}
    for delta in deltas:
        earlier = by_choice.get(delta.index)
        by_choice[delta.index] = delta if earlier is None else earlier.then(delta)
    return tuple(by_choice.values())
