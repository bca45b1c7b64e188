"""Cache-aware routing (SGLang's router): send a request where the longest prefix of its
prompt is already cached, so its prefill is mostly a cache hit, unless that replica is
overloaded, in which case balance load instead.

Where a replica reports its cache (`ReplicaSnapshot.prefix_summary`) the router reads
it. Otherwise it keeps its own approximate view, as SGLang's does: per replica, the
chained block hashes of the prompts it sent there, least recently routed dropped first
once the view holds as many blocks as the replica's KV pool."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import attrs

from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext, prefix_block_hashes
from servelab.options import non_negative_int
from servelab.plugins.routers.least_loaded import least_loaded


_non_negative = non_negative_int("router")


@attrs.frozen
class PrefixAffinityOptions:
    # Go to the best-cached replica only while its queued + running tokens exceed the
    # least-loaded replica's by at most this many (SGLang: balance_abs_threshold).
    load_margin_tokens: int = attrs.field(default=16384, validator=_non_negative)
    # Below this many cached tokens a match does not count: route by load.
    min_match_tokens: int = attrs.field(default=1, validator=_non_negative)
    # Blocks the approximate view keeps per replica (0: the replica's KV pool size, else 65536).
    max_tracked_blocks: int = attrs.field(default=0, validator=_non_negative)


class PrefixAffinityRouter:
    def __init__(self, options: PrefixAffinityOptions, context: RouterContext) -> None:
        self.options = options
        self.block_size = context.block_size
        self.capacity = options.max_tracked_blocks or context.num_kv_blocks or 65536
        self.views: dict[int, OrderedDict[int, None]] = {}  # replica id -> block hashes, oldest first

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaSnapshot]) -> int:
        hashes = prefix_block_hashes(request.prompt_token_ids, self.block_size, request.lora_id)
        live = {r.replica_id for r in replicas}
        for gone in [i for i in self.views if i not in live]:
            del self.views[gone]  # a replica that left took its cache with it
        lightest = least_loaded(replicas)
        matched = {r.replica_id: self._cached_tokens(r, hashes) for r in replicas}
        best = min(replicas, key=lambda r: (-matched[r.replica_id], r.load_tokens, r.replica_id))
        chosen = lightest
        if (matched[best.replica_id] >= max(1, self.options.min_match_tokens)
                and best.load_tokens - lightest.load_tokens <= self.options.load_margin_tokens):
            chosen = best
        self._remember(chosen.replica_id, hashes)
        return chosen.replica_id

    def _cached_tokens(self, replica: ReplicaSnapshot, hashes: list[int]) -> int:
        if replica.prefix_summary is not None and replica.prefix_summary.block_size == self.block_size:
            view = replica.prefix_summary.block_hashes
        else:
            view = self.views.get(replica.replica_id, {})
        num_blocks = 0
        for block_hash in hashes:
            if block_hash not in view:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def _remember(self, replica_id: int, hashes: list[int]) -> None:
        view = self.views.setdefault(replica_id, OrderedDict())
        for block_hash in reversed(hashes):  # a prefix's deeper blocks age first, as a radix cache evicts leaves
            view[block_hash] = None
            view.move_to_end(block_hash)
        while len(view) > self.capacity:
            view.popitem(last=False)
