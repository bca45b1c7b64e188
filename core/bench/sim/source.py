"""A ModelSource for simulation: a named model shape on a named accelerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator
from servelab.bench.sim.runner import SimRunner, VirtualClock
from servelab.config import EngineConfig, EngineSection
from servelab.model.model_config import ModelConfig


class SimSource:
    tokenizer = None
    path: Path | None = None

    def __init__(self, shape: ModelConfig, hardware: Accelerator, clock: VirtualClock, dtype_bytes: int = 2,
                 tp: int = 1, memory_utilization: float | None = None) -> None:
        self.model_config = shape
        extra = {} if memory_utilization is None else {"memory_utilization": memory_utilization}
        self.cost_model = CostModel(shape, hardware, dtype_bytes, tp=tp, **extra)
        self.clock = clock

    def build_runner(self, attention: Any, engine: EngineSection, num_blocks: int, max_positions: int) -> SimRunner:
        return SimRunner(self.cost_model, self.clock)

    def fit_config(self, config: EngineConfig) -> EngineConfig:
        """The config with KV blocks sized to the accelerator's memory (unless set)."""
        overrides: dict[str, Any] = {}
        if config.engine.num_kv_blocks is None:
            overrides["engine.num_kv_blocks"] = self.cost_model.kv_blocks(config.engine.block_size)
        if config.engine.max_model_len is None:
            overrides["engine.max_model_len"] = min(self.model_config.max_position_embeddings, 4096)
        return config.with_overrides(overrides) if overrides else config
