"""The engine on a thread of its own, driven from asyncio.

`LLMEngine.step()` runs the model synchronously, so one dedicated thread owns the engine
and makes every call on it. The event loop hands it commands (add a group of requests,
abort some, stop) through a queue; the thread hands back each step's results, the
requests' events and a stats snapshot, in one `call_soon_threadsafe` callback per step.
The thread steps while any request is in flight and blocks on the queue when none is.

Events are keyed as the engine keys them: new tokens by sequence id (the request id, or
"{request_id}#{i}" for completion i > 0 of an n > 1 request), the finished output by
request id. Every event of a request goes to the queue its HTTP request reads.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable, Iterable, Sequence as Seq

import attrs
import structlog

from servelab.errors import RequestError, ServelabError
from servelab.interfaces import AllocatorStats, SchedulerStats
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams
from servelab.server.detokenizer import Decode, Detokenizer

logger = structlog.get_logger(__name__)


class EngineUnavailable(ServelabError):
    """The engine loop is stopping or has failed; no new request can start."""


class AdmissionFailed(ServelabError):
    """The engine raised something other than RequestError while taking this request in:
    a fault of ours, not of the client's; the request is refused and nothing of it remains."""


@attrs.frozen
class RequestEvent:
    """What one step did for one sequence (tokens) or request (output, error)."""

    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[Any, ...] = ()  # SamplingParams.logprobs: one {token id: Logprob} per new token
    prompt_logprobs: tuple[Any, ...] = ()  # SamplingParams.prompt_logprobs, once the prompt is scored
    output: RequestOutput | None = None  # set once, when the request finished or was aborted
    error: str | None = None  # the engine failed; the request is gone
    deltas: tuple[Any, ...] = ()  # the request's text deltas, when it registered a decode function
    decode_error: str | None = None  # its decode function failed (see detokenizer.py)

    @property
    def is_last(self) -> bool:
        return self.output is not None or self.error is not None


@attrs.frozen
class EngineSnapshot:
    """The engine's counters after a loop iteration (read on the event loop, never live)."""

    scheduler: SchedulerStats
    allocator: AllocatorStats


@attrs.frozen
class NewRequest:
    """One engine request to add: its id, the prompt (text or ids), its params."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float


Events = dict[str, RequestEvent]
Listener = Callable[[Events, EngineSnapshot], None]


class AsyncEngine:
    """Owns the engine thread. Every method is called from the event loop's thread."""

    def __init__(self, engine: Any, listener: Listener | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._listener = listener
        self.on_failure = on_failure  # called on the event loop once the engine has failed
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._unstarted: dict[str, int] = {}  # request id -> sequences, until its first token
        self.num_waiting = 0  # sequences of requests added here that have no token yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._detokenizer: Detokenizer | None = None
        self.snapshot = _snapshot(engine)
        self.error: str | None = None  # set when the engine failed
        self.stopping = False

    # ------------------------------------------------------------ event loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._detokenizer = Detokenizer(lambda events, snapshot: self._call_soon(self._deliver, events, snapshot),
                                        RequestEvent)
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    async def add(self, requests: Seq[NewRequest], decode: Decode | None = None) -> asyncio.Queue:
        """Add a group of requests, all or none (RequestError names the first bad one).

        Returns one queue receiving `(sequence or request id, RequestEvent)` for every
        request of the group until each has had its output. Until a request's first token
        its sequences count in `num_waiting`. With `decode`, each event keyed by a request
        id also carries that request's text deltas, decoded on the detokenizer's thread.
        """
        if self.error is not None or self.stopping:
            raise EngineUnavailable(self.error or "the server is shutting down")
        request_ids = [request.request_id for request in requests]
        if decode is not None:
            self._detokenizer.register(request_ids, decode)
        events: asyncio.Queue = asyncio.Queue()
        for request in requests:
            self._queues[request.request_id] = events
            self._unstarted[request.request_id] = request.params.n
            self.num_waiting += request.params.n
        accepted = self._loop.create_future()
        self._commands.put(("add", list(requests), accepted))
        try:
            await accepted
        except BaseException as exc:
            self._detokenizer.unregister(request_ids)
            for request in requests:
                self._queues.pop(request.request_id, None)
                self._started(request.request_id)
            if isinstance(exc, asyncio.CancelledError):  # the client left while the group was queued
                self.abort([r.request_id for r in requests])
            raise
        return events

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
        if request_ids:
            self._commands.put(("abort", request_ids, None))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is still in flight and stop the thread."""
        self.stopping = True
        if self._thread is None:
            return
        self._commands.put(("stop", None, None))
        await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.to_thread(self._detokenizer.stop)

    def _deliver(self, events: Events, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot
        for key, event in events.items():
            request_id = key.partition("#")[0]
            self._started(request_id)
            target = self._queues.get(request_id)
            if target is not None:
                target.put_nowait((key, event))
        for key, event in events.items():  # after every sibling's tokens went out
            if event.is_last:
                self._queues.pop(key, None)
                self._detokenizer.unregister([key])
        if self._listener is not None:
            self._listener(events, snapshot)

    def _started(self, request_id: str) -> None:
        self.num_waiting -= self._unstarted.pop(request_id, 0)

    # ------------------------------------------------------------ engine thread side

    def _run(self) -> None:
        in_flight: set[str] = set()  # request ids
        try:
            self._serve(in_flight)
        except Exception as exc:  # a broken engine must not hang its clients
            self._fail(exc, in_flight, {})
            self._refuse_until_stopped()

    def _serve(self, in_flight: set[str]) -> None:
        """Take commands and step until told to stop; an exception here is the engine's death."""
        engine = self.engine
        while True:
            events: Events = {}
            stop = False
            for kind, payload, future in self._take_commands(block=not engine.has_unfinished()):
                if kind == "add" and not stop:
                    self._add(payload, future, in_flight)
                elif kind == "add":
                    self._resolve(future, EngineUnavailable("the server is shutting down"))
                elif kind == "abort":
                    self._abort(payload, in_flight, events)
                else:
                    stop = True
            if stop:
                self._abort(list(in_flight), in_flight, events)
                self._post(events, _snapshot(engine))
                return
            if engine.has_unfinished():
                result = engine.step()
                logprobs = result.new_logprobs
                for sequence_id, token_ids in result.new_token_ids.items():
                    events[sequence_id] = RequestEvent(tuple(token_ids), tuple(logprobs.get(sequence_id, ())))
                for request_id, scored in result.prompt_logprobs.items():
                    events[request_id] = attrs.evolve(events.get(request_id, RequestEvent()),
                                                      prompt_logprobs=tuple(scored))
                for output in result.finished:
                    _merge_output(events, output)
                    in_flight.discard(output.request_id)
            self._post(events, _snapshot(engine))

    def _take_commands(self, block: bool) -> list[tuple[str, Any, Any]]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _add(self, requests: list[NewRequest], future: asyncio.Future, in_flight: set[str]) -> None:
        try:
            for request in requests:  # all or none
                self.engine.validate_request(request.prompt, request.params)
            for request in requests:
                self.engine.add_request(request.prompt, request.params, request_id=request.request_id,
                                        arrival_time=request.arrival_time)
                in_flight.add(request.request_id)
        except RequestError as exc:
            self._resolve(future, exc)
        except Exception as exc:  # a fault while taking this group in fails this group alone
            logger.exception("request.admission_failed", request_ids=[r.request_id for r in requests])
            for request in requests:
                if request.request_id in in_flight:
                    self.engine.abort(request.request_id)
                    in_flight.discard(request.request_id)
            self._resolve(future, AdmissionFailed(f"{type(exc).__name__}: {exc}"))
        else:
            self._resolve(future, None)

    def _abort(self, request_ids: list[str], in_flight: set[str], events: Events) -> None:
        for request_id in request_ids:
            output = self.engine.abort(request_id)
            in_flight.discard(request_id)
            if output is not None:
                _merge_output(events, output)

    def _fail(self, exc: Exception, in_flight: set[str], events: Events) -> None:
        logger.exception("engine.failed", error=str(exc))
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        for request_id in in_flight:
            events[request_id] = RequestEvent(error=message)
        try:
            snapshot = _snapshot(self.engine)
        except Exception:  # the policies may be as broken as the step was
            snapshot = self.snapshot
        self._call_soon(self._mark_failed, message)
        self._post(events, snapshot)

    def _refuse_until_stopped(self) -> None:
        while True:
            kind, _, future = self._commands.get()
            if kind == "stop":
                return
            if kind == "add":
                self._resolve(future, EngineUnavailable("the engine has failed"))

    def _mark_failed(self, message: str) -> None:
        self.error = message
        if self.on_failure is not None:
            self.on_failure(message)

    def _resolve(self, future: asyncio.Future, exc: BaseException | None) -> None:
        def resolve() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(None)
            else:
                future.set_exception(exc)

        self._call_soon(resolve)

    def _post(self, events: Events, snapshot: EngineSnapshot) -> None:
        self._detokenizer.put(events, snapshot)  # then on to _deliver, on the event loop

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


def _merge_output(events: Events, output: RequestOutput) -> None:
    previous = events.get(output.request_id)
    events[output.request_id] = attrs.evolve(previous, output=output) if previous is not None else RequestEvent(
        output=output)


def _snapshot(engine: Any) -> EngineSnapshot:
    return EngineSnapshot(engine.scheduler.stats(), engine.allocator.stats())
