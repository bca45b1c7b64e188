"""Built-in schedulers."""

import servelab
from servelab.plugin_types import SchedulerPlugin
from servelab.kit import ContinuousOptions
from servelab.kit import QueueOptions


@servelab.hookimpl
def servelab_register_schedulers():
    return [
        SchedulerPlugin(
            name="static",
            factory="servelab.plugins.schedulers.static:StaticScheduler",
            options=QueueOptions,
            description="static batching: run a batch to completion before admitting anyone; finished slots idle",
        ),
        SchedulerPlugin(
            name="continuous",
            factory="servelab.kit:ContinuousScheduler",
            options=ContinuousOptions,
            description="iteration-level batching (Orca): admit and retire every step, priority order, "
                        "preempt by recompute",
        ),
        SchedulerPlugin(
            name="chunked-prefill",
            factory="servelab.kit:ChunkedPrefillScheduler",
            options=QueueOptions,
            description="continuous batching with prompts split into chunks under the token budget, decodes first",
        ),
    ]
