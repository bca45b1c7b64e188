"""Counters of a disaggregated deployment, per role (prefill, decode)."""

from __future__ import annotations

import attrs


@attrs.define
class TransferMetrics:
    """One role's transfer counters (a producer's or a consumer's)."""

    role: str
    transfers: int = 0  # handoffs offered (producer) or loaded (consumer)
    bytes: int = 0  # block bytes saved (producer) or loaded (consumer)
    blocks_skipped: int = 0  # consumer: blocks its own prefix cache already held
    transfer_seconds: float = 0.0  # time in the data path and transport
    leases_expired: int = 0  # producer: holds freed because the lease lapsed
    rejects: int = 0  # consumer: handoffs rejected before admission
    recomputes: int = 0  # consumer: requests whose KV was computed again (failure policy "recompute")
    failures: int = 0  # requests ended with an error by the failure policy "fail"
    held_blocks: int = 0  # producer: blocks held for consumers right now

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in attrs.asdict(self).items() if k != "role"}
