"""Where an engine's model comes from: a checkpoint on disk (the real thing) or, for the
simulator, a shape and a cost model. The engine asks a source for the model's config,
its tokenizer, and a runner (prepare(plan, allocator) -> inputs; execute(inputs) -> logits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from servelab.config import EngineSection
from servelab.model.loader import DTYPES, Checkpoint, load_model
from servelab.model.model_config import ModelConfig
from servelab.model.tokenizer import Tokenizer
from servelab.runner import ModelRunner


class ModelSource(Protocol):
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path | None  # checkpoint directory, when there is one

    def build_runner(self, attention: Any, engine: EngineSection, num_blocks: int, max_positions: int) -> Any:
        """The runner that executes step plans."""


class CheckpointSource:
    """A Hugging Face checkpoint directory (or builtin:<name>)."""

    def __init__(self, model: str) -> None:
        self.checkpoint = Checkpoint.open(model)
        self.model_config = self.checkpoint.config
        self.tokenizer = self.checkpoint.tokenizer
        self.path = self.checkpoint.path

    def build_runner(self, attention: Any, engine: EngineSection, num_blocks: int, max_positions: int) -> Any:
        model = load_model(self.checkpoint, engine.dtype, engine.device, max_positions, engine.prepack_weights,
                           engine.weights, quantized_activations=engine.quantized_activations)
        return ModelRunner(model, attention, num_blocks, engine.block_size, DTYPES[engine.dtype],
                           torch.device(engine.device))
