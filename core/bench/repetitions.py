"""Independent, position-fair timed repetitions for `servelab bench`.

Three things keep one config's figures from depending on the others or on its column:

- The warm-up runs the whole workload once per config, offline (every request at t=0),
  so the widest batches the timed runs reach have been run once before any clock
  starts. A shorter warm-up left them to the first timed run, which first-touched the
  memory for them (measured: 18-64% more minor page faults than the same run on a
  second engine right after) on behalf of the whole process: whichever config ran
  first paid, and the next one did not.
- Repetition i starts from config i mod n, so any remaining cost of going first is
  spread over every config and the median sees it at most once in n runs.
- Before the warm-up and every repetition, a prefix-caching allocator's cache is
  emptied (`reset_prefix_cache`), so a repetition never reuses prefixes computed by the
  one before; `warm_cache` keeps them instead.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from servelab.bench.driver import RunRecord, run_workload
from servelab.interfaces import PrefixCachingAllocator
from servelab.workload import Workload

DEFAULT_REPEATS = 5  # the median of five ignores two runs hit by a burst of load; the table shows min-max


def offline(workload: Workload) -> Workload:
    """The same requests, all arriving at once."""
    return attrs.evolve(workload, requests=tuple(attrs.evolve(r, arrival_time=0.0) for r in workload.requests))


def reset_prefix_cache(engine: Any) -> None:
    """Empty the engine's prefix cache, if its allocator keeps one."""
    if isinstance(engine.allocator, PrefixCachingAllocator):
        engine.allocator.reset_prefix_cache()


def warm_up(engines: list, workload: Workload, warm_cache: bool) -> None:
    """Run `workload` once through every engine, untimed."""
    for e in engines:
        if not warm_cache:
            reset_prefix_cache(e.engine)
        run_workload(e.engine, e.recorder, offline(workload), e.name)


def run_repetitions(engines: list, workload: Workload, repeats: int, warm_cache: bool,
                    progress: Callable[[int], None] | None = None,
                    after_each: Callable[[], None] | None = None) -> dict[str, list[RunRecord]]:
    """`repeats` rounds, each running every engine once, starting one config later each
    round; returns each config's records in round order. `after_each` runs after every
    round (the baseline's turn)."""
    records: dict[str, list[RunRecord]] = {e.name: [] for e in engines}
    for round_index in range(repeats):
        shift = round_index % len(engines)
        for e in engines[shift:] + engines[:shift]:
            if not warm_cache:
                reset_prefix_cache(e.engine)
            records[e.name].append(run_workload(e.engine, e.recorder, workload, e.name, progress))
        if after_each is not None:
            after_each()
    return records
