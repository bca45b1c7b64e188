"""The engine: one policy of each kind, a table of requests, and the step.

A step is eight stages that hand each other records (docs/design.md draws them):

    intake    requests whose preparation finished are queued   (servelab.intake)
    propose   the drafter drafts for the decoding sequences    (servelab.propose_stage)
    schedule  the scheduler plans the step: a StepPlan
    run       the runner executes the plan: a StepRun          (servelab.run_stage)
    sample    logits become tokens: Sampled                    (servelab.sampling_stage)
    verify    drafts are verified against the target's rows    (servelab.verify_stage)
    update    tokens are appended, stops found, requests finished (servelab.update_stage)
    report    observers see the step; the caller gets a StepResult
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections import Counter
import time
from typing import Any, Callable, Sequence as Seq

import attrs
import torch

from servelab.batch_queue import build_batch_queue
from servelab.config import EngineConfig
from servelab.engine_setup import build_policies, fork_refusal
from servelab.errors import RequestError
from servelab.expert_load import expert_load_of, pipeline_stats_of
from servelab.interfaces import ForkingAllocator, Sequence, SequenceStatus, StepPlan
from servelab.intake import Intake
from servelab.logging_setup import get_logger
from servelab.model_source import ModelSource
from servelab.outputs import RequestOutput, StageTimer, StepReport, StepResult, merge_step_results, request_output
from servelab.plan_check import PlanCheck
from servelab.propose_stage import ProposeStage
from servelab.registry import PluginRegistry
from servelab.request import Request, RequestSpec, RequestTable
from servelab.run_stage import RunStage, StepRun
from servelab.sampling_params import SamplingParams
from servelab.sampling_stage import SamplingStage, sampling_kernels_of
from servelab.speculation import SpeculationStats
from servelab.update_stage import UpdateStage
from servelab.verify_stage import VerifyStage

logger = get_logger(__name__)

class LLMEngine:
    """Owns the model runner and one policy of each kind; `step()` advances every request."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None,
                 clock: Callable[[], float] = time.perf_counter, source: ModelSource | None = None) -> None:
        self.config = config
        self.registry = registry or PluginRegistry.from_entry_points()
        self.clock = clock
        self._timer = time.perf_counter  # stage timings in StepReport: wall-clock even on a virtual clock
        parts = build_policies(config, self.registry, clock, source)
        self.source, self.limits = parts.source, parts.limits
        self.tokenizer, self.model_config = self.source.tokenizer, self.source.model_config
        self.allocator, self.scheduler, self.attention = parts.allocator, parts.scheduler, parts.attention
        self.runner, self.speculator, self.logits_pipeline = parts.runner, parts.speculator, parts.logits_pipeline
        self.host_tier = parts.host_tier  # `[kv_offload]`, or None
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._forking = self.allocator if isinstance(self.allocator, ForkingAllocator) else None
        self.requests = RequestTable()
        self.intake = Intake(self.tokenizer, self.model_config.vocab_size, self.limits.max_model_len,
                             config.engine.max_logprobs, self.logits_pipeline, self.runner,
                             fork_refusal(config, self.allocator, self.scheduler), lora=parts.lora)
        if parts.lora is not None:
            parts.lora.demand = self._adapter_demand
        generator = torch.Generator(device=torch.device(config.engine.device)).manual_seed(config.engine.seed)
        raw_logprobs = config.engine.logprobs_mode == "raw"
        spec = self.speculator
        self.proposing = ProposeStage(self.requests, spec) if spec is not None else None
        self.running = RunStage(self.runner, self.allocator, spec is not None and spec.needs_hidden_states,
                                spec.feature_layers if spec is not None else ())
        self.sampling = SamplingStage(self.requests, self.logits_pipeline, generator, raw_logprobs,
                                      sampling_kernels_of(self.attention))
        self.verifying = VerifyStage(self.requests, spec, self.logits_pipeline, generator, raw_logprobs) \
            if spec is not None else None
        self.updating = UpdateStage(self.requests, self.scheduler, self.allocator, self.eos_token_ids,
                                    self.limits.max_model_len, self.verifying.settle if spec is not None else None)
        self._plan_check = PlanCheck(self.requests, self.scheduler, config.scheduler.name)
        # pipeline parallelism: batches planned and submitted while earlier ones run, or None
        try:
            self._batches = build_batch_queue(config, self.runner, self.scheduler, spec, self.host_tier)
        except BaseException:
            self.runner.close()  # the other ranks already run
            raise
        self._drained: list[StepResult] = []  # batches completed outside a step (abort), returned by the next
        self._request_counter = itertools.count()
        self._step_index = 0
        self.registry.hook.servelab_engine_started(engine=self)
        logger.info("engine.started", model=config.engine.model, kv_blocks=self.limits.num_kv_blocks,
                    block_size=config.engine.block_size, max_model_len=self.limits.max_model_len,
                    allocator=config.allocator.name, scheduler=config.scheduler.name,
                    attention=config.attention.name)

    def close(self) -> None:
        """Release what outlives a step loop: under tensor parallelism, the other ranks.
        Idempotent; the engine cannot step afterwards when it had other ranks."""
        self._batches = None  # batches still in flight are abandoned with the ranks
        self.runner.close()

    # ------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises RequestError before touching any state."""
        return self.add_requests([RequestSpec(prompt, params, request_id, priority, arrival_time)])[0]

    def add_requests(self, specs: Seq[RequestSpec]) -> list[str]:
        """Validate and queue requests, all or none: RequestError before any state changes."""
        return self.admit(self.prepare_requests(specs))

    def prepare_requests(self, specs: Seq[RequestSpec]) -> list[Request]:
        """The records of requests, each checked once and its preparation started, all or
        none (RequestError). Changes nothing in the engine, so it may run on another
        thread than the step loop; `admit` then queues them."""
        checked = self.intake.check_all(specs)
        built: list[Request] = []
        shared: dict[int, dict] = {}  # the prompts of one request share their params: prepared once
        try:
            for spec, token_ids in zip(specs, checked):
                arrival = spec.arrival_time if spec.arrival_time is not None else self.clock()
                built.append(self.intake.build(spec, token_ids, spec.request_id or self.new_request_id(), arrival,
                                               shared))
        except BaseException:
            self.discard(built)
            raise
        return built

    def admit(self, requests: Seq[Request]) -> list[str]:
        """Queue prepared requests, all or none (RequestError for an id already in flight:
        the records are then discarded); one waiting for its preparation is queued once
        that is done."""
        taken: set[str] = set()
        try:
            for request in requests:
                self.requests.check_free(request.request_id, len(request.sequences), taken)
                taken.add(request.request_id)
        except RequestError:
            self.discard(requests)
            raise
        for request in requests:
            self.requests.add(request)
            if not request.preparing:
                self.scheduler.add(request.first)
        return [request.request_id for request in requests]

    def discard(self, requests: Seq[Request]) -> None:
        """Let go of prepared requests that will not be admitted."""
        for request in requests:
            request.release(self._release_sequence)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV; returns its output so far, or None."""
        request = self.requests.get(request_id)
        if request is not None and self._batches is not None and any(map(self._batches.holds, request.sequences)):
            self._drain()  # its KV is still being written down the pipeline
            request = self.requests.get(request_id)
        if request is None:
            return None
        now = self.clock()
        for seq in request.sequences:
            if seq.finish_reason is None:
                self.scheduler.abort(seq.request_id)  # None for a child not yet forked
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason, seq.finish_time = "abort", now
        return self._retire(request)

    def expert_load(self) -> dict[int, list[int]]:
        """A mixture-of-experts model's assignments per expert, per sparse layer, so far
        (empty for a dense model)."""
        return expert_load_of(self.runner)

    def pipeline_stats(self) -> Any:
        """Under pipeline parallelism, rank 0's stage times so far (compute, wait: its
        bubble); None otherwise."""
        stats = pipeline_stats_of(self.runner)
        if stats is not None and self._batches is not None:
            stats.batches_in_flight = self._batches.depth
            stats.overlapped_batches = self._batches.stats.overlapped
        return stats

    def has_unfinished(self) -> bool:
        """True while any request is queued, running or preparing, or a step still owes
        results (batches completed by an abort under pipeline parallelism)."""
        return self.scheduler.has_unfinished() or self.requests.has_preparing() or bool(self._drained)

    def num_preparing_requests(self) -> int:
        """Requests waiting for a logits processor's preparation (grammar compilation)."""
        return self.requests.num_preparing()

    def unfinished_sequences(self) -> list[Sequence]:
        """Every sequence in flight (waiting or running), children of n > 1 requests included."""
        return [seq for seq in self.requests.sequences() if not seq.is_finished]

    def _adapter_demand(self) -> tuple[dict[int, int], set[int]]:
        """Waiting sequences per LoRA adapter id (what a queue-aware residency policy keeps),
        and the ids of every adapter with unfinished sequences (kept in host memory)."""
        seqs = [seq for seq in self.requests.sequences() if seq.lora_id and not seq.is_finished]
        waiting = Counter(seq.lora_id for seq in seqs if seq.status is SequenceStatus.WAITING)
        return dict(waiting), {seq.lora_id for seq in seqs}

    def speculation_stats(self) -> SpeculationStats | None:
        """Drafted/accepted totals of the configured drafter; None without one."""
        return self.speculator.stats if self.speculator is not None else None

    # ------------------------------------------------------------ the step

    def step(self) -> StepResult:
        """Advance every request by one step (the stages in the module docstring)."""
        self._notify("servelab_step_started")
        timer = StageTimer(self._timer)
        failed = self._admit_prepared() if self.requests.has_preparing() else []
        if self.proposing is not None:
            self.proposing.propose()
        plan = timer.mark(self._schedule())
        if self._batches is not None:
            return self._with_drained(self._step_in_flight(plan, timer, failed))
        if plan.is_empty:
            return self._idle(plan, failed)
        inputs = timer.mark(self._prepare(plan))
        run = timer.mark(self._execute(plan, inputs))
        return self._finish(run, timer, failed)

    def _finish(self, run: StepRun, timer: StageTimer, failed: list[RequestOutput]) -> StepResult:
        """Sample, verify, update and retire what a forward produced."""
        sampled = self.sampling.sample(run)
        if self.verifying is not None:
            self.verifying.verify(run, sampled)
        timer.mark(sampled)
        updated = self.updating.update(run.plan, sampled, self.clock())
        outputs = timer.mark(self._retire_finished(updated.finished))
        self._report(run.plan, len(updated.finished), timer.seconds, sampled)
        return StepResult(updated.events, failed + outputs)

    def _step_in_flight(self, plan: StepPlan, timer: StageTimer, failed: list[RequestOutput]) -> StepResult:
        """A step with batches in flight (servelab.batch_queue): submit the plan, and complete
        the oldest batch once the queue is full or nothing more could be planned."""
        batches = self._batches
        if plan.is_empty and not batches:
            return self._idle(plan, failed)
        if not plan.is_empty:
            inputs = timer.mark(self._prepare(plan))
            batches.submitted(plan, inputs, self.running.submit(inputs))
            if not batches.is_full:
                return StepResult({}, failed)
        else:
            timer.mark(None)
        return self._complete_oldest(timer, failed)

    def _complete_oldest(self, timer: StageTimer, failed: list[RequestOutput]) -> StepResult:
        """The oldest batch in flight, completed and finished as a synchronous step's forward."""
        batch = self._batches.oldest()
        run = timer.mark(self.running.complete(batch.plan, batch.inputs, batch.ticket))
        self._notify("servelab_runner_executed", plan=batch.plan, inputs=batch.inputs)
        return self._finish(run, timer, failed)

    def _drain(self) -> None:
        """Complete every batch in flight now; their results go out with the next step's."""
        while self._batches:
            timer = StageTimer(self._timer)
            timer.mark(None)  # no schedule ...
            timer.mark(None)  # ... and no prepare in this step
            self._drained.append(self._complete_oldest(timer, []))

    def _with_drained(self, result: StepResult) -> StepResult:
        if not self._drained:
            return result
        results, self._drained = [*self._drained, result], []
        return merge_step_results(results)

    def _schedule(self) -> StepPlan:
        plan = self.scheduler.schedule()
        self._plan_check.check(plan, self._batches.held_ids() if self._batches is not None else None)
        if self.host_tier is not None:  # moves between tiers (with the copies queued before them), in order
            moves = self.host_tier.take_moves()
            if moves:
                plan = attrs.evolve(plan, kv_moves=tuple(moves))
        if self.proposing is not None:  # the plan carries the token trees
            plan = self.proposing.with_trees(plan)
        copies = self._forking.take_block_copies() if self._forking is not None else ()
        if copies:  # copy-on-write: shared blocks are copied before anything writes this step
            plan = attrs.evolve(plan, block_copies=tuple(copies))
        return plan

    def _prepare(self, plan: StepPlan) -> Any:
        self._notify("servelab_step_planned", plan=plan)
        scores_prompts = not self.requests.all_plain and any(seq.prompt_logprobs is not None
                                                              for seq, _ in plan.scheduled)
        return self.running.prepare(plan, self.clock(), scores_prompts)

    def _execute(self, plan: StepPlan, inputs: Any) -> StepRun:
        run = self.running.execute(plan, inputs)
        self._notify("servelab_runner_executed", plan=plan, inputs=inputs)
        return run

    def _retire_finished(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose last sequence finished this step."""
        done = {id(r): r for r in map(self.requests.of, finished) if r.is_finished}
        return [self._retire(request) for request in done.values()]

    def _idle(self, plan: StepPlan, failed: list[RequestOutput]) -> StepResult:
        self.running.move_blocks(plan)
        if self.speculator is not None:
            self.speculator.end_step()
        if self.requests.has_preparing() and not failed:  # block briefly instead of spinning
            futures = [f for request in self.requests.preparing() for f in request.preparing.values()]
            concurrent.futures.wait(futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED)
        return StepResult({}, failed)

    def _admit_prepared(self) -> list[RequestOutput]:
        """Queue the requests whose processors are prepared; a failed preparation fails its
        request. Returns the outputs of those that failed."""
        failed = []
        for request in self.requests.prepared_now():
            try:
                self.intake.finish_preparation(request)
            except RequestError as exc:
                request.fail(str(exc), self.clock())
                failed.append(self._retire(request))
                continue
            self.scheduler.add(request.first)
        return failed

    def _notify(self, hook_name: str, **values: Any) -> None:
        if self.registry.implemented(hook_name):
            getattr(self.registry.hook, hook_name)(engine=self, **values)

    def _release_sequence(self, seq: Sequence, states: dict[str, Any]) -> None:
        if self.speculator is not None:
            self.speculator.release(seq)
        if states:
            self.logits_pipeline.release(seq.request_id, states)

    def _retire(self, request: Request) -> RequestOutput:
        """The output of a request whose sequences have all finished; it leaves the table."""
        request.release(self._release_sequence)
        self.requests.remove(request)
        output = request_output(request.request_id, request.prompt, request.sequences, self._decode)
        self.registry.hook.servelab_request_finished(engine=self, output=output)
        logger.debug("request.finished", request_id=request.request_id, finish_reason=output.finish_reason,
                     prompt_tokens=len(output.prompt_token_ids), output_tokens=len(output.token_ids))
        return output

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer else ""

    def _report(self, plan: StepPlan, num_finished: int, seconds: tuple[float, ...], sampled: Any) -> None:
        self._step_index += 1
        if not self.registry.implemented("servelab_step_finished"):
            return
        hook = self.registry.hook.servelab_step_finished
        report = StepReport(
            step_index=self._step_index, num_seqs=len(plan.scheduled),
            num_scheduled_tokens=plan.num_scheduled_tokens, num_preempted=len(plan.preempted),
            num_finished=num_finished, schedule_seconds=seconds[0], prepare_seconds=seconds[1],
            forward_seconds=seconds[2], sample_seconds=seconds[3], update_seconds=seconds[4],
            allocator_stats=self.allocator.stats(), scheduler_stats=self.scheduler.stats(),
            num_draft_tokens=sum(sampled.num_drafts.values()), num_accepted_tokens=sum(sampled.num_accepted.values()),
            tier_stats=self.host_tier.stats() if self.host_tier is not None else None,
        )
        hook(engine=self, report=report)
