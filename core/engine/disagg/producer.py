"""The producer role: an engine that runs prefills, samples each request's first token,
holds the request's KV blocks under a lease and offers them through a transport.

The engine itself is unchanged: the request runs with max_tokens=1; when it finishes,
its full prompt blocks sit unheld in the engine's prefix cache, and a hold sequence
(`hold:<transfer id>`) takes them (`match_prefix`) before anything else can evict
them. The hold is freed when the transfer ends (loaded, rejected, aborted) or its lease
lapses, whichever comes first.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence as Seq

import attrs

from servelab.disagg.data_path import RunnerDataPath
from servelab.disagg.metrics import TransferMetrics
from servelab.disagg.requests import prefill_params
from servelab.errors import ConfigError, RequestError
from servelab.interfaces import (TERMINAL_STATES, BlockPayload, Handoff, KVDataPath, KVTransport,
                                 PrefixCachingAllocator, Sequence, prefix_block_hashes)
from servelab.logging_setup import get_logger
from servelab.outputs import RequestOutput
from servelab.request import RequestSpec
from servelab.sampling_params import SamplingParams

logger = get_logger(__name__)


@attrs.frozen
class PrefillDone:
    """A producer's answer for one request: a handoff to pass on, or the final output
    (the first token ended it: EOS, a stop token, max_tokens=1, an error or an abort)."""

    transfer_id: str
    output: RequestOutput
    handoff: Handoff | None = None


@attrs.define
class _Prefill:
    generator: Any  # its seeded generator, or None; kept here because a finished request lets go of its own
    params: SamplingParams  # the client's
    lora_id: int = 0  # the LoRA adapter it runs with (0: the base model)


@attrs.define
class _Hold:
    seq_id: str
    deadline: float
    num_blocks: int


def hold_id(transfer_id: str) -> str:
    return f"hold:{transfer_id}"


class PrefillWorker:
    """One producer engine and its holds."""

    def __init__(self, engine: Any, transport: KVTransport, name: str, lease_s: float,
                 clock: Callable[[], float] = time.time, data_path: KVDataPath | None = None) -> None:
        if not isinstance(engine.allocator, PrefixCachingAllocator):
            raise ConfigError(f"a prefill engine hands its KV on from its prefix cache: allocator "
                              f"{engine.config.allocator.name!r} has none; choose allocator 'hash' or 'radix'")
        self.engine, self.transport, self.name = engine, transport, name
        self.lease_s, self.clock = lease_s, clock
        self.block_size = engine.config.engine.block_size
        self.data_path = data_path or RunnerDataPath(engine.runner, engine.config.engine.kv_cache_dtype,
                                                     self.block_size)
        self.metrics = TransferMetrics("prefill")
        self._requests: dict[str, _Prefill] = {}  # transfer id -> its prefill in the engine
        self._holds: dict[str, _Hold] = {}  # transfer id -> its held blocks

    # ------------------------------------------------------------ requests

    def add(self, transfer_id: str, prompt: str | list[int], params: SamplingParams,
            arrival_time: float | None = None, lora_request: Any = None) -> None:
        """Queue the prefill of one completion named by the router's `transfer_id`, with the
        LoRA adapter `lora_request` or none (RequestError: refused, nothing queued). A text
        prompt is tokenized by the engine, as one colocated engine tokenizes it."""
        [record] = self.engine.prepare_requests([RequestSpec(prompt if isinstance(prompt, str) else list(prompt),
                                                             prefill_params(params), transfer_id,
                                                             arrival_time=arrival_time, lora_request=lora_request)])
        self.engine.admit([record])
        self._requests[transfer_id] = _Prefill(record.generators[0], params, record.first.lora_id)

    def add_completions(self, transfer_ids: Seq[str], prompt: str | list[int], params: Seq[SamplingParams],
                        arrival_time: float | None = None, lora_request: Any = None) -> None:
        """Queue a request's completions (transfer `transfer_ids[i]` runs `params[i]`; on one
        engine, they share its prefix cache), all or none: on RequestError none is left queued."""
        try:
            for transfer_id, completion in zip(transfer_ids, params):
                self.add(transfer_id, prompt, completion, arrival_time, lora_request)
        except RequestError:
            for transfer_id in transfer_ids:
                self.abort(transfer_id)
            raise

    def abort(self, transfer_id: str) -> None:
        """The client went away: stop the prefill, or end the transfer and free its hold."""
        self._requests.pop(transfer_id, None)
        self.engine.abort(transfer_id)
        if transfer_id in self._holds:
            self.transport.abort(transfer_id, "the client aborted the request")
            self._free(transfer_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def is_holding(self, transfer_id: str) -> bool:
        return transfer_id in self._holds

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    # ------------------------------------------------------------ the step

    def step(self) -> list[PrefillDone]:
        """One engine step (when there is work), then the holds' leases; the prefills it finished."""
        done = []
        if self.engine.has_unfinished():
            for output in self.engine.step().finished:
                answer = self._finished(output)
                if answer is not None:
                    done.append(answer)
        self.release_ended()
        return done

    def release_ended(self) -> None:
        """Free the holds whose transfer ended or whose lease lapsed."""
        now = self.clock()
        for transfer_id, hold in list(self._holds.items()):
            status = self.transport.poll(transfer_id)
            if status.state in TERMINAL_STATES:
                self._free(transfer_id)
                self.transport.forget(transfer_id)
                continue
            deadline = max(hold.deadline, status.lease_deadline)
            if now > deadline:
                self.metrics.leases_expired += 1
                logger.warning("kv_transfer.lease_expired", transfer_id=transfer_id, producer=self.name,
                               state=status.state.value, blocks=hold.num_blocks)
                self.transport.abort(transfer_id, "the producer's lease lapsed")
                self._free(transfer_id)

    def _finished(self, output: RequestOutput) -> PrefillDone | None:
        entry = self._requests.get(output.request_id)
        if entry is None:
            return None
        done = self._hand_on(output, entry)
        del self._requests[output.request_id]
        return done

    def _hand_on(self, output: RequestOutput, entry: _Prefill) -> PrefillDone:
        transfer_id = output.request_id
        if output.finish_reason != "length" or entry.params.max_tokens <= 1 or self._fills_context(output):
            return PrefillDone(transfer_id, output)  # the first token ended it, or it failed
        started = time.perf_counter()
        generator = entry.generator
        state = bytes(generator.get_state().numpy().tobytes()) if generator is not None else None
        handoff, payloads = self.hold_on_finish(transfer_id, output.prompt_token_ids, output.token_ids[0], state)
        if not payloads:  # a prompt shorter than a block: nothing held, nothing to move
            return PrefillDone(transfer_id, output, handoff)
        try:
            self.transport.offer(handoff, payloads)
        except Exception as exc:  # noqa: BLE001 - any transport failure: the consumer's failure policy decides
            logger.warning("kv_transfer.offer_failed", transfer_id=transfer_id, producer=self.name, error=str(exc))
            self._free(transfer_id)
            return PrefillDone(transfer_id, output, handoff)
        self.metrics.transfers += 1
        self.metrics.bytes += sum(len(p.data) for p in payloads)
        self.metrics.transfer_seconds += time.perf_counter() - started
        return PrefillDone(transfer_id, output, handoff)

    def _fills_context(self, output: RequestOutput) -> bool:
        """The prompt and the first token fill max_model_len: one engine stops there, so
        the request ends here (a decode engine would refuse it, or sample past the limit)."""
        return len(output.prompt_token_ids) + 1 >= self.engine.limits.max_model_len

    def hold_on_finish(self, transfer_id: str, prompt_token_ids: Seq[int], first_token_id: int,
                       sampler_state: bytes | None) -> tuple[Handoff, list[BlockPayload]]:
        """Hold the finished prefill's full prompt blocks (from the prefix cache, before
        anything evicts them, cached under the request's LoRA adapter if it has one) under
        a lease; the handoff and the blocks' payloads."""
        prompt = list(prompt_token_ids)
        entry = self._requests.get(transfer_id)
        lora_id = entry.lora_id if entry is not None else 0
        holder = Sequence(hold_id(transfer_id), prompt + [first_token_id], SamplingParams(max_tokens=1), self.clock(),
                          lora_id=lora_id)
        allocator = self.engine.allocator
        num_blocks = allocator.match_prefix(holder) // self.block_size
        blocks = list(allocator.block_table(holder.request_id))[:num_blocks]
        deadline = self.clock() + self.lease_s
        handoff = Handoff(transfer_id=transfer_id, producer=self.name, prompt_token_ids=tuple(prompt),
                          block_hashes=tuple(prefix_block_hashes(prompt, self.block_size, lora_id)[:num_blocks]),
                          num_tokens=len(prompt), layout=self.data_path.layout(), lease_deadline=deadline,
                          first_token_id=first_token_id, sampler_state=sampler_state)
        if not num_blocks:
            allocator.free(holder.request_id)
            return handoff, []
        self._holds[transfer_id] = _Hold(holder.request_id, deadline, num_blocks)
        self.metrics.held_blocks += num_blocks
        data = self.data_path.save(blocks)
        return handoff, [BlockPayload.of(transfer_id, i, d) for i, d in enumerate(data)]

    def _free(self, transfer_id: str) -> None:
        hold = self._holds.pop(transfer_id, None)
        if hold is not None:
            self.engine.allocator.free(hold.seq_id)
            self.metrics.held_blocks -= hold.num_blocks

    def shutdown(self) -> None:
        """The replica stops: holds whose transfer ended are freed, the others' transfers
        are ended (their consumers told) and freed too, and prefills in flight aborted."""
        self.release_ended()
        for transfer_id in list(self._holds):
            self.transport.abort(transfer_id, "the producer is shutting down")
            self._free(transfer_id)
        for transfer_id in list(self._requests):
            self._requests.pop(transfer_id)
            self.engine.abort(transfer_id)

    def crash(self) -> None:
        """Drop every hold without telling the transport (a producer process that died:
        its memory goes with it). For fault injection."""
        for transfer_id in list(self._holds):
            self._free(transfer_id)
        for transfer_id in list(self._requests):
            self._requests.pop(transfer_id)
            self.engine.abort(transfer_id)
