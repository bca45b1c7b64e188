"""Text <-> token ids through a checkpoint's `tokenizer.json` (HF `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from servelab.errors import CheckpointError


class Tokenizer:
    """Encodes prompts (with the tokenizer's own special-token template, as HF does)
    and decodes outputs (special tokens skipped)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise CheckpointError(f"cannot read tokenizer {str(path)!r}: {exc}") from None

    @classmethod
    def from_directory(cls, path: Path) -> "Tokenizer | None":
        file = path / "tokenizer.json"
        return cls(file) if file.is_file() else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens=False for text that already holds them (a rendered chat template)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of several texts; the work runs without Python's GIL, so a server can
        tokenize on worker threads while its other threads carry on."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer` (vocabulary, serialized form)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()
