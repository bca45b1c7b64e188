"""Adapter-affinity routing: send a request naming a LoRA adapter to a replica that holds
that adapter in its fast pool (`ReplicaSnapshot.resident_adapters`), so it runs without an
adapter load, unless that replica is overloaded, in which case balance load instead.
Requests of the base model, and adapters no replica holds, go to the least-loaded replica.
"""

from __future__ import annotations

from typing import Sequence

import attrs

from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext
from servelab.options import non_negative_int
from servelab.plugins.routers.least_loaded import least_loaded


@attrs.frozen
class AdapterAffinityOptions:
    # Go to the least-loaded replica holding the adapter only while its queued + running
    # tokens exceed the least-loaded replica's by at most this many.
    load_margin_tokens: int = attrs.field(default=16384, validator=non_negative_int("router"))


class AdapterAffinityRouter:
    def __init__(self, options: AdapterAffinityOptions, context: RouterContext) -> None:
        self.options = options

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaSnapshot]) -> int:
        lightest = least_loaded(replicas)
        holding = [r for r in replicas if request.adapter is not None and request.adapter in r.resident_adapters]
        if not holding:
            return lightest.replica_id
        best = least_loaded(holding)
        if best.load_tokens - lightest.load_tokens > self.options.load_margin_tokens:
            return lightest.replica_id
        return best.replica_id
