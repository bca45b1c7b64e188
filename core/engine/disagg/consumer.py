"""The consumer role: an engine that takes handoffs, loads into its pool only the blocks
its own prefix cache lacks, and decodes on from the producer's first token.

The engine itself is unchanged: a load sequence (`load:<transfer id>`) takes the blocks
the cache already holds (`match_prefix`), is allocated the rest, which the data path
fills from the payloads, and caches them (`cache_blocks`); the request is then admitted
as prompt + first token, the first token counted as generated (`RequestSpec.continues`),
and its prefix lookup hits every loaded block. The load sequence holds them until the
request's first step, so nothing evicts them in between. The prompt's last partial block
(fewer than block_size tokens) is computed here, together with the first token.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence as Seq

import attrs
import torch

from servelab.disagg.data_path import RunnerDataPath
from servelab.disagg.metrics import TransferMetrics
from servelab.disagg.requests import decode_params
from servelab.errors import ConfigError, RequestError
from servelab.interfaces import (Handoff, KVDataPath, KVTransport, PrefixCachingAllocator, Sequence, TransferError,
                                 TransferState, check_handoff, layout_mismatch, lease_state, payload_indices,
                                 prefix_block_hashes)
from servelab.logging_setup import get_logger
from servelab.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput
from servelab.request import RequestSpec
from servelab.routing import reported_prefix_summary
from servelab.sampling_params import SamplingParams

logger = get_logger(__name__)

FAILURE_POLICIES = ("fail", "recompute")


def load_id(transfer_id: str) -> str:
    return f"load:{transfer_id}"


@attrs.define
class _Accepted:
    handoff: Handoff
    params: SamplingParams  # the client's, whole
    arrival_time: float
    pinned: bool = False  # its load sequence holds the loaded blocks until its first step
    first_logprobs: list | None = None  # SamplingParams.logprobs: the producer's, of the first token
    prompt_logprobs: list | None = None  # SamplingParams.prompt_logprobs: the producer's
    lora_request: Any = None  # the LoRA adapter it runs with (the producer's), or None
    lora_id: int = 0  # that adapter's id in this engine


class DecodeWorker:
    """One consumer engine."""

    def __init__(self, engine: Any, transport: KVTransport, name: str, failure_policy: str = "fail",
                 clock: Callable[[], float] = time.time, data_path: KVDataPath | None = None) -> None:
        if failure_policy not in FAILURE_POLICIES:
            raise ConfigError(f"failure policy {failure_policy!r} is not one of {', '.join(FAILURE_POLICIES)}")
        if not isinstance(engine.allocator, PrefixCachingAllocator):
            raise ConfigError(f"a decode engine loads handed-over KV into its prefix cache: allocator "
                              f"{engine.config.allocator.name!r} has none; choose allocator 'hash' or 'radix'")
        self.engine, self.transport, self.name = engine, transport, name
        self.failure_policy, self.clock = failure_policy, clock
        self.block_size = engine.config.engine.block_size
        self.data_path = data_path or RunnerDataPath(engine.runner, engine.config.engine.kv_cache_dtype,
                                                     self.block_size)
        self.metrics = TransferMetrics("decode")
        self._waiting: dict[str, _Accepted] = {}  # transfer id -> a handoff whose payload is not ready yet
        self._admitted: dict[str, _Accepted] = {}  # transfer id -> its request in the engine
        self._whole: set[str] = set()  # requests computed here from the prompt (their prefill engine was lost)
        # the last step's new token ids by sequence id (a server streams them; the producer's first token is not here)
        self.events: dict[str, RequestEvent] = {}
        # Asked before a handoff is admitted: a reason to reject it, or None to take it.
        self.admission: Callable[[Handoff], str | None] = self.room_for

    # ------------------------------------------------------------ handoffs

    def accept(self, handoff: Handoff, params: SamplingParams, arrival_time: float | None = None,
               first_logprobs: list | None = None, prompt_logprobs: list | None = None,
               lora_request: Any = None) -> RequestOutput | None:
        """Take `handoff` for the request of `params` (one completion); what the producer
        scored comes with it: `first_logprobs` (the first token's, when params ask for
        logprobs) and `prompt_logprobs` (when they ask for prompt logprobs); `lora_request`:
        the adapter the producer ran it with (loaded here too). The request's final output
        when it ends here (the failure policy "fail", an adapter this engine cannot serve),
        else None (admitted, or waiting for its payload)."""
        entry = _Accepted(handoff, params, arrival_time if arrival_time is not None else self.clock(),
                          first_logprobs=first_logprobs, prompt_logprobs=prompt_logprobs,
                          lora_request=lora_request)
        try:
            entry.lora_id = self.engine.intake.lora_id(lora_request)
        except RequestError as exc:  # computing it again here would fail the same way
            self.transport.reject(handoff.transfer_id, str(exc))
            self.metrics.rejects += 1
            return self._error(entry, f"rejected before admission: {exc}")
        reason = self.admission(handoff)
        if reason is not None:
            self.transport.reject(handoff.transfer_id, reason)  # the producer frees at once
            self.metrics.rejects += 1
            return self._failed(entry, f"rejected before admission: {reason}")
        return self._try_load(entry)

    def recompute(self, transfer_id: str, prompt: list[int] | str, params: SamplingParams,
                  lora_request: Any = None) -> RequestOutput | None:
        """Serve a whole request here, prefill included: its prefill engine was lost before
        handing it on. Counted in `recomputes` and logged; its output (or its error) comes
        from `step` (or here, when the engine refuses it)."""
        try:
            [record] = self.engine.prepare_requests([RequestSpec(prompt, params, transfer_id,
                                                                 lora_request=lora_request)])
            self.engine.admit([record])
        except RequestError as exc:  # bad input: a failure, not a recompute
            self.metrics.failures += 1
            now = self.clock()
            return RequestOutput(transfer_id, None, list(prompt) if isinstance(prompt, list) else [],
                                 [CompletionOutput(0, [], "", "error")], RequestMetrics(now, None, None, now),
                                 error=str(exc))
        self.metrics.recomputes += 1
        logger.warning("kv_transfer.recompute", transfer_id=transfer_id, consumer=self.name,
                       reason="its prefill engine was lost before the handoff")
        self._whole.add(transfer_id)
        return None

    def room_for(self, handoff: Handoff) -> str | None:
        """The default admission: reject a handoff whose blocks the pool could never hold."""
        stats = self.engine.allocator.stats()
        if handoff.num_blocks > stats.num_blocks:
            return f"{handoff.num_blocks} KV blocks exceed this engine's pool of {stats.num_blocks}"
        return None

    def is_waiting(self, transfer_id: str) -> bool:
        """Its handoff is taken and its payload not ready yet."""
        return transfer_id in self._waiting

    def is_decoding(self, transfer_id: str) -> bool:
        """Its request is in this engine."""
        return transfer_id in self._admitted

    def abort(self, transfer_id: str) -> RequestOutput | None:
        """The client went away: end the transfer (if still open) and the request."""
        entry = self._waiting.pop(transfer_id, None) or self._admitted.pop(transfer_id, None)
        self.engine.allocator.free(load_id(transfer_id))
        self.transport.abort(transfer_id, "the client aborted the request")
        output = self.engine.abort(transfer_id)
        return self._final(entry, output) if entry is not None and output is not None else None

    def has_work(self) -> bool:
        return bool(self._waiting) or self.engine.has_unfinished()

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Retry the waiting handoffs, then one engine step; the requests that finished."""
        finished = [out for entry in list(self._waiting.values()) if (out := self._try_load(entry)) is not None]
        self.events = {}
        if self.engine.has_unfinished():
            result = self.engine.step()
            self.events = result.events
            for output in result.finished:
                entry = self._admitted.pop(output.request_id, None)
                if entry is not None:
                    if entry.pinned:  # it finished in its first step (a stop, or max_tokens 2)
                        self.engine.allocator.free(load_id(output.request_id))
                    finished.append(self._final(entry, output))
                elif output.request_id in self._whole:
                    self._whole.discard(output.request_id)
                    finished.append(output)
        self._unpin()
        return finished

    def _unpin(self) -> None:
        """Free the load sequences of requests that have had their first step."""
        for transfer_id, entry in self._admitted.items():
            if entry.pinned:
                request = self.engine.requests.get(transfer_id)
                if request is None or request.first.first_scheduled_time is not None:
                    self.engine.allocator.free(load_id(transfer_id))
                    entry.pinned = False

    def _try_load(self, entry: _Accepted) -> RequestOutput | None:
        handoff = entry.handoff
        transfer_id = handoff.transfer_id
        self._waiting.pop(transfer_id, None)
        if not handoff.num_blocks:  # nothing was handed over: the consumer computes the short prompt
            return self._admit(entry, pinned=False)
        try:
            problem = layout_mismatch(self.data_path.layout(), handoff.layout)
            if problem is not None:
                raise TransferError(f"transfer {transfer_id!r}: layout {problem}")
            own = prefix_block_hashes(handoff.prompt_token_ids, self.block_size, entry.lora_id)[:handoff.num_blocks]
            check_handoff(handoff, handoff.prompt_token_ids, own)
            state = lease_state(self.transport.poll(transfer_id), self.clock())
            if state is TransferState.OFFERED:
                self._waiting[transfer_id] = entry  # ask again later
                return None
            if state is not TransferState.READY:
                raise TransferError(f"transfer {transfer_id!r} is {state.value}, not ready")
            self._load(handoff, entry.lora_id)
        except TransferError as exc:
            self.engine.allocator.free(load_id(transfer_id))
            self.transport.abort(transfer_id, str(exc))
            return self._failed(entry, str(exc))
        self.transport.complete(transfer_id)
        return self._admit(entry, pinned=True)

    def _load(self, handoff: Handoff, lora_id: int) -> None:
        started = time.perf_counter()
        transfer_id, block_size = handoff.transfer_id, self.block_size
        loader = Sequence(load_id(transfer_id), [*handoff.prompt_token_ids, handoff.first_token_id],
                          SamplingParams(max_tokens=1), self.clock(), lora_id=lora_id)
        allocator = self.engine.allocator
        cached = allocator.match_prefix(loader) // block_size
        if not allocator.allocate(loader.request_id, handoff.num_blocks * block_size):
            raise TransferError(f"transfer {transfer_id!r}: no room for {handoff.num_blocks} KV blocks")
        needed = payload_indices(handoff, cached)
        table = list(allocator.block_table(loader.request_id))
        self.blocks_allocated(handoff, needed, [table[i] for i in needed])
        loader.num_computed_tokens = handoff.num_blocks * block_size
        allocator.cache_blocks(loader)
        self.metrics.transfers += 1
        self.metrics.blocks_skipped += min(cached, handoff.num_blocks)
        self.metrics.transfer_seconds += time.perf_counter() - started

    def remote_tokens(self, handoff: Handoff) -> int | None:
        """Tokens the producer holds that this engine's prefix cache lacks; None while the
        payload is not ready (ask again later)."""
        if lease_state(self.transport.poll(handoff.transfer_id), self.clock()) is TransferState.OFFERED:
            return None
        summary = reported_prefix_summary(self.engine.allocator)
        cached = summary.cached_tokens(handoff.prompt_token_ids) if summary is not None else 0
        return max(0, handoff.num_blocks * self.block_size - cached)

    def blocks_allocated(self, handoff: Handoff, indices: Seq[int], blocks: Seq[int]) -> None:
        """Receive the handoff's blocks `indices`, check each, and write them into `blocks`."""
        transfer_id = handoff.transfer_id
        payloads = self.transport.receive(transfer_id, list(indices))
        expected = self.data_path.layout().block_bytes
        for index in indices:
            payload = payloads[index] if index in payloads else None
            if payload is None or payload.index != index:
                raise TransferError(f"transfer {transfer_id!r}: block {index} missing from the payload")
            payload.verify(transfer_id, expected)
        self.data_path.load(list(blocks), [payloads[i].data for i in indices])
        self.metrics.bytes += sum(len(payloads[i].data) for i in indices)

    def _admit(self, entry: _Accepted, pinned: bool) -> RequestOutput | None:
        handoff = entry.handoff
        try:
            [record] = self.engine.prepare_requests([RequestSpec(
                [*handoff.prompt_token_ids, handoff.first_token_id], decode_params(entry.params),
                handoff.transfer_id, arrival_time=entry.arrival_time, lora_request=entry.lora_request,
                continues=(handoff.first_token_id,))])
            if handoff.sampler_state is not None and record.generators[0] is not None:
                record.generators[0].set_state(torch.frombuffer(bytearray(handoff.sampler_state), dtype=torch.uint8))
            self.engine.admit([record])
        except RequestError as exc:
            self.engine.allocator.free(load_id(handoff.transfer_id))
            return self._error(entry, str(exc))
        entry.pinned = pinned
        self._admitted[handoff.transfer_id] = entry
        return None

    def _failed(self, entry: _Accepted, reason: str) -> RequestOutput | None:
        if self.failure_policy == "recompute":
            self.metrics.recomputes += 1
            logger.warning("kv_transfer.recompute", transfer_id=entry.handoff.transfer_id, consumer=self.name,
                           reason=reason)
            return self._admit(entry, pinned=False)
        logger.warning("kv_transfer.failed", transfer_id=entry.handoff.transfer_id, consumer=self.name,
                       reason=reason)
        return self._error(entry, reason)

    def _error(self, entry: _Accepted, reason: str) -> RequestOutput:
        self.metrics.failures += 1
        handoff = entry.handoff
        now = self.clock()
        return RequestOutput(handoff.transfer_id, None, list(handoff.prompt_token_ids),
                             [CompletionOutput(0, [handoff.first_token_id], self._decode([handoff.first_token_id]),
                                               "error")],
                             RequestMetrics(entry.arrival_time, None, None, now), error=reason)

    def _final(self, entry: _Accepted, output: RequestOutput) -> RequestOutput:
        """The request's whole output: this engine's, whose first token is the producer's
        (RequestSpec.continues), with what the producer scored: the first token's logprobs
        and the prompt's."""
        completion = output.outputs[0]
        logprobs = completion.logprobs
        if logprobs:  # position 0 is the first token's, scored by the producer
            logprobs = [(entry.first_logprobs or [None])[0], *logprobs[1:]]
        return attrs.evolve(output, outputs=[attrs.evolve(completion, logprobs=logprobs)],
                            metrics=attrs.evolve(output.metrics, arrival_time=entry.arrival_time),
                            prompt_logprobs=entry.prompt_logprobs)

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return tokenizer.decode(token_ids) if tokenizer else ""

    def crash(self) -> list[RequestOutput]:
        """Drop every request and load without telling the transport, as a consumer
        process that died does; returns the errors its clients see (the connection lost)."""
        lost = []
        for transfer_id, entry in [*self._waiting.items(), *self._admitted.items()]:
            self.engine.allocator.free(load_id(transfer_id))
            self.engine.abort(transfer_id)
            lost.append(self._error(entry, f"decode engine {self.name} died"))
        self._waiting.clear()
        self._admitted.clear()
        return lost
