"""The one loop that drives engines to completion: admit each request at its arrival
time, step whichever engine is furthest behind, until every request has finished.

`LLM.generate`, `servelab generate`, the bench (one engine, real or simulated time) and
the simulated fleet (N engines, each on its own virtual clock, a router placing each
arrival) all run it. Engines step one at a time; an engine's step moves only its own
clock, so on virtual clocks steps of different engines overlap in simulated time as on
separate devices.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Generic, Sequence, TypeVar

import attrs

T = TypeVar("T")

NOW = -math.inf  # an arrival time that has always passed: admit before the first step


@attrs.frozen
class Arrival(Generic[T]):
    """A request (`item`, whatever the caller admits) due at `time` on the engines' clocks."""

    time: float
    item: T


def serve_arrivals(engines: Sequence[Any], arrivals: Sequence[Arrival[T]],
                   admit: Callable[[Arrival[T]], tuple[int, str]],
                   finished: Callable[[Arrival[T], int, Any], None]) -> None:
    """Admit every arrival, in time order, and step `engines` until each admitted request
    has finished.

    `admit(arrival)` adds the request to one engine and returns (that engine's index, the
    request id); `finished(arrival, engine index, RequestOutput)` gets each output.
    Outputs of requests admitted elsewhere are stepped past and dropped. An arrival is
    admitted once every busy engine's clock has reached its time (before the step at that
    instant); otherwise the busy engine whose clock is furthest behind steps. When no
    engine has work, the clocks wait for the next arrival: a virtual clock (one with
    `advance_to`) jumps to it, a real one sleeps."""
    arrivals = sorted(arrivals, key=lambda a: a.time)
    waiting_for: dict[str, Arrival[T]] = {}
    cursor = 0
    while cursor < len(arrivals) or waiting_for:
        busy = [i for i, engine in enumerate(engines) if engine.has_unfinished()]
        stepper = min(busy, key=lambda i: (engines[i].clock(), i)) if busy else None
        if cursor < len(arrivals):
            arrival = arrivals[cursor]
            if stepper is None or arrival.time <= engines[stepper].clock():
                if _reached(engines, arrival.time, busy):
                    index, request_id = admit(arrival)
                    waiting_for[request_id] = arrival
                    cursor += 1
                continue
        elif stepper is None:
            raise RuntimeError(f"no engine has work, yet requests {', '.join(sorted(waiting_for))} never finished")
        for output in engines[stepper].step().finished:
            arrival = waiting_for.pop(output.request_id, None)
            if arrival is not None:
                finished(arrival, stepper, output)


def _reached(engines: Sequence[Any], when: float, busy: list[int]) -> bool:
    """Bring the idle engines' clocks to `when`: a virtual clock jumps there; a real one
    has got there, or is slept towards it (False: not yet)."""
    for i, engine in enumerate(engines):
        if i not in busy and hasattr(engine.clock, "advance_to"):
            engine.clock.advance_to(when)
    late = [engine.clock for engine in engines if not hasattr(engine.clock, "advance_to") and engine.clock() < when]
    if late:
        time.sleep(max(0.0, min(0.05, when - late[0]())))
        return False
    return True
