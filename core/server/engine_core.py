"""The engine's step loop, apart from where it runs and how it is reached.

`EngineCore` owns an `LLMEngine` and makes every call on it: it takes commands (add a
group of requests, abort some, stop), steps while any request is in flight, blocks for
the next command when none is, and after every iteration sends one `CoreOutput`: the new
token ids of every sequence, the outputs of the requests that finished, the answers to
the add commands it took, and a stats snapshot. One message per step for all requests,
whatever carries it: a queue to a thread (connection.ThreadConnection), a pipe to
another process (engine_process) or a Ray actor call (replicas).

Commands are plain tuples so that they pickle cheaply:
    ("add", command_id, [NewRequest, ...])   all or none; answered in CoreOutput.resolved
    ("abort", None, [request_id, ...])       unknown ids are ignored
    ("stop", None, None)                      abort whatever is in flight, send it, return

Nothing per request runs on the step loop beyond its admission: an add is validated (and
its logits processors' per-request preparation, a grammar's compilation, awaited) on the
intake thread (intake.py), and only a group that passed reaches the loop. While work is
queued the loop sends at least one CoreOutput every HEARTBEAT_SECONDS (an empty one if
need be), so the front end can tell a stalled loop from a busy one (`/health`).

An exception out of a step (or the loop around it) is the engine's death: the last
CoreOutput carries `failure`, and every later add is refused until "stop".
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import attrs
import structlog

import servelab
from servelab.errors import RequestError
from servelab.expert_load import expert_load_of, pipeline_stats_of
from servelab.interfaces import AllocatorStats, ClosingProcessor, LoRARunner, SchedulerStats, SequenceStatus, WarmingProcessor
from servelab.outputs import RequestEvent, RequestOutput
from servelab.sampling_params import SamplingParams
from servelab.server.errors import AdmissionFailed, EngineUnavailable
from servelab.server.intake import Intake
from servelab.server.liveness import HEARTBEAT_SECONDS

logger = structlog.get_logger(__name__)


@attrs.frozen
class NewRequest:
    """One engine request to add: its id, the prompt (text or ids), its params."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float  # on the engine's clock (time.perf_counter unless the engine has its own)
    lora_request: Any = None  # servelab.LoRARequest: the LoRA adapter it runs with; None: the base model


@attrs.frozen
class EngineSnapshot:
    """The engine's counters after a loop iteration (read on the event loop, never live)."""

    scheduler: SchedulerStats
    allocator: AllocatorStats
    num_steps: int = 0  # totals since the engine started
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_running_tokens: int = 0  # context tokens of running sequences (for routers; 0 unless asked for)
    num_preparing: int = 0  # requests being validated or waiting for a grammar, not yet in the scheduler
    tier: Any = None  # TierStats of the host KV tier ([kv_offload]), None without one
    resident_adapters: tuple[str, ...] = ()  # LoRA adapters in the fast pool (for an adapter-affinity router)
    expert_load: Any = None  # a mixture-of-experts model's {layer: assignments per expert}, None for a dense one
    pipeline_bubble: float | None = None  # under pipeline parallelism, stage 0's idle share so far
    pipeline_stage_bubbles: tuple = ()  # every stage's idle share so far (None: not run yet)


@attrs.frozen
class EngineInfo:
    """What the front end needs to know of an engine it does not hold."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int = 20  # the most logprobs a request may ask for ([engine] max_logprobs)

    @classmethod
    def of(cls, engine: Any) -> "EngineInfo":
        return cls(engine.limits.max_model_len, engine.model_config.vocab_size, engine.config.engine.max_logprobs)


@attrs.frozen
class CoreOutput:
    """One loop iteration's results, for every request at once."""

    events: dict[str, RequestEvent]  # the step's, by sequence id ("{request_id}#{i}" for completion i > 0)
    finished: list[RequestOutput]  # requests that finished or were aborted
    snapshot: EngineSnapshot
    resolved: list[tuple[int, BaseException | None]] = attrs.field(factory=list)  # (add command id, its error)
    failure: str | None = None  # the engine failed: every request in flight is gone


Command = tuple[str, Any, Any]
EMPTY_SNAPSHOT = EngineSnapshot(SchedulerStats(0, 0, 0), AllocatorStats(0, 0, 0))


def _bubbles(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    return {"pipeline_bubble": stats.bubble_fraction, "pipeline_stage_bubbles": tuple(stats.stage_bubble_fractions)}


class StepCounter:
    """An observer plugin totalling steps and draft tokens for the snapshot."""

    def __init__(self) -> None:
        self.num_steps = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.tier_stats: Any = None

    @servelab.hookimpl
    def servelab_step_finished(self, engine: Any, report: Any) -> None:
        self.num_steps += 1
        self.num_draft_tokens += report.num_draft_tokens
        self.num_accepted_tokens += report.num_accepted_tokens
        self.tier_stats = report.tier_stats  # the host KV tier's, from the last step (None without one)


class EngineCore:
    """Runs an engine's step loop: `receive(block)` gives the commands waiting (at least
    one when `block`), `send(output)` takes each iteration's CoreOutput."""

    def __init__(self, engine: Any, receive: Callable[[bool], list[Command]],
                 send: Callable[[CoreOutput], None], count_running_tokens: bool = False) -> None:
        self.engine = engine
        self._count_running_tokens = count_running_tokens
        self._receive = receive
        self._send = send
        self._counter = StepCounter()
        self._last_snapshot = EMPTY_SNAPSHOT
        self._last_sent = time.monotonic()
        engine.registry.register(self._counter)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # commands for the loop, admitted groups included
        self._intake = Intake(engine, lambda command: self._inbox.put(command))
        self._processors = list(engine.logits_pipeline.processors.values())
        # xgrammar's import and the JSON-object grammar, off the loop before the first request needs them
        warm = [p.warm_up for p in self._processors if isinstance(p, WarmingProcessor)]
        if warm:
            threading.Thread(target=lambda: [w() for w in warm], name="servelab-warm-up", daemon=True).start()

    def run(self) -> None:
        in_flight: set[str] = set()  # request ids
        reader = threading.Thread(target=self._read_commands, name="servelab-commands", daemon=True)
        reader.start()
        try:
            self._serve(in_flight)
        except Exception as exc:  # a broken engine must not hang its clients
            self._fail(exc)
            self._refuse_until_stopped()
        finally:
            self._intake.close()
            for processor in self._processors:  # a grammar compiling now is killed, not waited for
                if isinstance(processor, ClosingProcessor):
                    processor.close()

    def _read_commands(self) -> None:
        """Commands from the connection: adds to the intake, the rest to the loop, in order
        (an abort reaches the intake first, so a group it held never reaches the loop)."""
        while True:
            for command in self._receive(True):
                kind, command_id, payload = command
                if kind == "add":
                    self._intake.submit(command_id, payload)
                    # the loop may sleep on the inbox: it wakes to send heartbeats while this prepares
                    self._inbox.put(("wake", None, None))
                    continue
                if kind == "abort":
                    self._intake.cancel(payload)
                self._inbox.put(command)
                if kind == "stop":
                    self._intake.close()
                    return

    def _take(self, block: bool) -> list[Command]:
        """The loop's commands: with `block`, waiting for one (up to a heartbeat while the
        intake holds requests, so that the loop keeps telling the front end it is alive)."""
        taken = []
        if block:
            try:
                taken.append(self._inbox.get(timeout=HEARTBEAT_SECONDS if self._intake.num_preparing else None))
            except queue.Empty:
                pass
        while True:
            try:
                taken.append(self._inbox.get_nowait())
            except queue.Empty:
                return taken

    def _send_output(self, output: CoreOutput) -> None:
        self._last_sent = time.monotonic()
        self._send(output)

    def snapshot(self) -> EngineSnapshot:
        counter = self._counter
        running_tokens = 0
        if self._count_running_tokens:
            running_tokens = sum(seq.num_tokens for seq in self.engine.unfinished_sequences()
                                 if seq.status is SequenceStatus.RUNNING)
        preparing = self._intake.num_preparing + self.engine.num_preparing_requests()
        self._last_snapshot = EngineSnapshot(self.engine.scheduler.stats(), self.engine.allocator.stats(),
                                             counter.num_steps, counter.num_draft_tokens, counter.num_accepted_tokens,
                                             running_tokens, preparing,
                                             counter.tier_stats, resident_adapters(self.engine),
                                             expert_load=expert_load_of(self.engine) or None,
                                             **_bubbles(pipeline_stats_of(self.engine)))
        return self._last_snapshot

    def _serve(self, in_flight: set[str]) -> None:
        engine = self.engine
        while True:
            events: dict[str, RequestEvent] = {}
            finished: list[RequestOutput] = []
            resolved: list[tuple[int, BaseException | None]] = []
            stop = False
            for kind, command_id, payload in self._take(not engine.has_unfinished()):
                if kind == "admit" and not stop:
                    resolved.append((command_id, self._admit(payload, in_flight)))
                elif kind == "admit":
                    self.engine.discard(payload.records)
                    resolved.append((command_id, EngineUnavailable("the server is shutting down")))
                elif kind == "refuse":
                    resolved.append((command_id, payload))
                elif kind == "abort":
                    self._abort(payload, in_flight, finished)
                elif kind == "stop":
                    stop = True
            if stop:
                self._abort(list(in_flight), in_flight, finished)
                self._send_output(CoreOutput(events, finished, self.snapshot(), resolved))
                return
            if resolved:  # answer admissions before the (slow) step, so requests count as started early
                self._send_output(CoreOutput({}, finished, self.snapshot(), resolved))
                finished = []
            if engine.has_unfinished():
                result = engine.step()
                events = result.events
                finished.extend(result.finished)
                for output in result.finished:
                    in_flight.discard(output.request_id)
            if events or finished:
                self._send_output(CoreOutput(events, finished, self.snapshot()))
            elif (engine.has_unfinished() or self._intake.num_preparing) and \
                    time.monotonic() - self._last_sent > HEARTBEAT_SECONDS:
                self._send_output(CoreOutput({}, [], self.snapshot()))  # the loop turns: a heartbeat

    def _admit(self, group: Any, in_flight: set[str]) -> BaseException | None:
        """Queue a group the intake validated (and prepared), unless it was aborted meanwhile."""
        if not self._intake.take(group):
            self.engine.discard(group.records)
            return EngineUnavailable("the request was aborted before it was admitted")
        try:  # checked and prepared on the intake's thread: queueing them is all that is left
            in_flight.update(self.engine.admit(group.records))
        except RequestError as exc:  # an id already in flight: admit took none of them
            return exc
        except Exception as exc:  # a fault while taking this group in fails this group alone
            logger.exception("request.admission_failed", request_ids=[r.request_id for r in group.requests])
            for record in group.records:
                if record.request_id in in_flight:
                    self.engine.abort(record.request_id)
                    in_flight.discard(record.request_id)
            return AdmissionFailed(f"{type(exc).__name__}: {exc}")
        return None

    def _abort(self, request_ids: list[str], in_flight: set[str], finished: list[RequestOutput]) -> None:
        for request_id in request_ids:
            output = self.engine.abort(request_id)
            in_flight.discard(request_id)
            if output is not None:
                finished.append(output)

    def _fail(self, exc: Exception) -> None:
        logger.exception("engine.failed", error=str(exc))
        try:
            snapshot = self.snapshot()
        except Exception:  # the policies may be as broken as the step was
            snapshot = self._last_snapshot
        self._send(CoreOutput({}, [], snapshot, failure=f"the engine failed: {type(exc).__name__}: {exc}"))

    def _refuse_until_stopped(self) -> None:
        while True:
            refused = []
            for kind, command_id, _ in self._take(True):
                if kind == "stop":
                    return
                if kind in ("admit", "refuse"):
                    refused.append((command_id, EngineUnavailable("the engine has failed")))
            if refused:
                self._send(CoreOutput({}, [], self._last_snapshot, refused))


def resident_adapters(engine: Any) -> tuple[str, ...]:
    """The LoRA adapters in the engine's fast pool (none without LoRA)."""
    runner = engine.runner
    return tuple(runner.lora.resident()) if isinstance(runner, LoRARunner) and runner.lora is not None else ()
