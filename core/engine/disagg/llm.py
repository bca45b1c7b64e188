"""`DisaggregatedLLM`: xPyD in one process. x prefill engines and y decode engines, each
a whole `LLMEngine`, a KV transport between them (`[kv_transfer]`, in-process unless the
config names another) and the P/D router placing each request.

A request of n > 1 completions is n handoffs: each completion is prefilled as a request of
its own (seed + i, as one engine seeds completion i) on one prefill engine, and decoded on;
their outputs are merged into the request's once all have ended."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence as Seq

import attrs

from servelab.config import EngineConfig
from servelab.disagg.consumer import DecodeWorker
from servelab.disagg.producer import PrefillWorker
from servelab.disagg.requests import merged_output, split_completions
from servelab.disagg.routing import PDRouter, mint_transfer_id
from servelab.engine import LLMEngine
from servelab.engine_setup import build_kv_transport
from servelab.errors import ConfigError, RequestError
from servelab.interfaces import KVTransferContext, RouteRequest
from servelab.outputs import RequestOutput
from servelab.registry import PluginRegistry
from servelab.routing import adapter_fields
from servelab.sampling_params import SamplingParams

DEFAULT_LEASE_S = 30.0


@attrs.define
class _Request:
    """One request as the router follows it: its completions, each a transfer of its own."""

    transfer_ids: list[str]  # by completion index; completion 0's is the request's id
    arrival: float  # on the deployment's clock
    ended: list[RequestOutput | None]  # by completion index, once each has ended
    first_token: float | None = None  # when its first token came (the deployment's clock)


@attrs.define
class _Completion:
    request_id: str
    index: int
    params: SamplingParams  # this completion's (servelab.disagg.requests.completion_params)
    lora_request: Any = None


class DisaggregatedLLM:
    """Prefill on `prefill_engines`, decode on `decode_engines`, the KV handed over.

    `failure_policy`: "fail" ends a request whose handoff failed with an error;
    "recompute" computes its KV again on the decode engine (counted in
    `metrics()["decode"]["recomputes"]` and logged as a warning). `lease_s`: how long a
    producer holds a request's blocks for its consumer.
    """

    def __init__(self, model: str | Path | None = None,
                 config: EngineConfig | Mapping[str, Any] | str | Path | None = None,
                 registry: PluginRegistry | None = None, prefill_engines: int = 1, decode_engines: int = 1,
                 failure_policy: str = "fail", lease_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.time, transport: Any = None, **overrides: Any) -> None:
        if prefill_engines < 1 or decode_engines < 1:
            raise ConfigError(f"a disaggregated deployment needs at least one prefill and one decode engine, got "
                              f"{prefill_engines}P{decode_engines}D")
        engine_config = EngineConfig.load(config)
        if model is not None:
            overrides["engine.model"] = str(model)
        if "allocator.name" not in overrides and engine_config.allocator.name not in ("hash", "radix"):
            overrides["allocator.name"] = "hash"  # both roles hand KV over through a prefix cache
        if overrides:
            engine_config = engine_config.with_overrides(overrides)
        self.config = engine_config
        self.registry = registry or PluginRegistry.from_entry_points()
        self.clock = clock
        self.transport = transport if transport is not None else build_kv_transport(
            engine_config, self.registry, KVTransferContext(role="both", name="in-process", clock=clock))
        self.prefill = [PrefillWorker(LLMEngine(engine_config, self.registry), self.transport, f"prefill-{i}",
                                      lease_s, clock) for i in range(prefill_engines)]
        self.decode = [DecodeWorker(LLMEngine(engine_config, self.registry), self.transport, f"decode-{i}",
                                    failure_policy, clock) for i in range(decode_engines)]
        engine = self.prefill[0].engine
        self.router = PDRouter(self.registry, prefill_engines, decode_engines, engine.config.engine.block_size,
                               engine.limits.num_kv_blocks)
        self._requests: dict[str, _Request] = {}  # request id -> the request
        self._completions: dict[str, _Completion] = {}  # transfer id -> the completion it carries

    @property
    def tokenizer(self):
        return self.prefill[0].engine.tokenizer

    def close(self) -> None:
        for worker in [*self.prefill, *self.decode]:
            worker.engine.close()
        self.transport.close()

    def __enter__(self) -> "DisaggregatedLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_request: Any = None) -> str:
        """Route a request (with the LoRA adapter `lora_request`, or none) to a prefill
        engine; returns its id, its first completion's transfer id (RequestError: refused)."""
        params = params or SamplingParams()
        completions = split_completions(params)
        transfer_ids = [mint_transfer_id() for _ in completions]
        request_id = transfer_ids[0]
        token_ids = list(prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt))
        route = RouteRequest(request_id, token_ids, params.max_tokens, **adapter_fields(lora_request))
        worker = self.prefill[self.router.choose_prefill(route, [w.engine for w in self.prefill])]
        worker.add_completions(transfer_ids, token_ids, completions, lora_request=lora_request)
        self._requests[request_id] = _Request(transfer_ids, self.clock(), [None] * len(completions))
        for index, (transfer_id, completion) in enumerate(zip(transfer_ids, completions)):
            self._completions[transfer_id] = _Completion(request_id, index, completion, lora_request)
        return request_id

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        transfer_ids = request.transfer_ids if request is not None else [request_id]
        self.forget(request_id)
        for transfer_id in transfer_ids:
            for worker in [*self.prefill, *self.decode]:
                worker.abort(transfer_id)

    def forget(self, transfer_id: str) -> None:
        """The request of a completion ended outside a step (its decode engine died): stop
        tracking it."""
        completion = self._completions.get(transfer_id)
        request = self._requests.pop(completion.request_id if completion is not None else transfer_id, None)
        for other in request.transfer_ids if request is not None else ():
            self._completions.pop(other, None)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or any(w.num_holds for w in self.prefill)

    def step(self) -> list[RequestOutput]:
        """One step of every engine with work; the requests that finished."""
        ended: list[RequestOutput] = []  # completions' outputs
        for worker in self.prefill:
            for done in worker.step():
                completion = self._completions.get(done.transfer_id)
                if completion is None:
                    continue  # aborted meanwhile
                request = self._requests[completion.request_id]
                if request.first_token is None:
                    request.first_token = self.clock()
                if done.handoff is None:
                    ended.append(done.output)
                    continue
                output = self._hand_to_decode(done, completion, request.arrival)
                if output is not None:
                    ended.append(output)
        for worker in self.decode:
            ended.extend(worker.step())
        return [output for output in map(self._completion_ended, ended) if output is not None]

    def _hand_to_decode(self, done: Any, completion: _Completion, arrival: float) -> RequestOutput | None:
        """A decode engine takes the handoff (with what the prefill engine scored); the
        completion's output if it ended there."""
        handoff = done.handoff
        request = RouteRequest(handoff.transfer_id, [*handoff.prompt_token_ids, handoff.first_token_id],
                               completion.params.max_tokens - 1, **adapter_fields(completion.lora_request))
        consumer = self.decode[self.router.choose_decode(request, [w.engine for w in self.decode])]
        return consumer.accept(handoff, completion.params, arrival, done.output.outputs[0].logprobs,
                               done.output.prompt_logprobs, completion.lora_request)

    def _completion_ended(self, output: RequestOutput) -> RequestOutput | None:
        """The request's output once its last completion has ended (`output` is one's), else None."""
        completion = self._completions.pop(output.request_id, None)
        if completion is None:
            return None  # its request was aborted or forgotten
        request = self._requests[completion.request_id]
        request.ended[completion.index] = output
        if any(o is None for o in request.ended):
            return None
        del self._requests[completion.request_id]
        return self._timed(merged_output(completion.request_id, request.ended), request)

    def _timed(self, output: RequestOutput, request: _Request) -> RequestOutput:
        """`output` with its times on the deployment's clock: arrival at the router, first
        token from the prefill engine, finish now (each engine keeps its own clock)."""
        now = self.clock()
        first = request.first_token if request.first_token is not None else now
        return attrs.evolve(output, metrics=attrs.evolve(
            output.metrics, arrival_time=request.arrival, first_scheduled_time=None, first_token_time=first,
            finish_time=now))

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 timeout_s: float = 600.0, lora_request: Any = None) -> list[RequestOutput]:
        """Run every prompt to completion, each with the LoRA adapter `lora_request` (one for
        all, or one per prompt) or none; outputs in prompt order (request_id: its first
        completion's transfer id)."""
        prompt_list = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)) else list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise RequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompt_list)
        if len(adapters) != len(prompt_list):
            raise RequestError(f"{len(adapters)} lora_requests for {len(prompt_list)} prompts")
        ids: list[str] = []
        try:
            for prompt, request_params, adapter in zip(prompt_list, params_list, adapters):
                ids.append(self.add_request(prompt, request_params, adapter))
        except BaseException:  # one refused prompt refuses the call: the ones added before it are aborted
            for request_id in ids:
                self.abort(request_id)
            raise
        outputs: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(outputs) < len(ids):
            if time.monotonic() > deadline:
                for transfer_id in ids:
                    if transfer_id not in outputs:
                        self.abort(transfer_id)
                raise TimeoutError(f"{len(ids) - len(outputs)} requests unfinished after {timeout_s} s")
            for output in self.step():
                outputs[output.request_id] = output
        return [outputs[i] for i in ids]

    # ------------------------------------------------------------ observability

    def metrics(self) -> dict[str, dict[str, float]]:
        """Transfer counters summed per role: {"prefill": {...}, "decode": {...}}."""
        totals: dict[str, dict[str, float]] = {}
        for worker in [*self.prefill, *self.decode]:
            role = totals.setdefault(worker.metrics.role, {})
            for key, value in worker.metrics.as_dict().items():
                role[key] = role.get(key, 0) + value
        return totals

    def leaked_blocks(self) -> dict[str, int]:
        """KV blocks still held by any sequence, per engine (0 everywhere when idle)."""
        return {worker.name: worker.engine.allocator.stats().num_used_blocks
                for worker in [*self.prefill, *self.decode]}
