"""Tiny random mixture-of-experts checkpoints (Mixtral- and Qwen2-MoE-shaped, seeded, built
with transformers: no download), each with a word-level tokenizer (token i is "w<i>"), for
trying `servelab generate`, `serve` and the measurements in docs/parallelism.md.

    python examples/measurements/moe_checkpoints.py --out path/to/moe
    # -> path/to/moe/mixtral, path/to/moe/qwen2_moe (and the larger mixtral-wide for timings)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from servelab.testing.tiny_model import TINY_SHAPES, build_checkpoint

# A wider Mixtral for timings: big enough that the experts' matmuls, not Python, dominate.
WIDE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=2048, max_position_embeddings=2048, num_local_experts=8,
            num_experts_per_tok=2)


def add_word_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = json.loads((directory / "config.json").read_text())["vocab_size"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoints into")
    args = parser.parse_args()
    out = Path(args.out)
    TINY_SHAPES.setdefault("mixtral-wide", WIDE)
    for kind in ("mixtral", "qwen2_moe", "mixtral-wide"):
        target = out / kind
        shutil.rmtree(target, ignore_errors=True)
        build_checkpoint(kind, target)
        add_word_tokenizer(target)
        print(target)


if __name__ == "__main__":
    main()
