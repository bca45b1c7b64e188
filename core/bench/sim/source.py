"""A ModelSource for simulation: a named model shape on a named accelerator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servelab.bench.sim.cost_model import KV_MEMORY_FRACTION, CostModel
from servelab.bench.sim.hardware import Accelerator, Interconnect, accelerator, interconnect
from servelab.bench.sim.runner import SimRunner, VirtualClock
from servelab.bench.sim.shapes import model_shape
from servelab.config import EngineConfig, EngineSection
from servelab.kv_sizing import DTYPE_BYTES
from servelab.model.model_config import ModelConfig


class SimSource:
    tokenizer = None
    path: Path | None = None

    def __init__(self, shape: ModelConfig, hardware: Accelerator, clock: VirtualClock,
                 dtype_bytes: int = DTYPE_BYTES["bfloat16"], link: Interconnect | None = None,
                 memory_utilization: float = KV_MEMORY_FRACTION) -> None:
        """The engine's config chooses the tensor parallelism (`[engine]
        tensor_parallel_size`); `link` joins its devices (default: the accelerator's
        interconnect) and `memory_utilization` sizes the KV pool."""
        self.model_config = shape
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.link = link
        self.memory_utilization = memory_utilization
        self.cost_model = self._cost_model(1, "auto")
        self.clock = clock

    @classmethod
    def named(cls, sim_model: str, accelerator_name: str, clock: VirtualClock, interconnect_name: str | None = None,
              memory_utilization: float = KV_MEMORY_FRACTION) -> "SimSource":
        """`--sim-model`, `--sim` and `--sim-interconnect` as the command line names them."""
        link = interconnect(interconnect_name) if interconnect_name else None
        return cls(model_shape(sim_model), accelerator(accelerator_name), clock, link=link,
                   memory_utilization=memory_utilization)

    def _cost_model(self, tensor_parallel: int, kv_cache_dtype: str) -> CostModel:
        return CostModel(self.model_config, self.hardware, self.dtype_bytes, tensor_parallel=tensor_parallel,
                         link=self.link, memory_utilization=self.memory_utilization, kv_cache_dtype=kv_cache_dtype)

    def _for_engine(self, engine: EngineSection) -> CostModel:
        """The cost model of one of `[engine] tensor_parallel_size` devices, its KV rows in
        `[engine] kv_cache_dtype`."""
        if (self.cost_model.tensor_parallel, self.cost_model.kv_cache_dtype) != (engine.tensor_parallel_size,
                                                                                  engine.kv_cache_dtype):
            self.cost_model = self._cost_model(engine.tensor_parallel_size, engine.kv_cache_dtype)
        return self.cost_model

    def build_runner(self, attention: Any, engine: EngineSection, num_blocks: int, max_positions: int) -> SimRunner:
        from servelab.bench.sim.hardware import interconnect

        block_bytes = self.model_config.kv_bytes_per_token(self.dtype_bytes, engine.kv_cache_dtype) * engine.block_size
        return SimRunner(self._for_engine(engine), self.clock, block_bytes,
                         interconnect(self.hardware.host_link), self.hardware.host_memory_bytes)

    def fit_config(self, config: EngineConfig) -> EngineConfig:
        """The config with KV blocks sized to the accelerator's memory (unless set). A
        fitted CPU profile prices this machine's engine: the config's dtype, and the KV
        pool and context the real engine sizes from the same config."""
        if not self.hardware.per_kernel:
            self.dtype_bytes = DTYPE_BYTES[config.engine.dtype]
            self.cost_model = self._cost_model(config.engine.tensor_parallel_size, config.engine.kv_cache_dtype)
            return config
        self._for_engine(config.engine)
        overrides: dict[str, Any] = {}
        if config.engine.num_kv_blocks is None:
            overrides["engine.num_kv_blocks"] = self.cost_model.kv_blocks(config.engine.block_size)
        if config.engine.max_model_len is None:
            overrides["engine.max_model_len"] = min(self.model_config.max_position_embeddings, 4096)
        return config.with_overrides(overrides) if overrides else config
