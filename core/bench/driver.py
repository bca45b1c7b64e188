"""Driving an engine through a workload in real (or simulated) time: requests are added
at their arrival offsets while the engine steps (servelab.arrivals, the loop the fleet
simulator shares); every step and every finished request is recorded for the metrics."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import attrs

from servelab.arrivals import Arrival, serve_arrivals
from servelab.errors import ConfigError
from servelab.expert_load import expert_load_of, pipeline_stats_of, pipeline_summary
from servelab.hookspecs import hookimpl
from servelab.interfaces import LoRARunner, SimulatedLoRARunner
from servelab.outputs import RequestOutput, StepReport
from servelab.request import RequestSpec
from servelab.sampling_params import SamplingParams
from servelab.workload import Workload


@attrs.frozen
class StepTrace:
    """Who one step ran, and when (the engine's clock): what the bench reads to say why a
    request missed its SLO (servelab.bench.miss_causes)."""

    start: float  # the step began
    end: float  # its report was made (its tokens appended)
    num_scheduled_tokens: int
    # Sequence ids that decoded (one token, plus drafts to verify); kept bare, as most are.
    decoding: tuple[str, ...]
    # (sequence id, tokens) of those that were not decoding: a prompt, a chunk of one, or
    # a recompute after preemption.
    prefilling: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]  # sequence ids preempted by recompute this step


class StepRecorder:
    """Observer plugin keeping every StepReport with the time it arrived, and a StepTrace
    of every step that ran."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.reports: list[tuple[float, StepReport]] = []
        self.traces: list[StepTrace] = []
        self._started = 0.0
        self._planned: tuple | None = None

    def clear(self) -> None:
        self.reports.clear()
        self.traces.clear()

    @hookimpl
    def servelab_step_started(self, engine):
        self._started = self.clock()

    @hookimpl
    def servelab_step_planned(self, engine, plan):
        decoding, prefilling = [], []
        for seq, num_new in plan.scheduled:
            if seq.is_decoding:
                decoding.append(seq.request_id)
            else:
                prefilling.append((seq.request_id, num_new))
        self._planned = (plan.num_scheduled_tokens, tuple(decoding), tuple(prefilling),
                         tuple(seq.request_id for seq in plan.preempted))

    @hookimpl
    def servelab_step_finished(self, engine, report):
        now = self.clock()
        self.reports.append((now, report))
        if self._planned is not None:
            self.traces.append(StepTrace(self._started, now, *self._planned))
            self._planned = None


@attrs.frozen
class RunRecord:
    """Everything one run of a workload produced."""

    config_name: str
    start_time: float
    end_time: float
    outputs: list[RequestOutput]  # in workload order
    steps: list[tuple[float, StepReport]]
    allocator_stats_before: Any
    allocator_stats_after: Any
    preemptions: int
    block_size: int
    discarded_tokens: int = 0  # computed tokens recompute preemptions threw away
    requests: tuple = ()  # the workload's BenchRequests, in workload order (deadlines, classes)
    replica_of: tuple[int, ...] = ()  # per request, in workload order: the replica that served it (fleets)
    step_traces: tuple[tuple[StepTrace, ...], ...] = ()  # per replica (one outside a fleet): every step's StepTrace
    expert_load_before: dict = attrs.field(factory=dict)  # a mixture-of-experts model's per-layer expert load
    expert_load_after: dict = attrs.field(factory=dict)
    pipeline_before: dict = attrs.field(factory=dict)  # a pipeline's stage-0 times (expert_load.pipeline_summary)
    pipeline_after: dict = attrs.field(factory=dict)
    adapters: dict = attrs.field(factory=dict)  # LoRA adapter traffic over the run (adapter_traffic); empty without


def run_workload(engine: Any, recorder: StepRecorder, workload: Workload, config_name: str,
                 progress: Callable[[int], None] | None = None) -> RunRecord:
    """Feed `workload` to `engine` honouring arrival times; returns when all have finished."""
    # What is alive now (torch's modules, the engine, the workload) outlives the run, so the
    # cyclic collector skips it until the run ends: each full collection would otherwise
    # rescan it all, stalling a step for a tenth of a second or more.
    gc.freeze()
    try:
        return _run(engine, recorder, workload, config_name, progress)
    finally:
        gc.unfreeze()


def _run(engine: Any, recorder: StepRecorder, workload: Workload, config_name: str,
         progress: Callable[[int], None] | None) -> RunRecord:
    clock = engine.clock
    outputs: dict[int, RequestOutput] = {}
    recorder.clear()
    stats_before = engine.allocator.stats()
    scheduler_before = engine.scheduler.stats()
    load_before = expert_load_of(engine.runner)
    pipeline_before = pipeline_summary(pipeline_stats_of(engine.runner))
    lora = lora_manager_of(engine, workload)
    adapters_before = adapter_counts(lora)
    start = clock()

    def admit(arrival: Arrival) -> tuple[int, str]:
        request = workload.requests[arrival.item]
        adapter = None if request.adapter is None else workload.lora_requests[request.adapter]
        spec = RequestSpec(request.prompt_token_ids, request_params(request), arrival_time=arrival.time,
                           lora_request=adapter)
        return 0, engine.add_requests([spec])[0]

    def finished(arrival: Arrival, _engine: int, output: RequestOutput) -> None:
        outputs[arrival.item] = output
        if progress:
            progress(1)

    serve_arrivals([engine], workload_arrivals(workload, start), admit, finished)
    end = clock()
    return RunRecord(
        config_name=config_name, start_time=start, end_time=end,
        outputs=[outputs[i] for i in range(len(workload.requests))], steps=list(recorder.reports),
        allocator_stats_before=stats_before, allocator_stats_after=engine.allocator.stats(),
        preemptions=engine.scheduler.stats().num_preemptions - scheduler_before.num_preemptions,
        block_size=engine.config.engine.block_size,
        discarded_tokens=engine.scheduler.stats().num_discarded_tokens - scheduler_before.num_discarded_tokens,
        requests=tuple(workload.requests), step_traces=(tuple(recorder.traces),),
        expert_load_before=load_before, expert_load_after=expert_load_of(engine.runner),
        pipeline_before=pipeline_before, pipeline_after=pipeline_summary(pipeline_stats_of(engine.runner)),
        adapters=adapter_traffic(adapters_before, adapter_counts(lora), len(recorder.reports)),
    )


def lora_manager_of(engine: Any, workload: Workload) -> Any:
    """The engine's LoRA manager where the workload names adapters (None where it names
    none); ConfigError where it names adapters the engine cannot serve."""
    if not workload.num_adapters:
        return None
    if len(workload.lora_requests) < workload.num_adapters:
        raise ConfigError(f"workload {workload.name!r} names {workload.num_adapters} LoRA adapters; "
                          f"{len(workload.lora_requests)} were written for it")
    lora = engine.runner.lora if isinstance(engine.runner, (LoRARunner, SimulatedLoRARunner)) else None
    if lora is None:
        raise ConfigError(f"workload {workload.name!r} runs LoRA adapters: set [engine] enable_lora = true "
                          f"(--set engine.enable_lora=true) and max_loras")
    return lora


def adapter_counts(lora: Any) -> tuple[int, int]:
    return (0, 0) if lora is None else (lora.num_pool_loads, lora.num_disk_reads)


def adapter_traffic(before: tuple[int, int], after: tuple[int, int], steps: int) -> dict:
    """Adapters put into the fast pool (and a step's share of them) and read from disk."""
    if before == after == (0, 0):
        return {}
    loads, reads = after[0] - before[0], after[1] - before[1]
    return {"adapter_pool_loads": loads, "adapter_loads_per_step": loads / steps if steps else None,
            "adapter_disk_reads": reads}


def workload_arrivals(workload: Workload, start: float) -> list[Arrival[int]]:
    """Each request's index in the workload, due at `start` plus its arrival offset
    (absolute times: (start + a) - start can round below a)."""
    return [Arrival(start + request.arrival_time, index) for index, request in enumerate(workload.requests)]


def request_params(request: Any) -> SamplingParams:
    """Greedy for exactly max_tokens tokens; a request carrying the bench JSON schema ends
    instead when its JSON is complete (structured output ends at EOS). Its deadline, if
    any, goes with it (SamplingParams.deadline)."""
    if request.json_schema:
        from servelab.structured import StructuredOutput
        from servelab.workload import BENCH_SCHEMA

        return SamplingParams(max_tokens=request.max_tokens, temperature=0, logprobs=request.logprobs,
                              structured=StructuredOutput.json(BENCH_SCHEMA), deadline=request.deadline)
    return SamplingParams(max_tokens=request.max_tokens, temperature=0, ignore_eos=True, logprobs=request.logprobs,
                          deadline=request.deadline)
