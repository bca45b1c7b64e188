"""Built-in LoRA adapter residency policies (`[adapter_residency] name = ...`)."""

import servelab
from servelab.plugin_types import AdapterResidencyPlugin
from servelab.plugins.residency.options import PinnedOptions


@servelab.hookimpl
def servelab_register_adapter_residency():
    return [
        AdapterResidencyPlugin(name="lru", factory="servelab.kit:LeastRecentlyUsedAdapter",
                               description="the adapter whose last step is oldest leaves the fast pool first"),
        AdapterResidencyPlugin(name="lfu", factory="servelab.plugins.residency.policies:LeastFrequentlyUsedAdapter",
                               description="the adapter run in the fewest steps first, then least recently used"),
        AdapterResidencyPlugin(name="pinned", factory="servelab.plugins.residency.policies:PinnedAdapters",
                               options=PinnedOptions,
                               description="lru that evicts the adapters named in `pinned` only when nothing else "
                                           "can go"),
        AdapterResidencyPlugin(name="queue-aware", factory="servelab.plugins.residency.policies:QueueAware",
                               description="keeps the adapters the waiting queue needs (S-LoRA): fewest waiting "
                                           "sequences first, then least recently used"),
    ]
