"""Built-in KV allocators."""

import servelab
from servelab.plugin_types import AllocatorPlugin


@servelab.hookimpl
def servelab_register_allocators():
    return [
        AllocatorPlugin(
            name="paged",
            factory="servelab.plugins.allocators.paged:PagedAllocator",
            description="PagedAttention block tables: blocks on demand from a free list",
        ),
    ]
