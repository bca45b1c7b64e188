"""Detokenization off the engine's step loop and off the event loop.

Each engine-loop iteration's events pass through here once: the requests that registered
a decode function get their new tokens (and finished outputs) turned into text deltas,
all in one batch, and the events go on to the event loop in one callback. That batch
runs on a thread of its own when the engine is on a thread of this process, and on the
thread that reads the engine's outputs when the engine is elsewhere (a process of its
own, a Ray actor). The engine decodes once per request, at retirement (the final text of
its output, which stop strings may have cut); the streamed deltas are decoded here, the
event loop never decodes, and there is one thread hand-off per step, not one per request.

A decode function that raises fails its own request alone: its event carries
`decode_error` instead of deltas, and every other request carries on.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import attrs
import structlog

from servelab.outputs import RequestEvent
from servelab.sequence import owner_of

logger = structlog.get_logger(__name__)

# decode(the request's events by sequence id) -> its text deltas
Decode = Callable[[dict[str, RequestEvent]], list[Any]]


class Detokenizer:
    """Turns each step's events into text deltas, then hands them to `deliver`."""

    def __init__(self, deliver: Callable[..., None], threaded: bool = True) -> None:
        self._deliver = deliver  # called with (events, *extra) from this thread: it must be thread-safe
        self._decoders: dict[str, Decode] = {}  # engine request id -> its decode function
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if threaded:  # else put() decodes on its caller's thread (one that only reads an engine's outputs)
            self._thread = threading.Thread(target=self._run, name="servelab-detokenizer", daemon=True)
            self._thread.start()

    def register(self, request_ids: list[str], decode: Decode) -> None:
        with self._lock:
            self._decoders.update((request_id, decode) for request_id in request_ids)

    def unregister(self, request_ids: list[str]) -> None:
        with self._lock:
            for request_id in request_ids:
                self._decoders.pop(request_id, None)

    def put(self, events: dict[str, RequestEvent], *extra: Any) -> None:
        """Queue one iteration's events (called from the thread that receives the engine's outputs)."""
        if self._thread is None:
            self._deliver(self._decode(events), *extra)
        else:
            self._queue.put((events, extra))

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            events, extra = item
            self._deliver(self._decode(events), *extra)

    def _decode(self, events: dict[str, RequestEvent]) -> dict[str, RequestEvent]:
        by_request: dict[str, dict[str, RequestEvent]] = {}
        for key, event in events.items():
            by_request.setdefault(owner_of(key), {})[key] = event
        with self._lock:
            decoders = {rid: self._decoders.get(rid) for rid in by_request}
        decoded = dict(events)
        for request_id, own in by_request.items():
            decode = decoders[request_id]
            if decode is None:
                continue
            base = events.get(request_id) or RequestEvent()
            try:
                decoded[request_id] = attrs.evolve(base, deltas=tuple(decode(own)))
            except Exception as exc:  # this request's text is lost; the others' is not
                logger.exception("request.detokenize_failed", request_id=request_id)
                decoded[request_id] = attrs.evolve(base, decode_error=f"{type(exc).__name__}: {exc}")
        return decoded
