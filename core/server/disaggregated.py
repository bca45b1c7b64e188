"""Prefill and decode replicas behind one server (`servelab serve --prefill-replicas N
--decode-replicas M`).

Each engine is a Ray actor (`RoleActor`, role_replicas.py; one process each, as
`--replicas`) running its role from servelab.disagg unchanged: a `PrefillWorker` (the
request runs with max_tokens=1, its KV held under a lease and offered through the
`[kv_transfer]` transport) or a `DecodeWorker` (it accepts a handoff, loads only the
blocks its prefix cache lacks, and decodes on).

`DisaggregatedEngine` is what the HTTP routes talk to, with the interface of one
AsyncEngine (as ReplicaSet has): it mints a transfer id per request, sends the request to
a prefill replica (the P/D router's prefill policy over the replicas' load), streams the
first token when the prefill ends, hands the handoff to a decode replica (the router's
decode policy over their load and prefix summaries) and streams that replica's tokens
into the same stream. Request times (TTFT, TPOT) are taken on this process's clock. A
request of n > 1 completions is n transfers, one per completion (seed + i, as one engine
seeds completion i), all prefilled on one replica; each streams under its completion's
key ("{request_id}#{i}", as one engine's) and the request's output, merged, comes once all
have ended. What the prefill replica scored (the first token's logprobs, the prompt's) is
streamed with the first token and handed on with the handoff.

Failures, per the deployment's failure policy (`--kv-failure-policy`):
- a prefill replica that dies ends each request it had not handed on: `recompute` sends
  the whole request to a decode replica (counted in its `recomputes`, logged as a
  warning), `fail` ends it with an error naming the replica. A handoff already offered
  stays loadable until its lease lapses; after that the decode replica applies the
  policy itself. With no prefill replica left, `recompute` serves new requests whole on
  the decode replicas and `fail` refuses them (503) and stops the server once the
  requests in flight have ended.
- a decode replica that dies ends its requests with an error naming it; with none left
  the server has failed (exit code 1, as when every `--replicas` replica has).
- a client that goes away aborts its request on both replicas: the prefill stopped or
  its hold freed, the transfer aborted, the decode replica's blocks freed.
- a request a replica's engine refuses (bad input) is refused at its add, RequestError (a
  400) naming the problem, by the prefill replica or by the decode replica computing it
  whole; one recomputed after its prefill replica was lost ends with that error. The
  replica serves on.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable, Sequence as Seq

import attrs
import structlog

from servelab.disagg.requests import merged_output, split_completions
from servelab.disagg.routing import PDRouter, mint_transfer_id
from servelab.errors import RequestError, ServelabError
from servelab.interfaces import ReplicaSnapshot, RouteRequest
from servelab.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput
from servelab.routing import adapter_fields
from servelab.sampling_params import SamplingParams
from servelab.sequence import owner_of, sequence_id
from servelab.server.detokenizer import Decode, Detokenizer
from servelab.server.engine_core import EMPTY_SNAPSHOT, EngineInfo, EngineSnapshot, EngineUnavailable, NewRequest
from servelab.server.engine_loop import Events
from servelab.server.replica_set import sum_snapshots, watch_liveness
from servelab.server.replicas import import_ray, start_ray, wait_started
from servelab.server.role_replicas import CONSUMER, PRODUCER, RoleActor, RoleReplica
from servelab.server.stream_buffer import StreamBuffer

logger = structlog.get_logger(__name__)

FAILURE_POLICIES = ("fail", "recompute")
DEFAULT_LEASE_S = 30.0


@attrs.define
class _Request:
    """One completion of an engine request (the only one, unless n > 1) as the front end follows it."""

    request: NewRequest
    transfer_id: str
    events: StreamBuffer
    params: SamplingParams  # the completion's (servelab.disagg.requests.completion_params)
    index: int = 0  # which completion of its request
    prefill: RoleReplica | None = None  # where its prefill runs (None once handed on, or recomputed)
    decode: RoleReplica | None = None  # where it decodes
    token_ids: list[int] = attrs.field(factory=list)  # streamed so far
    first_token_time: float | None = None
    added: asyncio.Future | None = None  # answered when the replica took it (or refused it)

    @property
    def key(self) -> str:
        """Its events' key: its sequence id in one engine."""
        return sequence_id(self.request.request_id, self.index)


class DisaggregatedEngine:
    """Prefill replicas then decode replicas, with the interface of one AsyncEngine."""

    def __init__(self, prefill: Seq[RoleReplica], decode: Seq[RoleReplica], router: PDRouter, block_size: int,
                 failure_policy: str, tokenizer: Any = None, metrics: Any = None,
                 liveness_timeout: float | None = None) -> None:
        if not prefill or not decode:
            raise ServelabError("a disaggregated server needs at least one prefill and one decode replica")
        self.prefill, self.decode = list(prefill), list(decode)
        self.replicas = [*self.prefill, *self.decode]
        self.router = router
        self.block_size = block_size
        self.failure_policy = failure_policy
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.on_failure: Any = None
        self.error: str | None = None
        self.stopping = False
        self._exit_when_idle: str | None = None  # the deployment cannot serve new requests: stop once idle
        self._requests: dict[str, list[_Request]] = {}  # engine request id -> its completions
        self._ended: dict[str, list[RequestOutput | None]] = {}  # engine request id -> its completions' outputs
        self._by_transfer: dict[str, _Request] = {}  # transfer id -> its completion
        self._queues: dict[str, StreamBuffer] = {}  # engine request id -> its reader's queue, until its last event
        self._loop: asyncio.AbstractEventLoop | None = None
        self._detokenizer: Detokenizer | None = None
        # a replica not heard from this long (its process stopped or hung) is killed and handled
        # as a dead one; None: no watchdog
        self.liveness_timeout = liveness_timeout
        self._watchdog: asyncio.Task | None = None
        self.info = EngineInfo(min(r.info.max_model_len for r in self.replicas), self.replicas[0].info.vocab_size,
                               min(r.info.max_logprobs for r in self.replicas))
        if metrics is not None:
            metrics.transfer_source = self.transfer_metrics

    @staticmethod
    def clock() -> float:
        return time.perf_counter()

    # ------------------------------------------------------------ the AsyncEngine interface

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._detokenizer = Detokenizer(lambda events, *extra: self._call_soon(self._deliver, events, *extra),
                                        threaded=True)
        for replica in self.replicas:
            replica.start(self._on_poll, self._on_exit)
        if self.liveness_timeout is not None:
            self._watchdog = self._loop.create_task(watch_liveness(self, self.liveness_timeout))

    def check_liveness(self) -> None:
        """A replica silent past the liveness timeout is killed (`watch_liveness` calls it).
        A live replica answers its poll at least every second, busy or idle, so silence is a
        stopped or hung process, whose requests would otherwise wait for it without end."""
        now = time.monotonic()
        for replica in self.replicas:
            silent = now - replica.last_heard
            if replica.dead or silent <= self.liveness_timeout:
                continue
            logger.error("disagg.replica_silent", replica=replica.name, silent_seconds=round(silent, 1))
            self._replica_died(replica, f"not heard from for {silent:.1f} s, liveness timeout "
                                        f"{self.liveness_timeout:g} s; killed")
            self._loop.run_in_executor(None, replica.stop, 1.0)  # its holds and blocks go with its process

    async def add(self, requests: Seq[NewRequest], decode: Decode | None = None,
                  events: StreamBuffer | None = None) -> StreamBuffer:
        """Add a group of requests, all or none (RequestError: a replica refused one)."""
        if self.error is not None or self.stopping or self._exit_when_idle is not None:
            raise EngineUnavailable(self.error or self._exit_when_idle or "the server is shutting down")
        request_ids = [request.request_id for request in requests]
        if decode is not None:
            self._detokenizer.register(request_ids, decode)
        events = events if events is not None else StreamBuffer()
        states: list[_Request] = []
        try:
            for request in requests:
                completions = [_Request(request, mint_transfer_id(), events, params, index,
                                        added=self._loop.create_future())
                               for index, params in enumerate(split_completions(request.params))]
                self._requests[request.request_id] = completions
                self._ended[request.request_id] = [None] * len(completions)
                self._queues[request.request_id] = events
                for state in completions:
                    self._by_transfer[state.transfer_id] = state
                states.extend(completions)
                self._route_prefill(completions)
            results = await asyncio.gather(*(state.added for state in states))
        except BaseException:  # a router that broke its contract, the engine failed, or the client left
            self._detokenizer.unregister(request_ids)
            self._drop(request_ids)
            raise
        refused = [error for error in results if error is not None]
        if refused:
            self._detokenizer.unregister(request_ids)
            self._drop(request_ids)
            raise RequestError(refused[0])
        return events

    def _drop(self, request_ids: Seq[str]) -> None:
        """Forget requests and abort them wherever they went."""
        for request_id in request_ids:
            for state in self._forget(request_id):
                self._abort_on_replicas(state)
            self._queues.pop(request_id, None)

    def _route_prefill(self, completions: Seq[_Request]) -> None:
        """Send a request's completions to one prefill replica (whose prefix cache they share)."""
        request = completions[0].request
        live = [r for r in self.prefill if not r.dead]
        if not live:
            for state in completions:
                self._recompute_or_fail(state, "no prefill replica is left")
            return
        prompt = request.prompt if isinstance(request.prompt, list) else []
        snapshots = [self._route_snapshot(r) for r in live]
        choice = self.router.route_prefill(RouteRequest(completions[0].transfer_id, prompt, request.params.max_tokens,
                                                        request.arrival_time, **adapter_fields(request.lora_request)),
                                           snapshots)
        replica = next(r for r in live if r.index == choice)
        for state in completions:
            state.prefill = replica
            if self.metrics is not None:
                self.metrics.routed(replica.name)
            replica.send(("add", state.transfer_id, request.prompt, state.params, None, request.lora_request))

    def _recompute_or_fail(self, state: _Request, reason: str) -> None:
        """Its prefill replica was lost before the handoff: the failure policy."""
        live = [r for r in self.decode if not r.dead]
        state.prefill = None
        if self.failure_policy == "recompute" and live:
            replica = min(live, key=lambda r: r.snapshot.scheduler.num_running + r.snapshot.scheduler.num_waiting)
            state.decode = replica
            replica.send(("recompute", state.transfer_id, state.request.prompt, state.params,
                          state.request.lora_request))
            return
        message = f"{reason}; the request ended by the failure policy {self.failure_policy!r}: retry"
        if state.added is not None and not state.added.done():
            state.added.set_result(None)  # taken in; it ends at once with the error
        now = self.clock()
        output = RequestOutput(state.transfer_id, None, [], [CompletionOutput(0, [], "", "error")],
                               RequestMetrics(now, None, None, now), error=message)
        self._put(None, {}, [output])

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort requests on both sides; each ends with an output whose finish_reason is "abort"."""
        outputs = []
        for request_id in request_ids:
            for state in self._requests.get(request_id, ()):
                if self._ended[request_id][state.index] is not None:
                    continue
                self._abort_on_replicas(state)
                if state.added is not None and not state.added.done():
                    state.added.set_result(None)  # its add returns the queue, where the abort output waits
                outputs.append(self._ended_early(state, "abort"))
        if outputs:
            self._put(None, {}, outputs)

    def _ended_early(self, state: _Request, finish_reason: str, error: str | None = None) -> RequestOutput:
        """A completion's output when it ends outside its replicas (aborted, or its replica
        lost): the tokens streamed so far."""
        now = self.clock()
        return RequestOutput(state.transfer_id, None, [], [CompletionOutput(0, list(state.token_ids),
                                                                            self._decode(state.token_ids),
                                                                            finish_reason)],
                             RequestMetrics(now, None, None, now), error=error)

    def _abort_on_replicas(self, state: _Request) -> None:
        for replica in (state.prefill, state.decode):
            if replica is not None:
                replica.send(("abort", [state.transfer_id]))

    def abort_all(self) -> None:
        self.abort(list(self._requests))

    def _completions(self) -> list[_Request]:
        """Every completion in flight (not yet ended)."""
        return [state for request_id, completions in self._requests.items() for state in completions
                if self._ended[request_id][state.index] is None]

    async def shutdown(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._loop is None:
            return
        await asyncio.gather(*(asyncio.to_thread(r.stop, timeout) for r in self.replicas))
        await asyncio.to_thread(self._detokenizer.stop)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        """Completions with no token yet."""
        return sum(1 for state in self._completions() if not state.token_ids)

    def stalled_seconds(self) -> float:
        """The longest a live replica with requests on it has not been heard from."""
        now = time.monotonic()
        states = self._completions()
        busy = {id(s.prefill) for s in states} | {id(s.decode) for s in states}
        return max((now - r.last_heard for r in self.replicas if not r.dead and id(r) in busy), default=0.0)

    @property
    def snapshot(self) -> EngineSnapshot:
        """The live replicas' counters summed (a dead replica's memory went with it)."""
        return sum_snapshots([r.snapshot for r in self.replicas if not r.dead] or [EMPTY_SNAPSHOT])

    def transfer_metrics(self) -> list[tuple[str, str, dict[str, float]]]:
        """(role, replica, counters) of every replica, as last reported."""
        return [("prefill" if r.role == PRODUCER else "decode", r.name, r.transfer_metrics) for r in self.replicas]

    def _route_snapshot(self, replica: RoleReplica) -> ReplicaSnapshot:
        snapshot = replica.snapshot
        queued = sum(1 for s in self._completions() if s.prefill is replica and not s.token_ids)
        return ReplicaSnapshot(
            replica_id=replica.index, num_waiting=snapshot.scheduler.num_waiting + queued,
            num_running=snapshot.scheduler.num_running, num_kv_blocks=snapshot.allocator.num_blocks,
            num_used_kv_blocks=snapshot.allocator.num_used_blocks, block_size=self.block_size,
            prefix_summary=replica.prefix_summary)

    # ------------------------------------------------------------ the replicas' reader threads

    def _on_poll(self, replica: RoleReplica, messages: list[tuple], report: tuple) -> None:
        self._call_soon(self._handle, replica, messages, report)

    def _on_exit(self, replica: RoleReplica, reason: str) -> None:
        self._call_soon(self._replica_died, replica, reason)

    # ------------------------------------------------------------ on the event loop

    def _handle(self, replica: RoleReplica, messages: list[tuple], report: tuple) -> None:
        replica.last_heard = time.monotonic()
        replica.snapshot, replica.transfer_metrics, replica.prefix_summary = report
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[Any]] = {}  # of those tokens, for the requests that asked
        prompt_logprobs: dict[str, list[Any]] = {}  # of the prompts scored, for the requests that asked
        finished: list[RequestOutput] = []
        for message in messages:
            kind = message[0]
            if kind == "added":
                self._added(message[1], message[2], finished)
            elif kind == "prefilled":
                self._prefilled(*message[1:], tokens, finished, logprobs, prompt_logprobs)
            elif kind == "step":
                for transfer_id, event in message[1].items():  # the decode engine's (servelab.outputs.RequestEvent)
                    tokens.setdefault(transfer_id, []).extend(event.new_token_ids)
                    if event.new_logprobs:
                        logprobs.setdefault(transfer_id, []).extend(event.new_logprobs)
                finished.extend(message[2])
            elif kind == "failed":
                logger.error("disagg.replica_engine_failed", replica=replica.name, error=message[1])
        self._put(replica, tokens, finished, logprobs, prompt_logprobs)

    def _added(self, transfer_id: str, refusal: str | None, finished: list[RequestOutput]) -> None:
        """A replica took a completion in, or refused it (bad input: `refusal` names the problem)."""
        state = self._by_transfer.get(transfer_id)
        if state is None:
            return
        if state.added is not None and not state.added.done():
            state.added.set_result(refusal)  # the client's add is still waiting: a refusal is its 400
        elif refusal is not None:  # recomputed after its prefill replica was lost, its add long answered
            finished.append(self._ended_early(state, "error", refusal))

    def _prefilled(self, transfer_id: str, output: RequestOutput, handoff: Any, tokens: dict[str, list[int]],
                   finished: list[RequestOutput], logprobs: dict[str, list[Any]],
                   prompt_logprobs: dict[str, list[Any]]) -> None:
        state = self._by_transfer.get(transfer_id)
        if state is None:
            return  # aborted meanwhile: the prefill replica freed its hold on the abort
        state.first_token_time = self.clock()
        first_logprobs = output.outputs[0].logprobs
        if first_logprobs:
            logprobs.setdefault(transfer_id, []).extend(first_logprobs)
        if output.prompt_logprobs is not None:  # streamed with the first token, as one engine does
            prompt_logprobs[transfer_id] = output.prompt_logprobs
        if handoff is None:  # the first token ended it, or it failed: the answer comes from P
            tokens.setdefault(transfer_id, []).extend(output.outputs[0].token_ids)
            finished.append(output)
            return
        tokens.setdefault(transfer_id, []).append(handoff.first_token_id)
        live = [r for r in self.decode if not r.dead]
        if not live:
            if state.prefill is not None:
                state.prefill.send(("abort", [transfer_id]))  # its hold freed now, not at the lease
            now = self.clock()
            finished.append(RequestOutput(transfer_id, None, [], [CompletionOutput(
                0, [handoff.first_token_id], self._decode([handoff.first_token_id]), "error")],
                RequestMetrics(now, None, None, now), error="no decode replica is left: retry"))
            return
        request = RouteRequest(transfer_id, [*handoff.prompt_token_ids, handoff.first_token_id],
                               state.params.max_tokens - 1, **adapter_fields(state.request.lora_request))
        choice = self.router.route_decode(request, [self._route_snapshot(r) for r in live])
        state.decode = next(r for r in live if r.index == choice)
        if self.metrics is not None:
            self.metrics.routed(state.decode.name)
        state.decode.send(("accept", handoff, state.params, None, first_logprobs, output.prompt_logprobs,
                           state.request.lora_request))

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def _put(self, replica: RoleReplica | None, tokens: dict[str, list[int]], finished: list[RequestOutput],
             logprobs: dict[str, list[Any]] | None = None, prompt_logprobs: dict[str, list[Any]] | None = None) -> None:
        """Turn transfer-keyed tokens (and their logprobs), prompt logprobs and completions'
        outputs into the requests' events, through the detokenizer: tokens by completion
        key, the rest by request id."""
        events: Events = {}
        now = self.clock()
        for transfer_id, token_ids in tokens.items():
            state = self._by_transfer.get(transfer_id)
            if state is None or not token_ids:
                continue
            state.token_ids.extend(token_ids)
            if state.first_token_time is None:
                state.first_token_time = now
            scores = logprobs.get(transfer_id, ()) if logprobs else ()
            events[state.key] = RequestEvent(tuple(token_ids), tuple(scores))
        for transfer_id, scored in (prompt_logprobs or {}).items():
            state = self._by_transfer.get(transfer_id)
            if state is not None:
                request_id = state.request.request_id
                events[request_id] = attrs.evolve(events.get(request_id, RequestEvent()), prompt_logprobs=tuple(scored))
        for output in finished:
            state = self._by_transfer.get(output.request_id)
            if state is None:
                continue
            output = self._completion_ended(state, output, now)
            if output is not None:
                previous = events.get(output.request_id)
                events[output.request_id] = (attrs.evolve(previous, output=output) if previous is not None
                                             else RequestEvent(output=output))
        if events or replica is not None:
            self._detokenizer.put(events, replica)

    def _completion_ended(self, state: _Request, output: RequestOutput, now: float) -> RequestOutput | None:
        """The request's output, timed on this clock, once `state` was its last completion to end."""
        request_id = state.request.request_id
        ended = self._ended[request_id]
        ended[state.index] = output
        if any(o is None for o in ended):
            return None
        completions = self._forget(request_id)
        merged = merged_output(request_id, ended)
        firsts = [s.first_token_time for s in completions if s.first_token_time is not None]
        first = min(firsts) if firsts else (now if any(o.token_ids for o in merged.outputs) else None)
        metrics = attrs.evolve(merged.metrics, arrival_time=state.request.arrival_time, first_scheduled_time=None,
                               first_token_time=first, finish_time=now)
        return attrs.evolve(merged, metrics=metrics,
                            prompt_token_ids=list(merged.prompt_token_ids) or self._prompt_ids(state))

    @staticmethod
    def _prompt_ids(state: _Request) -> list[int]:
        prompt = state.request.prompt
        return list(prompt) if isinstance(prompt, list) else []

    def _forget(self, request_id: str) -> list[_Request]:
        """Stop following a request; its completions."""
        completions = self._requests.pop(request_id, [])
        self._ended.pop(request_id, None)
        for state in completions:
            self._by_transfer.pop(state.transfer_id, None)
        return completions

    def _deliver(self, events: Events, replica: RoleReplica | None) -> None:
        """Each event to its request's queue (after the detokenizer's thread made its text)."""
        for key, event in events.items():
            target = self._queues.get(owner_of(key))
            if target is not None:
                target.put_nowait((key, event))
        for key, event in events.items():  # after every sibling completion's tokens went out
            if event.is_last:
                self._detokenizer.unregister([key])
                self._queues.pop(key, None)
        if self.metrics is not None:
            self.metrics.observe(events, self.snapshot)
            if replica is not None:
                self.metrics.observe_replica(replica.name, events, replica.snapshot)
        if self._exit_when_idle is not None and not self._requests and self.error is None:
            self._failed(self._exit_when_idle)

    def _replica_died(self, replica: RoleReplica, reason: str) -> None:
        if replica.dead or self.stopping:
            return
        replica.dead = True
        message = f"{'prefill' if replica.role == PRODUCER else 'decode'} replica {replica.name} died ({reason})"
        affected = [s for s in self._completions() if s.prefill is replica or s.decode is replica]
        logger.error("disagg.replica_died", replica=replica.name, role=replica.role, requests=len(affected),
                     failure_policy=self.failure_policy, error=reason)
        if self.metrics is not None:  # its blocks went with it (observed first: a first observation marks it up)
            self.metrics.observe_replica(replica.name, {}, EMPTY_SNAPSHOT)
            self.metrics.replica_down(replica.name)
        lost: list[RequestOutput] = []
        for state in affected:
            if state.decode is replica:
                lost.append(self._ended_early(state, "error", f"{message}: retry"))
            elif state.decode is None and not state.token_ids:  # not handed on: the failure policy
                logger.warning("kv_transfer.prefill_lost", transfer_id=state.transfer_id, replica=replica.name,
                               failure_policy=self.failure_policy)
                self._recompute_or_fail(state, message)
            else:
                state.prefill = None  # handed on: the decode replica loads it, or applies the policy at the lease
        if lost:
            self._put(None, {}, lost)
        live_prefill = [r for r in self.prefill if not r.dead]
        live_decode = [r for r in self.decode if not r.dead]
        if not live_decode:
            self._fail_all(f"every decode replica has failed; the last: {message}")
        elif not live_prefill and self.failure_policy == "fail":
            self._exit_when_idle = f"every prefill replica has failed; the last: {message}"
            if not self._requests:
                self._failed(self._exit_when_idle)
        elif not live_prefill:
            logger.warning("disagg.no_prefill_replica", failure_policy=self.failure_policy,
                           detail="new requests are computed whole on the decode replicas")

    def _fail_all(self, message: str) -> None:
        outputs = []
        for state in self._completions():
            outputs.append(self._ended_early(state, "error", message))
            if state.added is not None and not state.added.done():
                state.added.set_exception(EngineUnavailable(message))
        if outputs:
            self._put(None, {}, outputs)
        self._failed(message)

    def _failed(self, message: str) -> None:
        if self.error is not None:
            return
        self.error = message
        logger.error("disagg.failed", error=message)
        if self.on_failure is not None:
            self.on_failure(message)

    def _call_soon(self, callback: Any, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


# ---------------------------------------------------------------- starting it


def disaggregated_config(config: Any) -> Any:
    """`config` as both roles need it: an allocator with a prefix cache (`hash` unless it
    names `radix`), and a transport between processes (`shared-files` unless
    `[kv_transfer]` names one)."""
    overrides: dict[str, Any] = {}
    if config.allocator is None or config.allocator.name not in ("hash", "radix"):
        overrides["allocator.name"] = "hash"
    if config.kv_transfer is None:
        overrides["kv_transfer.name"] = "shared-files"
    return config.with_overrides(overrides) if overrides else config


def launch_disaggregated(config: Any, num_prefill: int, num_decode: int, failure_policy: str = "recompute",
                         lease_s: float = DEFAULT_LEASE_S, ray_address: str | None = None,
                         threads: int | None = None, tokenizer: Any = None, metrics: Any = None,
                         num_cpus_per_replica: float = 1.0,
                         liveness_timeout: float | None = None) -> tuple[DisaggregatedEngine, bool]:
    """Start `num_prefill` prefill and `num_decode` decode RoleActors (on the cluster at
    `ray_address`, else on a local Ray started here), wait until every model is loaded,
    and put them behind a DisaggregatedEngine. Returns it, and whether Ray was started here."""
    from servelab.logging_setup import configured_verbosity
    from servelab.registry import PluginRegistry

    if failure_policy not in FAILURE_POLICIES:
        raise ServelabError(f"--kv-failure-policy must be one of {', '.join(FAILURE_POLICIES)}, got {failure_policy!r}")
    if num_prefill < 1 or num_decode < 1:
        raise ServelabError(f"a disaggregated server needs at least one prefill and one decode replica, got "
                            f"{num_prefill}P{num_decode}D")
    if not lease_s > 0:
        raise ServelabError(f"--kv-lease-s must be > 0, got {lease_s}")
    config = disaggregated_config(config)
    registry = PluginRegistry.from_entry_points()
    router = PDRouter(registry, num_prefill, num_decode, config.engine.block_size, 0)  # names checked first
    ray = import_ray()
    started_here = start_ray(ray, ray_address, num_prefill + num_decode, num_cpus_per_replica)
    remote = ray.remote(num_cpus=num_cpus_per_replica, max_concurrency=4)(RoleActor)
    verbosity = configured_verbosity()
    roles = [(PRODUCER, f"prefill-{i}", i) for i in range(num_prefill)] + \
            [(CONSUMER, f"decode-{i}", i) for i in range(num_decode)]
    actors = [remote.remote(config, role, name, lease_s, failure_policy, threads, verbosity)
              for role, name, _ in roles]
    infos = wait_started(ray, actors, started_here, noun="prefill/decode replica")
    replicas = []
    for actor, (role, name, index), (info, pid) in zip(actors, roles, infos):
        logger.info("replica.started", replica=name, role=role, pid=pid, max_model_len=info.max_model_len)
        replicas.append(RoleReplica(actor, role, name, index, info, pid))
    engine = DisaggregatedEngine([r for r in replicas if r.role == PRODUCER],
                                 [r for r in replicas if r.role == CONSUMER], router, config.engine.block_size,
                                 failure_policy, tokenizer, metrics, liveness_timeout)
    logger.info("disagg.started", prefill=num_prefill, decode=num_decode, failure_policy=failure_policy,
                lease_s=lease_s, transport=config.kv_transfer.name)
    return engine, started_here
