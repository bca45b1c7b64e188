"""Built-in models that need no download.

`builtin:tiny` (the default model) and `builtin:tiny-draft` are small trained Llamas shipped
as package data in `servelab/model/assets/` (trained by examples/training/train_builtin_models.py on Python's
own documentation and standard-library sources; see `assets/README.md`); tiny's directory
also holds its Medusa heads (`medusa.safetensors`, `medusa_config.json`).

`builtin:tiny-random` is a 32 M-parameter Llama (hidden 512, 8 layers, GQA 8:4) with
seeded random weights and a byte-level BPE tokenizer trained on the Python standard
library's documentation strings. It is generated deterministically on first use into
the user cache directory. Its output is fluent-looking noise: it exists to exercise
and measure the engine, not to write prose.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from servelab.errors import CheckpointError

BUILTIN_PREFIX = "builtin:"
TINY_RANDOM = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
_GENERATED = {"tiny-random": TINY_RANDOM}
ASSETS = Path(__file__).resolve().parent / "assets"
_PACKAGED = ("tiny", "tiny-draft")  # directories under ASSETS


def cache_root() -> Path:
    base = os.environ.get("SERVELAB_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "servelab"
    )
    return Path(base)


def names() -> list[str]:
    return [BUILTIN_PREFIX + n for n in (*_PACKAGED, *_GENERATED)]


def resolve(model: str) -> Path:
    """The checkpoint directory for a path or a `builtin:<name>` spec."""
    if not model.startswith(BUILTIN_PREFIX):
        return Path(model)
    name = model[len(BUILTIN_PREFIX):]
    if name in _PACKAGED:
        return ASSETS / name
    if name not in _GENERATED:
        raise CheckpointError(f"unknown built-in model {model!r}; available: " + ", ".join(names()))
    path = cache_root() / name
    if not (path / "model.safetensors").is_file():
        _generate(path, _GENERATED[name])
    return path


def _generate(path: Path, config: dict) -> None:
    """Write the generated checkpoint into the cache (SERVELAB_CACHE), through a temporary
    directory that never outlives a failure; a cache that cannot take it (a file, a
    read-only place, a full disk) is a CheckpointError naming it."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tmp.mkdir(parents=True, exist_ok=True)
        _write_checkpoint(tmp, config)
        for file in tmp.iterdir():
            os.replace(file, path / file.name)
        tmp.rmdir()
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror or type(exc).__name__
        raise CheckpointError(f"cannot write the built-in model {path.name!r} into the cache {str(cache_root())!r} "
                              f"({reason}); set SERVELAB_CACHE to a writable directory with room") from None


def _write_checkpoint(directory: Path, config: dict) -> None:
    import torch
    from safetensors.torch import save_file

    train_tokenizer(config["vocab_size"]).save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    save_file(random_weights(config, generator), str(directory / "model.safetensors"))


def random_weights(config: dict, generator) -> dict:
    """Seeded N(0, 0.02) weights in the Hugging Face Llama layout."""
    import torch

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape):
        return torch.randn(*shape, generator=generator) * 0.02

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": normal(q_size, hidden),
            prefix + "self_attn.k_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": normal(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": normal(hidden, q_size),
            prefix + "mlp.gate_proj.weight": normal(inter, hidden),
            prefix + "mlp.up_proj.weight": normal(inter, hidden),
            prefix + "mlp.down_proj.weight": normal(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    return tensors


def stdlib_corpus(max_chars: int = 4_000_000) -> list[str]:
    """Documentation text that ships with Python itself."""
    from pydoc_data.topics import topics

    texts = [topics[key] for key in sorted(topics)]
    total = 0
    kept = []
    for text in texts:
        kept.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return kept


def train_tokenizer(vocab_size: int, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer with <unk>/<s>/</s>, adding <s> before each prompt,
    trained on `corpus` (default: `stdlib_corpus()`, the pydoc topics)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(stdlib_corpus() if corpus is None else corpus, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tokenizer
