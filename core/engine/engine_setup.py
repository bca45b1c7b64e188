"""Deriving the engine's limits (context length, token budget, KV blocks) from the
config and the model, with errors that name the key to change."""

from __future__ import annotations

from typing import Any, Callable

import attrs
import torch

from servelab.config import EngineConfig, EngineSection, build_options
from servelab.contracts.kv_transfer import KVTransferContext, KVTransport
from servelab.contracts.victim import VictimContext
from servelab.errors import ConfigError, PluginError
from servelab.interfaces import (AllocatorContext, AttentionContext, ContiguousAllocator, ContiguousBlockTablesBackend,
                                 DrafterContext, EvictionContext, FeatureDrafter, FeatureRunner, ForkingAllocator,
                                 ForkingScheduler, LMHeadRunner, LogitsProcessorContext, QuantizedKVBackend,
                                 SchedulerContext, SlotMovingRunner, TargetModel, TieredRunner, TreeAttentionBackend,
                                 TreeDrafter)
from servelab.kit.tier import HostTier
from servelab.logits_pipeline import LogitsPipeline
from servelab.lora_setup import attach_lora, max_loras_per_batch
from servelab.kv_sizing import DTYPE_BYTES, blocks_for, kv_pool_blocks
from servelab.model.loader import DTYPES
from servelab.model.model_config import ModelConfig
from servelab.model.onednn_caches import limit_onednn_caches
from servelab.model.shard_layout import check_experts_shardable, local_model_config
from servelab.model_source import CheckpointSource, ModelSource
from servelab.plugin_types import KINDS
from servelab.registry import PluginRegistry, RegisteredPolicy, build_policy, check_contract_version
from servelab.sampler import filtered_probs
from servelab.speculation import Speculator
from servelab.speculation_length import split_length_options


@attrs.frozen
class EngineLimits:
    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int


def resolve_limits(engine: EngineSection, model: ModelConfig) -> EngineLimits:
    max_model_len = engine.max_model_len or min(model.max_position_embeddings, 2048)
    if max_model_len > model.max_position_embeddings:
        raise ConfigError(
            f"[engine] max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={model.max_position_embeddings}")
    if model.sliding_window is not None and max_model_len > model.sliding_window:
        raise ConfigError(
            f"[engine] max_model_len={max_model_len} exceeds the model's sliding_window={model.sliding_window}, "
            f"which servelab does not implement; set max_model_len <= {model.sliding_window}")
    max_num_batched_tokens = engine.max_num_batched_tokens or max(2048, max_model_len)
    # Past what max_num_seqs sequences of max_model_len can hold, more blocks sit idle.
    useful_blocks = engine.max_num_seqs * blocks_for(max_model_len, engine.block_size)
    num_kv_blocks = engine.num_kv_blocks or min(
        kv_pool_blocks(engine.kv_cache_memory, model.kv_bytes_per_token(DTYPE_BYTES[engine.dtype], engine.kv_cache_dtype),
                       engine.block_size),
        useful_blocks)
    if num_kv_blocks * engine.block_size < max_model_len:
        raise ConfigError(
            f"the KV cache holds {num_kv_blocks} blocks x {engine.block_size} = "
            f"{num_kv_blocks * engine.block_size} tokens, fewer than max_model_len={max_model_len}; "
            f"raise [engine] kv_cache_memory or num_kv_blocks, or lower max_model_len")
    return EngineLimits(max_model_len, max_num_batched_tokens, num_kv_blocks)


def target_model(source: Any, runner: Any, engine: EngineSection) -> TargetModel | None:
    """What drafters may read of the target: its LM head (None for the simulator)."""
    if not isinstance(runner, LMHeadRunner):
        return None
    config = source.model_config
    return TargetModel(hidden_size=config.hidden_size, vocab_size=config.vocab_size, lm_head=runner.lm_head,
                       path=str(source.path) if source.path is not None else None,
                       dtype=DTYPES[engine.dtype], device=torch.device(engine.device),
                       embed=runner.embed if isinstance(runner, FeatureRunner) else None,
                       num_layers=config.num_layers)


def load_aux_model(spec: str, num_blocks: int, engine: EngineSection, registry: Any, attention: Any,
                   max_positions: int) -> Any:
    """Another checkpoint (a draft model) in the engine's dtype and device, with its own KV
    cache of `num_blocks` blocks and its own instance of the engine's attention backend."""
    source = CheckpointSource(spec)
    config = source.model_config
    if config.max_position_embeddings < max_positions:
        raise ConfigError(
            f"model {spec!r} handles {config.max_position_embeddings} positions, fewer than "
            f"max_model_len={max_positions}; lower [engine] max_model_len or choose another model")
    registered = registry.select("attention", attention.name)
    options = build_options(registered.plugin.options, attention.options, KINDS["attention"].section, attention.name)
    backend = build_policy(registered, options, AttentionContext(
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        block_size=engine.block_size, num_blocks=num_blocks, dtype=DTYPES[engine.dtype],
        device=torch.device(engine.device)))
    return source.build_runner(backend, engine, num_blocks, max_positions)


@attrs.frozen
class EnginePolicies:
    """What an engine is built from: the model source, its limits, one policy of each kind
    and the model runner."""

    source: ModelSource
    limits: EngineLimits
    allocator: Any
    scheduler: Any
    attention: Any
    runner: Any
    speculator: Speculator | None
    logits_pipeline: LogitsPipeline
    host_tier: HostTier | None = None  # `[kv_offload]`
    lora: Any = None  # the LoRA adapters (servelab.lora_manager.LoRAManager), `[engine] enable_lora`


def build_policies(config: EngineConfig, registry: PluginRegistry, clock: Any,
                   source: ModelSource | None) -> EnginePolicies:
    """Every policy the config names, the model and its runner. Names and options are
    checked before the (slow) model load."""
    selected = {kind: _select(registry, kind, section) for kind, section in _policy_sections(config)}
    source = source or CheckpointSource(config.engine.model)
    engine = config.engine
    check_experts_shardable(source.model_config, engine.tensor_parallel_size, engine.expert_parallel_size,
                            repr(engine.model))
    # Under tensor parallelism each rank holds its share of the heads: KV memory and the
    # attention backend are sized by what one rank holds.
    shard_config = local_model_config(source.model_config, engine.tensor_parallel_size)
    limits = resolve_limits(engine, shard_config)
    device = torch.device(engine.device)
    eviction = build_policy(*selected["evictors"], EvictionContext(limits.num_kv_blocks, engine.block_size))
    host_tier = _build_host_tier(config, registry, selected["evictors"][0], shard_config)
    allocator = build_policy(*selected["allocators"], AllocatorContext(
        num_blocks=limits.num_kv_blocks, block_size=engine.block_size, max_model_len=limits.max_model_len,
        eviction=eviction, host_tier=host_tier))
    scheduler = build_policy(*selected["schedulers"], SchedulerContext(
        allocator=allocator, max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
        max_model_len=limits.max_model_len, clock=clock, host_tier=host_tier,
        victims=victim_builder(registry, VictimContext(block_size=engine.block_size, max_num_seqs=engine.max_num_seqs,
                                                       can_swap=host_tier is not None)),
        max_loras_per_batch=max_loras_per_batch(config)))
    attention_context = AttentionContext(
        num_heads=shard_config.num_heads, num_kv_heads=shard_config.num_kv_heads, head_dim=shard_config.head_dim,
        block_size=engine.block_size, num_blocks=limits.num_kv_blocks, dtype=DTYPES[engine.dtype], device=device,
        kv_cache_dtype=engine.kv_cache_dtype)
    attention = build_policy(*selected["attention"], attention_context)
    _check_pairing(config, attention, allocator)
    _check_kv_cache_dtype(config, attention)
    if device.type == "cpu":  # before the first oneDNN kernel: then it is too late
        limit_onednn_caches(engine.onednn_cache_capacity)
    if engine.expert_parallel_size > 1:
        _check_expert_parallel(engine, source)
    if engine.pipeline_parallel_size > source.model_config.num_layers:
        raise ConfigError(f"[engine] pipeline_parallel_size={engine.pipeline_parallel_size} exceeds the model's "
                          f"{source.model_config.num_layers} decoder layers")
    ranks = max(engine.tensor_parallel_size * engine.pipeline_parallel_size, engine.expert_parallel_size)
    if ranks > 1 and isinstance(source, CheckpointSource):
        runner = _start_tensor_parallel(registry, TensorParallelSpec(
            source, engine, *selected["attention"], attention_context, limits.num_kv_blocks, limits.max_model_len,
            attention))
    else:
        runner = source.build_runner(attention, engine, limits.num_kv_blocks, limits.max_model_len)
    if host_tier is not None:
        _attach_host_tier(config, runner, host_tier, allocator)
    lora = attach_lora(config, selected["adapter_residency"], runner) if "adapter_residency" in selected else None
    speculator = None
    if "drafters" in selected:
        speculator = _build_speculator(config, registry, source, runner, limits, selected["drafters"], allocator,
                                       attention)
    pipeline = _build_logits_pipeline(config, registry, source, device)
    return EnginePolicies(source, limits, allocator, scheduler, attention, runner, speculator, pipeline, host_tier,
                          lora)


def victim_builder(registry: PluginRegistry, context: VictimContext) -> Callable[[str], Any]:
    """victims(name): the victim policy `name` (`[scheduler] preemption`), from the registry."""

    def build(name: str) -> Any:
        registered = registry.select("victims", name)
        return build_policy(registered, registered.plugin.options(), context)

    return build


def host_tier_blocks(config: EngineConfig, model: ModelConfig) -> int:
    """Blocks of the host tier `[kv_offload]` asks for (0: off)."""
    section, engine = config.kv_offload, config.engine
    if section.host_blocks:
        return section.host_blocks
    bytes_per_token = model.kv_bytes_per_token(DTYPE_BYTES[engine.dtype], engine.kv_cache_dtype)
    return kv_pool_blocks(section.host_memory, bytes_per_token, engine.block_size)


def _build_host_tier(config: EngineConfig, registry: PluginRegistry, eviction: RegisteredPolicy,
                     model: ModelConfig) -> HostTier | None:
    if not config.kv_offload.enabled:
        return None
    engine = config.engine
    if engine.tensor_parallel_size > 1:
        raise ConfigError("[kv_offload] is not supported with [engine] tensor_parallel_size > 1 yet; "
                          "remove [kv_offload] or run on one rank")
    num_blocks = host_tier_blocks(config, model)
    if num_blocks < 1:
        raise ConfigError(f"[kv_offload] host_memory={config.kv_offload.host_memory} bytes holds no "
                          f"{engine.block_size}-token block; raise it or use host_blocks")
    # The host tier evicts with its own instance of the `[eviction]` policy, sized to it.
    options = build_options(eviction.plugin.options, config.eviction.options, KINDS["evictors"].section,
                            config.eviction.name)
    policy = build_policy(eviction, options, EvictionContext(num_blocks, engine.block_size))
    block_bytes = model.kv_bytes_per_token(DTYPE_BYTES[engine.dtype], engine.kv_cache_dtype) * engine.block_size
    return HostTier(num_blocks, engine.block_size, policy, int(block_bytes))


def _attach_host_tier(config: EngineConfig, runner: Any, host_tier: HostTier, allocator: Any) -> None:
    if not isinstance(runner, TieredRunner):
        raise ConfigError(f"[kv_offload] needs a runner that holds a host KV tier; {type(runner).__name__} "
                          f"does not")
    runner.attach_host_tier(host_tier.num_blocks, config.kv_offload.path or None)
    if isinstance(allocator, ForkingAllocator):  # copies queued before a move travel before it
        host_tier.copy_source = allocator.take_block_copies


@attrs.frozen
class TensorParallelSpec:
    """What a runner over several ranks is built from (servelab_tensor_parallel_runner)."""

    source: CheckpointSource
    engine: EngineSection
    attention: RegisteredPolicy
    attention_options: Any
    attention_context: AttentionContext  # one rank's share of the heads
    num_blocks: int
    max_positions: int
    backend: Any  # rank 0's attention backend


def _check_expert_parallel(engine: EngineSection, source: ModelSource) -> None:
    moe = source.model_config.moe
    if moe is None:
        raise ConfigError(f"[engine] expert_parallel_size={engine.expert_parallel_size} needs a mixture-of-experts "
                          f"model; {engine.model!r} is dense ({source.model_config.model_type})")
    if moe.num_experts < engine.expert_parallel_size:
        raise ConfigError(f"[engine] expert_parallel_size={engine.expert_parallel_size} exceeds the model's "
                          f"{moe.num_experts} experts")
    if not isinstance(source, CheckpointSource):
        raise ConfigError("[engine] expert_parallel_size > 1 runs a checkpoint's model, not a simulated one")


def _start_tensor_parallel(registry: PluginRegistry, spec: TensorParallelSpec) -> Any:
    runner = registry.hook.servelab_tensor_parallel_runner(spec=spec)
    if runner is None:
        raise ConfigError(f"[engine] tensor_parallel_size={spec.engine.tensor_parallel_size} needs a plugin that "
                          f"runs the model over several ranks (servelab.distributed, registered by servelab's "
                          f"entry points); this registry has none")
    return runner


def _policy_sections(config: EngineConfig):
    yield "allocators", config.allocator
    yield "schedulers", config.scheduler
    yield "attention", config.attention
    yield "evictors", config.eviction
    if config.engine.enable_lora:  # chosen only where adapters are served
        yield "adapter_residency", config.adapter_residency
    if config.drafter is not None:
        yield "drafters", config.drafter


def _select(registry: PluginRegistry, kind: str, section: Any) -> tuple[RegisteredPolicy, Any]:
    registered = registry.select(kind, section.name)
    values = section.options
    if kind == "drafters":  # the engine's own keys (dynamic speculation length) serve every drafter
        _, values = split_length_options(values)
    return registered, build_options(registered.plugin.options, values, KINDS[kind].section, section.name)


def _check_pairing(config: EngineConfig, attention: Any, allocator: Any) -> None:
    needs_contiguous = (isinstance(attention, ContiguousBlockTablesBackend)
                        and attention.requires_contiguous_block_tables)
    if needs_contiguous and not (isinstance(allocator, ContiguousAllocator) and allocator.contiguous_block_tables):
        raise ConfigError(
            f"attention {config.attention.name!r} reads each sequence's K/V as one contiguous run of blocks, "
            f"but allocator {config.allocator.name!r} hands out block tables that are not contiguous: "
            f"choose allocator 'naive' (contiguous reservations), or attention 'torch-paged' (any block table)")


def _check_kv_cache_dtype(config: EngineConfig, attention: Any) -> None:
    """A quantized cache needs a backend that declares it reads and writes that format."""
    kv_cache_dtype = config.engine.kv_cache_dtype
    if kv_cache_dtype == "auto":
        return
    if isinstance(attention, QuantizedKVBackend) and kv_cache_dtype in attention.supported_kv_cache_dtypes:
        return
    supported = sorted(attention.supported_kv_cache_dtypes) if isinstance(attention, QuantizedKVBackend) else []
    raise ConfigError(
        f"[engine] kv_cache_dtype={kv_cache_dtype!r}: attention {config.attention.name!r} cannot store a quantized "
        f"KV cache in that format (it supports {', '.join(supported) or 'none'}); choose attention 'cpu-paged', "
        f"'torch-paged' or 'cupy-paged' (CUDA) (int8, fp8_e4m3, fp8_e5m2), or kv_cache_dtype 'auto'")


def _build_speculator(config: EngineConfig, registry: PluginRegistry, source: ModelSource, runner: Any,
                      limits: EngineLimits, selected: tuple[RegisteredPolicy, Any], allocator: Any,
                      attention: Any) -> Speculator:
    engine = config.engine
    context = DrafterContext(
        vocab_size=source.model_config.vocab_size, max_model_len=limits.max_model_len,
        max_num_seqs=engine.max_num_seqs, block_size=engine.block_size, num_kv_blocks=limits.num_kv_blocks,
        seed=engine.seed, filtered_probs=filtered_probs, target=target_model(source, runner, engine),
        load_model=lambda spec, num_blocks: load_aux_model(spec, num_blocks, engine, registry, config.attention,
                                                           limits.max_model_len))
    drafter = build_policy(*selected, context)
    if isinstance(drafter, TreeDrafter) and drafter.proposes_trees:
        _check_trees(config, attention, runner)
    if isinstance(drafter, FeatureDrafter) and not isinstance(runner, FeatureRunner):
        raise ConfigError(f"drafter {config.drafter.name!r} reads the target's intermediate features "
                          f"(FeatureDrafter); the {type(runner).__name__} does not return them (FeatureRunner): "
                          f"use the single-process model runner")
    length, _ = split_length_options(config.drafter.options)
    return Speculator(config.drafter.name, drafter, allocator, limits.max_model_len, source.model_config.vocab_size,
                      length, slot_mover=runner.move_slots if isinstance(runner, SlotMovingRunner) else None,
                      block_size=engine.block_size)


def _check_trees(config: EngineConfig, attention: Any, runner: Any) -> None:
    """A drafter proposing token trees needs a backend that attends them under a tree mask
    and a runner that moves an accepted path's K/V into place."""
    drafter = config.drafter.name
    if not (isinstance(attention, TreeAttentionBackend) and attention.supports_tree_attention):
        raise ConfigError(
            f"drafter {drafter!r} proposes token trees, but attention backend {config.attention.name!r} does not "
            f"support tree masks (the TreeAttentionBackend capability, supports_tree_attention); choose attention "
            f"'cpu-paged' or 'torch-paged', or configure the drafter to propose chains")
    if not isinstance(runner, SlotMovingRunner):
        raise ConfigError(
            f"drafter {drafter!r} proposes token trees, but the model runner {type(runner).__name__} cannot move "
            f"KV slots (the SlotMovingRunner capability, move_slots); configure the drafter to propose chains")


def _build_logits_pipeline(config: EngineConfig, registry: PluginRegistry, source: ModelSource,
                           device: torch.device) -> LogitsPipeline:
    """Every installed logits processor; requests select which ones they use."""
    section = config.logits_processors
    installed = registry.policies("logits_processors")
    unknown = sorted(set(section.options) - set(installed))
    if unknown:
        raise ConfigError(f"[logits_processors] has options for unknown processor {unknown[0]!r}; "
                          f"installed: {', '.join(installed) or 'none'}")
    context = LogitsProcessorContext(vocab_size=source.model_config.vocab_size,
                                     eos_token_ids=frozenset(source.model_config.eos_token_ids),
                                     tokenizer=source.tokenizer, device=device)
    processors = {}
    for name, registered in installed.items():
        check_contract_version(registered, KINDS["logits_processors"])
        options = build_options(registered.plugin.options, section.options.get(name, {}),
                                KINDS["logits_processors"].section, name)
        processors[name] = build_policy(registered, options, context)
    return LogitsPipeline(processors, section.default)


def fork_refusal(config: EngineConfig, allocator: Any, scheduler: Any) -> str | None:
    """Why these policies cannot sample n > 1 (by forking a prompt's KV), or None."""
    lacking = []
    if not isinstance(allocator, ForkingAllocator):
        lacking.append(f"allocator {config.allocator.name!r} cannot fork (choose naive, paged, radix or hash)")
    if not isinstance(scheduler, ForkingScheduler):
        lacking.append(f"scheduler {config.scheduler.name!r} cannot fork")
    return " and ".join(lacking) or None


def build_kv_transport(config: EngineConfig, registry: PluginRegistry, context: KVTransferContext) -> Any:
    """The KV transport `[kv_transfer]` selects (the default, in-process, without the
    section), its options checked: what a disaggregated deployment's roles hand KV over."""
    kind = KINDS["kv_transfers"]
    section = config.kv_transfer
    name = section.name if section is not None else kind.default
    registered = registry.select(kind.key, name)
    options = build_options(registered.plugin.options, section.options if section is not None else {}, kind.section,
                            name)
    transport = build_policy(registered, options, context)
    if not isinstance(transport, KVTransport):
        raise PluginError(f"KV transport {name!r} from distribution {registered.distribution!r} built "
                          f"{type(transport).__name__}, which lacks the KVTransport methods")
    return transport
