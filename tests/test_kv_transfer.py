"""The KV-transport conformance suite, run on every built-in transport, and seeded faulty
transports proving each of its invariants fails when broken."""

from __future__ import annotations

import math
import re

import attrs
import pytest

from servelab.contracts.kv_transfer import BlockPayload, TransferState, TransferStatus
from servelab.plugins.transports.in_process import InProcessTransport
from servelab.plugins.transports.shared_files import SharedFilesOptions, SharedFilesTransport
from servelab.testing import ContractViolation
from servelab.testing.kv_transfer import (BOUNDED, DELIVERY, IDENTITY, LEAK, TAKEN_ONCE, UNIQUE_IDS, WORKLOAD,
                                          ScenarioResult, TransportContract, check_invariants, colocated_reference,
                                          run_scenario)


class TestInProcessTransport(TransportContract):
    plugin_name = "in-process"


class TestSharedFilesTransport(TransportContract):
    plugin_name = "shared-files"  # built in a temporary directory by the fixture below

    @pytest.fixture
    def servelab_factory(self, tmp_path):
        return lambda options, context: SharedFilesTransport(SharedFilesOptions(path=str(tmp_path / "kv")), context)


class TestTorchStoreTransport(TransportContract):
    plugin_name = "torch-store"


def test_torch_store_endpoints_on_one_store_see_one_another():
    from servelab.contracts.kv_transfer import KVTransferContext
    from servelab.plugins.transports.torch_store import TorchStoreOptions, TorchStoreTransport
    from servelab.testing.kv_transfer import sample_handoff

    server = TorchStoreTransport(TorchStoreOptions(port=0, serve=True), KVTransferContext("producer", "p"))
    consumers = [TorchStoreTransport(TorchStoreOptions(port=server.port, serve=False, timeout_s=5),
                                     KVTransferContext("consumer", f"d{i}")) for i in range(2)]
    handoff, payloads = sample_handoff("t-remote", num_blocks=3)
    server.offer(handoff, payloads)
    taken = [c.pending() for c in consumers]
    assert sorted(len(t) for t in taken) == [0, 1]  # one consumer took it
    [received] = [t[0] for t in taken if t]
    assert received == handoff
    assert consumers[1].receive("t-remote", [2])[2].data == payloads[2].data
    consumers[0].reject("t-remote", "full")
    assert server.poll("t-remote").state is TransferState.REJECTED
    server.complete("t-remote")  # too late: a terminal state stays
    assert consumers[1].poll("t-remote").reason == "full"
    server.forget("t-remote")
    assert consumers[0].poll("t-remote").state is TransferState.UNKNOWN
    with pytest.raises(Exception, match="offered before"):
        consumers[0].offer(handoff, payloads)


# ---------------------------------------------------------------- seeded faulty transports


class DuplicatingTransport(InProcessTransport):
    """Accepts a second offer of a transfer id (overwriting the first)."""

    def offer(self, handoff, payloads):
        self._seen.discard(handoff.transfer_id)
        super().offer(handoff, payloads)


class TakenTwiceTransport(InProcessTransport):
    """Hands out every open handoff on every call."""

    def pending(self):
        return [t.handoff for t in self._transfers.values()]


class LeakyTransport(InProcessTransport):
    """Forgets completions and reports leases that never lapse: the producer holds forever."""

    def complete(self, transfer_id):
        pass

    def poll(self, transfer_id):
        status = super().poll(transfer_id)
        return attrs.evolve(status, lease_deadline=math.inf) if status.state is not TransferState.UNKNOWN else status


class StuckTransport(InProcessTransport):
    """Never reports a payload ready, and keeps its leases alive: consumers wait forever."""

    def poll(self, transfer_id):
        status = super().poll(transfer_id)
        if status.state is TransferState.READY:
            return TransferStatus(TransferState.OFFERED, math.inf)
        return status


class ResealingTransport(InProcessTransport):
    """Delivers another transfer's block bytes, with checksums forged for this transfer."""

    def receive(self, transfer_id, indices):
        received = super().receive(transfer_id, indices)
        others = [t for tid, t in self._transfers.items() if tid != transfer_id and t.payloads]
        if not others:
            return received
        donor = next(iter(others[0].payloads.values()))
        return {i: BlockPayload.of(transfer_id, i, donor.data) for i in received}


def contract_for(transport_class):
    class Contract(TransportContract):
        factory = transport_class

    contract = Contract()
    contract._factory, contract._options = transport_class, None
    return contract


def test_a_duplicating_transport_breaks_unique_ids():
    with pytest.raises(ContractViolation, match=re.escape(UNIQUE_IDS)):
        contract_for(DuplicatingTransport).test_a_transfer_id_is_offered_once()


def test_a_transport_handing_out_twice_breaks_taken_once():
    with pytest.raises(ContractViolation, match=re.escape(TAKEN_ONCE)):
        contract_for(TakenTwiceTransport).test_each_handoff_is_taken_once()


@pytest.mark.parametrize(("transport", "invariant"), [(LeakyTransport, LEAK), (StuckTransport, BOUNDED),
                                                      (ResealingTransport, IDENTITY)])
def test_seeded_faulty_transports_are_caught(transport, invariant, servelab_tiny_checkpoint):
    reference = colocated_reference(servelab_tiny_checkpoint)
    result = run_scenario(lambda context: transport(None, context), servelab_tiny_checkpoint, "none")
    with pytest.raises(ContractViolation, match=re.escape(invariant)):
        check_invariants(result, reference)


def test_an_answer_for_another_prompt_breaks_delivery(servelab_tiny_checkpoint):
    reference = colocated_reference(servelab_tiny_checkpoint)
    result = run_scenario(lambda context: InProcessTransport(None, context), servelab_tiny_checkpoint, "none")
    check_invariants(result, reference)  # the clean run holds every invariant
    swapped = dict(result.outputs)
    swapped[0], swapped[1] = result.outputs[1], result.outputs[0]
    with pytest.raises(ContractViolation, match=re.escape(DELIVERY)):
        check_invariants(attrs.evolve(result, outputs=swapped), reference)


def test_the_workload_exercises_a_shared_prefix_and_a_sub_block_prompt():
    assert WORKLOAD[0].prompt_token_ids[:12] == WORKLOAD[1].prompt_token_ids[:12]
    assert len(WORKLOAD[2].prompt_token_ids) < 4 and WORKLOAD[1].seed is not None
    assert ScenarioResult.__attrs_attrs__  # a record the suite's users may read


CONSUMER_PROCESS = """
import sys, time
from servelab.contracts.kv_transfer import KVTransferContext
kind, where = sys.argv[1], sys.argv[2]
if kind == "shared-files":
    from servelab.plugins.transports.shared_files import SharedFilesOptions, SharedFilesTransport
    transport = SharedFilesTransport(SharedFilesOptions(path=where), KVTransferContext("consumer", "d"))
else:
    from servelab.plugins.transports.torch_store import TorchStoreOptions, TorchStoreTransport
    transport = TorchStoreTransport(TorchStoreOptions(port=int(where), serve=False, timeout_s=20),
                                    KVTransferContext("consumer", "d"))
deadline = time.monotonic() + 20
taken = []
while not taken and time.monotonic() < deadline:
    taken = transport.pending()
    time.sleep(0.02)
[handoff] = taken
payloads = transport.receive(handoff.transfer_id, range(handoff.num_blocks))
for payload in payloads.values():
    payload.verify(handoff.transfer_id, handoff.layout.block_bytes)
transport.complete(handoff.transfer_id)
print(handoff.transfer_id, handoff.first_token_id, sum(len(p.data) for p in payloads.values()))
"""


@pytest.mark.parametrize("kind", ["shared-files", "torch-store"])
def test_a_handoff_crosses_to_another_process(kind, tmp_path):
    import subprocess
    import sys

    from servelab.contracts.kv_transfer import KVTransferContext
    from servelab.plugins.transports.torch_store import TorchStoreOptions, TorchStoreTransport
    from servelab.testing.kv_transfer import sample_handoff

    if kind == "shared-files":
        where = str(tmp_path / "kv")
        producer = SharedFilesTransport(SharedFilesOptions(path=where), KVTransferContext("producer", "p"))
    else:
        producer = TorchStoreTransport(TorchStoreOptions(port=0, serve=True), KVTransferContext("producer", "p"))
        where = str(producer.port)
    handoff, payloads = sample_handoff("t-cross", num_blocks=3)
    producer.offer(handoff, payloads)
    result = subprocess.run([sys.executable, "-c", CONSUMER_PROCESS, kind, where], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["t-cross", "7", str(3 * handoff.layout.block_bytes)]
    assert producer.poll("t-cross").state is TransferState.LOADED
    producer.forget("t-cross")
    assert producer.poll("t-cross").state is TransferState.UNKNOWN


def test_shared_files_sweeps_the_folders_of_transfers_a_dead_producer_left(tmp_path):
    """A producer that died never forgets its transfers: once one has ended and its lease
    is long past, the next offer or end by any endpoint removes its folder; an ended
    transfer still inside the grace (a live producer forgets it at its next step) stays."""
    from servelab.contracts.kv_transfer import KVTransferContext
    from servelab.plugins.transports import shared_files
    from servelab.testing.kv_transfer import ManualClock, sample_handoff

    clock = ManualClock()
    where = shared_files.SharedFilesOptions(path=str(tmp_path / "kv"))
    dead = SharedFilesTransport(where, KVTransferContext("producer", "p0", clock))
    consumer = SharedFilesTransport(where, KVTransferContext("consumer", "d", clock))
    orphan, payloads = sample_handoff("t-orphan", deadline=clock() + 5)
    dead.offer(orphan, payloads)
    consumer.complete("t-orphan")  # loaded; its producer is gone before it forgets the transfer
    clock.advance(5 + shared_files.ORPHAN_GRACE_S / 2)
    live = SharedFilesTransport(where, KVTransferContext("producer", "p1", clock))
    fresh, payloads = sample_handoff("t-fresh", deadline=clock() + 5)
    live.offer(fresh, payloads)
    assert consumer.poll("t-orphan").state is TransferState.LOADED  # inside the grace: kept
    clock.advance(shared_files.ORPHAN_GRACE_S)
    consumer.abort("t-fresh", "the client left")  # any endpoint's next end sweeps
    assert consumer.poll("t-orphan").state is TransferState.UNKNOWN
    assert [f.name for f in (tmp_path / "kv").iterdir()] == [live._folder("t-fresh").name]  # ended, not yet swept
