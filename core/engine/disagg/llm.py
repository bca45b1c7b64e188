"""`DisaggregatedLLM`: xPyD in one process. x prefill engines and y decode engines, each
a whole `LLMEngine`, a KV transport between them (`[kv_transfer]`, in-process unless the
config names another) and the P/D router placing each request."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence as Seq

import attrs

from servelab.config import EngineConfig
from servelab.disagg.consumer import DecodeWorker
from servelab.disagg.producer import PrefillWorker
from servelab.disagg.requests import check_disaggregable
from servelab.disagg.routing import PDRouter, mint_transfer_id
from servelab.engine import LLMEngine
from servelab.engine_setup import build_kv_transport
from servelab.errors import ConfigError, RequestError
from servelab.interfaces import KVTransferContext, RouteRequest
from servelab.outputs import RequestOutput
from servelab.registry import PluginRegistry
from servelab.sampling_params import SamplingParams

DEFAULT_LEASE_S = 30.0


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
        self._params: dict[str, tuple[SamplingParams, float]] = {}  # transfer id -> params, arrival
        self._first_token: dict[str, float] = {}  # transfer id -> when its first token came (the deployment's clock)

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

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> str:
        """Route a request to a prefill engine; returns its transfer id (RequestError: refused)."""
        params = params or SamplingParams()
        check_disaggregable(params)
        transfer_id = mint_transfer_id()
        token_ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        choice = self.router.choose_prefill(RouteRequest(transfer_id, token_ids, params.max_tokens),
                                            [w.engine for w in self.prefill])
        arrival = self.clock()
        self.prefill[choice].add(transfer_id, list(token_ids), params, arrival_time=None)  # a text prompt encoded
        self._params[transfer_id] = (params, arrival)
        return transfer_id

    def abort(self, transfer_id: str) -> None:
        self.forget(transfer_id)
        for worker in self.prefill:
            worker.abort(transfer_id)
        for worker in self.decode:
            worker.abort(transfer_id)

    def forget(self, transfer_id: str) -> None:
        """The request ended outside a step (its decode engine died): stop tracking it."""
        self._params.pop(transfer_id, None)
        self._first_token.pop(transfer_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._params) or any(w.num_holds for w in self.prefill)

    def step(self) -> list[RequestOutput]:
        """One step of every engine with work; the requests that finished."""
        finished: list[RequestOutput] = []
        for worker in self.prefill:
            for done in worker.step():
                entry = self._params.get(done.transfer_id)
                if entry is None:
                    continue  # aborted meanwhile
                self._first_token[done.transfer_id] = self.clock()
                if done.handoff is None:
                    finished.append(done.output)
                    continue
                params, arrival = entry
                request = RouteRequest(done.transfer_id, [*done.handoff.prompt_token_ids, done.handoff.first_token_id],
                                       params.max_tokens - 1)
                consumer = self.decode[self.router.choose_decode(request, [w.engine for w in self.decode])]
                output = consumer.accept(done.handoff, params, arrival, done.output.outputs[0].logprobs)
                if output is not None:
                    finished.append(output)
        for worker in self.decode:
            finished.extend(worker.step())
        return [self._timed(output) for output in finished]

    def _timed(self, output: RequestOutput) -> RequestOutput:
        """`output` with its times on the deployment's clock: arrival at the router, first
        token from the prefill engine, finish now (each engine keeps its own clock)."""
        params = self._params.pop(output.request_id, None)
        first = self._first_token.pop(output.request_id, None)
        if params is None:
            return output
        now = self.clock()
        return attrs.evolve(output, metrics=attrs.evolve(
            output.metrics, arrival_time=params[1], first_scheduled_time=None,
            first_token_time=first if first is not None else now, finish_time=now))

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 timeout_s: float = 600.0) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order (request_id: its transfer id)."""
        prompt_list = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)) else list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise RequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        ids = [self.add_request(p, sp) for p, sp in zip(prompt_list, params_list)]
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
