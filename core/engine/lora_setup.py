"""Serving LoRA adapters (`[engine] enable_lora`): the residency policy, the model's LoRA
layers and the manager of the adapters' tiers, attached to the model runner."""

from __future__ import annotations

from typing import Any

from servelab.config import EngineConfig
from servelab.contracts.adapter_residency import ResidencyContext
from servelab.errors import ConfigError
from servelab.interfaces import LoRARunner, SimulatedLoRARunner
from servelab.lora_manager import LoRAManager
from servelab.model.lora_adapter import load_adapter
from servelab.model.lora_layers import LoRAState, install_lora
from servelab.registry import build_policy


def max_loras_per_batch(config: EngineConfig) -> int | None:
    """The scheduler's adapter cap (SchedulerContext.max_loras_per_batch): None without LoRA."""
    engine = config.engine
    if not engine.enable_lora:
        return None
    return engine.max_loras_per_batch or engine.max_loras


def attach_lora(config: EngineConfig, selected: tuple[Any, Any], runner: Any) -> LoRAManager | None:
    """The runner's LoRA manager, its model's target layers wrapped; None without LoRA.
    `selected` is the registered residency policy and its options."""
    engine = config.engine
    if not engine.enable_lora:
        return None
    if isinstance(runner, SimulatedLoRARunner) and engine.tensor_parallel_size == 1:
        model_config, state, loader = runner.model_config, LoRAState(engine.max_loras), runner.load_adapter
    elif isinstance(runner, LoRARunner):
        state = install_lora(runner.model, engine.max_loras, engine.max_lora_rank)
        model_config, loader = runner.model.config, load_adapter
    else:
        raise ConfigError(f"[engine] enable_lora needs the single-process model runner; {type(runner).__name__} "
                          f"does not run LoRA adapters (tensor_parallel_size must be 1)")
    max_cpu_loras = engine.max_cpu_loras or engine.max_loras
    residency = build_policy(*selected, ResidencyContext(max_loras=engine.max_loras, max_cpu_loras=max_cpu_loras))
    runner.lora = LoRAManager(model_config, state, residency, max_cpu_loras, engine.max_lora_rank, loader)
    return runner.lora
