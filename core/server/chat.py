"""Chat messages -> one prompt: the checkpoint's own chat template, or a plain default.

A Hugging Face checkpoint carries its template in `chat_template.jinja` or in the
`chat_template` key of `tokenizer_config.json`, a GGUF file in its `tokenizer.chat_template`
metadata; either way it travels on the checkpoint's tokenizer (`Tokenizer.chat_template`,
with the special tokens' texts it may name). It is rendered the way `transformers`
renders it (a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`,
`raise_exception`, `tojson`, `strftime_now`), and the result is tokenized without the
tokenizer's own special tokens, because the template already writes them.

Without a template the default is one `role: content` line per message followed by
`assistant:`, tokenized like a completion prompt (special tokens added).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from servelab.errors import RequestError


@attrs.frozen
class RenderedChat:
    """A rendered conversation and how to tokenize it."""

    text: str
    add_special_tokens: bool  # False when the template wrote them itself


class ChatTemplate:
    """Renders OpenAI-style message lists into prompt text."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self._special_tokens = dict(special_tokens or {})
        self._template = _compile(source) if source is not None else None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatTemplate":
        """The template the checkpoint's tokenizer carries (`servelab.model.tokenizer.Tokenizer`:
        from the checkpoint directory's files, or a GGUF file's metadata), or the plain default."""
        if tokenizer is None:
            return cls(None)
        return cls(tokenizer.chat_template, tokenizer.special_tokens)

    @classmethod
    def from_directory(cls, path: str | Path) -> "ChatTemplate":
        """The template a checkpoint directory carries, or the plain default."""
        from servelab.model.tokenizer import read_chat_template

        return cls(*read_chat_template(Path(path)))

    @property
    def is_default(self) -> bool:
        return self._template is None

    def render(self, messages: list[dict[str, str]]) -> RenderedChat:
        """Prompt text for `messages` (each {"role", "content"}), ready for the assistant's turn."""
        if self._template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return RenderedChat("\n".join([*lines, "assistant:"]), add_special_tokens=True)
        import jinja2

        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise RequestError(f"messages: the chat template rejected them: {exc}") from None
        return RenderedChat(text, add_special_tokens=False)


def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes HTML characters, which chat templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)

