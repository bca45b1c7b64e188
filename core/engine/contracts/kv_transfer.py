"""The KV-transfer contract (kind `kv_transfers`, `[kv_transfer]`): how a request's KV
cache moves from the engine that ran its prefill (the producer) to the engine that
decodes it (the consumer). Changes by version: docs/contract-versions.md ("kv_transfers").

Three parts, each small:

- the *handoff record* (`Handoff`): what the producer hands on for one request, keyed by
  a global transfer id the router mints once (never an engine-local request id);
- the *data path* (`KVDataPath`): a request's blocks out of one paged pool as bytes, and
  into another, for every KV dtype the pool holds (an int8/FP8 block carries its scales
  inline, at the end of each (token, KV head) row, so a block's bytes are complete);
- the *transport* (`KVTransport`, what a `[kv_transfer]` plugin builds): offer a handoff
  with its block payloads, receive them, poll a transfer's state, complete, reject,
  abort, and renew its lease.

The scheduler side (`ProducerScheduler`, `ConsumerScheduler`) is what the producer and
consumer roles of `servelab.disagg` state: how many of a request's tokens a remote producer holds, what to
do once local blocks are allocated for them, and on finish whether to hold the blocks
for a consumer under a lease.
"""

from __future__ import annotations

import enum
import zlib
from typing import Protocol, Sequence as Seq, runtime_checkable

import attrs

__all__ = [
    "KV_TRANSFER_VERSION",
    "TransferState",
    "TERMINAL_STATES",
    "KVLayout",
    "Handoff",
    "BlockPayload",
    "TransferStatus",
    "KVTransferContext",
    "KVTransport",
    "KVDataPath",
    "ProducerScheduler",
    "ConsumerScheduler",
    "TransferError",
    "block_checksum",
]

KV_TRANSFER_VERSION = 1


class TransferState(enum.Enum):
    """Where one transfer stands. A producer frees its held blocks on every terminal state
    and when the lease lapses, whichever comes first."""

    UNKNOWN = "unknown"  # the transport has never seen this transfer id
    OFFERED = "offered"  # the handoff is published; block payloads may still be arriving
    READY = "ready"  # every block payload is written
    LOADED = "loaded"  # terminal: the consumer loaded what it needed
    REJECTED = "rejected"  # terminal: the consumer will not take it
    ABORTED = "aborted"  # terminal: either side gave up (client abort, crash, lapsed lease)


TERMINAL_STATES = frozenset({TransferState.LOADED, TransferState.REJECTED, TransferState.ABORTED})


class TransferError(RuntimeError):
    """A transfer cannot be completed (missing or corrupt payload, wrong request, lapsed lease)."""


@attrs.frozen
class KVLayout:
    """How the producer's pool lays out a block: a consumer loads only a matching layout."""

    block_size: int  # token slots per block
    kv_cache_dtype: str  # "auto" (the model dtype) or a quantized format: int8, fp8_e4m3, fp8_e5m2
    storage_dtype: str  # the cache tensor's element type, e.g. "torch.bfloat16", "torch.uint8"
    scales: str  # "none", or "inline-row": a float scale at the end of each (token, KV head) row
    layer_range: tuple[int, int]  # [first, last) decoder layers the payload holds
    block_shape: tuple[int, ...]  # one layer's K (or V) block, in the cache's own dimension order
    # Tensor-parallel rank -> KV heads [first, last) it holds; one rank: ((0, num_kv_heads),)
    tp_rank_map: tuple[tuple[int, int], ...] = ((0, 0),)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the layer range, K and V."""
        elements = 1
        for size in self.block_shape:
            elements *= size
        return elements * _element_bytes(self.storage_dtype) * 2 * (self.layer_range[1] - self.layer_range[0])


def _element_bytes(storage_dtype: str) -> int:
    name = storage_dtype.removeprefix("torch.")
    if name in ("uint8", "int8") or name.startswith("float8"):
        return 1
    if name in ("bfloat16", "float16"):
        return 2
    if name == "float32":
        return 4
    raise ValueError(f"KV storage dtype {storage_dtype!r} has no known element size")


@attrs.frozen
class Handoff:
    """One request's handoff from producer to consumer (what the producer hands on).

    `transfer_id` is minted once by the router for the request and names the transfer
    on both sides and in the transport: an engine's own request ids never do.
    `block_hashes` are the chained hashes (`servelab.contracts.router.prefix_block_hashes`)
    of the full prompt blocks the producer holds, so a consumer loads only the blocks its
    own prefix cache lacks and checks that the payload belongs to its request.
    `sampler_state`: the request's seeded generator after the first token (None unseeded),
    so a seeded request samples on exactly as on one engine.
    """

    transfer_id: str
    producer: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    num_tokens: int  # tokens whose K/V the producer holds (the prompt)
    layout: KVLayout
    lease_deadline: float  # the producer frees the blocks after this time (the transport's clock)
    first_token_id: int
    sampler_state: bytes | None = None
    version: int = KV_TRANSFER_VERSION

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def block_checksum(transfer_id: str, index: int, data: bytes) -> int:
    """CRC-32 of a block's bytes, seeded by its transfer and position: a payload written
    for another transfer or block fails the check."""
    return zlib.crc32(data, zlib.crc32(f"{transfer_id}/{index}".encode()))


@attrs.frozen
class BlockPayload:
    """The bytes of one block (every layer of the layout's range, K then V), with its check."""

    index: int  # the block's position in the request (0: the first prompt block)
    data: bytes
    checksum: int

    @classmethod
    def of(cls, transfer_id: str, index: int, data: bytes) -> "BlockPayload":
        return cls(index, data, block_checksum(transfer_id, index, data))

    def verify(self, transfer_id: str, expected_bytes: int) -> None:
        if len(self.data) != expected_bytes:
            raise TransferError(f"transfer {transfer_id!r} block {self.index}: {len(self.data)} bytes, "
                                f"expected {expected_bytes} (a partial write)")
        if block_checksum(transfer_id, self.index, self.data) != self.checksum:
            raise TransferError(f"transfer {transfer_id!r} block {self.index}: checksum mismatch "
                                f"(corrupt, or written for another transfer)")


@attrs.frozen
class TransferStatus:
    """`KVTransport.poll`'s answer."""

    state: TransferState
    lease_deadline: float = 0.0  # latest deadline (renewals included); 0 for an unknown transfer
    reason: str = ""  # why it was rejected or aborted


@attrs.frozen
class KVTransferContext:
    """What a transport factory receives."""

    role: str  # "producer", "consumer" or "both" (one process holding both ends)
    name: str  # this endpoint's name (the producer named in its handoffs)
    clock: object = None  # callable -> seconds; None: time.time (shared by processes on one machine)


@runtime_checkable
class KVTransport(Protocol):
    """Moves handoffs and their block payloads between engines.

    Every call returns promptly (no call waits for the other side). A transfer id is
    unique for the transport's life: a second `offer` of an id is refused. A transport
    never hands a payload of one transfer to another (`receive` takes the transfer id
    and returns that transfer's payloads or raises TransferError).
    """

    def offer(self, handoff: Handoff, payloads: Seq[BlockPayload]) -> None:
        """Producer: publish `handoff` and its block payloads (the state becomes READY
        once every payload is written)."""

    def pending(self) -> list[Handoff]:
        """Consumer: handoffs offered and not yet taken (each returned once)."""

    def receive(self, transfer_id: str, indices: Seq[int]) -> dict[int, BlockPayload]:
        """Consumer: the payloads of the blocks `indices` of a READY transfer; TransferError
        when any is missing or the transfer is unknown or ended."""

    def poll(self, transfer_id: str) -> TransferStatus:
        """Either side: the transfer's state and lease."""

    def complete(self, transfer_id: str) -> None:
        """Consumer: loaded; the producer may free its blocks."""

    def reject(self, transfer_id: str, reason: str) -> None:
        """Consumer: will not take it (before admitting it); the producer frees at once."""

    def abort(self, transfer_id: str, reason: str) -> None:
        """Either side: give the transfer up; terminal."""

    def renew(self, transfer_id: str, lease_deadline: float) -> None:
        """Either side: move the lease deadline (a heartbeat); ignored once terminal."""

    def forget(self, transfer_id: str) -> None:
        """Producer, after freeing on a terminal state: drop what the transport kept."""

    def close(self) -> None:
        """Release the transport's resources (idempotent)."""


@runtime_checkable
class KVDataPath(Protocol):
    """A paged pool's blocks as bytes, out and in (the runner's tensors; any KV dtype)."""

    def layout(self) -> KVLayout:
        """This pool's layout."""

    def save(self, blocks: Seq[int]) -> list[bytes]:
        """The bytes of each physical block in `blocks` (every layer, K then V)."""

    def load(self, blocks: Seq[int], data: Seq[bytes]) -> None:
        """Write each payload into its physical block (the inverse of `save`)."""


@runtime_checkable
class ProducerScheduler(Protocol):
    """The scheduler side of a producer (servelab.disagg.producer.PrefillWorker states it)."""

    def hold_on_finish(self, transfer_id: str, prompt_token_ids: Seq[int], first_token_id: int,
                       sampler_state: bytes | None) -> tuple[Handoff, list[BlockPayload]]:
        """The request's prefill finished with `first_token_id`: hold its blocks under a
        lease; the handoff to pass on and its block payloads (none for a prompt shorter
        than a block: nothing is held)."""


@runtime_checkable
class ConsumerScheduler(Protocol):
    """The scheduler side of a consumer (servelab.disagg.consumer.DecodeWorker states it)."""

    def remote_tokens(self, handoff: Handoff) -> int | None:
        """Tokens of the request the producer holds and this engine's prefix cache lacks
        (None: ask again later, the payload is not ready)."""

    def blocks_allocated(self, handoff: Handoff, indices: Seq[int], blocks: Seq[int]) -> None:
        """Local blocks are allocated for the remote tokens: load the handoff's blocks
        `indices` into the physical `blocks` (TransferError when they cannot be)."""


def layout_mismatch(ours: KVLayout, theirs: KVLayout) -> str | None:
    """Why a payload of layout `theirs` cannot load into a pool of layout `ours`, or None."""
    pairs = (("block_size", ours.block_size, theirs.block_size),
             ("kv_cache_dtype", ours.kv_cache_dtype, theirs.kv_cache_dtype),
             ("storage_dtype", ours.storage_dtype, theirs.storage_dtype), ("scales", ours.scales, theirs.scales),
             ("layer_range", ours.layer_range, theirs.layer_range),
             ("block_shape", ours.block_shape, theirs.block_shape))
    for field, mine, other in pairs:
        if mine != other:
            return f"{field} {other!r} differs from this pool's {mine!r}"
    return None


__all__.append("layout_mismatch")


def payload_indices(handoff: Handoff, cached_blocks: int) -> list[int]:
    """The block positions a consumer holding the first `cached_blocks` still needs."""
    return list(range(min(cached_blocks, handoff.num_blocks), handoff.num_blocks))


__all__.append("payload_indices")


def lease_state(status: TransferStatus, now: float) -> TransferState:
    """`status.state`, or ABORTED once its lease lapsed before it ended."""
    if status.state in TERMINAL_STATES or status.state is TransferState.UNKNOWN:
        return status.state
    return TransferState.ABORTED if now > status.lease_deadline else status.state


__all__.append("lease_state")


def check_handoff(handoff: Handoff, prompt_token_ids: Seq[int], block_hashes: Seq[int]) -> None:
    """TransferError unless `handoff` is for this prompt (its hashes match `block_hashes`,
    the consumer's own hashes of the prompt's full blocks)."""
    if handoff.version > KV_TRANSFER_VERSION:
        raise TransferError(f"transfer {handoff.transfer_id!r}: handoff version {handoff.version} is newer than "
                            f"this servelab's KV-transfer contract (version {KV_TRANSFER_VERSION})")
    if tuple(prompt_token_ids) != handoff.prompt_token_ids or tuple(block_hashes) != handoff.block_hashes:
        raise TransferError(f"transfer {handoff.transfer_id!r} carries the KV of another prompt "
                            f"(its block hashes do not match this request's)")


__all__.append("check_handoff")
