"""A ModelSource for simulation: a named model shape on a named accelerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.sim.cost_model import CostModel
from servelab.bench.sim.hardware import Accelerator, Interconnect
from servelab.bench.sim.runner import SimRunner, VirtualClock
from servelab.config import EngineConfig, EngineSection
from servelab.model.model_config import ModelConfig


class SimSource:
    tokenizer = None
    path: Path | None = None

    def __init__(self, shape: ModelConfig, hardware: Accelerator, clock: VirtualClock, dtype_bytes: int = 2,
                 link: Interconnect | None = None) -> None:
        self.model_config = shape
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.link = link
        self.cost_model = CostModel(shape, hardware, dtype_bytes, link=link)
        self.clock = clock

    def _for_tensor_parallel(self, size: int) -> CostModel:
        """The cost model of one of `size` devices (`[engine] tensor_parallel_size`)."""
        if self.cost_model.tensor_parallel != size:
            self.cost_model = CostModel(self.model_config, self.hardware, self.dtype_bytes, size, self.link)
        return self.cost_model

    def build_runner(self, attention: Any, engine: EngineSection, num_blocks: int, max_positions: int) -> SimRunner:
        return SimRunner(self._for_tensor_parallel(engine.tensor_parallel_size), self.clock)

    def fit_config(self, config: EngineConfig) -> EngineConfig:
        """The config with KV blocks sized to the accelerator's memory (unless set)."""
        self._for_tensor_parallel(config.engine.tensor_parallel_size)
        overrides: dict[str, Any] = {}
        if config.engine.num_kv_blocks is None:
            overrides["engine.num_kv_blocks"] = self.cost_model.kv_blocks(config.engine.block_size)
        if config.engine.max_model_len is None:
            overrides["engine.max_model_len"] = min(self.model_config.max_position_embeddings, 4096)
        return config.with_overrides(overrides) if overrides else config
