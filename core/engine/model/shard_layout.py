"""Which slice of the model each tensor-parallel rank holds (Megatron-style).

Query heads are split evenly; KV heads are split when there are at least as many as
ranks, else each KV head is replicated on the ranks whose query heads read it. The MLP's
intermediate dimension and the vocabulary (embedding and LM head rows, padded to equal
shards) are split in contiguous ranges. Norms are replicated.
"""

from __future__ import annotations

import attrs

from servelab.errors import ConfigError
from servelab.model.model_config import ModelConfig


def check_shardable(config: ModelConfig, size: int) -> None:
    """A ConfigError naming the model dimension that `size` ranks cannot split."""
    if size < 1:
        raise ConfigError(f"[engine] tensor_parallel_size must be >= 1, got {size}")
    if config.num_heads % size:
        raise ConfigError(
            f"[engine] tensor_parallel_size={size} does not divide the model's num_attention_heads="
            f"{config.num_heads}; choose a divisor of {config.num_heads}")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ConfigError(
            f"[engine] tensor_parallel_size={size} and the model's num_key_value_heads={kv} must divide "
            f"one another (KV heads are split, or replicated when there are fewer than ranks)")
    if config.intermediate_size < size:
        raise ConfigError(f"[engine] tensor_parallel_size={size} exceeds the model's "
                          f"intermediate_size={config.intermediate_size}")


def check_experts_shardable(config: ModelConfig, tensor_parallel_size: int, expert_parallel_size: int,
                            model: str = "the model") -> None:
    """A ConfigError where tensor parallelism would have to shard a mixture-of-experts
    model's experts: it runs only with expert parallelism over the same ranks (EP = TP)."""
    if tensor_parallel_size > 1 and config.moe is not None and expert_parallel_size != tensor_parallel_size:
        raise ConfigError(f"[engine] tensor_parallel_size > 1 does not shard a mixture-of-experts model's experts "
                          f"yet ({model} is {config.model_type}); spread them over the same ranks with "
                          f"expert_parallel_size={tensor_parallel_size}")


def _range(total: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's contiguous share of `total`, the remainder spread over the first ranks."""
    return rank * total // size, (rank + 1) * total // size


@attrs.frozen
class ShardLayout:
    config: ModelConfig  # the whole model's
    rank: int
    size: int

    def __attrs_post_init__(self) -> None:
        check_shardable(self.config, self.size)

    @property
    def heads(self) -> tuple[int, int]:
        """Query heads [start, end) of this rank."""
        per = self.config.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    @property
    def kv_heads(self) -> tuple[int, int]:
        """KV heads [start, end): a share, or the one head this rank's query heads read."""
        kv = self.config.num_kv_heads
        if kv >= self.size:
            per = kv // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * kv // self.size
        return head, head + 1

    @property
    def intermediate(self) -> tuple[int, int]:
        return _range(self.config.intermediate_size, self.rank, self.size)

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """Vocabulary rows [start, end) this rank holds (its shard is padded to vocab_per_rank)."""
        start = self.rank * self.vocab_per_rank
        return min(start, self.config.vocab_size), min(start + self.vocab_per_rank, self.config.vocab_size)

    def local_config(self) -> ModelConfig:
        """The shape one rank's decoder layers and attention see (heads, MLP width, vocab shard)."""
        start, end = self.intermediate
        kv_start, kv_end = self.kv_heads
        return attrs.evolve(self.config, num_heads=self.config.num_heads // self.size,
                            num_kv_heads=kv_end - kv_start, intermediate_size=end - start,
                            vocab_size=self.vocab_per_rank)


def local_model_config(config: ModelConfig, size: int) -> ModelConfig:
    """What one of `size` ranks holds of `config` (rank 0's; every rank's heads count the same)."""
    return ShardLayout(config, 0, size).local_config() if size > 1 else config
