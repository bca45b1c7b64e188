"""The torch-store transport: handoffs, block payloads and states as keys of a
`torch.distributed.TCPStore`, the key-value store torch.distributed already runs between
machines (a process group's rendezvous). One endpoint serves the store (`serve = true`,
usually the router's host); the others connect to `host:port`.

Keys, per transfer id: `<id>/offered` (an atomic counter: the first offer gets 1, so an
id is offered once across machines), `<id>/handoff`, `<id>/block/<i>` (an 8-byte
checksum, then the block's bytes), `<id>/state` (changed by compare-and-set, so a
terminal state is never overwritten) and `<id>/taken` (a counter: the consumer that gets
1 took it). `offers/count` and `offers/<n>` list the offers in order for `pending`.
"""

from __future__ import annotations

import datetime
import json
import time
from typing import Any, Sequence as Seq

import attrs

from servelab.interfaces import (TERMINAL_STATES, BlockPayload, Handoff, KVTransferContext, TransferError,
                                 TransferState, TransferStatus)
from servelab.options import non_negative_int
from servelab.plugins.transports.shared_files import handoff_from_json, handoff_to_json


@attrs.frozen
class TorchStoreOptions:
    host: str = "127.0.0.1"
    port: int = attrs.field(default=0, validator=non_negative_int("kv_transfer"))  # 0 with serve: any free port
    serve: bool = True  # this endpoint runs the store (else it connects to host:port)
    timeout_s: int = attrs.field(default=30, validator=non_negative_int("kv_transfer"))


class TorchStoreTransport:
    """A KVTransport over a torch.distributed TCPStore."""

    def __init__(self, options: TorchStoreOptions | None = None, context: KVTransferContext | None = None) -> None:
        import torch.distributed as dist

        options = options or TorchStoreOptions()
        self.store = dist.TCPStore(options.host, options.port, None, options.serve,
                                   datetime.timedelta(seconds=options.timeout_s), wait_for_workers=False)
        self.port = self.store.port
        clock = context.clock if context is not None else None
        self.clock = clock if callable(clock) else time.time
        self._cursor = 0  # offers this endpoint has looked at (pending)

    # ------------------------------------------------------------ producer

    def offer(self, handoff: Handoff, payloads: Seq[BlockPayload]) -> None:
        transfer_id = handoff.transfer_id
        if self.store.add(f"{transfer_id}/offered", 1) != 1:
            raise TransferError(f"transfer {transfer_id!r} was offered before; transfer ids are unique")
        self.store.set(f"{transfer_id}/state", _state(TransferState.OFFERED, handoff.lease_deadline, ""))
        for payload in payloads:
            self.store.set(f"{transfer_id}/block/{payload.index}",
                           payload.checksum.to_bytes(8, "little") + payload.data)
        self.store.set(f"{transfer_id}/handoff", handoff_to_json(handoff))
        if {p.index for p in payloads} >= set(range(handoff.num_blocks)):
            self._move(transfer_id, TransferState.READY, handoff.lease_deadline, "")
        self.store.set(f"offers/{self.store.add('offers/count', 1)}", transfer_id)

    # ------------------------------------------------------------ consumer

    def pending(self) -> list[Handoff]:
        found = []
        count = self.store.add("offers/count", 0)
        while self._cursor < count:
            self._cursor += 1
            transfer_id = self.store.get(f"offers/{self._cursor}").decode()
            if self.poll(transfer_id).state in TERMINAL_STATES or not self._has(f"{transfer_id}/handoff"):
                continue
            if self.store.add(f"{transfer_id}/taken", 1) == 1:
                found.append(handoff_from_json(self.store.get(f"{transfer_id}/handoff").decode()))
        return found

    def receive(self, transfer_id: str, indices: Seq[int]) -> dict[int, BlockPayload]:
        status = self.poll(transfer_id)
        if status.state is TransferState.UNKNOWN:
            raise TransferError(f"transfer {transfer_id!r} is unknown to this transport")
        if status.state in TERMINAL_STATES:
            raise TransferError(f"transfer {transfer_id!r} has ended ({status.state.value}: {status.reason})")
        if self.clock() > status.lease_deadline:
            raise TransferError(f"transfer {transfer_id!r}: its lease lapsed")
        payloads = {}
        for index in indices:
            key = f"{transfer_id}/block/{index}"
            if not self._has(key):
                raise TransferError(f"transfer {transfer_id!r}: block {index} was never written")
            raw = self.store.get(key)
            payloads[index] = BlockPayload(index, raw[8:], int.from_bytes(raw[:8], "little"))
        return payloads

    # ------------------------------------------------------------ either side

    def poll(self, transfer_id: str) -> TransferStatus:
        key = f"{transfer_id}/state"
        if not self._has(key):
            return TransferStatus(TransferState.UNKNOWN)
        record: dict[str, Any] = json.loads(self.store.get(key))
        return TransferStatus(TransferState(record["state"]), float(record["deadline"]), record["reason"])

    def complete(self, transfer_id: str) -> None:
        self._end(transfer_id, TransferState.LOADED, "")

    def reject(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.REJECTED, reason)

    def abort(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.ABORTED, reason)

    def renew(self, transfer_id: str, lease_deadline: float) -> None:
        status = self.poll(transfer_id)
        if status.state not in TERMINAL_STATES and status.state is not TransferState.UNKNOWN:
            self._move(transfer_id, status.state, max(status.lease_deadline, lease_deadline), status.reason)

    def forget(self, transfer_id: str) -> None:
        self._drop_blocks(transfer_id)
        for key in (f"{transfer_id}/handoff", f"{transfer_id}/state"):  # `offered` stays: never offered again
            self.store.delete_key(key)

    def close(self) -> None:
        pass  # the store lives as long as the endpoint serving it

    # ------------------------------------------------------------ keys

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def _move(self, transfer_id: str, state: TransferState, deadline: float, reason: str) -> bool:
        """Compare-and-set the state from what it is now; False when another endpoint moved it first
        or it has ended."""
        key = f"{transfer_id}/state"
        current = self.store.get(key)
        if TransferState(json.loads(current)["state"]) in TERMINAL_STATES:
            return False
        desired = _state(state, deadline, reason)
        return self.store.compare_set(key, current.decode(), desired) == desired.encode()

    def _end(self, transfer_id: str, state: TransferState, reason: str) -> None:
        status = self.poll(transfer_id)
        if status.state is TransferState.UNKNOWN:
            return
        if self._move(transfer_id, state, status.lease_deadline, reason):
            self._drop_blocks(transfer_id)  # the bytes are no longer anyone's

    def _drop_blocks(self, transfer_id: str) -> None:
        if not self._has(f"{transfer_id}/handoff"):
            return
        handoff = handoff_from_json(self.store.get(f"{transfer_id}/handoff").decode())
        for index in range(handoff.num_blocks):
            self.store.delete_key(f"{transfer_id}/block/{index}")


def _state(state: TransferState, deadline: float, reason: str) -> str:
    return json.dumps({"state": state.value, "deadline": deadline, "reason": reason})
