"""The engine: builds the policies named in the config and runs the step loop.

One step reads top to bottom: schedule -> prepare inputs -> run the model -> sample ->
append tokens, check stops, retire finished requests. Policies are the branches.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from typing import Any, Callable

import attrs
import numpy as np
import torch

from servelab.config import EngineConfig, build_options
from servelab.distributed.layout import local_model_config
from servelab.engine_setup import EngineLimits, load_aux_model, resolve_limits, target_model
from servelab.errors import ConfigError, RequestError
from servelab.interfaces import (
    AllocatorContext,
    AttentionContext,
    DrafterContext,
    ForkingAllocator,
    ForkingScheduler,
    LogitsProcessorContext,
    PrefixCachingAllocator,
    SchedulerContext,
    Sequence,
    SequenceStatus,
    StepPlan,
)
from servelab.logging_setup import get_logger
from servelab.logits_pipeline import LogitsPipeline, ProcessorFailed
from servelab.logprobs import log_softmax, position_logprobs
from servelab.model.loader import DTYPES
from servelab.model.onednn_caches import limit_onednn_caches
from servelab.model.source import CheckpointSource, ModelSource
from servelab.model.tokenizer import IncrementalDecoder
from servelab.outputs import PositionLogprobs, RequestOutput, StepReport, request_output
from servelab.registry import PluginRegistry, RegisteredPolicy, build_policy
from servelab.sampler import filtered_probs, sample
from servelab.sampling_params import SamplingParams
from servelab.speculation import SpeculationStats, Speculator

logger = get_logger(__name__)
_SECTION_OF_KIND = {"allocators": "allocator", "schedulers": "scheduler", "drafters": "drafter", "attention": "attention"}


@attrs.frozen
class StepResult:
    """What a step produced: new tokens per sequence, and the requests it finished.

    `new_token_ids` is keyed by sequence id: the request id, or "{request_id}#{i}" for
    completion i > 0 of a request with SamplingParams.n > 1.
    """

    new_token_ids: dict[str, list[int]]
    finished: list[RequestOutput]
    # SamplingParams.logprobs: the logprobs of those new tokens, for the sequences that asked.
    new_logprobs: dict[str, list[PositionLogprobs]] = attrs.field(factory=dict)
    # SamplingParams.prompt_logprobs: by request id, in the step that scored the whole prompt.
    prompt_logprobs: dict[str, list[PositionLogprobs | None]] = attrs.field(factory=dict)


def _all_token_ids(prompt: list | tuple) -> bool:
    """Every item is an int, not a bool."""
    return set(map(type, prompt)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class LLMEngine:
    """Owns the model runner and one policy of each kind; `step()` advances every request."""

    def __init__(self, config: EngineConfig, registry: PluginRegistry | None = None,
                 clock: Callable[[], float] = time.perf_counter, source: ModelSource | None = None) -> None:
        self.config = config
        self.registry = registry or PluginRegistry.from_entry_points()
        self.clock = clock
        self._timer = time.perf_counter  # stage timings in StepReport: wall-clock even on a virtual clock
        # Every name and option is checked before the (slow) model load.
        selected = {kind: self._select(kind, section) for kind, section in self._policy_sections()}
        self.source = source or CheckpointSource(config.engine.model)
        self.tokenizer = self.source.tokenizer
        self.model_config = self.source.model_config
        engine = config.engine
        # Under tensor parallelism each rank holds its share of the heads: KV memory and the
        # attention backend are sized by what one rank holds.
        shard_config = local_model_config(self.model_config, engine.tensor_parallel_size)
        self.limits: EngineLimits = resolve_limits(engine, shard_config)
        device = torch.device(engine.device)
        dtype = DTYPES[engine.dtype]
        self.allocator = build_policy(selected["allocators"][0], selected["allocators"][1], AllocatorContext(
            num_blocks=self.limits.num_kv_blocks, block_size=engine.block_size,
            max_model_len=self.limits.max_model_len))
        self.scheduler = build_policy(selected["schedulers"][0], selected["schedulers"][1], SchedulerContext(
            allocator=self.allocator, max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=self.limits.max_num_batched_tokens,
            max_model_len=self.limits.max_model_len, clock=clock))
        attention_context = AttentionContext(
            num_heads=shard_config.num_heads, num_kv_heads=shard_config.num_kv_heads,
            head_dim=shard_config.head_dim, block_size=engine.block_size,
            num_blocks=self.limits.num_kv_blocks, dtype=dtype, device=device)
        self.attention = build_policy(selected["attention"][0], selected["attention"][1], attention_context)
        if getattr(self.attention, "requires_contiguous_block_tables", False) and not getattr(
                self.allocator, "contiguous_block_tables", False):  # see interfaces.ContiguousAllocator
            raise ConfigError(
                f"attention {config.attention.name!r} reads each sequence's K/V as one contiguous run of blocks, "
                f"but allocator {config.allocator.name!r} hands out block tables that are not contiguous: "
                f"choose allocator 'naive' (contiguous reservations), or attention 'torch-paged' (any block table)")
        if device.type == "cpu":  # before the first oneDNN kernel: then it is too late
            limit_onednn_caches(engine.onednn_cache_capacity)
        if engine.tensor_parallel_size > 1 and isinstance(self.source, CheckpointSource):
            self.runner = self._start_tensor_parallel(selected["attention"], attention_context)
        else:
            self.runner = self.source.build_runner(self.attention, engine, self.limits.num_kv_blocks,
                                                   self.limits.max_model_len)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.speculator = self._build_speculator(selected["drafters"]) if "drafters" in selected else None
        self.logits_pipeline = self._build_logits_pipeline(device)
        # Sequences with logits work (processors or logprobs): the only ones that leave the
        # plain sampling path. Requests waiting for a processor's `prepare` (grammar compilation).
        self._logits_work: set[str] = set()
        self._prompt_logprobs: set[str] = set()  # sequences still collecting prompt logprobs
        self._pending: dict[str, tuple[list[Sequence], dict[str, concurrent.futures.Future]]] = {}
        self._step_failures: dict[str, str] = {}  # sequence id -> error, this step
        self._scored_prompts: dict[str, list] = {}  # request id -> prompt logprobs completed this step
        # Optional allocator capabilities, looked up once.
        self._forking = self.allocator if isinstance(self.allocator, ForkingAllocator) else None
        self._prefix_cache = self.allocator if isinstance(self.allocator, PrefixCachingAllocator) else None
        self._sequences: dict[str, Sequence] = {}  # by sequence id, children of n > 1 requests included
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its n sequences, for n > 1
        self._parent_of: dict[str, str] = {}  # child sequence id -> request id
        self._unforked: set[str] = set()  # n > 1 requests that have not sampled their first tokens
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

    def _start_tensor_parallel(self, attention: tuple[RegisteredPolicy, Any], context: AttentionContext) -> Any:
        from servelab.distributed.runner import start_tensor_parallel
        from servelab.distributed.shard_runner import ShardSpec

        engine = self.config.engine
        spec = ShardSpec(model_path=str(self.source.path), engine=engine, attention=attention[0],
                         attention_options=attention[1], attention_context=context,
                         num_blocks=self.limits.num_kv_blocks, max_positions=self.limits.max_model_len,
                         size=engine.tensor_parallel_size)
        return start_tensor_parallel(spec, self.model_config.vocab_size, engine.tensor_parallel_timeout_s,
                                     backend=self.attention)

    def close(self) -> None:
        """Release what outlives a step loop: under tensor parallelism, the other ranks.
        Idempotent; the engine cannot step afterwards when it had other ranks."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _policy_sections(self):
        yield "allocators", self.config.allocator
        yield "schedulers", self.config.scheduler
        yield "attention", self.config.attention
        if self.config.drafter is not None:
            yield "drafters", self.config.drafter

    def _build_speculator(self, selected: tuple[RegisteredPolicy, Any]) -> Speculator:
        engine = self.config.engine
        context = DrafterContext(
            vocab_size=self.model_config.vocab_size, max_model_len=self.limits.max_model_len,
            max_num_seqs=engine.max_num_seqs, block_size=engine.block_size,
            num_kv_blocks=self.limits.num_kv_blocks, seed=engine.seed, filtered_probs=filtered_probs,
            target=target_model(self.source, self.runner, engine),
            load_model=lambda spec, num_blocks: load_aux_model(spec, num_blocks, engine, self.registry,
                                                               self.config.attention, self.limits.max_model_len))
        drafter = build_policy(selected[0], selected[1], context)
        return Speculator(self.config.drafter.name, drafter, self.allocator, self.limits.max_model_len,
                          self.model_config.vocab_size)

    def _build_logits_pipeline(self, device: torch.device) -> LogitsPipeline:
        """Every installed logits processor; requests select which ones they use."""
        section = self.config.logits_processors
        installed = self.registry.policies("logits_processors")
        unknown = sorted(set(section.options) - set(installed))
        if unknown:
            raise ConfigError(f"[logits_processors] has options for unknown processor {unknown[0]!r}; "
                              f"installed: {', '.join(installed) or 'none'}")
        context = LogitsProcessorContext(vocab_size=self.model_config.vocab_size, eos_token_ids=self.eos_token_ids,
                                         tokenizer=self.tokenizer, device=device)
        processors = {}
        for name, registered in installed.items():
            options = build_options(registered.plugin.options, section.options.get(name, {}), "logits_processors",
                                    name)
            processors[name] = build_policy(registered, options, context)
        return LogitsPipeline(processors, section.default)

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
        elif isinstance(prompt, (list, tuple)) and _all_token_ids(prompt):
            token_ids = list(prompt)
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise RequestError("prompt is empty")
        if len(token_ids) > self.limits.max_model_len:
            raise RequestError(
                f"prompt has {len(token_ids)} tokens, more than max_model_len={self.limits.max_model_len}")
        vocab_size = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
        return token_ids

    def validate_request(self, prompt: str | list[int], params: SamplingParams | None) -> list[int]:
        """The prompt's token ids, or RequestError naming what is wrong; changes nothing."""
        if params is not None and not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if params is not None and params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; this checkpoint has none")
        if params is not None and params.top_k > self.model_config.vocab_size:
            raise RequestError(f"top_k must be -1 (disabled) or in 1..{self.model_config.vocab_size} "
                               f"(the vocabulary), got {params.top_k}")
        if params is not None and params.n > 1:
            self._check_can_fork(params.n)
        if params is not None and (params.has_logits_work or self.logits_pipeline.defaults):
            self._check_logits_work(params)
        return self.encode_prompt(prompt)

    def _check_logits_work(self, params: SamplingParams) -> None:
        limit = self.config.engine.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise RequestError(f"{name} must be <= {limit} (the engine's max_logprobs), got {value}")
        if params.prompt_logprobs is not None and not getattr(self.runner, "supports_prompt_logprobs", False):
            raise RequestError(f"prompt_logprobs: this engine's model runner ({type(self.runner).__name__}) "
                               f"cannot score prompts")
        self.logits_pipeline.validate(params)

    def _check_can_fork(self, n: int) -> None:
        lacking = []
        if self._forking is None:
            lacking.append(f"allocator {self.config.allocator.name!r} cannot fork (choose naive, paged, radix or hash)")
        if not isinstance(self.scheduler, ForkingScheduler):
            lacking.append(f"scheduler {self.config.scheduler.name!r} cannot fork")
        if lacking:
            raise RequestError(f"n={n} samples by forking the prompt's KV, but {' and '.join(lacking)}")

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival_time: float | None = None) -> str:
        """Validate and queue a request; raises RequestError before touching any state."""
        token_ids = self.validate_request(prompt, params)
        params = params or SamplingParams()
        request_id = request_id or self.new_request_id()
        arrival_time = arrival_time if arrival_time is not None else self.clock()
        # Completion 0 is the request's own sequence; with n > 1 the others are forked
        # from it once its prompt is computed (see _with_forks).
        group = [Sequence(request_id if i == 0 else f"{request_id}#{i}", token_ids, params, arrival_time,
                          priority=priority, completion_index=i) for i in range(params.n)]
        for seq in group:
            if seq.request_id in self._sequences:
                raise RequestError(f"request id {seq.request_id!r} is already in flight")
        generators = {}  # built before any state changes: a seed torch refuses leaves nothing behind
        if params.seed is not None:
            generators = {seq.request_id: torch.Generator(device=self.runner.device).manual_seed(
                params.seed + seq.completion_index) for seq in group}
        pending = self._start_logits_work(group) if params.has_logits_work or self.logits_pipeline.defaults else {}
        self._generators.update(generators)
        for seq in group:
            self._sequences[seq.request_id] = seq
            if self.tokenizer is not None:
                self._decoders[seq.request_id] = IncrementalDecoder(self.tokenizer)
        self._prompts[request_id] = prompt if isinstance(prompt, str) else None
        if params.n > 1:
            self._groups[request_id] = group
            self._parent_of.update((child.request_id, request_id) for child in group[1:])
            self._unforked.add(request_id)
        if pending:
            self._pending[request_id] = (group, pending)  # queued once its processors are prepared
        else:
            self.scheduler.add(group[0])
        return request_id

    def _start_logits_work(self, group: list[Sequence]) -> dict[str, concurrent.futures.Future]:
        """Set up logprobs and processor states (or the futures they wait for); on a
        processor's failure nothing remains and RequestError names it."""
        params = group[0].params
        pending = self.logits_pipeline.prepare(params)
        if not pending:
            self._admit_processors(group, {})
        for seq in group:
            if params.logprobs is not None:
                seq.logprobs = []
            self._logits_work.add(seq.request_id)
        if params.prompt_logprobs is not None:
            first = group[0]
            first.prompt_logprobs = [None]  # the first token: nothing predicts it
            if len(first.prompt_token_ids) > 1:
                self._prompt_logprobs.add(first.request_id)
            else:
                self._scored_prompts[first.request_id] = first.prompt_logprobs
        return pending

    def _admit_processors(self, group: list[Sequence], prepared: dict[str, Any]) -> None:
        admitted = []
        try:
            for seq in group:
                self.logits_pipeline.admit(seq, prepared)
                admitted.append(seq)
        except ProcessorFailed as exc:
            for seq in admitted:
                self.logits_pipeline.release(seq.request_id)
            raise RequestError(str(exc)) from None

    def _admit_pending(self) -> list[RequestOutput]:
        """Queue the requests whose processors are prepared; a failed preparation fails its
        request. Returns the outputs of those that failed."""
        failed = []
        for request_id, (group, futures) in list(self._pending.items()):
            if not all(future.done() for future in futures.values()):
                continue
            del self._pending[request_id]
            try:
                errors = [f"logits processor {name!r} failed to prepare: {future.exception()}"
                          for name, future in futures.items() if future.exception() is not None]
                if errors:
                    raise RequestError(errors[0])
                self._admit_processors(group, {name: future.result() for name, future in futures.items()})
            except RequestError as exc:
                now = self.clock()
                for seq in group:
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason, seq.error, seq.finish_time = "error", str(exc), now
                self._unforked.discard(request_id)
                failed.append(self._retire(group[0]))
                continue
            self.scheduler.add(group[0])
        return [output for output in failed if output is not None]

    def _wait_for_pending(self, timeout: float = 0.05) -> None:
        """Nothing to run but requests waiting to be prepared: block briefly instead of spinning."""
        futures = [future for _, waiting in self._pending.values() for future in waiting.values()]
        concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV; returns its output so far, or None."""
        if request_id not in self._sequences or request_id in self._parent_of:
            return None
        self._pending.pop(request_id, None)
        now = self.clock()
        for seq in self._groups.get(request_id, [self._sequences[request_id]]):
            if seq.finish_reason is None:
                self.scheduler.abort(seq.request_id)  # None for a child not yet forked
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = "abort"
                seq.finish_time = now
        self._unforked.discard(request_id)
        return self._retire(self._sequences[request_id])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def unfinished_sequences(self) -> list[Sequence]:
        """Every sequence in flight (waiting or running), children of n > 1 requests included."""
        return [seq for seq in self._sequences.values() if not seq.is_finished]

    def speculation_stats(self) -> SpeculationStats | None:
        """Drafted/accepted totals of the configured drafter; None without one."""
        return self.speculator.stats if self.speculator is not None else None

    # ------------------------------------------------------------ the step

    def step(self) -> StepResult:
        timer = self._timer
        t0 = timer()
        prepared_failures = self._admit_pending() if self._pending else []
        if self.speculator is not None:
            self.speculator.propose([s for s in self._sequences.values() if s.status is SequenceStatus.RUNNING])
        plan = self.scheduler.schedule()
        copies = self._forking.take_block_copies() if self._forking is not None else ()
        t1 = timer()
        if copies:  # copy-on-write: shared blocks are copied before anything writes this step
            self.runner.copy_blocks(copies)
        if plan.is_empty:
            if self.speculator is not None:
                self.speculator.end_step()
            if self._pending and not prepared_failures:
                self._wait_for_pending()
            return StepResult({}, prepared_failures)
        self._note_scheduled(plan, self.clock())
        if self._prompt_logprobs:
            inputs = self.runner.prepare(plan, self.allocator, prompt_logprobs=True)
        else:
            inputs = self.runner.prepare(plan, self.allocator)
        t2 = timer()
        if self.speculator is not None and self.speculator.needs_hidden_states:
            logits, hidden = self.runner.execute_with_hidden(inputs)
        else:
            logits, hidden = self.runner.execute(inputs), None
        if getattr(inputs, "prompt_logits", ()):
            logits, hidden = self._collect_prompt_logprobs(plan, inputs, logits, hidden)
        t3 = timer()
        sampled = [plan.scheduled[row][0] for row in inputs.sampled_seq_rows]
        new_tokens, forks, num_drafts, num_accepted = self._sample(sampled, inputs.num_logits_rows, logits, hidden)
        t4 = timer()
        now = self.clock()
        for seq, num_new in plan.scheduled:
            seq.num_computed_tokens += num_new
        if self._step_failures:
            failed = self._fail_sequences(new_tokens, now)
        finished, emitted = self._append_new_tokens(new_tokens, now, num_drafts, num_accepted)
        if self._step_failures:
            finished.extend(failed)
            self._step_failures.clear()
        new_logprobs = self._new_logprobs(emitted) if self._logits_work else {}
        if self.speculator is not None:
            self.speculator.end_step()
            self.speculator.record(sum(num_drafts.values()), sum(num_accepted.values()), len(num_drafts),
                                   len(emitted), sum(map(len, emitted.values())))
        if self._prefix_cache is not None:  # only verified tokens count as computed by now
            for seq, _ in plan.scheduled:
                self._prefix_cache.cache_blocks(seq)
        for parent, children in forks:  # before `finish`, which may free the parent's KV
            self.scheduler.fork(parent, [child for child in children if child.finish_reason is None])
        self.scheduler.finish(finished)
        outputs = [output for output in map(self._retire, finished) if output is not None]
        t5 = timer()
        self._report(plan, len(finished), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                     sum(num_drafts.values()), sum(num_accepted.values()))
        scored_prompts = {}
        if self._scored_prompts:
            scored_prompts, self._scored_prompts = self._scored_prompts, {}
        return StepResult(emitted, prepared_failures + outputs, new_logprobs, scored_prompts)

    def _fail_sequences(self, new_tokens: dict[Sequence, list[int]], now: float) -> list[Sequence]:
        """Sequences a logits processor failed this step end with finish_reason "error"
        (without this step's token); the rest of the batch goes on."""
        failed = []
        for seq_id, error in self._step_failures.items():
            seq = self._sequences.get(seq_id)
            if seq is None or seq.finish_reason is not None:
                continue
            new_tokens.pop(seq, None)
            seq.finish_reason, seq.error, seq.finish_time = "error", error, now
            failed.append(seq)
        return failed

    def _new_logprobs(self, emitted: dict[str, list[int]]) -> dict[str, list[PositionLogprobs]]:
        result = {}
        for seq_id, tokens in emitted.items():
            seq = self._sequences[seq_id]
            if seq.logprobs is not None:
                end = len(seq.output_token_ids)
                result[seq_id] = seq.logprobs[end - len(tokens): end]
        return result

    def _collect_prompt_logprobs(self, plan: StepPlan, inputs: Any, logits: torch.Tensor,
                                 hidden: torch.Tensor | None):
        """Score the prompt positions the runner added after the sampling rows; returns the
        sampling rows (logits, hidden) alone."""
        num_rows = sum(inputs.num_logits_rows)
        logprobs = log_softmax(logits[num_rows:])
        offset = 0
        for row, first, count in inputs.prompt_logits:
            seq = plan.scheduled[row][0]
            scored = seq.prompt_logprobs
            scored.extend([None] * (first + 1 - len(scored)))  # positions the prefix cache skipped
            targets = seq.prompt_token_ids[first + 1: first + 1 + count]
            scored.extend(position_logprobs(logprobs[offset: offset + count], targets,
                                            [seq.params.prompt_logprobs] * count))
            offset += count
            if len(scored) >= len(seq.prompt_token_ids) and seq.request_id in self._prompt_logprobs:
                self._prompt_logprobs.discard(seq.request_id)
                self._scored_prompts[seq.request_id] = scored
        return logits[:num_rows], hidden[:num_rows] if hidden is not None else None

    def _append_new_tokens(self, new_tokens: dict[Sequence, list[int]], now: float, num_drafts: dict[str, int],
                           num_accepted: dict[str, int]) -> tuple[list[Sequence], dict[str, list[int]]]:
        """Append each sequence's new tokens up to its first stop; settle its verified drafts.
        Returns the sequences that finished, and the tokens each sequence emitted."""
        finished: list[Sequence] = []
        emitted: dict[str, list[int]] = {}
        append_token = self._append_token
        for seq, tokens in new_tokens.items():
            if len(tokens) == 1:
                if append_token(seq, tokens[0], now):
                    finished.append(seq)
                emitted[seq.request_id] = tokens  # a list of this step's own
            else:
                before = seq.num_tokens
                for token_id in tokens:
                    if append_token(seq, token_id, now):
                        finished.append(seq)
                        break
                emitted[seq.request_id] = seq.output_token_ids[before - seq.num_tokens:]  # always >= 1 token
            seq.num_sampling_steps += 1
            if self.speculator is not None and seq.request_id in num_drafts:
                self.speculator.settle(seq, num_drafts[seq.request_id], num_accepted[seq.request_id],
                                       seq.num_tokens - len(emitted[seq.request_id]))
        return finished, emitted

    def _sample(self, sampled: list[Sequence], num_rows: list[int], logits: torch.Tensor,
                hidden: torch.Tensor | None):
        """New tokens per sequence: sampled from its one logits row, or its drafts verified
        against its rows. Returns ({seq: tokens}, forks, {seq id: drafts verified},
        {seq id: drafts accepted})."""
        if num_rows.count(1) == len(num_rows):  # nothing to verify: one row per sequence
            first_rows, spec, plain_seqs = list(range(len(num_rows))), [], sampled
        else:
            first_rows = np.cumsum([0] + num_rows[:-1]).tolist()
            plain = [i for i, n in enumerate(num_rows) if n == 1]
            spec = [i for i, n in enumerate(num_rows) if n > 1]
            plain_seqs = [sampled[i] for i in plain]
            plain_rows = [first_rows[i] for i in plain]
        plain_logits, plain_seqs, forks = self._with_forks(
            logits[torch.tensor(plain_rows, dtype=torch.int64, device=logits.device)] if spec else logits, plain_seqs)
        new_tokens: dict[Sequence, list[int]] = {}
        work = self._logits_work
        if plain_seqs:
            generators = ([self._generators.get(s.request_id) for s in plain_seqs] if self._generators
                          else [None] * len(plain_seqs))
            if work and not work.isdisjoint([s.request_id for s in plain_seqs]):
                token_ids = self._sample_with_logits_work(plain_logits, plain_seqs, generators)
            else:
                token_ids = sample(plain_logits, [s.params for s in plain_seqs], generators, self._default_generator)
            new_tokens = {seq: [token_id] for seq, token_id in zip(plain_seqs, token_ids)}
        num_drafts: dict[str, int] = {}
        num_accepted: dict[str, int] = {}
        if spec:
            spec_seqs = [sampled[i] for i in spec]
            spec_first, spec_rows = [first_rows[i] for i in spec], [num_rows[i] for i in spec]
            worked = bool(work) and not work.isdisjoint([s.request_id for s in spec_seqs])
            draft_logprobs = self._process_draft_rows(logits, spec_seqs, spec_first, spec_rows) if worked else None
            verified = self.speculator.verify(spec_seqs, logits, spec_first, spec_rows,
                                              [self._generators.get(s.request_id) for s in spec_seqs],
                                              self._default_generator)
            if worked:
                self._settle_draft_rows(spec_seqs, spec_rows, verified, draft_logprobs)
            for seq, i, result in zip(spec_seqs, spec, verified):
                new_tokens[seq] = result.token_ids
                num_drafts[seq.request_id] = num_rows[i] - 1
                num_accepted[seq.request_id] = result.num_accepted
        if hidden is not None:
            self.speculator.remember_hidden(sampled, first_rows, num_accepted, hidden, forks)
        return new_tokens, forks, num_drafts, num_accepted

    # ------------------------------------------------------------ logits work (processors, logprobs)

    def _logprob_rows(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        if not rows:
            return None
        return log_softmax(logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)])

    def _sample_with_logits_work(self, logits: torch.Tensor, seqs: list[Sequence],
                                 generators: list[torch.Generator | None]) -> list[int]:
        """Sampling when some rows have processors or want logprobs (the others ride along)."""
        raw = self.config.engine.logprobs_mode == "raw"
        logprob_rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
        logprobs = self._logprob_rows(logits, logprob_rows) if raw else None
        processed = [i for i, s in enumerate(seqs) if self.logits_pipeline.has_states(s.request_id)]
        if processed:
            self.logits_pipeline.apply(logits, [seqs[i] for i in processed], processed, self._step_failures)
        if not raw:
            logprobs = self._logprob_rows(logits, logprob_rows)
        token_ids = sample(logits, [s.params for s in seqs], generators, self._default_generator)
        for i in processed:
            self.logits_pipeline.accept(seqs[i], token_ids[i:i + 1], self._step_failures)
        if logprob_rows:
            positions = position_logprobs(logprobs, [token_ids[i] for i in logprob_rows],
                                          [seqs[i].params.logprobs for i in logprob_rows])
            for i, position in zip(logprob_rows, positions):
                seqs[i].logprobs.append(position)
        return token_ids

    def _process_draft_rows(self, logits: torch.Tensor, seqs: list[Sequence], first_rows: list[int],
                            num_rows: list[int]) -> dict[str, torch.Tensor]:
        """Before verification: each sequence's rows processed with the states its drafts
        lead to (accepted tentatively), and the logprobs of the rows of those that want them."""
        raw = self.config.engine.logprobs_mode == "raw"

        def rows_logprobs() -> dict[str, torch.Tensor]:
            wanted = [(s, first, n) for s, first, n in zip(seqs, first_rows, num_rows) if s.logprobs is not None]
            if not wanted:
                return {}
            logprobs = self._logprob_rows(logits, [first + j for _, first, n in wanted for j in range(n)])
            starts = np.cumsum([0] + [n for _, _, n in wanted]).tolist()
            return {s.request_id: logprobs[start: start + n] for (s, _, n), start in zip(wanted, starts)}

        by_seq = rows_logprobs() if raw else {}
        self.logits_pipeline.apply_speculative(logits, seqs, first_rows, num_rows, self._step_failures)
        return by_seq if raw else rows_logprobs()

    def _settle_draft_rows(self, seqs: list[Sequence], num_rows: list[int], verified: list[Any],
                           logprobs: dict[str, torch.Tensor]) -> None:
        """After verification: processors forget rejected drafts and take the target's token;
        emitted token i's logprob is read off the row that verified it (the target's)."""
        for seq, n, result in zip(seqs, num_rows, verified):
            if self.logits_pipeline.has_states(seq.request_id):
                self.logits_pipeline.settle_speculative(seq, n - 1, result.num_accepted, result.token_ids,
                                                        self._step_failures)
            rows = logprobs.get(seq.request_id)
            if rows is not None:
                tokens = result.token_ids
                seq.logprobs.extend(position_logprobs(rows[: len(tokens)], tokens, [seq.params.logprobs] * len(tokens)))

    def _with_forks(self, logits: torch.Tensor, sampled: list[Sequence]):
        """Parallel sampling: a request with n > 1 samples all n first tokens from its one
        prefill's logits row; its n - 1 children are forked from it after this step.

        Returns the logits rows, the sequences they sample for, and (parent, children) pairs.
        """
        if not self._unforked or not any(seq.request_id in self._unforked for seq in sampled):
            return logits, sampled, []
        rows: list[int] = []
        seqs: list[Sequence] = []
        forks = []
        for row, seq in enumerate(sampled):
            rows.append(row)
            seqs.append(seq)
            if seq.request_id in self._unforked:
                self._unforked.discard(seq.request_id)
                children = self._groups[seq.request_id][1:]
                for child in children:
                    child.first_scheduled_time = seq.first_scheduled_time
                rows.extend([row] * len(children))
                seqs.extend(children)
                forks.append((seq, children))
        return logits[torch.tensor(rows, device=logits.device)], seqs, forks

    def _note_scheduled(self, plan: StepPlan, now: float) -> None:
        for seq, _ in plan.scheduled:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> bool:
        """Append a sampled token; True when the sequence has finished."""
        output = seq.output_token_ids
        output.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif params.stop and len(output) >= params.min_tokens and self._hit_stop_string(seq):
            seq.finish_reason = "stop"
        elif (len(output) >= params.max_tokens
              or len(seq.prompt_token_ids) + len(output) >= self.limits.max_model_len):  # seq.num_tokens, inlined
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
                seq.stop_text = decoder.text[:at]
                return True
        return False

    def _retire(self, seq: Sequence) -> RequestOutput | None:
        """The request's output once all its sequences have finished, else None."""
        if seq.request_id not in self._sequences:
            return None  # retired with its siblings earlier in this step
        request_id = self._parent_of.get(seq.request_id, seq.request_id)
        group = self._groups.get(request_id, [seq])
        if any(s.finish_reason is None for s in group):
            return None  # parallel sampling: siblings still running
        self._groups.pop(request_id, None)
        for s in group:
            del self._sequences[s.request_id]
            self._generators.pop(s.request_id, None)
            self._decoders.pop(s.request_id, None)
            self._parent_of.pop(s.request_id, None)
            if self.speculator is not None:
                self.speculator.release(s.request_id)
            if s.request_id in self._logits_work:
                self._logits_work.discard(s.request_id)
                self._prompt_logprobs.discard(s.request_id)
                self.logits_pipeline.release(s.request_id)
        output = request_output(request_id, self._prompts.pop(request_id, None), group, self._decode)
        self.registry.hook.servelab_request_finished(engine=self, output=output)
        logger.debug("request.finished", request_id=request_id, finish_reason=group[0].finish_reason,
                     prompt_tokens=len(group[0].prompt_token_ids), output_tokens=len(group[0].output_token_ids))
        return output

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer else ""

    def _report(self, plan: StepPlan, num_finished: int, seconds: tuple[float, ...], num_draft_tokens: int = 0,
                num_accepted_tokens: int = 0) -> None:
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
            num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens,
        )
        hook(engine=self, report=report)

    def num_preparing_requests(self) -> int:
        """Requests waiting for a logits processor's preparation (grammar compilation)."""
        return len(self._pending)
