"""Round robin over the live replicas, in replica id order."""

from __future__ import annotations

from typing import Any, Sequence

from servelab.interfaces import ReplicaSnapshot, RouteRequest, RouterContext


class RoundRobinRouter:
    """The next live replica after the one chosen last; a replica that left is skipped
    and one that joins is taken in its turn."""

    def __init__(self, options: Any, context: RouterContext) -> None:
        self.last = -1

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaSnapshot]) -> int:
        ids = sorted(r.replica_id for r in replicas)
        self.last = next((i for i in ids if i > self.last), ids[0])
        return self.last
