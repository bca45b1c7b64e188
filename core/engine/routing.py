"""Routing requests over engine replicas: building the configured router, and the load
snapshot a replica reports to it. Shared by the simulated fleet and live replicas."""

from __future__ import annotations

from typing import Any, Sequence

from servelab.config import DEFAULT_ROUTER, EngineConfig, PolicySection, build_options
from servelab.errors import ConfigError, PluginError
from servelab.interfaces import (LoRARunner, PrefixReportingAllocator, PrefixSummary, ReplicaSnapshot, RouteRequest, Router,
                                 RouterContext, SequenceStatus, SimulatedLoRARunner)
from servelab.plugin_types import KINDS
from servelab.registry import PluginRegistry, build_policy


def adapter_fields(lora_request: Any) -> dict[str, Any]:
    """A RouteRequest's adapter fields for a request's LoRARequest (None: the base model)."""
    if lora_request is None:
        return {}
    return {"adapter": lora_request.lora_name, "lora_id": lora_request.lora_int_id}


def router_section(config: EngineConfig) -> PolicySection:
    """The config's `[router]`, or the default router."""
    return config.router if config.router is not None else PolicySection(DEFAULT_ROUTER)


def build_router(config: EngineConfig, registry: PluginRegistry, context: RouterContext) -> Router:
    """The router `config` selects (`[router] name = ...`), its options checked."""
    if context.num_replicas < 1:
        raise ConfigError(f"a fleet needs at least one replica, got {context.num_replicas}")
    section = router_section(config)
    registered = registry.select("routers", section.name)
    options = build_options(registered.plugin.options, section.options, KINDS["routers"].section, section.name)
    router = build_policy(registered, options, context)
    if not isinstance(router, Router):
        raise PluginError(f"router {section.name!r} from distribution {registered.distribution!r} "
                          f"built {type(router).__name__}, which has no route(request, replicas) method")
    return router


def route_problem(choice: Any, replicas: Sequence[ReplicaSnapshot]) -> tuple[str, str] | None:
    """(invariant, detail) when `choice` is not one replica id of `replicas`, else None."""
    live = sorted(r.replica_id for r in replicas)
    if choice is None:
        return "request lost", "route() returned None"
    if isinstance(choice, (list, tuple, set, frozenset)):
        return "request duplicated", f"route() returned several replicas {choice!r}; a choice is one replica id"
    if not isinstance(choice, int) or isinstance(choice, bool) or choice not in live:
        return "routed to a live replica", f"route() chose {choice!r}; the replicas that can take work are {live}"
    return None


def checked_route(router: Router, name: str, request: RouteRequest, replicas: Sequence[ReplicaSnapshot]) -> int:
    """The router's choice for `request`; a PluginError naming the router when it is not
    one of `replicas`."""
    choice = router.route(request, replicas)
    problem = route_problem(choice, replicas)
    if problem is not None:
        raise PluginError(f"router {name!r} broke its contract ({problem[0]}) on request "
                          f"{request.request_id!r}: {problem[1]}")
    return choice


def reported_prefix_summary(allocator: Any) -> PrefixSummary | None:
    """What `allocator`'s prefix cache holds, where it reports it (PrefixReportingAllocator,
    as the `hash` and `radix` allocators are); None otherwise."""
    return allocator.prefix_summary() if isinstance(allocator, PrefixReportingAllocator) else None


def replica_snapshot(engine: Any, replica_id: int, prefix_summary: PrefixSummary | None = None) -> ReplicaSnapshot:
    """The load of one engine (an LLMEngine) as a router sees it."""
    queued = running = num_waiting = num_running = 0
    for seq in engine.unfinished_sequences():
        if seq.status is SequenceStatus.RUNNING:
            num_running += 1
            running += seq.num_tokens
        elif seq.status is SequenceStatus.WAITING:
            num_waiting += 1
            queued += seq.num_uncomputed_tokens
    stats = engine.allocator.stats()
    return ReplicaSnapshot(
        replica_id=replica_id, num_waiting=num_waiting, num_running=num_running, num_queued_tokens=queued,
        num_running_tokens=running, num_kv_blocks=stats.num_blocks, num_used_kv_blocks=stats.num_used_blocks,
        block_size=engine.config.engine.block_size, prefix_summary=prefix_summary,
        resident_adapters=engine.runner.lora.resident()
        if isinstance(engine.runner, (LoRARunner, SimulatedLoRARunner)) and engine.runner.lora is not None else ())
