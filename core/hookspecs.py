"""pluggy hook specifications: one registration hook per policy kind, and observer
hooks for lifecycle events.

A complete plugin module (register it under the `servelab.plugins` entry-point group,
or at run time with `PluginRegistry.register(module)`)::

    import attrs
    import servelab
    from servelab.plugin_types import SchedulerPlugin

    @attrs.frozen
    class SJFOptions:
        max_wait_steps: int = 100

    @servelab.hookimpl
    def servelab_register_schedulers():
        return [SchedulerPlugin(name="sjf", factory="my_pkg.sjf:SJFScheduler",
                                options=SJFOptions, description="shortest job first")]
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT = "servelab"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def servelab_register_allocators() -> list[Any]:
    """Return AllocatorPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_allocators():
            return [AllocatorPlugin(name="mine", factory="pkg.mod:MyAllocator")]
    """


@hookspec
def servelab_register_schedulers() -> list[Any]:
    """Return SchedulerPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_schedulers():
            return [SchedulerPlugin(name="mine", factory="pkg.mod:MyScheduler")]
    """


@hookspec
def servelab_register_drafters() -> list[Any]:
    """Return DrafterPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_drafters():
            return [DrafterPlugin(name="mine", factory="pkg.mod:MyDrafter")]
    """


@hookspec
def servelab_register_attention() -> list[Any]:
    """Return AttentionPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_attention():
            return [AttentionPlugin(name="mine", factory="pkg.mod:MyBackend")]
    """


@hookspec
def servelab_register_routers() -> list[Any]:
    """Return RouterPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_routers():
            return [RouterPlugin(name="mine", factory="pkg.mod:MyRouter")]
    """


@hookspec
def servelab_register_logits_processors() -> list[Any]:
    """Return LogitsProcessorPlugin records.

    Example::

        @servelab.hookimpl
        def servelab_register_logits_processors():
            return [LogitsProcessorPlugin(name="mine", factory="pkg.mod:MyProcessor")]
    """


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
