"""Requests on their way into the engine, validated and prepared off the step loop.

An add command's requests become the engine's request records on the intake's thread
(`engine.prepare_requests`: each checked once, the prompt against the vocabulary and
context, every sampling field, each logits processor's own checks, and the per-request
preparation of their logits processors, a grammar's compilation, started); the group
reaches the step loop only once all of it is done, and the loop only queues the
records (`engine.admit`), so it never runs per-request work. An abort that
arrives first cancels the group's preparation (a compilation nobody else waits for
stops) and the group never reaches the loop.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Any, Callable

import attrs
import structlog

from servelab.errors import RequestError
from servelab.request import RequestSpec
from servelab.server.errors import AdmissionFailed, EngineUnavailable

logger = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Group:
    """One add command on its way in."""

    command_id: int
    requests: list[Any]  # NewRequest
    records: list[Any] = attrs.field(factory=list)  # the engine's Request records, once prepared
    tickets: list[concurrent.futures.Future] = attrs.field(factory=list)
    cancelled: bool = False
    decided: bool = False  # its preparation ended (well or not)
    taken: bool = False  # the loop has it


def prepare_off_loop(engine: Any, requests: list[Any]) -> tuple[list[Any], list[concurrent.futures.Future]]:
    """The engine's records of a group's requests (RequestError names the first bad one,
    and then none exist) and the preparations to wait for before the loop may queue them."""
    records = engine.prepare_requests([RequestSpec(r.prompt, r.params, r.request_id, arrival_time=r.arrival_time,
                                                   lora_request=r.lora_request) for r in requests])
    tickets = list({id(f): f for record in records for f in record.preparing.values()}.values())
    return records, tickets


class Intake:
    """Validates and prepares add commands on a thread of its own; `post` hands the loop
    ("admit", command id, Group) or ("refuse", command id, error)."""

    def __init__(self, engine: Any, post: Callable[[tuple[str, Any, Any]], None]) -> None:
        self._engine = engine
        self._post = post
        self._lock = threading.Lock()
        self._groups: dict[str, Group] = {}  # request id -> its group, until the loop takes it or it is refused
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def num_preparing(self) -> int:
        """Requests validated or prepared here that the loop has not taken yet."""
        return len(self._groups)

    def submit(self, command_id: int, requests: list[Any]) -> None:
        group = Group(command_id, list(requests))
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                for request in group.requests:
                    self._groups[request.request_id] = group
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="servelab-intake", daemon=True)
                    self._thread.start()
        if closed:
            self._post(("refuse", command_id, EngineUnavailable("the server is shutting down")))
            return
        self._jobs.put(group)

    def cancel(self, request_ids: list[str]) -> None:
        """Aborted before the loop took them: their groups are dropped, their preparation cancelled."""
        tickets = []
        with self._lock:
            for request_id in request_ids:
                group = self._groups.get(request_id)
                if group is not None and not group.taken and not group.cancelled:
                    group.cancelled = True
                    tickets.extend(group.tickets)
        for ticket in tickets:
            ticket.cancel()

    def take(self, group: Group) -> bool:
        """The loop takes a group it was handed; False when it was aborted meanwhile."""
        with self._lock:
            self._forget(group)
            if group.cancelled:
                return False
            group.taken = True
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            groups = set(self._groups.values())
        self.cancel([r.request_id for g in groups for r in g.requests])
        self._jobs.put(None)

    def _forget(self, group: Group) -> None:
        for request in group.requests:
            if self._groups.get(request.request_id) is group:
                del self._groups[request.request_id]

    def _run(self) -> None:
        while (group := self._jobs.get()) is not None:
            self._prepare(group)

    def _prepare(self, group: Group) -> None:
        if group.cancelled:
            return self._refuse(group, None)
        try:
            records, tickets = prepare_off_loop(self._engine, group.requests)
        except RequestError as exc:
            return self._refuse(group, exc)
        except Exception as exc:  # a fault of ours while validating this group fails it alone
            logger.exception("request.intake_failed", request_ids=[r.request_id for r in group.requests])
            return self._refuse(group, AdmissionFailed(f"{type(exc).__name__}: {exc}"))
        with self._lock:
            group.records, group.tickets = records, tickets
            cancelled = group.cancelled
        if cancelled:
            for ticket in tickets:
                ticket.cancel()
        if not tickets:
            self._decide(group)
        for ticket in tickets:
            ticket.add_done_callback(lambda _, group=group: self._decide(group))

    def _decide(self, group: Group) -> None:
        """Once every preparation of the group is done: hand it to the loop, or refuse it."""
        with self._lock:
            if group.decided or not all(ticket.done() for ticket in group.tickets):
                return
            group.decided = True
        if group.cancelled:
            return self._refuse(group, None)
        if any(ticket.cancelled() for ticket in group.tickets):
            return self._refuse(group, None)
        for ticket in group.tickets:
            error = ticket.exception()
            if error is not None:
                if not isinstance(error, RequestError):
                    error = AdmissionFailed(f"a logits processor failed to prepare: {type(error).__name__}: {error}")
                return self._refuse(group, error)
        self._post(("admit", group.command_id, group))

    def _refuse(self, group: Group, error: BaseException | None) -> None:
        with self._lock:
            self._forget(group)
            records, group.records = group.records, []
        self._engine.discard(records)  # the records' processor states, if any were made
        self._post(("refuse", group.command_id,
                    error if error is not None else EngineUnavailable("the request was aborted")))
