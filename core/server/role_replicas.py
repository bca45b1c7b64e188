"""The prefill and decode engines of `servelab serve --prefill-replicas N --decode-replicas M`.

`RoleActor` is one engine and its role from servelab.disagg, unchanged (a `PrefillWorker`
or a `DecodeWorker`), on a thread of a Ray actor: it takes command batches (add, accept,
recompute, abort, stop) and a long poll brings back what each step did, with the engine's
snapshot and its role's transfer counters. `RoleReplica` is the front end's handle on one:
commands down, a reader thread for its polls (servelab.server.disaggregated routes
between them).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any

import structlog

from servelab.errors import RequestError
from servelab.server.engine_core import EMPTY_SNAPSHOT, EngineInfo, EngineSnapshot
from servelab.server.liveness import POLL_SECONDS
from servelab.server.replicas import import_ray

logger = structlog.get_logger(__name__)

PRODUCER, CONSUMER = "producer", "consumer"
_HOLD_WAIT_S = 0.01  # the loop's wait for a command while only holds or handoffs not ready yet keep it busy
_IDLE_WAIT_S = 0.5  # and while it has nothing to do (it refreshes its snapshot this often)


class RoleActor:
    """One prefill or decode engine and its role, on a thread of a Ray actor."""

    def __init__(self, config: Any, role: str, name: str, lease_s: float, failure_policy: str,
                 threads: int | None, verbosity: int | None) -> None:
        if verbosity is not None:
            from servelab.logging_setup import configure_logging

            configure_logging(verbosity)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from servelab.disagg.consumer import DecodeWorker
        from servelab.disagg.producer import PrefillWorker
        from servelab.engine import LLMEngine
        from servelab.engine_setup import build_kv_transport
        from servelab.interfaces import KVTransferContext
        from servelab.registry import PluginRegistry

        registry = PluginRegistry.from_entry_points()
        self.role, self.name = role, name
        self.engine = LLMEngine(config, registry)
        self.transport = build_kv_transport(config, registry, KVTransferContext(role=role, name=name))
        self.worker: Any = (PrefillWorker(self.engine, self.transport, name, lease_s) if role == PRODUCER
                            else DecodeWorker(self.engine, self.transport, name, failure_policy))
        self._commands: queue.Queue = queue.Queue()
        self._next_batch = 0  # actor calls may run out of order: command batches carry a number
        self._early: dict[int, list[tuple]] = {}
        self._order = threading.Lock()
        self._ready = threading.Condition()
        self._messages: list[tuple] = []
        self._report: tuple[EngineSnapshot, dict[str, float], Any] = (EMPTY_SNAPSHOT, {}, None)
        self._num_steps = 0
        self._done = False
        self._thread = threading.Thread(target=self._run, name=f"servelab-{name}", daemon=True)
        self._thread.start()

    def info(self) -> tuple[EngineInfo, int]:
        return EngineInfo.of(self.engine), os.getpid()

    def send(self, batch: int, commands: list[tuple]) -> None:
        with self._order:
            self._early[batch] = commands
            while self._next_batch in self._early:
                for command in self._early.pop(self._next_batch):
                    self._commands.put(command)
                self._next_batch += 1

    def poll(self, timeout: float) -> tuple[list[tuple], tuple[EngineSnapshot, dict[str, float], Any], bool]:
        """The loop's messages since the last poll (waiting up to `timeout` for one), its
        latest report (snapshot, transfer counters, prefix summary) and whether it stopped."""
        with self._ready:
            self._ready.wait_for(lambda: self._messages or self._done, timeout)
            messages, self._messages = self._messages, []
            return messages, self._report, self._done

    # ------------------------------------------------------------ the loop's thread

    def _emit(self, message: tuple) -> None:
        with self._ready:
            self._messages.append(message)
            self._ready.notify_all()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # a broken engine must not hang its clients
            logger.exception("disagg.replica_failed", replica=self.name)
            self._emit(("failed", f"{type(exc).__name__}: {exc}"))
        finally:
            self.transport.close()
            with self._ready:
                self._done = True
                self._ready.notify_all()

    def _loop(self) -> None:
        worker, engine = self.worker, self.engine
        last_report = 0.0
        while True:
            if engine.has_unfinished():
                wait = 0.0
            elif worker.has_work() or (self.role == PRODUCER and worker.num_holds):
                wait = _HOLD_WAIT_S  # holds to release, or handoffs to load once ready: no need to spin
            else:
                wait = _IDLE_WAIT_S
            commands = self._take(wait)
            for command in commands:
                if command[0] == "stop":
                    if self.role == PRODUCER:
                        worker.shutdown()
                    self._refresh_report()  # the front end's last word on this replica's blocks
                    return
                self._command(command)
            changed = bool(commands)
            if worker.has_work() or (self.role == PRODUCER and worker.num_holds):
                changed |= self._step()
            now = time.monotonic()
            if changed or now - last_report > _IDLE_WAIT_S:
                self._refresh_report()
                last_report = now

    def _take(self, wait: float) -> list[tuple]:
        taken = []
        try:
            taken.append(self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait())
        except queue.Empty:
            return taken
        while True:
            try:
                taken.append(self._commands.get_nowait())
            except queue.Empty:
                return taken

    def _command(self, command: tuple) -> None:
        kind, *args = command
        worker = self.worker
        if kind == "add":  # producer: (transfer id, prompt, params, arrival time, LoRA adapter)
            try:
                worker.add(*args)
            except RequestError as exc:
                self._emit(("added", args[0], str(exc)))
            else:
                self._emit(("added", args[0], None))
        elif kind == "accept":  # consumer: (handoff, params, arrival time, the first token's and the prompt's
            # logprobs, LoRA adapter)
            output = worker.accept(*args)
            if output is not None:
                self._emit(("step", {}, [output]))
        elif kind == "recompute":  # consumer: (transfer id, prompt, params, LoRA adapter)
            refused = worker.recompute(*args)  # the request's error output when the engine refused it
            self._emit(("added", args[0], refused.error if refused is not None else None))
        elif kind == "abort":
            for transfer_id in args[0]:
                worker.abort(transfer_id)

    def _step(self) -> bool:
        """One step of the worker; whether anything the report shows changed."""
        stepping = self.engine.has_unfinished()
        released = False
        if self.role == PRODUCER:
            holds = self.worker.num_holds
            done = self.worker.step()
            for answer in done:
                self._emit(("prefilled", answer.transfer_id, answer.output, answer.handoff))
            released = self.worker.num_holds < holds  # a hold let go: its blocks are free
        else:
            finished = self.worker.step()
            events = self.worker.events
            if events or finished:
                self._emit(("step", events, finished))
        if stepping:
            self._num_steps += 1
        return stepping or released

    def _refresh_report(self) -> None:
        from servelab.routing import reported_prefix_summary

        engine = self.engine
        snapshot = EngineSnapshot(engine.scheduler.stats(), engine.allocator.stats(), self._num_steps)
        summary = reported_prefix_summary(engine.allocator) if self.role == CONSUMER else None
        with self._ready:
            self._report = (snapshot, self.worker.metrics.as_dict(), summary)


class RoleReplica:
    """The front end's handle on one RoleActor: commands down, a reader thread for its polls."""

    def __init__(self, actor: Any, role: str, name: str, index: int, info: EngineInfo, pid: int) -> None:
        self.actor, self.role, self.name, self.index = actor, role, name, index
        self.info, self.pid = info, pid
        self.snapshot = EMPTY_SNAPSHOT
        self.transfer_metrics: dict[str, float] = {}
        self.prefix_summary: Any = None
        self.dead = False
        self.last_heard = time.monotonic()
        self._batches = 0
        self._stopping = False
        self._reader: threading.Thread | None = None

    def start(self, on_poll: Any, on_exit: Any) -> None:
        self.last_heard = time.monotonic()  # the watchdog counts silence from now, not from the actor's start
        self._reader = threading.Thread(target=self._read, args=(on_poll, on_exit), daemon=True,
                                        name=f"servelab-{self.name}")
        self._reader.start()

    def send(self, command: tuple) -> None:
        if self.dead:
            return
        self.actor.send.remote(self._batches, [command])
        self._batches += 1

    def stop(self, timeout: float) -> None:
        self._stopping = True
        self.send(("stop",))
        if self._reader is not None:
            self._reader.join(timeout)
        import_ray().kill(self.actor)

    def _read(self, on_poll: Any, on_exit: Any) -> None:
        ray = import_ray()
        while True:
            try:
                messages, report, done = ray.get(self.actor.poll.remote(POLL_SECONDS))
            except Exception as exc:  # RayActorError and its kin: the actor (or its node) is gone
                if not self._stopping:
                    text = str(exc).strip()
                    on_exit(self, f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else 'no message'}")
                return
            on_poll(self, messages, report)
            if done:
                if not self._stopping:
                    on_exit(self, "its engine loop stopped")
                return
