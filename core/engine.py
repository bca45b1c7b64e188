"""The engine: builds the policies named in the config and runs the step loop.

One step reads top to bottom: schedule -> prepare inputs -> run the model -> sample ->
append tokens, check stops, retire finished requests. Policies are the branches.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import attrs
import structlog
import torch

from servelab.config import EngineConfig, build_options
from servelab.engine_setup import EngineLimits, resolve_limits
from servelab.errors import RequestError
from servelab.interfaces import AllocatorContext, AttentionContext, SchedulerContext, Sequence, StepPlan
from servelab.model.loader import DTYPES
from servelab.model.source import CheckpointSource, ModelSource
from servelab.model.tokenizer import IncrementalDecoder
from servelab.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepReport
from servelab.registry import PluginRegistry, RegisteredPolicy, build_policy
from servelab.sampler import sample
from servelab.sampling_params import SamplingParams

logger = structlog.get_logger(__name__)
_SECTION_OF_KIND = {"allocators": "allocator", "schedulers": "scheduler", "drafters": "drafter", "attention": "attention"}


@attrs.frozen
class StepResult:
    """What a step produced: new tokens per request, and the requests it finished."""

    new_token_ids: dict[str, list[int]]
    finished: list[RequestOutput]


class LLMEngine:
    """Owns the model runner and one policy of each kind; `step()` advances every request."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None,
                 clock: Callable[[], float] = time.perf_counter, source: ModelSource | None = None) -> None:
        self.config = config
        self.registry = registry or PluginRegistry.from_entry_points()
        self.clock = clock
        # Every name and option is checked before the (slow) model load.
        selected = {kind: self._select(kind, section) for kind, section in self._policy_sections()}
        self.source = source or CheckpointSource(config.engine.model)
        self.tokenizer = self.source.tokenizer
        self.model_config = self.source.model_config
        self.limits: EngineLimits = resolve_limits(config.engine, self.model_config)
        engine = config.engine
        device = torch.device(engine.device)
        dtype = DTYPES[engine.dtype]
        self.allocator = build_policy(selected["allocators"][0], selected["allocators"][1], AllocatorContext(
            num_blocks=self.limits.num_kv_blocks, block_size=engine.block_size,
            max_model_len=self.limits.max_model_len))
        self.scheduler = build_policy(selected["schedulers"][0], selected["schedulers"][1], SchedulerContext(
            allocator=self.allocator, max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_model_len=self.limits.max_model_len, clock=clock))
        self.attention = build_policy(selected["attention"][0], selected["attention"][1], AttentionContext(
            num_heads=self.model_config.num_heads, num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim, block_size=engine.block_size,
            num_blocks=self.limits.num_kv_blocks, dtype=dtype, device=device))
        self.runner = self.source.build_runner(self.attention, engine, self.limits.num_kv_blocks,
                                               self.limits.max_model_len)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self._sequences: dict[str, Sequence] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._prompts: dict[str, str | None] = {}
        self._default_generator = torch.Generator(device=device).manual_seed(engine.seed)
        self._request_counter = itertools.count()
        self._step_index = 0
        self.registry.hook.servelab_engine_started(engine=self)
        logger.info("engine.started", model=engine.model, kv_blocks=self.limits.num_kv_blocks,
                    block_size=engine.block_size, max_model_len=self.limits.max_model_len,
                    allocator=config.allocator.name, scheduler=config.scheduler.name,
                    attention=config.attention.name)

    def _policy_sections(self):
        yield "allocators", self.config.allocator
        yield "schedulers", self.config.scheduler
        yield "attention", self.config.attention

    def _select(self, kind: str, section: Any) -> tuple[RegisteredPolicy, Any]:
        registered = self.registry.select(kind, section.name)
        options = build_options(registered.plugin.options, section.options, _SECTION_OF_KIND[kind], section.name)
        return registered, options

    # ------------------------------------------------------------ requests

    def new_request_id(self) -> str:
        return f"req-{next(self._request_counter)}"

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, validated against the vocabulary and max_model_len."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this checkpoint has no tokenizer.json: pass prompts as lists of token ids")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError("prompt is empty")
        if len(token_ids) > self.limits.max_model_len:
            raise RequestError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len={self.limits.max_model_len}")
        bad = [t for t in token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.model_config.vocab_size})")
        return token_ids

    def validate_request(self, prompt: str | list[int], params: SamplingParams | None) -> list[int]:
        """The prompt's token ids, or RequestError naming what is wrong; changes nothing."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if params is not None and params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none")
        return self.encode_prompt(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises RequestError before touching any state."""
        token_ids = self.validate_request(prompt, params)
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        if request_id in self._sequences:
            raise RequestError(f"request id {request_id!r} is already in flight")
        seq = Sequence(request_id, token_ids, params, arrival_time if arrival_time is not None else self.clock(),
                       priority=priority)
        self._sequences[request_id] = seq
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        if params.seed is not None:
            self._generators[request_id] = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        if self.tokenizer is not None:
            self._decoders[request_id] = IncrementalDecoder(self.tokenizer)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV; returns its output so far, or None."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        seq.finish_time = self.clock()
        return self._retire(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------ the step

    def step(self) -> StepResult:
        t0 = self.clock()
        plan = self.scheduler.schedule()
        t1 = self.clock()
        if plan.is_empty:
            return StepResult({}, [])
        self._note_scheduled(plan, t1)
        inputs = self.runner.prepare(plan, self.allocator)
        t2 = self.clock()
        logits = self.runner.execute(inputs)
        t3 = self.clock()
        sampled = [plan.scheduled[row][0] for row in inputs.sampled_seq_rows]
        token_ids = sample(logits, [s.params for s in sampled],
                           [self._generators.get(s.request_id) for s in sampled], self._default_generator)
        t4 = self.clock()
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
        new_tokens = {}
        finished = []
        for seq, token_id in zip(sampled, token_ids):
            new_tokens[seq.request_id] = [token_id]
            if self._append_token(seq, token_id, t4):
                finished.append(seq)
        self.scheduler.finish(finished)
        outputs = [self._retire(seq) for seq in finished]
        t5 = self.clock()
        self._report(plan, len(finished), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4))
        return StepResult(new_tokens, outputs)

    def _note_scheduled(self, plan: StepPlan, now: float) -> None:
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> bool:
        """Append a sampled token; True when the sequence has finished."""
        seq.output_token_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif params.stop and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            seq.finish_reason = "length"
        else:
            return False
        seq.finish_time = now
        return True

    def _hit_stop_string(self, seq: Sequence) -> bool:
        decoder = self._decoders[seq.request_id]
        decoder.update(seq.output_token_ids)
        for stop in seq.params.stop:
            at = decoder.text.find(stop)
            if at >= 0:
                seq.output_text = decoder.text[:at]
                return True
        return False

    def _retire(self, seq: Sequence) -> RequestOutput:
        request_id = seq.request_id
        del self._sequences[request_id]
        self._generators.pop(request_id, None)
        self._decoders.pop(request_id, None)
        prompt = self._prompts.pop(request_id, None)
        if seq.output_text or (seq.params.stop and seq.finish_reason == "stop"):
            text = seq.output_text
        else:
            text = self.tokenizer.decode(seq.output_token_ids) if self.tokenizer else ""
        output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, list(seq.output_token_ids), text, seq.finish_reason)],
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                   seq.finish_time, seq.num_preemptions),
        )
        self.registry.hook.servelab_request_finished(engine=self, output=output)
        logger.debug("request.finished", request_id=request_id, finish_reason=seq.finish_reason,
                     prompt_tokens=len(seq.prompt_token_ids), output_tokens=len(seq.output_token_ids))
        return output

    def _report(self, plan: StepPlan, num_finished: int, seconds: tuple[float, ...]) -> None:
        self._step_index += 1
        hook = self.registry.hook.servelab_step_finished
        if not hook.get_hookimpls():
            return
        report = StepReport(
            step_index=self._step_index, num_seqs=len(plan.scheduled),
            num_scheduled_tokens=plan.num_scheduled_tokens, num_preempted=len(plan.preempted),
            num_finished=num_finished, schedule_seconds=seconds[0], prepare_seconds=seconds[1],
            forward_seconds=seconds[2], sample_seconds=seconds[3], update_seconds=seconds[4],
            allocator_stats=self.allocator.stats(), scheduler_stats=self.scheduler.stats(),
        )
        hook(engine=self, report=report)
