"""RouterContract: what every router must do, whatever it optimises.

    from servelab.testing import RouterContract

    class TestMine(RouterContract):
        plugin_name = "mine"           # or: factory = MyRouter

The contract fixes no placement (balance load, follow the cache, anything): it fixes
that every request goes to exactly one replica that can take it, and that the same
calls give the same choices. Its fleets lose and regain replicas mid-run and share
prompt prefixes, so a router that remembers a replica that left, or indexes the list
instead of reading ids, fails.
"""

from __future__ import annotations

from typing import Any

import attrs

from servelab.interfaces import (FinishAwareRouter, PrefixSummary, ReplicaSnapshot, RouteRequest, Router, RouterContext,
                                 prefix_block_hashes)
from servelab.routing import route_problem
from servelab.testing.contract import PolicyContract, check, exercising, since
from servelab.testing.objectives import ObjectiveChecks

BLOCK_SIZE = 4


@attrs.define
class _Replica:
    replica_id: int
    in_flight: dict[str, tuple[RouteRequest, int]] = attrs.field(factory=dict)  # id -> (request, finish tick)
    cached: set[int] = attrs.field(factory=set)  # block hashes of prompts it served

    def snapshot(self, report_prefixes: bool) -> ReplicaSnapshot:
        requests = [r for r, _ in self.in_flight.values()]
        waiting = requests[4:]  # four run at once; the rest queue
        running = requests[:4]
        return ReplicaSnapshot(
            replica_id=self.replica_id, num_waiting=len(waiting), num_running=len(running),
            num_queued_tokens=sum(len(r.prompt_token_ids) for r in waiting),
            num_running_tokens=sum(len(r.prompt_token_ids) + r.max_tokens for r in running),
            num_kv_blocks=64, num_used_kv_blocks=min(64, sum(len(r.prompt_token_ids) // BLOCK_SIZE for r in running)),
            block_size=BLOCK_SIZE,
            prefix_summary=PrefixSummary(BLOCK_SIZE, self.cached) if report_prefixes else None)


@attrs.frozen
class FleetEvent:
    """One step of a scripted fleet: replicas leave or join, then a request arrives."""

    request: RouteRequest
    leave: tuple[int, ...] = ()
    join: tuple[int, ...] = ()
    duration: int = 3  # ticks the request stays in flight


class ToyFleet:
    """Replicas as ledgers: each routed request stays in flight `duration` ticks (one
    tick per arrival), the first four in flight on a replica running and the rest
    queued. Records every delivery and tells the router when a request finishes."""

    def __init__(self, router: Any, num_replicas: int, report_prefixes: bool = False) -> None:
        self.router = router
        self.replicas = {i: _Replica(i) for i in range(num_replicas)}
        self.report_prefixes = report_prefixes
        self.tick = 0
        self.delivered: dict[str, int] = {}  # request id -> replica it went to
        self.choices: list[Any] = []

    def run(self, events: list[FleetEvent]) -> list[Any]:
        for event in events:
            for replica_id in event.leave:
                gone = self.replicas.pop(replica_id, None)
                for request, _ in (gone.in_flight.values() if gone else ()):
                    self._finished(request.request_id, replica_id)  # its requests fail
            for replica_id in event.join:
                self.replicas.setdefault(replica_id, _Replica(replica_id))
            self.route(event.request, event.duration)
            self._advance()
        while any(r.in_flight for r in self.replicas.values()):
            self._advance()
        return self.choices

    def snapshots(self) -> list[ReplicaSnapshot]:
        return [replica.snapshot(self.report_prefixes) for replica in self.replicas.values()]

    def route(self, request: RouteRequest, duration: int) -> None:
        replicas = self.snapshots()
        with exercising("request lost"):
            choice = self.router.route(request, replicas)
        self.choices.append(choice)
        check_choice(choice, request, replicas)
        check(request.request_id not in self.delivered, "request duplicated",
              f"{request.request_id} was routed twice")
        self.delivered[request.request_id] = choice
        replica = self.replicas[choice]
        replica.in_flight[request.request_id] = (request, self.tick + duration)
        replica.cached.update(prefix_block_hashes(request.prompt_token_ids, BLOCK_SIZE))

    def _advance(self) -> None:
        self.tick += 1
        for replica in self.replicas.values():
            for request_id, (_, finish) in list(replica.in_flight.items()):
                if finish <= self.tick:
                    del replica.in_flight[request_id]
                    self._finished(request_id, replica.replica_id)

    def _finished(self, request_id: str, replica_id: int) -> None:
        if isinstance(self.router, FinishAwareRouter):
            with exercising("request_finished accepts every request it routed"):
                self.router.request_finished(request_id, replica_id)


def check_choice(choice: Any, request: RouteRequest, replicas: list[ReplicaSnapshot]) -> None:
    """One replica id, of a replica in `replicas`."""
    problem = route_problem(choice, replicas)
    if problem is not None:
        check(False, problem[0], f"{problem[1]} (request {request.request_id})")


def prompts_with_shared_prefixes(num_requests: int, num_prefixes: int = 3, prefix_len: int = 12,
                                 tail_len: int = 3) -> list[list[int]]:
    """Prompts drawn from a few shared prefixes with distinct tails (deterministic)."""
    prefixes = [[100 * (p + 1) + t for t in range(prefix_len)] for p in range(num_prefixes)]
    return [prefixes[(i * 7) % num_prefixes] + [10_000 + i * tail_len + t for t in range(tail_len)]
            for i in range(num_requests)]


def churn_scenario(num_replicas: int = 4, num_requests: int = 48) -> list[FleetEvent]:
    """Shared-prefix requests; replica 1 leaves a third of the way in and comes back at
    two thirds, replica `num_replicas` (new) joins at the half, and the last replica
    leaves then."""
    events = []
    last = num_replicas - 1
    for i, prompt in enumerate(prompts_with_shared_prefixes(num_requests)):
        leave: tuple[int, ...] = ()
        join: tuple[int, ...] = ()
        if i == num_requests // 3 and num_replicas > 1:
            leave = (1,)
        if i == num_requests // 2:
            join = (num_replicas,)
            leave = (last,) if last != 1 else ()
        if i == 2 * num_requests // 3:
            join = (1,)
        events.append(FleetEvent(RouteRequest(f"r{i}", prompt, max_tokens=8 + i % 5, arrival_time=float(i)),
                                 leave=leave, join=join, duration=2 + i % 4))
    return events


class RouterContract(PolicyContract, ObjectiveChecks):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements Router
    - routed to a live replica: route() returns the replica_id (an int) of one of the
      snapshots it was given, never of a replica that left, never a list position
    - request lost: route() returns a choice for every request (None, or raising, loses it)
    - request duplicated: a choice is one replica id, never several; no request is routed twice
    - deterministic: fresh routers given the same calls choose the same replicas
    - request_finished (where defined) accepts every request the router routed
    - version 2: requests carrying a `session` key are routed like any other
    """

    kind = "routers"
    num_replicas = 4
    max_examples = 30

    def context(self, num_replicas: int | None = None) -> RouterContext:
        return RouterContext(num_replicas=num_replicas or self.num_replicas, block_size=BLOCK_SIZE,
                             num_kv_blocks=64, seed=0)

    def run_fleet(self, events: list[FleetEvent], report_prefixes: bool = False,
                  num_replicas: int | None = None) -> list[Any]:
        num_replicas = num_replicas or self.num_replicas
        return ToyFleet(self.make(self.context(num_replicas)), num_replicas, report_prefixes).run(events)

    # ------------------------------------------------------------ scenarios

    def test_implements_router(self):
        router = self.make(self.context())
        check(isinstance(router, Router), "implements Router", f"{type(router).__name__} has no route()")

    def test_one_replica_gets_every_request(self):
        events = [FleetEvent(RouteRequest(f"r{i}", p)) for i, p in enumerate(prompts_with_shared_prefixes(12))]
        check(self.run_fleet(events, num_replicas=1) == [0] * 12, "routed to a live replica",
              "with one replica every request goes to replica 0")

    def test_replicas_leaving_and_joining(self):
        self.run_fleet(churn_scenario(self.num_replicas))

    def test_replicas_reporting_their_prefix_caches(self):
        self.run_fleet(churn_scenario(self.num_replicas), report_prefixes=True)

    @since(2)
    def test_requests_carrying_a_session(self):
        """Version 2: RouteRequest.session; a router that ignores it still routes every
        request to a live replica, the same way each time."""
        events = [attrs.evolve(event, request=attrs.evolve(event.request, session=f"user-{i % 3}"))
                  for i, event in enumerate(churn_scenario(self.num_replicas))]
        first = self.run_fleet(events)
        second = self.run_fleet(events)
        check(first == second, "deterministic", lambda: _first_difference(first, second))

    def test_same_calls_same_choices(self):
        for report_prefixes in (False, True):
            first = self.run_fleet(churn_scenario(self.num_replicas), report_prefixes)
            second = self.run_fleet(churn_scenario(self.num_replicas), report_prefixes)
            check(first == second, "deterministic", lambda: _first_difference(first, second))

    # ------------------------------------------------------------ randomised

    def test_random_fleets(self):
        from hypothesis import given
        from hypothesis import strategies as st

        max_replicas = 6
        event = st.tuples(st.integers(0, 3), st.integers(1, 6), st.lists(st.integers(0, max_replicas - 1), max_size=2),
                          st.lists(st.integers(0, max_replicas - 1), max_size=2), st.integers(1, 5))

        @self.hypothesis_settings()
        @given(num_replicas=st.integers(1, max_replicas), raw=st.lists(event, min_size=1, max_size=30),
               report_prefixes=st.booleans())
        def run(num_replicas, raw, report_prefixes):
            events = _events(num_replicas, raw)
            first = self.run_fleet(events, report_prefixes, num_replicas)
            second = self.run_fleet(events, report_prefixes, num_replicas)
            check(first == second, "deterministic", lambda: _first_difference(first, second))

        run()


def _events(num_replicas: int, raw: list[tuple]) -> list[FleetEvent]:
    """Fleet events from drawn tuples, never leaving the fleet empty."""
    live = set(range(num_replicas))
    events = []
    for i, (prefix, tail, leave, join, duration) in enumerate(raw):
        join = tuple(sorted(set(join) - live))
        live |= set(join)
        leave = tuple(sorted(r for r in set(leave) & live))[: max(0, len(live) - 1)]
        live -= set(leave)
        prompt = [50 + prefix] * 8 + [1000 + i] * tail
        events.append(FleetEvent(RouteRequest(f"r{i}", prompt, max_tokens=4), leave, join, duration))
    return events


def _first_difference(first: list, second: list) -> str:
    index = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return (f"the same calls chose differently from request {index}: "
            f"{first[index:index + 5]} then {second[index:index + 5]}")
