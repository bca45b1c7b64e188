"""The LoRA adapters a bench workload names (`adapters=N`): written as `peft` saves them,
so the engine reads them as it reads any adapter.

Adapter k has rank RANKS[k % 4] over every projection a LoRA update may target (lora_alpha
= 2 r), with seeded random weights of the size peft's initialisation gives A and a small
B, so the update changes the output as a trained one does. A simulated run writes only
the configs (`weights=False`): the simulator reads an adapter's shapes, never its weights
(servelab.model.lora_adapter.adapter_shapes), so a simulated 70B model's adapters cost no
disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import attrs

from servelab.lora_request import LoRARequest
from servelab.model.lora_adapter import ATTENTION_MODULES, CONFIG_FILE, TARGET_MODULES, WEIGHTS_FILE, module_shape
from servelab.model.model_config import ModelConfig
from servelab.workload import Workload

RANKS = (8, 16, 32, 64)
B_STD = 0.02


def adapter_name(index: int) -> str:
    return f"adapter-{index}"


def adapter_rank(index: int) -> int:
    return RANKS[index % len(RANKS)]


def write_bench_adapters(count: int, config: ModelConfig, root: Path, weights: bool = True) -> list[LoRARequest]:
    """Adapters 0..count-1 in `root`, as LoRARequests (ids 1..count)."""
    requests = []
    for index in range(count):
        path = root / adapter_name(index)
        path.mkdir(parents=True, exist_ok=True)
        rank = adapter_rank(index)
        (path / CONFIG_FILE).write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
            "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))
        if weights:
            _write_weights(path / WEIGHTS_FILE, config, rank, seed=index)
        requests.append(LoRARequest(adapter_name(index), index + 1, str(path)))
    return requests


class BenchAdapters:
    """The adapters a session's workloads name, written once into `root` (their weights
    only for a real run: a simulated one reads their shapes)."""

    def __init__(self, root: Path, model_config: ModelConfig, weights: bool) -> None:
        self.root, self.model_config, self.weights = root, model_config, weights
        self.requests: list[LoRARequest] = []

    def attach(self, workload: Workload) -> Workload:
        """The workload with the LoRARequests its requests name (written on first need)."""
        if workload.num_adapters > len(self.requests):
            self.requests = write_bench_adapters(workload.num_adapters, self.model_config, self.root, self.weights)
        return attrs.evolve(workload, lora_requests=tuple(self.requests)) if workload.num_adapters else workload


def _write_weights(file: Path, config: ModelConfig, rank: int, seed: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in TARGET_MODULES:
            group = "self_attn" if module in ATTENTION_MODULES else "mlp"
            out_features, in_features = module_shape(config, module)
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * B_STD
    save_file(tensors, str(file))
