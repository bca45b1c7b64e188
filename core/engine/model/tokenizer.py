"""Text <-> token ids through a checkpoint's `tokenizer.json` (HF `tokenizers`), and the
checkpoint's chat template, which travels with its tokenizer as in Hugging Face's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servelab.errors import CheckpointError


class Tokenizer:
    """Encodes prompts (with the tokenizer's own special-token template, as HF does)
    and decodes outputs (special tokens skipped). `chat_template` is the checkpoint's
    jinja chat template (None when it has none) and `special_tokens` the texts a template
    may name ({"bos_token": "<s>", ...})."""

    def __init__(self, path: Path | None = None, *, backend: Any = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if backend is None:
            try:
                backend = HFTokenizer.from_file(str(path))
            except Exception as exc:
                raise CheckpointError(f"cannot read tokenizer {str(path)!r}: {exc}") from None
        self._tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_directory(cls, path: Path) -> "Tokenizer | None":
        """A Hugging Face checkpoint directory's tokenizer.json, with the chat template from
        `chat_template.jinja` or the `chat_template` key of tokenizer_config.json."""
        file = path / "tokenizer.json"
        if not file.is_file():
            return None
        template, special = read_chat_template(path)
        return cls(file, chat_template=template, special_tokens=special)

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


def read_chat_template(path: Path) -> tuple[str | None, dict[str, str]]:
    """A checkpoint directory's chat template (`chat_template.jinja`, else the `chat_template`
    key of tokenizer_config.json; None without either) and its special tokens' texts."""
    config = _read_json(path / "tokenizer_config.json")
    special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    jinja_file = path / "chat_template.jinja"
    template = (jinja_file.read_text(encoding="utf-8") if jinja_file.is_file()
                else _pick_template(config.get("chat_template")))
    return template, {name: text for name, text in special.items() if text is not None}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value: Any) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} with a "default" one."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None
