"""Built-in preemption victims (`[scheduler] preemption = ...`), made of servelab.kit."""

import servelab
from servelab.plugin_types import VictimPlugin


@servelab.hookimpl
def servelab_register_victims():
    return [
        VictimPlugin(name="newest", factory="servelab.kit.victims:Newest",
                     description="the last of the running batch in rank order (lowest priority, newest)"),
        VictimPlugin(name="fewest-computed-tokens", factory="servelab.kit.victims:FewestComputedTokens",
                     description="the one whose recompute costs least"),
        VictimPlugin(name="most-kv-blocks", factory="servelab.kit.victims:MostKVBlocks",
                     description="the one holding the most KV blocks: one preemption frees the most"),
        VictimPlugin(name="lowest-priority-then-newest", factory="servelab.kit.victims:LowestPriorityThenNewest",
                     description="the largest priority value, then the latest arrival (aging ignored)"),
    ]
