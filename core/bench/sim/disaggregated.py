"""Simulated prefill/decode fleets: `servelab bench --sim ACC --disaggregate xPyD`.

x prefill and y decode replicas, each a simulated engine on its own virtual clock
(servelab.bench.sim.fleet.SimReplica: the unchanged scheduler and allocator, the cost
model's step times), run the same producer and consumer roles, P/D router and in-process
transport as a real deployment (servelab.disagg). What the simulator adds is time: a
handoff becomes loadable on a decode replica `link.seconds(bytes)` after its prefill
finished, its bytes the prompt's full blocks at the model's KV bytes per token
(servelab.bench.sim.handoff). The same workload also runs on x + y colocated replicas
(the same devices), so the rows compare goodput per device.

The loop takes events in time order: the next arrival (the P/D router places it on a
prefill replica), the next handoff ready to load (placed on a decode replica, KV-aware),
or the step of the replica furthest behind among those with work; an idle replica's
clock jumps to the event that gives it work.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Sequence as Seq

import attrs

from servelab.bench.disaggregated import summarize_outputs
from servelab.bench.metrics import SLO
from servelab.bench.sim.fleet import SimFleet, SimReplica, run_fleet
from servelab.bench.sim.handoff import HandoffLink, handoff_link
from servelab.config import EngineConfig
from servelab.disagg.consumer import DecodeWorker
from servelab.disagg.producer import PrefillWorker
from servelab.disagg.routing import PDRouter
from servelab.engine_setup import build_kv_transport
from servelab.errors import ConfigError
from servelab.interfaces import KVLayout, KVTransferContext, RouteRequest
from servelab.registry import PluginRegistry
from servelab.sampling_params import SamplingParams
from servelab.workload import Workload


class PricedDataPath:
    """A simulated pool's data path: no bytes move (the simulator has no KV tensors); the
    bytes a block would carry are priced by the fleet instead."""

    def __init__(self, config: EngineConfig, num_layers: int) -> None:
        engine = config.engine
        self._layout = KVLayout(block_size=engine.block_size, kv_cache_dtype=engine.kv_cache_dtype,
                                storage_dtype="torch.uint8", scales="priced", layer_range=(0, num_layers),
                                block_shape=(0,))

    def layout(self) -> KVLayout:
        return self._layout

    def save(self, blocks: Seq[int]) -> list[bytes]:
        return [b""] * len(blocks)

    def load(self, blocks: Seq[int], data: Seq[bytes]) -> None:
        pass


@attrs.define
class _Now:
    time: float = 0.0

    def __call__(self) -> float:
        return self.time


def pd_config(config: EngineConfig) -> EngineConfig:
    """Both roles hand KV over through a prefix cache."""
    return config if config.allocator.name in ("hash", "radix") else config.with_overrides({"allocator.name": "hash"})


def run_pd_fleet(config: EngineConfig, workload: Workload, prefill: int, decode: int, accelerator: str,
                 sim_model: str, link: HandoffLink, lease_s: float = 60.0, prefill_tp: int = 1,
                 decode_tp: int = 1) -> dict[str, Any]:
    """Serve `workload` on a simulated xPyD fleet, each prefill replica over `prefill_tp`
    devices and each decode replica over `decode_tp` (tensor parallelism per role); its
    outputs (workload order), its simulated seconds and the KV bytes its handoffs moved."""
    config = pd_config(config)
    now = _Now()
    registry = PluginRegistry.from_entry_points()
    transport = build_kv_transport(config, registry, KVTransferContext(role="both", name="simulated", clock=now))
    prefill_config = config.with_overrides({"engine.tensor_parallel_size": prefill_tp})
    decode_config = config.with_overrides({"engine.tensor_parallel_size": decode_tp})
    prefill_replicas = [SimReplica(i, prefill_config, accelerator, sim_model) for i in range(prefill)]
    decode_replicas = [SimReplica(prefill + i, decode_config, accelerator, sim_model) for i in range(decode)]
    first = prefill_replicas[0].engine
    model = first.model_config
    # the simulated model's own KV row (the simulator prices weights and KV in bf16)
    bytes_per_token = model.kv_bytes_per_token(first.source.dtype_bytes, config.engine.kv_cache_dtype)
    producers = [PrefillWorker(r.engine, transport, f"prefill-{i}", lease_s, now,
                               PricedDataPath(r.config, model.num_layers)) for i, r in enumerate(prefill_replicas)]
    consumers = [DecodeWorker(r.engine, transport, f"decode-{i}", "recompute", now,
                              PricedDataPath(r.config, model.num_layers)) for i, r in enumerate(decode_replicas)]
    router = PDRouter(registry, prefill, decode, first.config.engine.block_size, first.limits.num_kv_blocks)
    clocks = {id(w): r.clock for w, r in zip([*producers, *consumers], [*prefill_replicas, *decode_replicas])}

    arrivals = sorted((r.arrival_time, i) for i, r in enumerate(workload.requests))
    order = itertools.count()
    ready: list[tuple[float, int, Any, int]] = []  # (time, tie, PrefillDone, request index)
    ids: dict[str, int] = {}
    first_token: dict[int, float] = {}
    outputs: dict[int, Any] = {}
    moved = 0
    next_arrival = 0
    while len(outputs) < len(workload.requests):
        busy = [w for w in [*producers, *consumers] if w.has_work()]
        candidates = []
        if next_arrival < len(arrivals):
            candidates.append((arrivals[next_arrival][0], 0, None))
        if ready:
            candidates.append((ready[0][0], 1, None))
        candidates.extend((clocks[id(w)].now, 2, w) for w in busy)
        if not candidates:
            raise RuntimeError(f"simulated P/D fleet stalled with {len(workload.requests) - len(outputs)} "
                               f"requests unfinished")
        when, kind, worker = min(candidates, key=lambda c: (c[0], c[1]))
        now.time = when
        if kind == 0:
            _, index = arrivals[next_arrival]
            next_arrival += 1
            request = workload.requests[index]
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            transfer_id = f"xfer-{index}"
            choice = router.choose_prefill(RouteRequest(transfer_id, request.prompt_token_ids, request.max_tokens,
                                                        when), [p.engine for p in producers])
            clock = clocks[id(producers[choice])]
            if not producers[choice].has_work():
                clock.advance_to(when)
            producers[choice].add(transfer_id, list(request.prompt_token_ids), params, arrival_time=when)
            ids[transfer_id] = index
        elif kind == 1:
            _, _, done, index = heapq.heappop(ready)
            request = workload.requests[index]
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True)
            route = RouteRequest(done.transfer_id, [*done.handoff.prompt_token_ids, done.handoff.first_token_id],
                                 request.max_tokens - 1, when)
            consumer = consumers[router.choose_decode(route, [c.engine for c in consumers])]
            if not consumer.has_work():
                clocks[id(consumer)].advance_to(when)
            failed = consumer.accept(done.handoff, params, arrival_time=done.output.metrics.arrival_time)
            if failed is not None:
                outputs[index] = failed
        elif isinstance(worker, PrefillWorker):
            for done in worker.step():
                index = ids[done.transfer_id]
                first_token[index] = done.output.metrics.first_token_time
                if done.handoff is None:
                    outputs[index] = done.output
                    continue
                nbytes = done.handoff.num_blocks * done.handoff.layout.block_size * bytes_per_token
                moved += nbytes
                heapq.heappush(ready, (clocks[id(worker)].now + link.seconds(nbytes), next(order), done, index))
        else:
            for output in worker.step():
                index = ids[output.request_id]
                outputs[index] = attrs.evolve(output, metrics=attrs.evolve(
                    output.metrics, first_token_time=first_token.get(index, output.metrics.first_token_time)))
    start = min((r.arrival_time for r in workload.requests), default=0.0)
    end = max(r.clock.now for r in [*prefill_replicas, *decode_replicas])
    return {"outputs": [outputs[i] for i in range(len(workload.requests))], "seconds": end - start,
            "kv_bytes_moved": moved,
            "recomputes": sum(c.metrics.recomputes for c in consumers)}


def run_pd_comparison(config: EngineConfig, workload: Workload, topologies: Seq[tuple[int, int]], accelerator: str,
                      sim_model: str, link_name: str, slo: SLO) -> dict[str, Any]:
    """Each xPyD topology against as many colocated replicas (the same devices), simulated."""
    link = handoff_link(link_name)
    rows = []
    for prefill, decode in topologies:
        fleet = SimFleet(f"colocated x{prefill + decode}", pd_config(config), prefill + decode, accelerator, sim_model)
        record = run_fleet(fleet, workload)
        rows.append({**summarize_outputs(fleet.name, record.run.outputs, record.run.end_time - record.run.start_time,
                                         slo), "devices": prefill + decode})
        result = run_pd_fleet(config, workload, prefill, decode, accelerator, sim_model, link)
        rows.append({**summarize_outputs(f"{prefill}P{decode}D", result["outputs"], result["seconds"], slo,
                                         result["kv_bytes_moved"], result["recomputes"]),
                     "devices": prefill + decode})
    for row in rows:
        row["goodput_per_device"] = row["goodput_rps"] / row["devices"]
    return {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "link": link_name, "rows": rows,
            "identical": {}}


def plan_pd(config: EngineConfig, workload: Workload, accelerator: str, sim_model: str, link_name: str, slo: SLO,
            max_devices: int, attainment: float) -> dict[str, Any]:
    """`servelab size --disaggregate N`: on 2..N devices, every colocated fleet (replicas x
    tensor-parallel degree) and every xPyD split with a tensor-parallel degree per role
    (x prefill replicas of TPp devices and y decode replicas of TPd, x TPp + y TPd devices),
    run on `workload`; the best is the most goodput per device among those meeting
    `attainment` of the SLO (DistServe's placement search, over P:D ratios and per-role
    parallelism). Degrees the model's heads do not divide are skipped."""
    link = handoff_link(link_name)
    rows = []
    for devices in range(2, max_devices + 1):
        for replicas, tp in _splits(devices):
            tp_config = pd_config(config).with_overrides({"engine.tensor_parallel_size": tp})
            name = f"colocated x{replicas}" + (f" TP{tp}" if tp > 1 else "")
            fleet = _fleet_or_none(name, tp_config, replicas, accelerator, sim_model)
            if fleet is None:
                continue
            record = run_fleet(fleet, workload)
            rows.append({**summarize_outputs(fleet.name, record.run.outputs,
                                             record.run.end_time - record.run.start_time, slo), "devices": devices})
        for prefill, prefill_tp, decode, decode_tp in _role_splits(devices):
            try:
                result = run_pd_fleet(config, workload, prefill, decode, accelerator, sim_model, link,
                                      prefill_tp=prefill_tp, decode_tp=decode_tp)
            except ConfigError:  # a degree the model's heads do not divide
                continue
            name = f"{prefill}P{_tp(prefill_tp)}{decode}D{_tp(decode_tp)}"
            rows.append({**summarize_outputs(name, result["outputs"], result["seconds"], slo,
                                             result["kv_bytes_moved"], result["recomputes"]), "devices": devices})
    for row in rows:
        row["goodput_per_device"] = row["goodput_rps"] / row["devices"]
    meeting = [row for row in rows if row["slo_attainment"] >= attainment]
    best = max(meeting, key=lambda row: (row["goodput_per_device"], -row["devices"]), default=None)
    return {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}, "attainment": attainment, "link": link_name,
            "rows": rows, "identical": {}, "best": best["topology"] if best is not None else None}


def _tp(degree: int) -> str:
    return f"(TP{degree})" if degree > 1 else ""


def _splits(devices: int) -> list[tuple[int, int]]:
    """(replicas, tensor-parallel degree) filling `devices` exactly, degrees powers of two."""
    return [(devices // tp, tp) for tp in (1, 2, 4, 8) if tp <= devices and devices % tp == 0]


def _role_splits(devices: int) -> list[tuple[int, int, int, int]]:
    """(prefill replicas, their degree, decode replicas, their degree) filling `devices`."""
    found = []
    for prefill_devices in range(1, devices):
        for prefill, prefill_tp in _splits(prefill_devices):
            for decode, decode_tp in _splits(devices - prefill_devices):
                found.append((prefill, prefill_tp, decode, decode_tp))
    return found


def _fleet_or_none(name: str, config: EngineConfig, replicas: int, accelerator: str, sim_model: str) -> SimFleet | None:
    try:
        return SimFleet(name, config, replicas, accelerator, sim_model)
    except ConfigError:  # a degree the model's heads do not divide
        return None
