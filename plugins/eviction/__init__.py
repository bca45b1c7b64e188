"""Built-in prefix-cache eviction policies (`[eviction] name = ...`)."""

import servelab
from servelab.plugin_types import EvictionPlugin


@servelab.hookimpl
def servelab_register_evictors():
    return [
        EvictionPlugin(name="lru", factory="servelab.kit:LeastRecentlyUsed",
                       description="least recently used first (radix: leaves, tail first)"),
        EvictionPlugin(name="lfu", factory="servelab.plugins.eviction.policies:LeastFrequentlyUsed",
                       description="fewest prefix hits first, then least recently used"),
        EvictionPlugin(name="slru", factory="servelab.plugins.eviction.policies:SegmentedLRU",
                       description="segmented LRU: blocks never reused (probation) before reused ones (protected)"),
        EvictionPlugin(name="waiting-aware", factory="servelab.plugins.eviction.policies:WaitingAware",
                       description="LRU that spares the prefixes waiting requests are about to hit"),
    ]
