"""The in-process transport: producer and consumer engines in one process share one table."""

from __future__ import annotations

import time
from typing import Any, Sequence as Seq

import attrs

from servelab.interfaces import (TERMINAL_STATES, BlockPayload, Handoff, KVTransferContext, TransferError,
                                 TransferState, TransferStatus)


@attrs.define
class _Transfer:
    handoff: Handoff
    payloads: dict[int, BlockPayload]
    state: TransferState
    lease_deadline: float
    reason: str = ""
    taken: bool = False


class InProcessTransport:
    """Handoffs and block payloads in a dict, keyed by the router's transfer id."""

    def __init__(self, options: Any = None, context: KVTransferContext | None = None) -> None:
        clock = context.clock if context is not None else None
        self.clock = clock if callable(clock) else time.time
        self._transfers: dict[str, _Transfer] = {}
        self._seen: set[str] = set()  # every id ever offered: an id is never reused

    def offer(self, handoff: Handoff, payloads: Seq[BlockPayload]) -> None:
        if handoff.transfer_id in self._seen:
            raise TransferError(f"transfer {handoff.transfer_id!r} was offered before; transfer ids are unique")
        self._seen.add(handoff.transfer_id)
        by_index = {p.index: p for p in payloads}
        ready = set(by_index) >= set(range(handoff.num_blocks))
        self._transfers[handoff.transfer_id] = _Transfer(
            handoff, by_index, TransferState.READY if ready else TransferState.OFFERED, handoff.lease_deadline)

    def pending(self) -> list[Handoff]:
        taken = []
        for transfer in self._transfers.values():
            if not transfer.taken and transfer.state not in TERMINAL_STATES:
                transfer.taken = True
                taken.append(transfer.handoff)
        return taken

    def receive(self, transfer_id: str, indices: Seq[int]) -> dict[int, BlockPayload]:
        transfer = self._live(transfer_id)
        missing = [i for i in indices if i not in transfer.payloads]
        if missing:
            raise TransferError(f"transfer {transfer_id!r}: blocks {missing} were never written")
        return {i: transfer.payloads[i] for i in indices}

    def poll(self, transfer_id: str) -> TransferStatus:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            return TransferStatus(TransferState.UNKNOWN)
        return TransferStatus(transfer.state, transfer.lease_deadline, transfer.reason)

    def complete(self, transfer_id: str) -> None:
        self._end(transfer_id, TransferState.LOADED, "")

    def reject(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.REJECTED, reason)

    def abort(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.ABORTED, reason)

    def renew(self, transfer_id: str, lease_deadline: float) -> None:
        transfer = self._transfers.get(transfer_id)
        if transfer is not None and transfer.state not in TERMINAL_STATES:
            transfer.lease_deadline = max(transfer.lease_deadline, lease_deadline)

    def forget(self, transfer_id: str) -> None:
        self._transfers.pop(transfer_id, None)

    def close(self) -> None:
        self._transfers.clear()

    def _live(self, transfer_id: str) -> _Transfer:
        transfer = self._transfers.get(transfer_id)
        if transfer is None:
            raise TransferError(f"transfer {transfer_id!r} is unknown to this transport")
        if transfer.state in TERMINAL_STATES:
            raise TransferError(f"transfer {transfer_id!r} has ended ({transfer.state.value}: {transfer.reason})")
        if self.clock() > transfer.lease_deadline:
            raise TransferError(f"transfer {transfer_id!r}: its lease lapsed")
        return transfer

    def _end(self, transfer_id: str, state: TransferState, reason: str) -> None:
        transfer = self._transfers.get(transfer_id)
        if transfer is not None and transfer.state not in TERMINAL_STATES:
            transfer.state, transfer.reason = state, reason
            transfer.payloads.clear()  # the bytes are no longer anyone's
