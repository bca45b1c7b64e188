"""TransportContract: what a KV transport (kind `kv_transfers`,
`servelab.contracts.kv_transfer`) must do, with faults injected at every state.

    from servelab.testing import TransportContract

    class TestMine(TransportContract):
        factory = MyTransport                # factory(options, KVTransferContext) -> transport
        # or: plugin_name = "shared-files" (an installed one, by name)

Two layers of tests. The transport's own rules, on hand-made handoffs: a transfer id is
offered once, each handoff is taken once, `receive` returns that transfer's payloads and
nothing else, an ended or lapsed transfer delivers nothing, a reject or abort is final.
Then a 1P1D deployment (`servelab.disagg.DisaggregatedLLM`, two engines on a tiny
model) runs a workload through the transport with one fault injected per scenario
(`FAULTS`: drop, delay, duplicate, partial write, payload misdelivered, producer crash
mid-transfer, consumer crash, reject before admission, client abort at each state, a
lease that lapses), under both failure policies, and four invariants must hold:

- LEAK: 0 KV blocks held on either engine once the lease and a margin have passed;
- IDENTITY: every output equals one colocated engine's (greedy, and seeded sampling);
- BOUNDED: every request not aborted ends, with its output or an error, within a bound;
- DELIVERY: a request's output is its own (prompt and tokens), never another transfer's.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence as Seq

import attrs
import pytest

from servelab.contracts.kv_transfer import (BlockPayload, Handoff, KVLayout, KVTransferContext, KVTransport,
                                            TransferError, TransferState)
from servelab.testing.contract import PolicyContract, check, exercising

IMPLEMENTS = "implements KVTransport"
UNIQUE_IDS = "a transfer id is offered once"
TAKEN_ONCE = "each handoff is taken once"
OWN_PAYLOADS = "receive returns the transfer's own payloads"
ENDED_IS_FINAL = "an ended transfer delivers nothing"
LEAK = "no KV blocks leaked after lease + margin"
IDENTITY = "disaggregated output equals one colocated engine's"
BOUNDED = "every accepted request ends within the bound"
DELIVERY = "no transfer delivered to the wrong request"

FAULTS = ("none", "drop", "delay", "duplicate", "partial-write", "misdeliver", "producer-crash", "consumer-crash",
          "reject", "abort-prefill", "abort-held", "abort-waiting", "abort-decoding", "lapsed-lease")
LEASE_S = 1.0
MARGIN_S = 0.5
MAX_STEPS = 300  # the bound: a 3-request workload ends well inside it on any transport that works


class ManualClock:
    """A clock the scenarios move by hand (leases lapse without waiting)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ---------------------------------------------------------------- hand-made handoffs


def sample_handoff(transfer_id: str, num_blocks: int = 2, deadline: float = 1e12) -> tuple[Handoff, list[BlockPayload]]:
    layout = KVLayout(block_size=4, kv_cache_dtype="auto", storage_dtype="torch.float32", scales="none",
                      layer_range=(0, 1), block_shape=(1, 4, 2), tp_rank_map=((0, 1),))
    prompt = tuple(range(3, 3 + 4 * num_blocks + 1))
    handoff = Handoff(transfer_id=transfer_id, producer="p", prompt_token_ids=prompt,
                      block_hashes=tuple(range(num_blocks)), num_tokens=len(prompt), layout=layout,
                      lease_deadline=deadline, first_token_id=7)
    payloads = [BlockPayload.of(transfer_id, i, bytes([i + len(transfer_id)]) * layout.block_bytes)
                for i in range(num_blocks)]
    return handoff, payloads


# ---------------------------------------------------------------- fault injection


class FaultInjector:
    """The transport under test with one fault injected (`FAULTS`); every other call passes through."""

    def __init__(self, inner: Any, fault: str, clock: ManualClock) -> None:
        self.inner, self.fault, self.clock = inner, fault, clock
        self.delayed: dict[str, tuple[Handoff, list[BlockPayload], int]] = {}
        self.duplicate_refused: bool | None = None
        self.others: dict[str, list[BlockPayload]] = {}  # payloads seen per transfer (for misdelivery)

    def offer(self, handoff: Handoff, payloads: Seq[BlockPayload]) -> None:
        payloads = list(payloads)
        self.others[handoff.transfer_id] = payloads
        if self.fault == "drop":
            return
        if self.fault in ("delay", "abort-waiting", "lapsed-lease"):
            self.delayed[handoff.transfer_id] = (handoff, payloads, 2 if self.fault == "delay" else 10**9)
            return
        if self.fault == "partial-write" and payloads:
            last = payloads[-1]
            payloads[-1] = attrs.evolve(last, data=last.data[: len(last.data) // 2])
        if self.fault == "producer-crash":
            payloads = payloads[: len(payloads) // 2]  # the rest never lands
        self.inner.offer(handoff, payloads)
        if self.fault == "duplicate":
            try:
                self.inner.offer(handoff, payloads)
                self.duplicate_refused = False
            except TransferError:
                self.duplicate_refused = True

    def poll(self, transfer_id: str):
        from servelab.contracts.kv_transfer import TransferStatus

        if transfer_id in self.delayed:
            handoff, payloads, polls = self.delayed[transfer_id]
            if polls <= 0 or self.clock() > handoff.lease_deadline:
                del self.delayed[transfer_id]
                if self.clock() <= handoff.lease_deadline:
                    self.inner.offer(handoff, payloads)
                    return self.inner.poll(transfer_id)
                return TransferStatus(TransferState.UNKNOWN)
            self.delayed[transfer_id] = (handoff, payloads, polls - 1)
            return TransferStatus(TransferState.OFFERED, handoff.lease_deadline)
        return self.inner.poll(transfer_id)

    def receive(self, transfer_id: str, indices: Seq[int]):
        received = self.inner.receive(transfer_id, indices)
        if self.fault == "misdeliver":  # another transfer's payloads, under this transfer's positions
            other = next((p for tid, p in self.others.items() if tid != transfer_id and p), None)
            if other is not None:
                return {i: attrs.evolve(other[min(i, len(other) - 1)], index=i) for i in received}
        return received

    def pending(self):
        return self.inner.pending()

    def complete(self, transfer_id: str) -> None:
        self.inner.complete(transfer_id)

    def reject(self, transfer_id: str, reason: str) -> None:
        self.inner.reject(transfer_id, reason)

    def abort(self, transfer_id: str, reason: str) -> None:
        self.delayed.pop(transfer_id, None)
        self.inner.abort(transfer_id, reason)

    def renew(self, transfer_id: str, lease_deadline: float) -> None:
        self.inner.renew(transfer_id, lease_deadline)

    def forget(self, transfer_id: str) -> None:
        self.inner.forget(transfer_id)

    def close(self) -> None:
        self.inner.close()


# ---------------------------------------------------------------- scenarios


@attrs.frozen
class WorkItem:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


# Two prompts sharing a 12-token prefix (the second finds blocks in the consumer's cache),
# one sampled with a seed, and one shorter than a block (nothing to hand over).
WORKLOAD = (
    WorkItem(tuple(range(5, 31)), 6),
    WorkItem(tuple(range(5, 17)) + tuple(range(60, 75)), 5, temperature=0.8, seed=11),
    WorkItem((9, 8, 7), 4),
)


@attrs.frozen
class ScenarioResult:
    fault: str
    failure_policy: str
    outputs: dict[int, Any]  # workload index -> RequestOutput
    aborted: frozenset[int]
    steps: int
    leaked: dict[str, int]
    held: int
    duplicate_refused: bool | None
    metrics: dict[str, dict[str, float]]


def engine_config(checkpoint: str) -> dict:
    return {"engine": {"model": checkpoint, "block_size": 4, "num_kv_blocks": 64, "max_num_seqs": 4,
                       "max_model_len": 128}, "allocator": {"name": "hash"}}


def sampling(item: WorkItem):
    from servelab.sampling_params import SamplingParams

    return SamplingParams(max_tokens=item.max_tokens, temperature=item.temperature, seed=item.seed,
                          ignore_eos=True)


@functools.lru_cache(maxsize=4)
def colocated_reference(checkpoint: str) -> tuple[tuple[int, ...], ...]:
    """Each workload item's tokens on one colocated engine."""
    from servelab.llm import LLM

    llm = LLM(config=engine_config(checkpoint))
    try:
        outputs = llm.generate([list(item.prompt_token_ids) for item in WORKLOAD], [sampling(i) for i in WORKLOAD])
    finally:
        llm.close()
    return tuple(tuple(o.token_ids) for o in outputs)


def run_scenario(make_transport: Callable[[KVTransferContext], Any], checkpoint: str, fault: str,
                 failure_policy: str = "recompute") -> ScenarioResult:
    """The workload through a 1P1D deployment over `make_transport`'s transport with `fault`."""
    from servelab.disagg.llm import DisaggregatedLLM

    clock = ManualClock()
    transport = FaultInjector(make_transport(KVTransferContext(role="both", name="contract", clock=clock)), fault,
                              clock)
    llm = DisaggregatedLLM(config=engine_config(checkpoint), failure_policy=failure_policy, lease_s=LEASE_S,
                           clock=clock, transport=transport)
    producer, consumer = llm.prefill[0], llm.decode[0]
    try:
        ids = [llm.add_request(list(item.prompt_token_ids), sampling(item)) for item in WORKLOAD]
        index = {tid: i for i, tid in enumerate(ids)}
        outputs: dict[int, Any] = {}
        aborted: set[int] = set()
        steps = 0
        victim = ids[0]
        while llm.has_unfinished() and steps < MAX_STEPS:
            steps += 1
            _inject_before_step(llm, fault, victim, steps, aborted, index)
            for output in llm.step():
                outputs[index[output.request_id]] = output
            if fault == "consumer-crash" and steps == 2:
                for output in consumer.crash():
                    llm.forget(output.request_id)
                    outputs[index[output.request_id]] = output
            if fault == "producer-crash" and producer.num_holds:
                producer.crash()
            clock.advance(0.05)
            if fault == "lapsed-lease" and steps % 5 == 0:
                clock.advance(LEASE_S)
        clock.advance(LEASE_S + MARGIN_S)  # every lease has lapsed: a hold still there is a leak
        for worker in llm.prefill:
            worker.release_ended()
        for worker in llm.decode:
            worker.step()
        return ScenarioResult(fault, failure_policy, outputs, frozenset(aborted), steps, llm.leaked_blocks(),
                              sum(w.num_holds for w in llm.prefill), transport.duplicate_refused, llm.metrics())
    finally:
        llm.close()


def _inject_before_step(llm: Any, fault: str, victim: str, steps: int, aborted: set[int],
                        index: dict[str, int]) -> None:
    producer, consumer = llm.prefill[0], llm.decode[0]
    if fault == "abort-prefill" and steps == 1:
        llm.abort(victim)
        aborted.add(index[victim])
    elif fault == "abort-held" and producer.is_holding(victim) and index[victim] not in aborted:
        llm.abort(victim)
        aborted.add(index[victim])
    elif fault == "abort-waiting" and consumer.is_waiting(victim) and index[victim] not in aborted:
        llm.abort(victim)
        aborted.add(index[victim])
    elif fault == "abort-decoding" and consumer.is_decoding(victim) and index[victim] not in aborted:
        llm.abort(victim)
        aborted.add(index[victim])
    elif fault == "reject" and steps == 1:
        consumer.admission = lambda handoff: "the consumer is full"


def check_invariants(result: ScenarioResult, reference: Seq[Seq[int]]) -> None:
    """ContractViolation naming the first invariant `result` breaks."""
    expected = set(range(len(WORKLOAD))) - result.aborted
    check(expected <= set(result.outputs), BOUNDED,
          lambda: f"fault {result.fault!r}: requests {sorted(expected - set(result.outputs))} still unfinished after "
                  f"{result.steps} steps")
    check(result.held == 0 and not any(result.leaked.values()), LEAK,
          lambda: f"fault {result.fault!r}: blocks held {result.leaked}, holds {result.held}")
    for i, output in result.outputs.items():
        check(tuple(output.prompt_token_ids) == WORKLOAD[i].prompt_token_ids, DELIVERY,
              lambda: f"fault {result.fault!r}: request {i} answered for prompt {output.prompt_token_ids}")
        if output.finish_reason == "error":
            check(result.failure_policy == "fail" or result.fault in ("consumer-crash",), IDENTITY,
                  lambda: f"fault {result.fault!r}: request {i} failed ({output.error}) under failure policy "
                          f"{result.failure_policy!r}, which recomputes")
            continue
        if i in result.aborted:
            continue
        check(tuple(output.token_ids) == tuple(reference[i]), IDENTITY,
              lambda: f"fault {result.fault!r}: request {i} gave {output.token_ids}, one engine gives "
                      f"{list(reference[i])}")


class TransportContract(PolicyContract):
    """Invariants: implements KVTransport; unique transfer ids; each handoff taken once; a
    transfer's own payloads only; an ended or lapsed transfer delivers nothing; and, in a
    1P1D deployment with each fault of FAULTS injected: LEAK, IDENTITY, BOUNDED, DELIVERY."""

    kind = "kv_transfers"

    def transport(self, clock: Callable[[], float] | None = None) -> Any:
        return self.make(KVTransferContext(role="both", name="contract", clock=clock))

    # ------------------------------------------------------------ the transport's own rules

    def test_implements_the_protocol(self):
        transport = self.transport()
        try:
            check(isinstance(transport, KVTransport), IMPLEMENTS, type(transport).__name__)
        finally:
            transport.close()

    def test_an_offer_is_ready_and_received_whole(self):
        transport = self.transport()
        try:
            handoff, payloads = sample_handoff("t-whole")
            with exercising(OWN_PAYLOADS):
                transport.offer(handoff, payloads)
                status = transport.poll("t-whole")
                received = transport.receive("t-whole", [0, 1])
            check(status.state is TransferState.READY, OWN_PAYLOADS, f"state after a whole offer: {status.state}")
            check(status.lease_deadline >= handoff.lease_deadline, OWN_PAYLOADS, "the lease deadline was lost")
            for payload in payloads:
                got = received[payload.index]
                check(got.data == payload.data and got.checksum == payload.checksum, OWN_PAYLOADS,
                      f"block {payload.index} came back changed")
                got.verify("t-whole", handoff.layout.block_bytes)
        finally:
            transport.close()

    def test_a_transfer_id_is_offered_once(self):
        transport = self.transport()
        try:
            handoff, payloads = sample_handoff("t-dup")
            transport.offer(handoff, payloads)
            with pytest.raises(TransferError):
                transport.offer(handoff, payloads)
        except BaseException as error:
            if type(error).__name__ == "Failed":  # pytest.raises saw no error
                check(False, UNIQUE_IDS, "a second offer of the same transfer id was accepted")
            raise
        finally:
            transport.close()

    def test_each_handoff_is_taken_once(self):
        transport = self.transport()
        try:
            for name in ("t-a", "t-b"):
                transport.offer(*sample_handoff(name))
            first = [h.transfer_id for h in transport.pending()]
            second = [h.transfer_id for h in transport.pending()]
            check(sorted(first) == ["t-a", "t-b"] and second == [], TAKEN_ONCE,
                  f"pending() gave {first}, then {second}")
        finally:
            transport.close()

    def test_receive_never_returns_another_transfers_payloads(self):
        transport = self.transport()
        try:
            first, first_payloads = sample_handoff("t-one")
            second, second_payloads = sample_handoff("t-two")
            transport.offer(first, first_payloads)
            transport.offer(second, second_payloads)
            for name, payloads in (("t-one", first_payloads), ("t-two", second_payloads)):
                received = transport.receive(name, [0, 1])
                for payload in payloads:
                    check(received[payload.index].data == payload.data, OWN_PAYLOADS,
                          f"{name} block {payload.index} holds another transfer's bytes")
            with pytest.raises(TransferError):
                transport.receive("t-never-offered", [0])
        finally:
            transport.close()

    def test_ended_transfers_deliver_nothing(self):
        clock = ManualClock()
        transport = self.transport(clock)
        try:
            ends = {"t-loaded": transport.complete, "t-rejected": lambda t: transport.reject(t, "full"),
                    "t-aborted": lambda t: transport.abort(t, "client left")}
            for name, end in ends.items():
                transport.offer(*sample_handoff(name, deadline=clock() + 10))
                end(name)
            states = {name: transport.poll(name).state for name in ends}
            check(states == {"t-loaded": TransferState.LOADED, "t-rejected": TransferState.REJECTED,
                             "t-aborted": TransferState.ABORTED}, ENDED_IS_FINAL, f"states {states}")
            for name in ends:
                transport.renew(name, clock() + 100)  # ignored once ended
                transport.abort(name, "again")  # a second end changes nothing
                check(transport.poll(name).state is states[name], ENDED_IS_FINAL, f"{name} changed state")
                with pytest.raises(TransferError):
                    transport.receive(name, [0])
            transport.offer(*sample_handoff("t-lapsing", deadline=clock() + 1))
            transport.renew("t-lapsing", clock() + 2)
            check(transport.poll("t-lapsing").lease_deadline >= clock() + 2, ENDED_IS_FINAL, "renew was lost")
            clock.advance(3)
            with pytest.raises(TransferError):
                transport.receive("t-lapsing", [0])
            transport.forget("t-loaded")
            check(transport.poll("t-loaded").state is TransferState.UNKNOWN, ENDED_IS_FINAL,
                  "a forgotten transfer is still known")
        finally:
            transport.close()

    # ------------------------------------------------------------ a deployment, faults injected

    @pytest.mark.parametrize("fault", FAULTS)
    def test_nothing_is_lost_under_fault(self, fault, servelab_tiny_checkpoint):
        reference = colocated_reference(servelab_tiny_checkpoint)
        result = run_scenario(lambda context: self.make(context), servelab_tiny_checkpoint, fault, "recompute")
        check_invariants(result, reference)
        if fault == "duplicate":
            check(result.duplicate_refused is True, UNIQUE_IDS, "a duplicate offer was accepted")
        if fault == "none":
            check(result.metrics["decode"]["recomputes"] == 0, IDENTITY,
                  lambda: f"a clean run recomputed: {result.metrics}")
            check(result.metrics["decode"]["blocks_skipped"] > 0, IDENTITY,
                  "the consumer loaded blocks its own prefix cache held")

    @pytest.mark.parametrize("fault", ("drop", "partial-write", "reject", "lapsed-lease"))
    def test_failure_policy_fail_ends_with_an_error(self, fault, servelab_tiny_checkpoint):
        reference = colocated_reference(servelab_tiny_checkpoint)
        result = run_scenario(lambda context: self.make(context), servelab_tiny_checkpoint, fault, "fail")
        check_invariants(result, reference)
        check(any(o.finish_reason == "error" for o in result.outputs.values()), BOUNDED,
              f"fault {fault!r} under failure policy 'fail' ended no request with an error")
