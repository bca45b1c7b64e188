"""The chunked-prefill scheduler is the kit's (`servelab.kit.ChunkedPrefillScheduler`)."""

from servelab.kit import ChunkedPrefillScheduler

__all__ = ["ChunkedPrefillScheduler"]
