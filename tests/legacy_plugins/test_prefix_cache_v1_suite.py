"""The version-1 prefix cache's own test suite: the allocator contract inherited as its
author wrote it against version 1 (frozen: do not edit). On this servelab the rules of
later versions and of capabilities it lacks (reset_prefix_cache) do not apply to it."""

from servelab.testing import AllocatorContract

from legacy_plugins.prefix_cache_v1 import FullBlockCacheV1


class TestFullBlockCacheV1(AllocatorContract):
    factory = FullBlockCacheV1
