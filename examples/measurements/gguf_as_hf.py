"""Write a GGUF model (a file, or a name such as smollm2-135m) as a Hugging Face checkpoint
directory, dequantized by transformers (through the gguf package, as servelab's loader
does), so that engines without a GGUF reader (vLLM's CPU build, transformers' static
baseline) run the very weights servelab runs.

    python examples/measurements/gguf_as_hf.py smollm2-135m ../peers/smollm2-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from servelab.model.named_models import NAMED_MODELS, locate


def write_hf_checkpoint(model: str, out: Path) -> Path:
    path = locate(model) if model in NAMED_MODELS else Path(model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # transformers refuses save_pretrained on a model it loaded from GGUF (it counts as
    # quantized): the dequantized tensors are written as they are, without the tied
    # lm_head.weight, and the config without its GGUF quantization fields.
    state = {name: tensor.contiguous() for name, tensor in hf.state_dict().items()
             if not (name == "lm_head.weight" and hf.config.tie_word_embeddings)}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a .gguf file or a named model (smollm2-135m)")
    parser.add_argument("out", type=Path, help="the checkpoint directory to write")
    args = parser.parse_args()
    print(write_hf_checkpoint(args.model, args.out))


if __name__ == "__main__":
    main()
