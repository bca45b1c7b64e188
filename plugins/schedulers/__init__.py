"""Built-in schedulers."""

import servelab
from servelab.plugin_types import SchedulerPlugin


@servelab.hookimpl
def servelab_register_schedulers():
    return [
        SchedulerPlugin(
            name="continuous",
            factory="servelab.plugins.schedulers.continuous:ContinuousScheduler",
            description="iteration-level batching (Orca): admit and retire every step, FCFS, preempt by recompute",
        ),
    ]
