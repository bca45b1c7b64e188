"""The P/D router: each request to a prefill engine, then its handoff to a decode engine.
Both choices are router policies (the `routers` kind): by default the least-loaded
prefill engine, and the decode engine whose prefix cache already holds most of the
prompt (`prefix-affinity`, reading each decode engine's reported prefix summary), so
the fewest blocks move."""

from __future__ import annotations

import uuid
from typing import Any, Sequence as Seq

from servelab.config import PolicySection, build_options
from servelab.interfaces import ReplicaSnapshot, RouteRequest, Router, RouterContext
from servelab.plugin_types import KINDS
from servelab.registry import PluginRegistry, build_policy
from servelab.routing import checked_route, reported_prefix_summary, replica_snapshot

DEFAULT_PREFILL_ROUTER = "least-loaded"
DEFAULT_DECODE_ROUTER = "prefix-affinity"


def mint_transfer_id() -> str:
    """A global transfer id, minted once per request by the router (never an engine's id)."""
    return f"xfer-{uuid.uuid4().hex}"


def _build(registry: PluginRegistry, section: PolicySection, context: RouterContext) -> Router:
    registered = registry.select("routers", section.name)
    options = build_options(registered.plugin.options, section.options, KINDS["routers"].section, section.name)
    return build_policy(registered, options, context)


class PDRouter:
    """Prefill then decode, each chosen by a router policy over its role's engines."""

    def __init__(self, registry: PluginRegistry, num_prefill: int, num_decode: int, block_size: int,
                 num_kv_blocks: int, prefill: PolicySection | None = None, decode: PolicySection | None = None
                 ) -> None:
        self.prefill_name = (prefill or PolicySection(DEFAULT_PREFILL_ROUTER)).name
        self.decode_name = (decode or PolicySection(DEFAULT_DECODE_ROUTER)).name
        self.prefill_router = _build(registry, prefill or PolicySection(DEFAULT_PREFILL_ROUTER),
                                     RouterContext(num_prefill, block_size, num_kv_blocks))
        self.decode_router = _build(registry, decode or PolicySection(DEFAULT_DECODE_ROUTER),
                                    RouterContext(num_decode, block_size, num_kv_blocks))

    def choose_prefill(self, request: RouteRequest, engines: Seq[Any]) -> int:
        snapshots = [replica_snapshot(engine, i) for i, engine in enumerate(engines)]
        return checked_route(self.prefill_router, self.prefill_name, request, snapshots)

    def choose_decode(self, request: RouteRequest, engines: Seq[Any]) -> int:
        """The decode engine for `request` (its prompt and first token), prefix caches read."""
        snapshots = [replica_snapshot(engine, i, reported_prefix_summary(engine.allocator))
                     for i, engine in enumerate(engines)]
        return checked_route(self.decode_router, self.decode_name, request, snapshots)

    def route_prefill(self, request: RouteRequest, snapshots: Seq[ReplicaSnapshot]) -> int:
        """The prefill engine's replica id, from load snapshots the caller took (engines in
        other processes: the server's prefill replicas)."""
        return checked_route(self.prefill_router, self.prefill_name, request, snapshots)

    def route_decode(self, request: RouteRequest, snapshots: Seq[ReplicaSnapshot]) -> int:
        """The decode engine's replica id, from snapshots carrying each one's prefix summary."""
        return checked_route(self.decode_router, self.decode_name, request, snapshots)
