"""pluggy hook specifications: one registration hook per policy kind, and observer
hooks for lifecycle events.

A plugin is a module (or any object) with `@servelab.hookimpl` functions named after
these specs. Register it under the `servelab.plugins` entry-point group of its
distribution, or at run time with `PluginRegistry.register(module)`. Each registration
spec below shows a complete, working plugin of its kind; the policy kinds themselves
are the rows of `servelab.plugin_types.KINDS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from servelab.plugin_types import (AllocatorPlugin, AttentionPlugin, DrafterPlugin, EvictionPlugin,
                                       LogitsProcessorPlugin, RouterPlugin, SchedulerPlugin, VictimPlugin)
    from servelab.plugin_types import AdapterResidencyPlugin
    from servelab.plugin_types import KVTransferPlugin

PROJECT = "servelab"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# ---------------------------------------------------------------- registration


@hookspec
def servelab_register_allocators() -> list[AllocatorPlugin]:
    """Return the KV allocators this plugin provides (`[allocator] name = ...`).

    A factory is called as `factory(options, AllocatorContext)` and returns a
    `servelab.interfaces.KVAllocator`. A complete plugin::

        import servelab
        from servelab.interfaces import AllocatorContext, AllocatorStats
        from servelab.plugin_types import AllocatorPlugin

        class LowestFirst:
            # Paged blocks, lowest free id first; no sharing.

            def __init__(self, options, context: AllocatorContext):
                self.num_blocks, self.block_size = context.num_blocks, context.block_size
                self.free_blocks = list(range(context.num_blocks))
                self.tables: dict[str, list[int]] = {}
                self.num_tokens: dict[str, int] = {}

            def allocate(self, seq_id, num_tokens):
                table = self.tables.get(seq_id, [])
                needed = -(-num_tokens // self.block_size) - len(table)
                if needed > len(self.free_blocks):
                    return False  # all or nothing
                self.free_blocks.sort()
                self.tables[seq_id] = table + [self.free_blocks.pop(0) for _ in range(needed)]
                self.num_tokens[seq_id] = max(num_tokens, self.num_tokens.get(seq_id, 0))
                return True

            def free(self, seq_id):
                self.free_blocks += self.tables.pop(seq_id, [])
                self.num_tokens.pop(seq_id, None)

            def block_table(self, seq_id):
                return self.tables.get(seq_id, [])

            def stats(self):
                used = self.num_blocks - len(self.free_blocks)
                slots = sum(self.num_tokens.values())
                return AllocatorStats(num_blocks=self.num_blocks, num_used_blocks=used,
                                      num_free_blocks=len(self.free_blocks), num_token_slots_used=slots,
                                      num_token_slots_reserved_empty=used * self.block_size - slots,
                                      block_size=self.block_size)

        @servelab.hookimpl
        def servelab_register_allocators():
            return [AllocatorPlugin(name="lowest-first", factory=LowestFirst,
                                    description="paged blocks, lowest free id first")]
    """


@hookspec
def servelab_register_schedulers() -> list[SchedulerPlugin]:
    """Return the schedulers this plugin provides (`[scheduler] name = ...`).

    A factory is called as `factory(options, SchedulerContext)` and returns a
    `servelab.interfaces.Scheduler`; the engine advances tokens and decides who
    finished, the scheduler only chooses who runs. A complete plugin::

        import collections
        import servelab
        from servelab.interfaces import SchedulerContext, SchedulerStats, SequenceStatus, StepPlan
        from servelab.plugin_types import SchedulerPlugin

        class OneAtATime:
            # First come, first served, one request at a time.

            def __init__(self, options, context: SchedulerContext):
                self.context, self.waiting, self.current = context, collections.deque(), None

            def add(self, seq):
                seq.status = SequenceStatus.WAITING
                self.waiting.append(seq)

            def abort(self, request_id):
                for seq in [self.current, *self.waiting]:
                    if seq is not None and seq.request_id == request_id:
                        self.finish([seq])
                        seq.finish_reason = "abort"
                        return seq
                return None

            def schedule(self):
                if self.current is None and self.waiting:
                    self.current = self.waiting.popleft()
                    self.current.status = SequenceStatus.RUNNING
                seq = self.current
                if seq is None:
                    return StepPlan(())
                num_new = min(seq.num_uncomputed_tokens, self.context.max_num_batched_tokens)
                # The engine sizes the KV pool to hold at least one max_model_len sequence.
                self.context.allocator.allocate(seq.request_id, seq.num_computed_tokens + num_new)
                return StepPlan(((seq, num_new),))

            def finish(self, seqs):
                for seq in seqs:
                    self.context.allocator.free(seq.request_id)
                    seq.status = SequenceStatus.FINISHED
                    if seq is self.current:
                        self.current = None
                    elif seq in self.waiting:
                        self.waiting.remove(seq)

            def has_unfinished(self):
                return self.current is not None or bool(self.waiting)

            def stats(self):
                return SchedulerStats(num_waiting=len(self.waiting), num_running=int(self.current is not None),
                                      num_preemptions=0)

        @servelab.hookimpl
        def servelab_register_schedulers():
            return [SchedulerPlugin(name="one-at-a-time", factory=OneAtATime,
                                    description="first come, first served, one request at a time")]
    """


@hookspec
def servelab_register_drafters() -> list[DrafterPlugin]:
    """Return the speculative drafters this plugin provides (`[drafter] name = ...`).

    A factory is called as `factory(options, DrafterContext)` and returns a
    `servelab.interfaces.Drafter`; the core verifies every draft losslessly. Options
    are an attrs class whose fields are the section's keys. A complete plugin::

        import attrs
        import servelab
        from servelab.interfaces import DrafterContext
        from servelab.plugin_types import DrafterPlugin

        @attrs.frozen
        class RepeatOptions:
            num_speculative_tokens: int = 2

        class RepeatLast:
            # Proposes the sequence's last token again, k times (fewer near max_model_len).

            def __init__(self, options: RepeatOptions, context: DrafterContext):
                self.k = options.num_speculative_tokens
                self.max_model_len = context.max_model_len

            def propose(self, seqs):
                # A draft never runs past max_model_len: each drafted token takes a position.
                return {seq.request_id: seq.token_slice(seq.num_tokens - 1, seq.num_tokens)
                        * min(self.k, self.max_model_len - seq.num_tokens) for seq in seqs}

        @servelab.hookimpl
        def servelab_register_drafters():
            return [DrafterPlugin(name="repeat-last", factory=RepeatLast, options=RepeatOptions,
                                  description="proposes the last token again, k times")]
    """


@hookspec
def servelab_register_attention() -> list[AttentionPlugin]:
    """Return the attention backends this plugin provides (`[attention] name = ...`).

    A factory is called as `factory(options, AttentionContext)` and returns a
    `servelab.interfaces.AttentionBackend`, which owns the KV cache's layout and must
    match the `torch-paged` reference within dtype tolerance. A complete plugin, the
    reference with its `forward` wrapped (where a kernel of your own would go)::

        import servelab
        from servelab.plugin_types import AttentionPlugin
        from servelab.plugins.kernels.torch_paged import TorchPagedAttention

        class CountingAttention(TorchPagedAttention):
            # The reference backend, counting the layer calls it serves.

            calls = 0

            def forward(self, *args, **kwargs):
                self.calls += 1
                return super().forward(*args, **kwargs)

        @servelab.hookimpl
        def servelab_register_attention():
            return [AttentionPlugin(name="counting", factory=CountingAttention,
                                    description="torch-paged, counting its calls")]
    """


@hookspec
def servelab_register_routers() -> list[RouterPlugin]:
    """Return the request routers this plugin provides (`[router] name = ...`, read by
    fleets of replicas; the engine ignores it).

    A factory is called as `factory(options, RouterContext)` and returns a
    `servelab.interfaces.Router`. A complete plugin::

        import servelab
        from servelab.interfaces import RouterContext
        from servelab.plugin_types import RouterPlugin

        class FewestWaiting:
            # The replica with the fewest queued sequences; ties to the lower id.

            def __init__(self, options, context: RouterContext):
                pass

            def route(self, request, replicas):
                return min(replicas, key=lambda r: (r.num_waiting, r.replica_id)).replica_id

        @servelab.hookimpl
        def servelab_register_routers():
            return [RouterPlugin(name="fewest-waiting", factory=FewestWaiting,
                                 description="the replica with the fewest queued sequences")]
    """


@hookspec
def servelab_register_victims() -> list[VictimPlugin]:
    """Return the preemption victim policies this plugin provides (`[scheduler] preemption
    = ...`; every scheduler built on `servelab.kit` preempts by it).

    A factory is called as `factory(options, VictimContext)` and returns a
    `servelab.contracts.victim.VictimPolicy`; `choose` may return a `Preemption` to decide
    swap or recompute too. A complete plugin, the cost-aware score (bytes reclaimed per
    second of recompute, discounted by what a prefix cache shares)::

        import servelab
        from servelab.kit import KeyedVictim
        from servelab.plugin_types import VictimPlugin

        class CheapestToRedo(KeyedVictim):
            # Most blocks freed per token to recompute; a shared block frees nothing.

            def key(self, seq, allocator):
                table = allocator.block_table(seq.request_id)
                owned = sum(1 for block in table if allocator.ref_count(block) == 1)
                return owned / (1 + seq.num_computed_tokens)

        @servelab.hookimpl
        def servelab_register_victims():
            return [VictimPlugin(name="cheapest-to-redo", factory=CheapestToRedo,
                                 description="most KV freed per token recomputed")]
    """


@hookspec
def servelab_register_kv_transfers() -> list[KVTransferPlugin]:
    """Return the KV transports this plugin provides (`[kv_transfer] name = ...`, read by
    disaggregated deployments, `servelab.disagg`; one engine ignores it).

    A factory is called as `factory(options, KVTransferContext)` and returns a
    `servelab.contracts.kv_transfer.KVTransport`; `servelab.testing.TransportContract`
    is the suite it must pass (faults injected at every state). A complete plugin::

        import servelab
        from servelab.plugin_types import KVTransferPlugin
        from servelab.plugins.transports.in_process import InProcessTransport

        class CountingTransport(InProcessTransport):
            # The in-process transport, counting the handoffs it was offered.

            offers = 0

            def offer(self, handoff, payloads):
                self.offers += 1
                super().offer(handoff, payloads)

        @servelab.hookimpl
        def servelab_register_kv_transfers():
            return [KVTransferPlugin(name="counting", factory=CountingTransport,
                                     description="in-process, counting its offers")]
    """


@hookspec
def servelab_register_evictors() -> list[EvictionPlugin]:
    """Return the prefix-cache eviction policies this plugin provides (`[eviction] name =
    ...`; every prefix cache built on `servelab.kit` orders its evictable blocks by it).

    A factory is called as `factory(options, EvictionContext)` and returns a
    `servelab.interfaces.EvictionPolicy`. A complete plugin::

        import servelab
        from servelab.kit import KeyedEviction
        from servelab.plugin_types import EvictionPlugin

        class DeepestFirst(KeyedEviction):
            # The longest prefixes go first; among equals the least recently used.

            def key(self, candidate):
                return -candidate.depth, candidate.last_access

        @servelab.hookimpl
        def servelab_register_evictors():
            return [EvictionPlugin(name="deepest-first", factory=DeepestFirst,
                                   description="evicts the longest cached prefixes first")]
    """


@hookspec
def servelab_register_adapter_residency() -> list[AdapterResidencyPlugin]:
    """Return the LoRA adapter residency policies this plugin provides (`[adapter_residency]
    name = ...`): which adapters in the fast pool (`[engine] max_loras`) make room when a
    step needs one that is not there.

    A factory is called as `factory(options, ResidencyContext)` and returns a
    `servelab.contracts.adapter_residency.AdapterResidencyPolicy`. A complete plugin::

        import servelab
        from servelab.kit import KeyedResidency
        from servelab.plugin_types import AdapterResidencyPlugin

        class LargestFirst(KeyedResidency):
            # The adapter taking the most pool memory goes first; among equals the oldest.

            def key(self, candidate):
                return -candidate.nbytes, candidate.last_used, candidate.lora_id

        @servelab.hookimpl
        def servelab_register_adapter_residency():
            return [AdapterResidencyPlugin(name="largest-first", factory=LargestFirst,
                                           description="evicts the largest adapters first")]
    """


@hookspec
def servelab_register_logits_processors() -> list[LogitsProcessorPlugin]:
    """Return the logits processors this plugin provides. Every installed processor is
    built at engine start; a request uses one when it names it
    (`SamplingParams(logits_processors=[...])`) or the config lists it in
    `[logits_processors] default`.

    A factory is called as `factory(options, LogitsProcessorContext)` and returns a
    `servelab.interfaces.LogitsProcessor`. A complete plugin::

        import attrs
        import servelab
        from servelab.interfaces import LogitsProcessorContext
        from servelab.plugin_types import LogitsProcessorPlugin

        @attrs.frozen
        class BanOptions:
            token_id: int = 0

        class BanOne:
            # Never samples one token id.

            def __init__(self, options: BanOptions, context: LogitsProcessorContext):
                self.token_id = options.token_id

            def new_state(self, request):
                return None  # nothing per request

            def apply(self, logits, states):
                logits[:, self.token_id] = float("-inf")
                return logits

            def accept(self, state, token_id):
                pass

            def rollback(self, state, num_tokens):
                pass

        @servelab.hookimpl
        def servelab_register_logits_processors():
            return [LogitsProcessorPlugin(name="ban-one", factory=BanOne, options=BanOptions,
                                          description="never samples [logits_processors.ban-one] token_id")]
    """


# ---------------------------------------------------------------- observers


@hookspec
def servelab_engine_started(engine: Any) -> None:
    """Called once the engine has built its model, cache and policies.

    Example::

        @servelab.hookimpl
        def servelab_engine_started(engine):
            print("KV blocks:", engine.allocator.stats().num_blocks)
    """


@hookspec
def servelab_step_finished(engine: Any, report: Any) -> None:
    """Called after every engine step with a StepReport (plan size, timings, KV stats).

    Example::

        @servelab.hookimpl
        def servelab_step_finished(engine, report):
            print(report.num_scheduled_tokens, report.allocator_stats.num_used_blocks)
    """


@hookspec
def servelab_request_finished(engine: Any, output: Any) -> None:
    """Called once per finished request with its RequestOutput.

    Example::

        @servelab.hookimpl
        def servelab_request_finished(engine, output):
            print(output.request_id, output.finish_reason, len(output.token_ids))
    """


# Step and runner events: what a profiler or a calibration needs to see of a step,
# without wrapping the engine's methods.


@hookspec
def servelab_step_started(engine: Any) -> None:
    """Called as each engine step begins, before anything of it runs.

    Example::

        @servelab.hookimpl
        def servelab_step_started(engine):
            self.started = time.process_time()
    """


@hookspec
def servelab_step_planned(engine: Any, plan: Any) -> None:
    """Called with the step's StepPlan once it is scheduled and not empty, before the
    runner prepares it (each sequence's num_computed_tokens is still the step's start).

    Example::

        @servelab.hookimpl
        def servelab_step_planned(engine, plan):
            print([num_new for _, num_new in plan.scheduled])
    """


@hookspec
def servelab_runner_executed(engine: Any, plan: Any, inputs: Any) -> None:
    """Called after the model runner executed a step, with the plan and the inputs it
    prepared (servelab.interfaces.StepInputs; the runner's own type).

    Example::

        @servelab.hookimpl
        def servelab_runner_executed(engine, plan, inputs):
            print(len(inputs.sampled_seq_rows), "sequences sampled")
    """


@hookspec(firstresult=True)
def servelab_tensor_parallel_runner(spec: Any) -> Any:
    """A runner spreading the model over spec.engine.tensor_parallel_size ranks
    (servelab.engine_setup.TensorParallelSpec), or None. servelab.distributed provides
    the built-in one, over torch.distributed; the engine calls this only when
    tensor_parallel_size > 1.

    Example::

        @servelab.hookimpl
        def servelab_tensor_parallel_runner(spec):
            return MyRunner(spec.source.path, spec.engine.tensor_parallel_size)  # a servelab.interfaces.Runner
    """
