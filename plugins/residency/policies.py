"""The built-in adapter residency policies besides `lru` (servelab.kit.residency): each is
one sort key over `servelab.contracts.adapter_residency.ResidentAdapter`, lowest evicted
first (SGLang's eviction strategies have the same shape)."""

from __future__ import annotations

from typing import Any

from servelab.interfaces import ResidencyContext, ResidentAdapter
from servelab.kit import KeyedResidency
from servelab.plugins.residency.options import PinnedOptions


class LeastFrequentlyUsedAdapter(KeyedResidency):
    """Fewest steps run first, then least recently used."""

    def key(self, candidate: ResidentAdapter) -> Any:
        return (candidate.uses, candidate.last_used, candidate.lora_id)


class PinnedAdapters(KeyedResidency):
    """Least recently used among the adapters not pinned; pinned ones go last."""

    def __init__(self, options: PinnedOptions | None = None, context: ResidencyContext | None = None) -> None:
        super().__init__(options, context)
        self.pinned = frozenset((options or PinnedOptions()).pinned)

    def key(self, candidate: ResidentAdapter) -> Any:
        return (candidate.name in self.pinned, candidate.last_used, candidate.lora_id)


class QueueAware(KeyedResidency):
    """S-LoRA's rule: keep what the waiting queue needs. Adapters no waiting sequence runs
    with go first (least recently used first), then those the fewest wait for."""

    def key(self, candidate: ResidentAdapter) -> Any:
        return (candidate.num_waiting, candidate.last_used, candidate.lora_id)
