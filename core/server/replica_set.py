"""N engine replicas behind one router, with the interface of one AsyncEngine.

`ReplicaSet` is what the HTTP routes talk to when `servelab serve --replicas N` runs:
the configured router (`[router]`, see servelab.routing) picks a live replica for each
request from the replicas' load (queued sequences and prompt tokens as the front end
knows them, running sequences and tokens and KV blocks from each replica's latest
snapshot). The replicas are AsyncEngines over any EngineConnection (Ray actors in the
server, engines on threads in the unit tests).

A replica that dies (its actor's process killed, its engine failed) is taken out of
rotation: its requests in flight end with an error naming the replica, the router is
told they finished, and the others keep serving. Only when every replica has failed
does the set report the engine failed (/health 503, exit code 1).

A replica that goes silent (its process stopped or hung: no output, not even a
heartbeat, for `liveness_timeout` seconds while it has work) is taken out of rotation
too, by a watchdog, and `servelab_replica_up` shows 0. Its requests that have not
started (an add it never answered, or a request still queued there: no token sent to
the client yet) fail over: they are aborted there and routed again to a live replica,
the client's stream unchanged (`servelab_requests_failed_over`). Its requests that
have started end with a retryable error naming the replica (their tokens so far went
out from the silent replica's sampling, so another could not continue them unseen), and
are aborted there. It comes back into rotation once it is
heard from again. /health stays 200 while any replica answers; it turns 503 only when
every replica is silent or dead.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Callable, Iterable, Sequence as Seq

import attrs
import structlog

from servelab.errors import ServelabError
from servelab.interfaces import (AllocatorStats, FinishAwareRouter, ReplicaSnapshot, RouteRequest, SchedulerStats,
                                 TierStats)
from servelab.routing import adapter_fields
from servelab.server.detokenizer import Decode
from servelab.server.engine_core import EngineInfo, EngineSnapshot, EngineUnavailable, NewRequest
from servelab.server.engine_loop import AsyncEngine, Events, RequestEvent
from servelab.server.stream_buffer import StreamBuffer

logger = structlog.get_logger(__name__)


class ReplicaSet:
    """N engine replicas behind one router, with the interface of one AsyncEngine."""

    def __init__(self, replicas: Seq[AsyncEngine], router: Any, router_name: str, block_size: int,
                 metrics: Any = None, liveness_timeout: float | None = None) -> None:
        if not replicas:
            raise ServelabError("a replica set needs at least one replica")
        self.replicas = list(replicas)
        self.router = router
        self.router_name = router_name
        self.block_size = block_size
        self.metrics = metrics
        self.on_failure: Callable[[str], None] | None = None
        self.error: str | None = None
        self.stopping = False
        self.dead: set[int] = set()
        self.liveness_timeout = liveness_timeout  # None: no watchdog (silent replicas stay in rotation)
        self.silent: dict[int, float] = {}  # replica -> when it was found silent (out of rotation meanwhile)
        self._watchdog: asyncio.Task | None = None
        self._owner: dict[str, int] = {}  # engine request id -> replica
        self._group_of: dict[str, str] = {}  # engine request id -> the routed group's key (its first id)
        self._group_left: dict[str, int] = {}  # group key -> its requests not finished yet
        self._groups: dict[str, tuple[list[NewRequest], Decode | None, StreamBuffer]] = {}  # to move a group
        self._moving: set[asyncio.Task] = set()
        for index, replica in enumerate(self.replicas):
            replica.on_failure = functools.partial(self._replica_failed, index)
            replica.listener = functools.partial(self._observe, index)
        self.info = EngineInfo(min(r.info.max_model_len for r in self.replicas), self.replicas[0].info.vocab_size,
                               min(r.info.max_logprobs for r in self.replicas))

    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    # ------------------------------------------------------------ the AsyncEngine interface

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()
        if self.liveness_timeout is not None:
            self._watchdog = asyncio.get_running_loop().create_task(watch_liveness(self, self.liveness_timeout))

    def check_liveness(self) -> None:
        """Silent replicas out, recovered ones back (`watch_liveness` calls it)."""
        now = time.monotonic()
        for index, since in list(self.silent.items()):
            if index in self.dead:
                del self.silent[index]
            elif self.replicas[index].last_heard > since:
                del self.silent[index]
                logger.warning("replica.recovered", replica=index)
                if self.metrics is not None:
                    self.metrics.replica_back(index)
        for index in self.live_replicas():
            stalled = self.replicas[index].stalled_seconds()
            if stalled > self.liveness_timeout:
                self._replica_silent(index, stalled, now)

    def _replica_silent(self, index: int, stalled: float, now: float) -> None:
        self.silent[index] = now
        message = (f"engine replica {index} stopped answering (not heard from for {stalled:.1f} s, liveness "
                   f"timeout {self.liveness_timeout:g} s); it is out of rotation: retry")
        logger.error("replica.silent", replica=index, stalled_seconds=round(stalled, 1), live=self.live_replicas())
        if self.metrics is not None:
            self.metrics.replica_down(index)
        replica = self.replicas[index]
        owned = [r for r, owner in self._owner.items() if owner == index]
        unstarted = [group for group in dict.fromkeys(self._group_of[r] for r in owned)
                     if group in self._groups
                     and not any(replica.has_started(request.request_id) for request in self._groups[group][0])]
        moving = [self._groups[group] for group in unstarted] if self.live_replicas() else []
        for requests, _, _ in moving:
            replica.detach([request.request_id for request in requests])
        replica.fail_in_flight(message)
        for request_id in owned:  # the router hears that each left the silent replica
            self._finished(request_id)
        for group in moving:
            task = asyncio.get_running_loop().create_task(self._move(group, index))
            self._moving.add(task)
            task.add_done_callback(self._moving.discard)

    async def _move(self, group: tuple[list[NewRequest], Decode | None, StreamBuffer], silent: int) -> None:
        """Route a group that never started on the silent replica again, into the queue its reader holds."""
        requests, decode, events = group
        if self.metrics is not None:
            self.metrics.failed_over(silent, len(requests))
        logger.warning("replica.failover", replica=silent, request_ids=[r.request_id for r in requests])
        try:
            await self._route_and_add(requests, decode, events)
        except BaseException as exc:
            failed = RequestEvent(error=f"engine replica {silent} stopped answering and no other replica took the "
                                        f"request ({exc}): retry")
            for request in requests:
                events.put_nowait((request.request_id, failed))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def add(self, requests: Seq[NewRequest], decode: Decode | None = None) -> StreamBuffer:
        """Route the group (every prompt of one HTTP request) to one live replica and add it
        there; an add that replica never answers (it went silent) is routed again."""
        return await self._route_and_add(list(requests), decode, None)

    async def _route_and_add(self, requests: list[NewRequest], decode: Decode | None,
                             events: StreamBuffer | None) -> StreamBuffer:
        first = requests[0]
        while True:
            live = self.live_replicas()
            if self.stopping or not live:
                raise EngineUnavailable(self.error or "the server is shutting down")
            prompt = first.prompt if isinstance(first.prompt, list) else []
            route = RouteRequest(first.request_id, prompt, first.params.max_tokens, first.arrival_time,
                                 **adapter_fields(first.lora_request))
            from servelab.routing import checked_route

            choice = checked_route(self.router, self.router_name, route, [self.route_snapshot(i) for i in live])
            for request in requests:
                self._owner[request.request_id] = choice
                self._group_of[request.request_id] = first.request_id
            self._group_left[first.request_id] = len(requests)
            if self.metrics is not None:
                self.metrics.routed(choice)
            try:
                events = await self.replicas[choice].add(requests, decode, events)
            except EngineUnavailable:
                for request in requests:
                    self._finished(request.request_id)
                if choice in self.silent and self.live_replicas():
                    if self.metrics is not None:
                        self.metrics.failed_over(choice, len(requests))
                    logger.warning("replica.failover", replica=choice, request_ids=[r.request_id for r in requests])
                    continue  # it went silent before it took the group: another replica will
                raise
            except BaseException:
                for request in requests:
                    self._finished(request.request_id)
                raise
            if first.request_id in self._group_left:  # not finished while the add was answered
                self._groups[first.request_id] = (requests, decode, events)
            return events

    def abort(self, request_ids: Iterable[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for request_id in request_ids:
            owner = self._owner.get(request_id)
            if owner is not None:
                by_replica.setdefault(owner, []).append(request_id)
        for owner, ids in by_replica.items():
            self.replicas[owner].abort(ids)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        for task in list(self._moving):
            task.cancel()
        await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))

    @property
    def num_in_flight(self) -> int:
        return sum(replica.num_in_flight for replica in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(self.replicas[index].num_waiting for index in self.live_replicas())

    def stalled_seconds(self) -> float:
        """The longest any replica in rotation has not been heard from while it had work;
        once every replica left is silent, how long the last of them has been."""
        live = self.live_replicas()
        if not live and self.silent:
            now = time.monotonic()
            return min(now - self.replicas[index].last_heard for index in self.silent)
        return max((self.replicas[i].stalled_seconds() for i in live), default=0.0)

    @property
    def snapshot(self) -> EngineSnapshot:
        """Every replica's counters summed (a dead replica's last ones included)."""
        return sum_snapshots([replica.snapshot for replica in self.replicas])

    # ------------------------------------------------------------ routing

    def live_replicas(self) -> list[int]:
        """The replicas in rotation: neither dead nor silent."""
        return [index for index in range(len(self.replicas)) if index not in self.dead and index not in self.silent]

    def route_snapshot(self, index: int) -> ReplicaSnapshot:
        """Replica `index`'s load now: what the front end has sent it and not seen start, and
        what it last reported running."""
        replica = self.replicas[index]
        snapshot = replica.snapshot
        return ReplicaSnapshot(
            replica_id=index, num_waiting=replica.num_waiting, num_running=snapshot.scheduler.num_running,
            num_queued_tokens=replica.num_waiting_tokens, num_running_tokens=snapshot.num_running_tokens,
            num_kv_blocks=snapshot.allocator.num_blocks, num_used_kv_blocks=snapshot.allocator.num_used_blocks,
            block_size=self.block_size, resident_adapters=snapshot.resident_adapters)

    # ------------------------------------------------------------ events (on the event loop)

    def _observe(self, index: int, events: Events, snapshot: EngineSnapshot) -> None:
        for key, event in events.items():
            if event.is_last:
                self._finished(key)
        if self.metrics is not None:
            self.metrics.observe(events, self.snapshot)
            self.metrics.observe_replica(index, events, snapshot)

    def _finished(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        group = self._group_of.pop(request_id, None)
        if group is None:
            return
        self._group_left[group] -= 1
        if self._group_left[group] == 0:
            del self._group_left[group]
            self._groups.pop(group, None)
            if isinstance(self.router, FinishAwareRouter):
                self.router.request_finished(group, owner)

    def _replica_failed(self, index: int, message: str) -> None:
        self.dead.add(index)
        logger.error("replica.failed", replica=index, error=message, live=self.live_replicas())
        for request_id in [r for r, owner in self._owner.items() if owner == index]:
            self._finished(request_id)
        if self.metrics is not None:
            self.metrics.replica_down(index)
        if not self.live_replicas() and self.error is None:
            self.error = f"every engine replica has failed; the last: {message}"
            if self.on_failure is not None:
                self.on_failure(self.error)


async def watch_liveness(front_end: Any, timeout: float) -> None:
    """Every fraction of the liveness timeout, until the front end stops: its
    `check_liveness()` (a replica set's or the disaggregated front end's)."""
    interval = min(1.0, timeout / 4)
    while not front_end.stopping:
        await asyncio.sleep(interval)
        front_end.check_liveness()


def sum_snapshots(snapshots: Seq[EngineSnapshot]) -> EngineSnapshot:
    scheduler = SchedulerStats(num_waiting=sum(s.scheduler.num_waiting for s in snapshots),
                               num_running=sum(s.scheduler.num_running for s in snapshots),
                               num_preemptions=sum(s.scheduler.num_preemptions for s in snapshots))
    kv = [s.allocator for s in snapshots]
    allocator = AllocatorStats(num_blocks=sum(a.num_blocks for a in kv),
                               num_used_blocks=sum(a.num_used_blocks for a in kv),
                               num_free_blocks=sum(a.num_free_blocks for a in kv),
                               num_cached_blocks=sum(a.num_cached_blocks for a in kv),
                               prefix_lookup_tokens=sum(a.prefix_lookup_tokens for a in kv),
                               prefix_hit_tokens=sum(a.prefix_hit_tokens for a in kv))
    adapters = sorted({name for s in snapshots for name in s.resident_adapters})
    return EngineSnapshot(scheduler, allocator, sum(s.num_steps for s in snapshots),
                          sum(s.num_draft_tokens for s in snapshots), sum(s.num_accepted_tokens for s in snapshots),
                          sum(s.num_running_tokens for s in snapshots), sum(s.num_preparing for s in snapshots),
                          tier=sum_tiers([s.tier for s in snapshots if s.tier is not None]),
                          resident_adapters=tuple(adapters))


def sum_tiers(tiers: Seq[TierStats]) -> TierStats | None:
    """The replicas' host tiers as one: blocks and moves summed (a block's size is the model's)."""
    if not tiers:
        return None
    counts = {field.name: sum(getattr(t, field.name) for t in tiers) for field in attrs.fields(TierStats)
              if field.name != "block_bytes"}
    return TierStats(block_bytes=tiers[0].block_bytes, **counts)
