"""servelab.arrivals: the loop the bench, the fleet simulator and LLM.generate share,
driven here by engines that take a fixed number of one-second steps per request."""

from __future__ import annotations

import attrs
import pytest

from servelab.arrivals import NOW, Arrival, serve_arrivals
from servelab.bench.sim.runner import VirtualClock


@attrs.frozen
class Output:
    request_id: str


@attrs.frozen
class Result:
    finished: list


class CountdownEngine:
    """Every request needs `steps` steps of one simulated second each, one request at a time."""

    def __init__(self, steps: int = 2) -> None:
        self.clock = VirtualClock()
        self.steps = steps
        self.queue: list[list] = []  # [request id, steps left]
        self.log: list[tuple[float, str]] = []  # (clock at the step's start, request id)

    def add_request(self, request_id: str) -> str:
        self.queue.append([request_id, self.steps])
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self) -> Result:
        head = self.queue[0]
        self.log.append((self.clock.now, head[0]))
        self.clock.advance(1.0)
        head[1] -= 1
        if head[1]:
            return Result([])
        self.queue.pop(0)
        return Result([Output(head[0])])


def test_one_engine_waits_for_arrivals_and_finishes_everything():
    engine = CountdownEngine()
    done = []
    serve_arrivals([engine], [Arrival(5.0, "b"), Arrival(0.0, "a")],
                   lambda a: (0, engine.add_request(a.item)), lambda a, i, out: done.append((a.item, engine.clock.now)))
    assert done == [("a", 2.0), ("b", 7.0)], "b waits, idle, for its arrival at 5 s"
    assert engine.log == [(0.0, "a"), (1.0, "a"), (5.0, "b"), (6.0, "b")]


def test_engines_step_furthest_behind_first_and_arrivals_come_before_the_step_at_their_time():
    engines = [CountdownEngine(steps=3), CountdownEngine(steps=1)]
    placed = []

    def admit(arrival):
        target = 0 if arrival.item == "long" else 1
        placed.append((arrival.item, [e.clock.now for e in engines]))
        return target, engines[target].add_request(arrival.item)

    finished = {}
    serve_arrivals(engines, [Arrival(0.0, "long"), Arrival(1.0, "short")], admit,
                   lambda a, i, out: finished.setdefault(a.item, (i, engines[i].clock.now)))
    assert finished == {"long": (0, 3.0), "short": (1, 2.0)}
    assert placed == [("long", [0.0, 0.0]), ("short", [1.0, 1.0])], "the idle engine's clock moved to the arrival"


def test_requests_admitted_now_all_queue_before_the_first_step():
    engine = CountdownEngine(steps=1)
    serve_arrivals([engine], [Arrival(NOW, name) for name in "xyz"],
                   lambda a: (0, engine.add_request(a.item)), lambda a, i, out: None)
    assert [request for _, request in engine.log] == ["x", "y", "z"]


def test_a_request_no_engine_finishes_is_an_error_not_a_hang():
    engine = CountdownEngine()
    with pytest.raises(RuntimeError, match="never finished"):
        serve_arrivals([engine], [Arrival(0.0, "lost")], lambda a: (0, "lost"), lambda a, i, out: None)
