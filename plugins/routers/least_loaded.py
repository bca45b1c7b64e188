"""Least loaded: the replica with the least queued + running work."""

from __future__ import annotations

from typing import Any, Sequence

from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext


def least_loaded(replicas: Sequence[ReplicaSnapshot]) -> ReplicaSnapshot:
    """Fewest queued + running tokens; ties to fewer sequences, then the lower id."""
    return min(replicas, key=lambda r: (r.load_tokens, r.num_waiting + r.num_running, r.replica_id))


class LeastLoadedRouter:
    def __init__(self, options: Any, context: RouterContext) -> None:
        pass

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaSnapshot]) -> int:
        return least_loaded(replicas).replica_id
