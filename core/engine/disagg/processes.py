"""xPyD with one OS process per engine: `ProcessDeployment`.

Each prefill and decode engine runs in its own process (multiprocessing, spawn) with its
role (`PrefillWorker` / `DecodeWorker`) and its own endpoint of a transport between
processes (`shared-files` unless the config names another), and talks to the router in
this process over two queues: commands down (add, accept, recompute, abort, stats,
stop), results up (a finished prefill with its handoff, a finished request, stats).

A prefill process that dies takes its holds with it; the router notices (the process is
not alive) and ends each request it had there by the failure policy: `recompute` sends
the whole request to a decode engine (counted, and logged as a warning), `fail` ends it
with an error. A handoff already offered stays loadable until its lease lapses.

A request of n > 1 completions is n handoffs, one per completion (as `DisaggregatedLLM`
splits it), its output merged once every completion has ended.

A request an engine refuses (bad input: RequestError) ends with an error naming the
problem, its completions all or none queued; the engine process, its other requests and
its KV blocks are untouched.
"""

from __future__ import annotations

import itertools
import multiprocessing
import queue
import time
from typing import Any, Mapping, Sequence as Seq

import attrs

from servelab.disagg.requests import merged_output, split_completions
from servelab.disagg.routing import mint_transfer_id
from servelab.errors import ConfigError, RequestError
from servelab.logging_setup import get_logger
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput
from servelab.sampling_params import SamplingParams

logger = get_logger(__name__)

_IDLE_WAIT_S = 0.01


@attrs.define
class _Completion:
    """One completion of a request, a transfer of its own."""

    request_id: str
    index: int
    prompt: list[int] | str
    params: SamplingParams  # this completion's (servelab.disagg.requests.completion_params)
    prefill: str  # the prefill engine it was sent to
    lora_request: Any = None


def _role_main(role: str, name: str, config: Mapping[str, Any], lease_s: float, failure_policy: str,
               commands: Any, results: Any) -> None:
    """One engine's process: its role's loop over the command queue."""
    from servelab.config import EngineConfig
    from servelab.disagg.consumer import DecodeWorker
    from servelab.disagg.producer import PrefillWorker
    from servelab.engine import LLMEngine
    from servelab.engine_setup import build_kv_transport
    from servelab.interfaces import KVTransferContext
    from servelab.registry import PluginRegistry

    engine_config = EngineConfig.load(dict(config))
    registry = PluginRegistry.from_entry_points()
    engine = LLMEngine(engine_config, registry)
    transport = build_kv_transport(engine_config, registry, KVTransferContext(role=role, name=name))
    worker: Any = (PrefillWorker(engine, transport, name, lease_s) if role == "producer"
                   else DecodeWorker(engine, transport, name, failure_policy))
    results.put(("ready", name))
    while True:
        busy = worker.has_work() or (role == "producer" and worker.num_holds)
        try:
            command = commands.get(timeout=0 if busy else _IDLE_WAIT_S)
        except queue.Empty:
            command = None
        if command is not None:
            if command[0] == "stop":
                break
            _run_command(command, worker, engine, name, results, role)
            continue
        if role == "producer":
            for done in worker.step():
                results.put(("prefilled", done.transfer_id, done.output, done.handoff))
        else:
            for output in worker.step():
                results.put(("output", output))
    transport.close()


def _run_command(command: tuple, worker: Any, engine: Any, name: str, results: Any, role: str) -> None:
    """One command from the router to the `role` engine; what it answers goes on `results`."""
    kind, *args = command
    if kind == "add":  # a request's completions, all or none; a refusal is the request's error alone
        transfer_ids = args[0]
        try:
            worker.add_completions(*args)
        except RequestError as exc:
            results.put(("refused", transfer_ids, str(exc)))
    elif kind in ("accept", "recompute"):  # a request the engine refuses comes back as its error output
        output = worker.accept(*args) if kind == "accept" else worker.recompute(*args)
        if output is not None:
            results.put(("output", output))
    elif kind == "abort":
        worker.abort(args[0])
    elif kind == "stats":
        if role == "producer":
            # holds whose transfer ended are freed on the loop's next pass; counted before
            # then, they would be reported as held
            worker.release_ended()
        results.put(("stats", name, engine.allocator.stats().num_used_blocks, worker.metrics.as_dict()))


class ProcessDeployment:
    """x prefill and y decode engines, one process each, behind a router in this process."""

    def __init__(self, config: Mapping[str, Any], prefill_engines: int = 1, decode_engines: int = 1,
                 failure_policy: str = "recompute", lease_s: float = 30.0, start_timeout_s: float = 300.0) -> None:
        if failure_policy not in ("fail", "recompute"):
            raise ConfigError(f"failure policy {failure_policy!r} is not one of fail, recompute")
        config = {**config, "kv_transfer": dict(config.get("kv_transfer", {"name": "shared-files"}))}
        self.failure_policy = failure_policy
        context = multiprocessing.get_context("spawn")
        self.results = context.Queue()
        self.engines: dict[str, tuple[Any, Any, str]] = {}  # name -> (process, command queue, role)
        for role, count in (("producer", prefill_engines), ("consumer", decode_engines)):
            for i in range(count):
                name = f"{'prefill' if role == 'producer' else 'decode'}-{i}"
                commands = context.Queue()
                process = context.Process(target=_role_main, name=f"servelab-{name}", daemon=True,
                                          args=(role, name, config, lease_s, failure_policy, commands, self.results))
                process.start()
                self.engines[name] = (process, commands, role)
        self.engine_metrics: dict[str, dict[str, float]] = {}  # per engine, as of the last used_blocks()
        self._outputs: list[RequestOutput] = []
        self._completions: dict[str, _Completion] = {}  # transfer id -> its completion
        self._ended: dict[str, list[RequestOutput | None]] = {}  # request id -> its completions' outputs so far
        self._prefilled: set[str] = set()
        self._next_decode = itertools.cycle([n for n, (_, _, r) in self.engines.items() if r == "consumer"])
        self._next_prefill = itertools.cycle([n for n, (_, _, r) in self.engines.items() if r == "producer"])
        ready: set[str] = set()
        deadline = time.monotonic() + start_timeout_s
        while len(ready) < len(self.engines):
            message = self._get(deadline)
            if message[0] == "ready":
                ready.add(message[1])
        self.dead: set[str] = set()

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: list[int] | str, params: SamplingParams, lora_request: Any = None) -> str:
        """Send a request's completions to a prefill engine, which tokenizes a text prompt as
        one engine does; returns its id (its first completion's transfer id). A request an
        engine refuses (RequestError: too long a prompt, an adapter it cannot serve, a bad
        schema) ends with finish_reason "error" and the reason in `error`."""
        completions = split_completions(params)
        transfer_ids = [mint_transfer_id() for _ in completions]
        name = next(n for n in self._next_prefill if n not in self.dead)
        self._ended[transfer_ids[0]] = [None] * len(completions)
        for index, (transfer_id, completion) in enumerate(zip(transfer_ids, completions)):
            self._completions[transfer_id] = _Completion(transfer_ids[0], index, prompt, completion, name,
                                                         lora_request)
        self.engines[name][1].put(("add", transfer_ids, prompt, completions, None, lora_request))
        return transfer_ids[0]

    def generate(self, prompts: Seq[list[int] | str], params: Seq[SamplingParams], timeout_s: float = 120.0,
                 lora_request: Any = None) -> list[RequestOutput]:
        ids = [self.add_request(p, sp, lora_request) for p, sp in zip(prompts, params)]
        return self.wait(ids, timeout_s)

    def abort(self, request_id: str) -> None:
        """The caller gave up on a request: each of its completions is stopped wherever it is
        (its prefill, its hold, its transfer, its decode) and forgotten; no output comes."""
        transfer_ids = [tid for tid, c in self._completions.items() if c.request_id == request_id]
        for transfer_id in transfer_ids:
            del self._completions[transfer_id]
            self._prefilled.discard(transfer_id)
            for name, (process, commands, _) in self.engines.items():
                if name not in self.dead and process.is_alive():
                    commands.put(("abort", transfer_id))
        self._ended.pop(request_id, None)
        self._outputs = [o for o in self._outputs if o.request_id != request_id]

    def wait(self, ids: Seq[str], timeout_s: float) -> list[RequestOutput]:
        """The outputs of `ids`, in order; TimeoutError after `timeout_s`, the unfinished
        ones aborted."""
        deadline = time.monotonic() + timeout_s
        found: dict[str, RequestOutput] = {}
        while any(i not in found for i in ids):
            for output in self._outputs:
                found[output.request_id] = output
            self._outputs = [o for o in self._outputs if o.request_id not in ids]
            if all(i in found for i in ids):
                break
            self._check_prefill_engines()
            try:
                self._handle(self._get(min(deadline, time.monotonic() + 0.1)))
            except TimeoutError:
                if time.monotonic() > deadline:
                    for request_id in ids:
                        if request_id not in found:
                            self.abort(request_id)
                    raise
        return [found[i] for i in ids]

    def kill(self, name: str) -> None:
        """Kill an engine's process (fault injection: a prefill process dying mid-stream)."""
        process = self.engines[name][0]
        process.kill()
        process.join(timeout=10)

    def used_blocks(self, timeout_s: float = 30.0) -> dict[str, int]:
        """KV blocks held by any sequence, per live engine."""
        names = [n for n in self.engines if n not in self.dead and self.engines[n][0].is_alive()]
        for name in names:
            self.engines[name][1].put(("stats",))
        deadline = time.monotonic() + timeout_s
        found: dict[str, int] = {}
        while len(found) < len(names):
            message = self._get(deadline)
            if message[0] == "stats":
                found[message[1]] = message[2]
                self.engine_metrics[message[1]] = message[3]
            else:
                self._handle(message)
        return found

    def close(self, timeout_s: float = 10.0) -> None:
        for process, commands, _ in self.engines.values():
            if process.is_alive():
                commands.put(("stop",))
        for process, _, _ in self.engines.values():
            process.join(timeout=timeout_s)
            if process.is_alive():
                process.kill()
                process.join(timeout=timeout_s)

    def __enter__(self) -> "ProcessDeployment":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ messages

    def _get(self, deadline: float) -> tuple:
        try:
            return self.results.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError("no message from the engine processes before the deadline") from None

    def _handle_queued(self) -> None:
        """Every message already waiting, handled without blocking."""
        while True:
            try:
                message = self.results.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "prefilled":
            _, transfer_id, output, handoff = message
            if transfer_id in self._prefilled:  # ended already by the failure policy: its engine was counted dead
                return
            self._prefilled.add(transfer_id)
            completion = self._completions.get(transfer_id)
            if completion is None:
                return
            if handoff is None:
                self._finish(output)
                return
            decode = next(self._next_decode)
            self.engines[decode][1].put(("accept", handoff, completion.params, output.metrics.arrival_time,
                                         output.outputs[0].logprobs, output.prompt_logprobs,
                                         completion.lora_request))
        elif kind == "output":
            self._finish(message[1])
        elif kind == "refused":  # bad input: the request ends with the engine's reason, nothing else changes
            _, transfer_ids, reason = message
            for transfer_id in transfer_ids:
                completion = self._completions.get(transfer_id)
                if completion is not None:
                    self._finish(_error_output(transfer_id, completion.prompt, reason))

    def _finish(self, output: RequestOutput) -> None:
        """One completion ended: its request's output once it was the last."""
        completion = self._completions.pop(output.request_id, None)
        self._prefilled.discard(output.request_id)
        if completion is None:
            return
        ended = self._ended[completion.request_id]
        ended[completion.index] = output
        if all(o is not None for o in ended):
            del self._ended[completion.request_id]
            merged = merged_output(completion.request_id, ended)
            if isinstance(completion.prompt, str):  # the decode engine was given its tokens
                merged = attrs.evolve(merged, prompt=completion.prompt)
            self._outputs.append(merged)

    def _check_prefill_engines(self) -> None:
        """End, by the failure policy, the requests a dead prefill process had not handed on."""
        for name, (process, _, role) in self.engines.items():
            if role != "producer" or name in self.dead or process.is_alive():
                continue
            self.dead.add(name)
            # What it handed on before it died may still wait in the queue: those requests are
            # not lost, and recomputing them as well would run each twice on the decode side.
            self._handle_queued()
            lost = [tid for tid, c in self._completions.items() if c.prefill == name and tid not in self._prefilled]
            logger.warning("kv_transfer.prefill_engine_died", engine=name, requests=len(lost),
                           failure_policy=self.failure_policy)
            for transfer_id in lost:
                self._prefilled.add(transfer_id)  # a handoff of it arriving late is not taken as well
                completion = self._completions[transfer_id]
                prompt = completion.prompt
                if self.failure_policy == "recompute":
                    self.engines[next(self._next_decode)][1].put(("recompute", transfer_id, prompt,
                                                                  completion.params, completion.lora_request))
                else:
                    self._finish(_error_output(transfer_id, prompt, f"prefill engine {name} died"))


def _error_output(transfer_id: str, prompt: list[int] | str, reason: str) -> RequestOutput:
    """A completion that ended with an error before any token."""
    now = time.perf_counter()
    return RequestOutput(transfer_id, prompt if isinstance(prompt, str) else None,
                         list(prompt) if isinstance(prompt, list) else [], [CompletionOutput(0, [], "", "error")],
                         RequestMetrics(now, None, None, now), error=reason)
