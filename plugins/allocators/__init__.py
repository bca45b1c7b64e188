"""Built-in KV allocators."""

import servelab
from servelab.plugin_types import AllocatorPlugin


@servelab.hookimpl
def servelab_register_allocators():
    return [
        AllocatorPlugin(
            name="naive",
            factory="servelab.plugins.allocators.naive:NaiveAllocator",
            description="one contiguous max_model_len reservation per sequence, first fit (pre-PagedAttention)",
        ),
        AllocatorPlugin(
            name="paged",
            factory="servelab.kit:PagedAllocator",
            description="PagedAttention block tables: ref-counted blocks on demand, fork and copy-on-write",
        ),
        AllocatorPlugin(
            name="radix",
            factory="servelab.plugins.allocators.radix:RadixAllocator",
            description="paged blocks plus a radix-tree prefix cache: shared prompt prefixes computed once",
        ),
        AllocatorPlugin(
            name="hash",
            factory="servelab.plugins.allocators.hash_prefix:HashAllocator",
            description="paged blocks plus a hash prefix cache (chained block hashes, LRU eviction), as in vLLM",
        ),
    ]
