"""A GGUF file's tokenizer, rebuilt with `tokenizers` from the file's metadata.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, the merges, each
token's type (normal, control, user-defined, ...) and the special token ids as metadata
keys. For a byte-level BPE vocabulary (`tokenizer.ggml.model = "gpt2"`) that is enough to
build the tokenizer the model was trained with; `tokenizer.ggml.pre` names how the text is
split before the merges apply, as llama.cpp's own vocabulary loader reads it.
"""

from __future__ import annotations

from typing import Any

from servelab.errors import CheckpointError
from servelab.logging_setup import get_logger

logger = get_logger(__name__)

SUPPORTED_TOKENIZER_MODELS = ("gpt2",)  # byte-level BPE
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> how the text is split: GPT-2's regex (ByteLevel's own), GPT-2's
# regex after every digit is split off (SmolLM), or another regex (Llama 3, Qwen2).
_PRE_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` a GGUF file's metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise CheckpointError(f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: "
                              f"{', '.join(SUPPORTED_TOKENIZER_MODELS)} (byte-level BPE)")
    tokens: list[str] = metadata.get("tokenizer.ggml.tokens") or []
    merges: list[str] = metadata.get("tokenizer.ggml.merges") or []
    if not tokens or not merges:
        raise CheckpointError("GGUF file lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                                     fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata)
    tokenizer.decoder = decoders.ByteLevel()
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token, kind in zip(tokens, token_types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, token_types) if kind == _USER_DEFINED])
    tokenizer.post_processor = _post_processor(metadata, tokens, processors)
    return tokenizer


def special_tokens(metadata: dict[str, Any]) -> dict[str, str]:
    """{"bos_token": "<s>", ...}: the texts a chat template may refer to."""
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    named = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}
    found = {name: metadata.get(f"tokenizer.ggml.{key}") for name, key in named.items()}
    return {name: tokens[i] for name, i in found.items() if isinstance(i, int) and 0 <= i < len(tokens)}


def _pre_tokenizer(metadata: dict[str, Any]) -> Any:
    from tokenizers import Regex, pre_tokenizers

    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_SPLITS:
        logger.warning("gguf.pre_tokenizer_unknown", pre=pre, using="GPT-2's split",
                       known=", ".join(sorted(_PRE_SPLITS)))
    split = _PRE_SPLITS.get(pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    if split is None:
        return byte_level
    if split == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False)])


def _post_processor(metadata: dict[str, Any], tokens: list[str], processors: Any) -> Any:
    """BOS (and EOS) around every prompt where the file asks for them."""
    single, special = "$A", []
    for flag, key, place in (("add_bos_token", "bos_token_id", "before"), ("add_eos_token", "eos_token_id", "after")):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if metadata.get(f"tokenizer.ggml.{flag}") and isinstance(token_id, int):
            token = tokens[token_id]
            single = f"{token} {single}" if place == "before" else f"{single} {token}"
            special.append((token, token_id))
    return processors.TemplateProcessing(single=single, special_tokens=special)
