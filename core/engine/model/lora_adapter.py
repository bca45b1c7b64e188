"""PEFT LoRA adapters as `peft` saves them: `adapter_config.json` + `adapter_model.safetensors`.

An adapter adds, to some of the decoder's linear layers, a low-rank update
`y += scale * (x A^T) B^T` with A [r, in_features] and B [out_features, r], where
`scale = lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`). `rank_pattern`
and `alpha_pattern` give some modules their own r and alpha; `target_modules` (a list of
module names, or one regex matched against the whole module name) and
`layers_to_transform` say which modules carry one.

The adapter is held in float32 whatever the base model's weights are (fp32, bf16, int8 or
int4 blocks): the update is computed in float and added to the base layer's output.

What `peft` can save but this engine does not serve is refused by name, never ignored:
DoRA (`use_dora`), `modules_to_save`, bias training (`bias`), `fan_in_fan_out` weights,
targets outside the attention and MLP projections (embeddings, LM head), LoRA types other
than plain LoRA. So are adapters that do not fit the base (shapes), that are too large
(`max_lora_rank`) or whose weights are not finite. Every error names the file and the
field or tensor.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import attrs
import torch

from servelab.errors import CheckpointError
from servelab.model.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The Hugging Face projection names a LoRA update may target, by the fused layer that
# holds them in this model (servelab.model.llama: qkv_proj, gate_up_proj).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTENTION_MODULES + MLP_MODULES
_WEIGHT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(CheckpointError):
    """An adapter this engine cannot serve; the message names the file and the field."""


@attrs.frozen
class LoRAModule:
    """One target module's update: delta(x) = scale * (x @ lora_a.T) @ lora_b.T."""

    lora_a: torch.Tensor  # [rank, in_features] float32
    lora_b: torch.Tensor  # [out_features, rank] float32
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@attrs.frozen
class LoRAAdapter:
    """A loaded adapter: its updates by (layer index, Hugging Face module name)."""

    name: str
    path: Path
    modules: Mapping[tuple[int, str], LoRAModule] = attrs.field(eq=False)

    @property
    def max_rank(self) -> int:
        return max(module.rank for module in self.modules.values())

    @property
    def nbytes(self) -> int:
        return sum(m.lora_a.numel() * 4 + m.lora_b.numel() * 4 for m in self.modules.values())


def module_names(config: ModelConfig) -> list[str]:
    """The full names (as peft sees them in a Hugging Face model) of every module an
    adapter may target in a model of `config`."""
    return [f"model.layers.{layer}.{'self_attn' if m in ATTENTION_MODULES else 'mlp'}.{m}"
            for layer in range(config.num_layers) for m in TARGET_MODULES]


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out_features, in_features) of a target module."""
    hidden, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (config.intermediate_size, hidden), "up_proj": (config.intermediate_size, hidden),
            "down_proj": (hidden, config.intermediate_size)}[module]


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter saved in directory `path`, checked against a base model of `config`."""
    path = Path(path)
    settings = read_adapter_config(path)
    tensors = _read_weights(path / WEIGHTS_FILE)
    return LoRAAdapter(name, path, _modules(path, settings, tensors, config, max_rank))


def adapter_shapes(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter in directory `path` as its adapter_config.json describes it, checked as
    `load_adapter` checks it, its weights on the meta device (shapes, no data; the weights
    file is not read): what the simulator prices."""
    path = Path(path)
    settings = read_adapter_config(path)
    modules: dict[tuple[int, str], LoRAModule] = {}
    for module_name in sorted(_targets(path, settings, config)):
        rank, scale = _rank_and_scale(path / CONFIG_FILE, settings, module_name, max_rank)
        out_features, in_features = module_shape(config, module_name.rsplit(".", 1)[1])
        modules[(int(module_name.split(".")[2]), module_name.rsplit(".", 1)[1])] = LoRAModule(
            torch.empty(rank, in_features, device="meta"), torch.empty(out_features, rank, device="meta"), scale)
    return LoRAAdapter(name, path, modules)


def _rank_and_scale(config_file: Path, settings: dict[str, Any], name: str, max_rank: int) -> tuple[int, float]:
    """Module `name`'s rank and update scale, as peft derives them from the config."""
    rank = int(_pattern_value(settings.get("rank_pattern") or {}, name, settings.get("r", 8)))
    alpha = float(_pattern_value(settings.get("alpha_pattern") or {}, name, settings.get("lora_alpha", 8)))
    if rank > max_rank:
        raise LoRAAdapterError(f"{config_file}: r = {rank} for {name} exceeds max_lora_rank = {max_rank}")
    return rank, alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def read_adapter_config(path: Path) -> dict[str, Any]:
    """adapter_config.json, with every setting this engine cannot serve refused by name."""
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} is not a directory (it should hold {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
    try:
        settings = json.loads(file.read_text())
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoRAAdapterError(f"{file}: not readable JSON ({exc})") from None
    if not isinstance(settings, dict):
        raise LoRAAdapterError(f"{file}: expected a JSON object, got {type(settings).__name__}")
    refusals = {
        "peft_type": (settings.get("peft_type", "LORA") != "LORA", "only peft_type LORA is served"),
        "use_dora": (bool(settings.get("use_dora")), "DoRA adapters are not supported"),
        "modules_to_save": (bool(settings.get("modules_to_save")),
                            "adapters that replace whole modules (modules_to_save) are not supported"),
        "bias": (settings.get("bias", "none") != "none", "adapters with trained biases are not supported"),
        "fan_in_fan_out": (bool(settings.get("fan_in_fan_out")), "fan_in_fan_out weights are not supported"),
        "layers_pattern": (_is_set(settings.get("layers_pattern")) and not _is_set(settings.get("layers_to_transform")),
                           "layers_pattern without layers_to_transform is not supported"),
    }
    for field, (refused, why) in refusals.items():
        if refused:
            raise LoRAAdapterError(f"{file}: {field} = {settings.get(field)!r}: {why}")
    for field in ("r", "lora_alpha"):
        value = settings.get(field, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAAdapterError(f"{file}: {field} must be a positive number, got {value!r}")
    for field in ("rank_pattern", "alpha_pattern"):
        if not isinstance(settings.get(field) or {}, dict):
            raise LoRAAdapterError(f"{file}: {field} must be an object of module pattern -> number")
    return settings


def _is_set(value: Any) -> bool:
    return value is not None and value != [] and value != ""


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {str(file.parent)!r} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAAdapterError(f"{file}: not a readable safetensors file ({exc})") from None


def _targets(path: Path, settings: dict[str, Any], config: ModelConfig) -> set[str]:
    """The module names the adapter's config targets, in this model."""
    file = path / CONFIG_FILE
    names = module_names(config)
    target = settings.get("target_modules")
    if isinstance(target, str):
        try:
            matched = {name for name in names if re.fullmatch(target, name)}
        except re.error as exc:
            raise LoRAAdapterError(f"{file}: target_modules {target!r} is not a valid regex ({exc})") from None
    elif isinstance(target, list) and all(isinstance(t, str) for t in target):
        unsupported = sorted(t for t in target if t not in TARGET_MODULES)
        if unsupported:
            raise LoRAAdapterError(f"{file}: target_modules names {', '.join(unsupported)}: only "
                                   f"{', '.join(TARGET_MODULES)} take a LoRA update here")
        matched = {name for name in names if name.rsplit(".", 1)[1] in target}
    else:
        raise LoRAAdapterError(f"{file}: target_modules must be a list of module names or a regex, got {target!r}")
    layers = settings.get("layers_to_transform")
    if _is_set(layers):
        layers = [layers] if isinstance(layers, int) else layers
        if not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < config.num_layers for i in layers):
            raise LoRAAdapterError(f"{file}: layers_to_transform must list layers in 0..{config.num_layers - 1}, "
                                   f"got {settings.get('layers_to_transform')!r}")
        matched = {name for name in matched if int(name.split(".")[2]) in layers}
    if not matched:
        raise LoRAAdapterError(f"{file}: target_modules {target!r} matches no module this model's adapters may "
                               f"target (e.g. {names[0]})")
    return matched


def _pattern_value(patterns: Mapping[str, Any], name: str, default: float) -> float:
    """peft's rule: the first pattern p with re.match(rf"(.*\\.)?({p})$", name)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


def _modules(path: Path, settings: dict[str, Any], tensors: dict[str, torch.Tensor], config: ModelConfig,
             max_rank: int) -> dict[tuple[int, str], LoRAModule]:
    file = path / WEIGHTS_FILE
    targets = _targets(path, settings, config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        found = _WEIGHT_KEY.match(key)
        if found is None or found.group(3) not in TARGET_MODULES:
            raise LoRAAdapterError(f"{file}: tensor {key!r} is not a LoRA weight of a module adapters may target "
                                   f"here ({', '.join(TARGET_MODULES)})")
        layer, group, module, which = found.groups()
        name = f"model.layers.{layer}.{group}.{module}"
        if name not in targets:
            raise LoRAAdapterError(f"{file}: tensor {key!r} updates {name}, which {CONFIG_FILE}'s target_modules / "
                                   f"layers_to_transform do not target (or this model has no such layer)")
        pairs.setdefault(name, {})[which] = tensor
    config_file = path / CONFIG_FILE
    modules: dict[tuple[int, str], LoRAModule] = {}
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAAdapterError(f"{file}: {name} has no {missing}.weight")
        rank, scale = _rank_and_scale(config_file, settings, name, max_rank)
        a, b = pair["A"], pair["B"]
        out_features, in_features = module_shape(config, name.rsplit(".", 1)[1])
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise LoRAAdapterError(
                f"{file}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base model's "
                f"[{out_features}, {in_features}] layer with r = {rank} (expected lora_A [{rank}, {in_features}], "
                f"lora_B [{out_features}, {rank}])")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAAdapterError(f"{file}: {name}: LoRA weights must be floating point, got {a.dtype} / {b.dtype}")
        for which, tensor in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise LoRAAdapterError(f"{file}: {name}.{which}.weight holds non-finite values (NaN or inf)")
        layer = int(name.split(".")[2])
        modules[(layer, name.rsplit(".", 1)[1])] = LoRAModule(a.float().contiguous(), b.float().contiguous(), scale)
    if not modules:
        raise LoRAAdapterError(f"{file}: holds no LoRA weights")
    return modules
