"""PEFT LoRA adapters for the LoRA tests, built with `peft` on the tiny checkpoints (no
download): random A and B (peft zeroes B at init, which would make every adapter the
identity), saved as peft saves them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def build_adapter(base: str, path: Path, *, r: int = 4, alpha: float = 8, seed: int = 0,
                  target_modules: Any = ("q_proj", "v_proj"), scale: float = 0.15, **settings: Any) -> str:
    """Save a peft LoRA adapter of `base` to `path`; returns the directory."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **settings)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(path))
    return str(path)


def peft_greedy(base: str, adapter: str | None, prompt: list[int], max_tokens: int, merged: bool = False) -> list[int]:
    """peft's (or, `merged`, the merged weights') greedy continuation of `prompt`."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def edit_config(path: str, **changes: Any) -> None:
    """Change adapter_config.json's fields in place."""
    file = Path(path) / "adapter_config.json"
    settings = json.loads(file.read_text())
    settings.update(changes)
    file.write_text(json.dumps(settings))
