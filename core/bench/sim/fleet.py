"""Simulated fleets: N replicas of one engine config, each with its own virtual clock,
cost model and unchanged scheduler and allocator, behind the config's router.

The bench's loop (servelab.arrivals) keeps the replicas in step: the next event is
either the next arrival, which the router places using every replica's load snapshot at
that instant, or the step of the replica whose clock is furthest behind among those with
work; a replica's step runs from its clock's time and moves only its clock forward, so
steps on different replicas overlap in simulated time as they would on separate devices."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import attrs

from servelab.arrivals import Arrival, serve_arrivals
from servelab.bench.comparison import annotate
from servelab.bench.bench_adapters import BenchAdapters
from servelab.bench.driver import (RunRecord, StepRecorder, adapter_counts, adapter_traffic, lora_manager_of,
                                   workload_arrivals)
from servelab.bench.metrics import SLO, summarize
from servelab.bench.sim.runner import VirtualClock
from servelab.bench.sim.source import SimSource
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.interfaces import AllocatorStats, FinishAwareRouter, RouteRequest, RouterContext
from servelab.registry import PluginRegistry
from servelab.routing import (build_router, checked_route, replica_snapshot, reported_prefix_summary,
                              router_section)
from servelab.request import RequestSpec
from servelab.sampling_params import SamplingParams
from servelab.workload import Workload, build_workload


class SimReplica:
    """One simulated engine with its own clock and step recorder."""

    def __init__(self, replica_id: int, config: EngineConfig, accelerator_name: str, sim_model: str,
                 interconnect_name: str | None = None) -> None:
        from servelab.engine import LLMEngine

        self.replica_id = replica_id
        self.clock = VirtualClock()
        source = SimSource.named(sim_model, accelerator_name, self.clock, interconnect_name)
        self.config = source.fit_config(config)
        registry = PluginRegistry.from_entry_points()
        self.recorder = StepRecorder(self.clock)
        registry.register(self.recorder)
        self.engine = LLMEngine(self.config, registry, clock=self.clock, source=source)


class SimFleet:
    """`num_replicas` simulated replicas of `config` behind the router it selects; each
    replica spreads the model over `[engine] tensor_parallel_size` devices."""

    def __init__(self, name: str, config: EngineConfig, num_replicas: int, accelerator_name: str,
                 sim_model: str, interconnect_name: str | None = None) -> None:
        if num_replicas < 1:
            raise ConfigError(f"--replicas must be at least 1, got {num_replicas}")
        self.name = name
        self.replicas = [SimReplica(i, config, accelerator_name, sim_model, interconnect_name)
                         for i in range(num_replicas)]
        first = self.replicas[0]
        self.config = first.config
        self.router_name = router_section(config).name
        self.router = build_router(config, PluginRegistry.from_entry_points(), RouterContext(
            num_replicas=num_replicas, block_size=first.config.engine.block_size,
            num_kv_blocks=first.engine.limits.num_kv_blocks, seed=first.config.engine.seed))

    @property
    def engine(self) -> Any:
        """The first replica's engine (limits and model shape are the same for all)."""
        return self.replicas[0].engine


@attrs.frozen
class FleetRecord:
    run: RunRecord  # the whole fleet's outputs and steps, as one run
    replica_of: list[int]  # per request, in workload order: the replica it was routed to
    per_replica: list[RunRecord]


def run_fleet(fleet: SimFleet, workload: Workload, progress: Callable[[int], None] | None = None) -> FleetRecord:
    """Route and serve `workload` on the fleet; returns when every request finished."""
    replicas = fleet.replicas
    start = max(r.clock.now for r in replicas)
    for r in replicas:
        r.clock.advance_to(start)
        r.recorder.clear()
    before = [r.engine.allocator.stats() for r in replicas]
    schedulers_before = [r.engine.scheduler.stats() for r in replicas]
    loras = [lora_manager_of(r.engine, workload) for r in replicas]
    adapters_before = [adapter_counts(lora) for lora in loras]
    num_requests = len(workload.requests)
    replica_of: dict[int, int] = {}
    outputs: dict[int, Any] = {}
    by_replica: list[list[Any]] = [[] for _ in replicas]
    finished_hook = fleet.router.request_finished if isinstance(fleet.router, FinishAwareRouter) else None

    def admit(arrival: Arrival) -> tuple[int, str]:
        """Route the request on every replica's load at its arrival (idle clocks are there)
        and, where its allocator reports one, its prefix cache's summary."""
        request, request_id = workload.requests[arrival.item], f"req-{arrival.item}"
        adapter = None if request.adapter is None else workload.lora_requests[request.adapter]
        snapshots = [replica_snapshot(r.engine, r.replica_id, reported_prefix_summary(r.engine.allocator))
                     for r in replicas]
        route = RouteRequest(request_id, request.prompt_token_ids, request.max_tokens, arrival.time,
                             adapter=None if adapter is None else adapter.lora_name)
        choice = checked_route(fleet.router, fleet.router_name, route, snapshots)
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True,
                                deadline=request.deadline)
        replicas[choice].engine.add_requests([RequestSpec(request.prompt_token_ids, params, request_id,
                                                          arrival_time=arrival.time, lora_request=adapter)])
        replica_of[arrival.item] = choice
        return choice, request_id

    def finished(arrival: Arrival, replica: int, output: Any) -> None:
        outputs[arrival.item] = output
        by_replica[replica].append(output)
        if finished_hook is not None:
            finished_hook(output.request_id, replica)
        if progress:
            progress(1)

    serve_arrivals([r.engine for r in replicas], workload_arrivals(workload, start), admit, finished)
    end = max(r.clock.now for r in replicas)
    after = [r.engine.allocator.stats() for r in replicas]
    per_replica = [
        RunRecord(config_name=f"{fleet.name}/{r.replica_id}", start_time=start, end_time=end,
                  outputs=by_replica[r.replica_id], steps=list(r.recorder.reports),
                  allocator_stats_before=before[r.replica_id], allocator_stats_after=after[r.replica_id],
                  preemptions=r.engine.scheduler.stats().num_preemptions
                  - schedulers_before[r.replica_id].num_preemptions,
                  block_size=r.config.engine.block_size,
                  discarded_tokens=r.engine.scheduler.stats().num_discarded_tokens
                  - schedulers_before[r.replica_id].num_discarded_tokens,
                  adapters=adapter_traffic(adapters_before[r.replica_id], adapter_counts(loras[r.replica_id]),
                                           len(r.recorder.reports)))
        for r in replicas]
    steps = sorted((step for record in per_replica for step in record.steps), key=lambda item: item[0])
    run = RunRecord(config_name=fleet.name, start_time=start, end_time=end,
                    outputs=[outputs[i] for i in range(num_requests)], steps=steps,
                    allocator_stats_before=_total(before), allocator_stats_after=_total(after),
                    preemptions=sum(record.preemptions for record in per_replica),
                    block_size=fleet.config.engine.block_size,
                    discarded_tokens=sum(record.discarded_tokens for record in per_replica),
                    requests=tuple(workload.requests), replica_of=tuple(replica_of[i] for i in range(num_requests)),
                    step_traces=tuple(tuple(r.recorder.traces) for r in replicas),
                    adapters=adapter_traffic(tuple(map(sum, zip(*adapters_before))),
                                             tuple(map(sum, zip(*(adapter_counts(lora) for lora in loras)))),
                                             len(steps)))
    return FleetRecord(run, [replica_of[i] for i in range(num_requests)], per_replica)


def fleet_metrics(record: FleetRecord, slo: SLO, num_replicas: int, router: str) -> dict[str, Any]:
    """The bench's metrics for the whole fleet, plus how the router spread the work."""
    metrics = summarize(record.run, slo)
    counts = [record.replica_of.count(i) for i in range(num_replicas)]
    hit_rates = []
    for replica in record.per_replica:
        before, after = replica.allocator_stats_before, replica.allocator_stats_after
        lookups = after.prefix_lookup_tokens - before.prefix_lookup_tokens
        hit_rates.append((after.prefix_hit_tokens - before.prefix_hit_tokens) / lookups if lookups else None)
    metrics["fleet"] = {"router": router, "replicas": num_replicas, "requests_per_replica": counts,
                        "prefix_hit_rate_per_replica": hit_rates}
    if record.run.adapters:
        metrics["fleet"]["adapter_pool_loads_per_replica"] = [replica.adapters.get("adapter_pool_loads", 0)
                                                              for replica in record.per_replica]
    return metrics


def _total(stats: list[AllocatorStats]) -> AllocatorStats:
    """The fleet's allocators as one pool: every count summed."""
    fields = [f.name for f in attrs.fields(AllocatorStats) if f.name != "block_size"]
    return AllocatorStats(**{name: sum(getattr(s, name) for s in stats) for name in fields},
                          block_size=stats[0].block_size)


def run_fleet_bench(configs: list[tuple[str, EngineConfig]], options: Any) -> dict[str, Any]:
    """`servelab bench --sim ACC --replicas N`: each config as a fleet of N replicas, one
    simulated run each (the clock is simulated, so one run is the figure)."""
    if not options.sim_accelerator:
        raise ConfigError(f"--replicas {options.replicas} simulates a fleet: add --sim ACCELERATOR "
                          "(live replicas are served by `servelab serve --replicas`)")
    if options.baseline or options.rates:
        raise ConfigError("--replicas compares routers on one workload: drop --baseline and --rates")
    fleets = [SimFleet(name, config, options.replicas, options.sim_accelerator, options.sim_model,
                       options.sim_interconnect) for name, config in configs]
    with tempfile.TemporaryDirectory(prefix="servelab-fleet-adapters-") as root:
        adapters = BenchAdapters(Path(root), fleets[0].engine.model_config, weights=False)
        workload = adapters.attach(build_workload(options.workload, fleets[0].engine.model_config.vocab_size))
        return _run_fleets(configs, fleets, workload, options)


def _run_fleets(configs: list[tuple[str, EngineConfig]], fleets: list[SimFleet], workload: Workload,
                options: Any) -> dict[str, Any]:
    if options.save_workload:
        workload.save(options.save_workload)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
    for fleet in fleets:
        if longest > fleet.engine.limits.max_model_len:
            raise ConfigError(f"workload has a request of {longest} tokens, over config {fleet.name!r}'s "
                              f"max_model_len={fleet.engine.limits.max_model_len}; raise [engine] max_model_len")
    runs, records = [], []
    for fleet in fleets:
        record = run_fleet(fleet, workload)
        records.append(record.run)
        metrics = fleet_metrics(record, options.slo, options.replicas, fleet.router_name)
        runs.append({"config": fleet.name, "metrics": metrics,
                     "repeats_output_tokens_per_s": [metrics["output_tokens_per_s"]]})
    result = {"workload": {"spec": workload.name, "num_requests": len(workload.requests),
                           "prompt_tokens": workload.num_prompt_tokens, "output_tokens": workload.num_output_tokens},
              "slo": attrs.asdict(options.slo), "replicas": options.replicas, "runs": runs}
    return annotate(result, configs, records, True, options.imbalance_factor)
