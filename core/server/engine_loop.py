"""The front end's view of one engine core, driven from asyncio.

`AsyncEngine` hands commands (add a group of requests, abort some, stop) to an engine
core through an `EngineConnection` (engine_connection.py: on a thread, in a process of
its own, or in a Ray actor) and gets back one `CoreOutput` per step for every request
at once: the engine's own events (servelab.outputs.RequestEvent), each finished output
put on its request's. They are detokenized on a thread of their own (detokenizer.py), and
delivered to the event loop in one callback per step, where every event goes to the queue
its HTTP request reads.

Events are keyed as the engine keys them: new tokens by sequence id (the request id, or
"{request_id}#{i}" for completion i > 0 of an n > 1 request), the finished output by
request id.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable, Iterable, Sequence as Seq

import structlog

from servelab.outputs import RequestEvent, RequestOutput
from servelab.sequence import owner_of
from servelab.server.detokenizer import Decode, Detokenizer
from servelab.server.engine_connection import EngineConnection, ThreadConnection
from servelab.server.engine_core import (EMPTY_SNAPSHOT, AdmissionFailed, CoreOutput, EngineInfo, EngineSnapshot,
                                         EngineUnavailable, NewRequest)
from servelab.server.stream_buffer import StreamBuffer

logger = structlog.get_logger(__name__)

__all__ = ["AdmissionFailed", "AsyncEngine", "EngineSnapshot", "EngineUnavailable", "NewRequest", "RequestEvent",
           "ThreadConnection"]


Events = dict[str, RequestEvent]
Listener = Callable[[Events, EngineSnapshot], None]


class AsyncEngine:
    """One engine core behind a connection. Every method is called from the event loop's thread."""

    def __init__(self, connection: EngineConnection, listener: Listener | None = None,
                 on_failure: Callable[[str], None] | None = None, name: str = "engine") -> None:
        self.connection = connection
        self.name = name  # which replica, in logs and errors
        self.listener = listener  # called on the event loop with each step's events and snapshot
        self.on_failure = on_failure  # called on the event loop once the engine has failed
        self._queues: dict[str, StreamBuffer] = {}
        self._unstarted: dict[str, tuple[int, int]] = {}  # request id -> (sequences, their prompt tokens)
        self._pending: dict[int, asyncio.Future] = {}  # add commands the core has not answered
        self._command_ids = itertools.count()
        self.num_waiting = 0  # sequences of requests added here that have no token yet
        self.num_waiting_tokens = 0  # and their prompt tokens (as far as known: token-id prompts)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._detokenizer: Detokenizer | None = None
        self.snapshot = EMPTY_SNAPSHOT
        self.error: str | None = None  # set when the engine failed
        self.stopping = False
        self._started_connection = False
        self._last_heard = time.monotonic()  # the core's last output (its loop turned), or work sent to an idle one

    @property
    def info(self) -> EngineInfo:
        return self.connection.info

    def clock(self) -> float:
        return self.connection.clock()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # An engine on a thread of this process would decode on its own time: give the decoding
        # a thread. Other connections deliver on a reader thread that has nothing else to do.
        self._detokenizer = Detokenizer(lambda events, *extra: self._call_soon(self._deliver, events, *extra),
                                        threaded=isinstance(self.connection, ThreadConnection))
        self.connection.start(self._on_output, self._on_exit)
        self._started_connection = True

    async def add(self, requests: Seq[NewRequest], decode: Decode | None = None,
                  events: StreamBuffer | None = None) -> StreamBuffer:
        """Add a group of requests, all or none (RequestError names the first bad one).

        Returns one queue receiving `(sequence or request id, RequestEvent)` for every
        request of the group until each has had its output (`events`, when given: a group
        moved here from another engine keeps its reader's queue). Until a request's first
        token its sequences count in `num_waiting`. With `decode`, each event keyed by a
        request id also carries that request's text deltas, decoded on the detokenizer's thread.
        """
        if self.error is not None or self.stopping:
            raise EngineUnavailable(self.error or "the server is shutting down")
        request_ids = [request.request_id for request in requests]
        if decode is not None:
            self._detokenizer.register(request_ids, decode)
        if events is None:
            events = StreamBuffer()  # bounded: a lagging reader's events merge (stream_buffer.py)
        for request in requests:
            self._queues[request.request_id] = events
            tokens = request.params.n * (len(request.prompt) if isinstance(request.prompt, list) else 0)
            self._unstarted[request.request_id] = (request.params.n, tokens)
            self.num_waiting += request.params.n
            self.num_waiting_tokens += tokens
        command_id = next(self._command_ids)
        if not self._pending and len(self._queues) == len(requests):  # an idle core: its clock starts now
            self._last_heard = time.monotonic()
        accepted = self._pending[command_id] = self._loop.create_future()
        self.connection.send(("add", command_id, list(requests)))
        try:
            await accepted
        except BaseException as exc:
            self._detokenizer.unregister(request_ids)
            for request in requests:
                self._queues.pop(request.request_id, None)
                self._started(request.request_id)
            if isinstance(exc, asyncio.CancelledError):  # the client left while the group was queued
                self.abort(request_ids)
            raise
        finally:
            self._pending.pop(command_id, None)
        return events

    def stalled_seconds(self) -> float:
        """Seconds since the core was last heard from while work is queued in it (0 when
        none is): a core that steps, or waits for a grammar, sends at least a heartbeat
        every liveness.HEARTBEAT_SECONDS."""
        if not self._queues and not self._pending:
            return 0.0
        return max(0.0, time.monotonic() - self._last_heard)

    @property
    def last_heard(self) -> float:
        """time.monotonic() of the core's last output (or of work sent to it while idle)."""
        return self._last_heard

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight here with `message` (and refuse the adds the core
        has not answered), and abort them in the core, which may still be alive: a core
        that stopped answering. The engine itself is not marked failed."""
        failed = RequestEvent(error=message)
        request_ids = list(self._queues)
        for request_id, target in self._queues.items():
            self._started(request_id)
            target.put_nowait((request_id, failed))
        self._detokenizer.unregister(request_ids)
        self._queues.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineUnavailable(message))
        if request_ids:
            self.connection.send(("abort", None, request_ids))

    def has_started(self, request_id: str) -> bool:
        """Whether any event of the request (a token, its end) has reached its queue."""
        return request_id not in self._unstarted

    def detach(self, request_ids: Seq[str]) -> None:
        """Forget requests that have not started, without a word to their readers, and abort
        them in the core (which may be stopped: the abort waits in its pipe): the reader's
        queue is about to be fed by another engine."""
        for request_id in request_ids:
            self._queues.pop(request_id, None)
            self._started(request_id)
        self._detokenizer.unregister(list(request_ids))
        self.abort(request_ids)

    @property
    def num_in_flight(self) -> int:
        """Engine requests added here that have not had their output (or error) yet."""
        return len(self._queues)

    def abort_all(self) -> None:
        """Abort every request in flight: each ends with an output whose finish_reason is "abort"."""
        self.abort(list(self._queues))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests now (their KV is freed before the next step); unknown ids are ignored."""
        request_ids = list(request_ids)
        if request_ids and self.error is None:
            self.connection.send(("abort", None, request_ids))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the core."""
        self.stopping = True
        if not self._started_connection:
            return
        await asyncio.to_thread(self.connection.stop, timeout)
        await asyncio.to_thread(self._detokenizer.stop)

    # ------------------------------------------------------------ the connection's thread

    def _on_output(self, output: CoreOutput) -> None:
        self._last_heard = time.monotonic()
        for command_id, error in output.resolved:
            self._call_soon(self._resolve, command_id, error)
        events: Events = output.events
        for finished in output.finished:
            event = events.get(finished.request_id)
            if event is None:
                events[finished.request_id] = RequestEvent(output=finished)
            else:
                event.output = finished
        # then _deliver, on the event loop (an output that only answers admissions brings a
        # snapshot too: a refused or cancelled request leaves the waiting count there)
        self._detokenizer.put(events, output.snapshot, output.failure)

    def _on_exit(self, message: str) -> None:
        self._detokenizer.put({}, self.snapshot, message)

    # ------------------------------------------------------------ event loop side

    def _deliver(self, events: Events, snapshot: EngineSnapshot, failure: str | None = None) -> None:
        self.snapshot = snapshot
        for key, event in events.items():
            request_id = owner_of(key)
            self._started(request_id)
            target = self._queues.get(request_id)
            if target is not None:
                target.put_nowait((key, event))
        for key, event in events.items():  # after every sibling's tokens went out
            if event.is_last:
                self._queues.pop(key, None)
                self._detokenizer.unregister([key])
        if self.listener is not None:
            self.listener(events, snapshot)
        if failure is not None and self.error is None:
            self._fail(failure)

    def _fail(self, message: str) -> None:
        """The engine is gone: every request in flight ends with an error, every add waiting is refused."""
        logger.error("engine.failed", engine=self.name, error=message)
        self.error = message
        failed = RequestEvent(error=message)
        for request_id, target in self._queues.items():
            self._started(request_id)
            target.put_nowait((request_id, failed))
        self._detokenizer.unregister(list(self._queues))
        self._queues.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(EngineUnavailable(message))
        if self.on_failure is not None:
            self.on_failure(message)

    def _resolve(self, command_id: int, error: BaseException | None) -> None:
        future = self._pending.get(command_id)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _started(self, request_id: str) -> None:
        sequences, tokens = self._unstarted.pop(request_id, (0, 0))
        self.num_waiting -= sequences
        self.num_waiting_tokens -= tokens

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass
