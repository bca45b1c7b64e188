"""The shared-files transport: processes on one machine meet in a directory (on tmpfs,
such as /dev/shm, the bytes never leave memory).

One folder per transfer, named by a digest of the router's transfer id:
`handoff.json`, `block-<i>.bin` (an 8-byte checksum, then the block's bytes) and
`state.json` (state, lease deadline, reason). Every file is written to a temporary name
and renamed into place, so a reader sees a whole file or none; a consumer claims a
handoff by creating `taken` exclusively, so each is taken once across processes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence as Seq

import attrs

from servelab.interfaces import (TERMINAL_STATES, BlockPayload, Handoff, KVLayout, KVTransferContext, TransferError,
                                 TransferState, TransferStatus)


# A transfer that ended this long past its lease deadline and is still in the directory
# lost its producer (a live one forgets each ended transfer at its next step): its folder
# is removed by whichever endpoint sweeps next.
ORPHAN_GRACE_S = 60.0
SWEEP_INTERVAL_S = 10.0


@attrs.frozen
class SharedFilesOptions:
    # The meeting directory; empty: a folder under /dev/shm (else the temp dir) named "servelab-kv".
    path: str = ""


def default_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, "servelab-kv")


def handoff_to_json(handoff: Handoff) -> str:
    record = attrs.asdict(handoff)
    record["sampler_state"] = (base64.b64encode(handoff.sampler_state).decode()
                               if handoff.sampler_state is not None else None)
    return json.dumps(record)


def handoff_from_json(text: str) -> Handoff:
    record = json.loads(text)
    layout = record.pop("layout")
    layout = KVLayout(**{**layout, "layer_range": tuple(layout["layer_range"]),
                         "block_shape": tuple(layout["block_shape"]),
                         "tp_rank_map": tuple(tuple(r) for r in layout["tp_rank_map"])})
    state = record.pop("sampler_state")
    return Handoff(**{**record, "layout": layout, "prompt_token_ids": tuple(record["prompt_token_ids"]),
                      "block_hashes": tuple(record["block_hashes"])},
                   sampler_state=base64.b64decode(state) if state is not None else None)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class SharedFilesTransport:
    """Handoffs, block payloads and states as files in one directory."""

    def __init__(self, options: SharedFilesOptions | None = None, context: KVTransferContext | None = None) -> None:
        self.root = Path((options.path if options is not None else "") or default_path())
        self.root.mkdir(parents=True, exist_ok=True)
        clock = context.clock if context is not None else None
        self.clock = clock if callable(clock) else time.time
        self._next_sweep = self.clock()

    # ------------------------------------------------------------ producer

    def offer(self, handoff: Handoff, payloads: Seq[BlockPayload]) -> None:
        self._sweep_orphans()
        folder = self._folder(handoff.transfer_id)
        try:
            folder.mkdir()
        except FileExistsError:
            raise TransferError(f"transfer {handoff.transfer_id!r} was offered before; transfer ids are unique") \
                from None
        self._write_state(folder, TransferState.OFFERED, handoff.lease_deadline, "")
        for payload in payloads:
            _write_atomic(folder / f"block-{payload.index}.bin", payload.checksum.to_bytes(8, "little") + payload.data)
        _write_atomic(folder / "handoff.json", handoff_to_json(handoff).encode())
        written = {p.index for p in payloads}
        if written >= set(range(handoff.num_blocks)):
            self._write_state(folder, TransferState.READY, handoff.lease_deadline, "")

    # ------------------------------------------------------------ consumer

    def pending(self) -> list[Handoff]:
        found = []
        for folder in sorted(self.root.iterdir()) if self.root.is_dir() else ():
            if not (folder / "handoff.json").is_file() or (folder / "taken").exists():
                continue
            status = self._read_state(folder)
            if status.state in TERMINAL_STATES:
                continue
            try:
                os.close(os.open(folder / "taken", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except (FileExistsError, FileNotFoundError):
                continue  # another consumer took it, or the producer forgot it
            try:
                found.append(handoff_from_json((folder / "handoff.json").read_text()))
            except (OSError, ValueError, TypeError) as exc:
                self._write_state(folder, TransferState.ABORTED, status.lease_deadline, f"unreadable handoff: {exc}")
        return found

    def receive(self, transfer_id: str, indices: Seq[int]) -> dict[int, BlockPayload]:
        folder = self._folder(transfer_id)
        status = self.poll(transfer_id)
        if status.state is TransferState.UNKNOWN:
            raise TransferError(f"transfer {transfer_id!r} is unknown to this transport")
        if status.state in TERMINAL_STATES:
            raise TransferError(f"transfer {transfer_id!r} has ended ({status.state.value}: {status.reason})")
        if self.clock() > status.lease_deadline:
            raise TransferError(f"transfer {transfer_id!r}: its lease lapsed")
        payloads = {}
        for index in indices:
            try:
                raw = (folder / f"block-{index}.bin").read_bytes()
            except FileNotFoundError:
                raise TransferError(f"transfer {transfer_id!r}: block {index} was never written") from None
            payloads[index] = BlockPayload(index, raw[8:], int.from_bytes(raw[:8], "little"))
        return payloads

    # ------------------------------------------------------------ either side

    def poll(self, transfer_id: str) -> TransferStatus:
        folder = self._folder(transfer_id)
        if not folder.is_dir():
            return TransferStatus(TransferState.UNKNOWN)
        return self._read_state(folder)

    def complete(self, transfer_id: str) -> None:
        self._end(transfer_id, TransferState.LOADED, "")

    def reject(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.REJECTED, reason)

    def abort(self, transfer_id: str, reason: str) -> None:
        self._end(transfer_id, TransferState.ABORTED, reason)

    def renew(self, transfer_id: str, lease_deadline: float) -> None:
        status = self.poll(transfer_id)
        if status.state not in TERMINAL_STATES and status.state is not TransferState.UNKNOWN:
            self._write_state(self._folder(transfer_id), status.state, max(status.lease_deadline, lease_deadline),
                              status.reason)

    def forget(self, transfer_id: str) -> None:
        shutil.rmtree(self._folder(transfer_id), ignore_errors=True)

    def close(self) -> None:
        pass  # the directory is shared: each producer forgets its own transfers

    # ------------------------------------------------------------ files

    def _folder(self, transfer_id: str) -> Path:
        return self.root / hashlib.sha256(transfer_id.encode()).hexdigest()[:32]

    def _sweep_orphans(self) -> None:
        """Remove the folders of transfers that ended more than ORPHAN_GRACE_S past their
        lease (their producer died before forgetting them); at most every SWEEP_INTERVAL_S."""
        now = self.clock()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_INTERVAL_S
        for folder in list(self.root.iterdir()) if self.root.is_dir() else ():
            status = self._read_state(folder)
            if status.state in TERMINAL_STATES and now > status.lease_deadline + ORPHAN_GRACE_S:
                shutil.rmtree(folder, ignore_errors=True)

    def _end(self, transfer_id: str, state: TransferState, reason: str) -> None:
        self._sweep_orphans()
        status = self.poll(transfer_id)
        if status.state in TERMINAL_STATES or status.state is TransferState.UNKNOWN:
            return
        folder = self._folder(transfer_id)
        self._write_state(folder, state, status.lease_deadline, reason)
        try:
            for block in folder.glob("block-*.bin"):  # the bytes are no longer anyone's
                block.unlink(missing_ok=True)
        except FileNotFoundError:
            pass  # the producer forgot the transfer meanwhile (its folder is gone, blocks and all)

    @staticmethod
    def _write_state(folder: Path, state: TransferState, deadline: float, reason: str) -> None:
        try:
            _write_atomic(folder / "state.json",
                          json.dumps({"state": state.value, "deadline": deadline, "reason": reason}).encode())
        except FileNotFoundError:
            pass  # the producer forgot the transfer meanwhile

    @staticmethod
    def _read_state(folder: Path) -> TransferStatus:
        try:
            record: dict[str, Any] = json.loads((folder / "state.json").read_text())
        except (FileNotFoundError, ValueError):
            return TransferStatus(TransferState.UNKNOWN)
        return TransferStatus(TransferState(record["state"]), float(record["deadline"]), record["reason"])
