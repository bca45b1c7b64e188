"""Which slice of the model each tensor-parallel rank holds: servelab.model.shard_layout
(model geometry the engine sizes its KV cache by, so it lives with the model)."""

from servelab.model.shard_layout import ShardLayout, check_shardable, local_model_config

__all__ = ["ShardLayout", "check_shardable", "local_model_config"]
