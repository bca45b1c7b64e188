"""Chat messages -> one prompt: the checkpoint's own chat template, one the server was
started with (`--chat-template`), or one a request brings (only when the server trusts
request templates).

A Hugging Face checkpoint carries its template in `chat_template.jinja` or in the
`chat_template` key of `tokenizer_config.json`, a GGUF file in its `tokenizer.chat_template`
metadata; either way it travels on the checkpoint's tokenizer (`Tokenizer.chat_template`,
with the special tokens' texts it may name). It is rendered the way `transformers`
renders it (a sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`,
`raise_exception`, `tojson`, `strftime_now`), and the result is tokenized without the
tokenizer's own special tokens, because the template already writes them.

Without a template there is no chat: the server refuses it with a 400 naming the missing
template, as vLLM does, rather than invent a prompt format that changes results. The
`plain` format (one `role: content` line per message, then `assistant:`, tokenized like a
completion prompt) is servelab's own models' format, and any checkpoint's with
`--chat-template plain`.

A request's own template (`--trust-request-chat-template`) runs within a time budget
(`REQUEST_TEMPLATE_SECONDS`): a template that loops for good would otherwise hold a codec
worker for good (threads cannot be killed), and with every worker held no text request is
served and the process cannot exit. Rendering is traced (`sys.settrace` on the worker's
thread, for that render alone) and stopped with a RequestError once the budget is spent.
Whatever else such a template raises (a division by zero, a type error) is the request's
fault too: a RequestError naming it, not a failure of the server's.
"""

from __future__ import annotations

import functools
import json
import sys
import time
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

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None, plain: bool = False) -> None:
        self.source = source
        self.plain = plain
        self._special_tokens = dict(special_tokens or {})
        self._template = _compile(source) if source is not None else None

    @classmethod
    def plain_format(cls) -> "ChatTemplate":
        """servelab's own models' format: `role: content` lines, then `assistant:`."""
        return cls(None, plain=True)

    @property
    def is_missing(self) -> bool:
        return self._template is None and not self.plain

    def with_source(self, source: str | None) -> "ChatTemplate":
        """This template, or the same special tokens with another template's source."""
        return self if source is None else ChatTemplate(source, self._special_tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "ChatTemplate":
        """The template the checkpoint's tokenizer carries (`servelab.model.tokenizer.Tokenizer`:
        from the checkpoint directory's files, or a GGUF file's metadata); missing when it carries none."""
        if tokenizer is None:
            return cls(None)
        return cls(tokenizer.chat_template, tokenizer.special_tokens)

    @classmethod
    def from_directory(cls, path: str | Path) -> "ChatTemplate":
        """The template a checkpoint directory carries (missing when it carries none)."""
        from servelab.model.tokenizer import read_chat_template

        return cls(*read_chat_template(Path(path)))

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as tokenizer_config.json names them."""
        return dict(self._special_tokens)

    @property
    def kind(self) -> str:
        return "plain" if self.plain else "missing" if self._template is None else "jinja"

    def render(self, messages: list[dict[str, str]], source: str | None = None,
               variables: dict[str, Any] | None = None) -> RenderedChat:
        """Prompt text for `messages` (each {"role", "content"}), ready for the assistant's
        turn; with `source`, that template instead (a request's own), and `variables`
        (chat_template_kwargs) passed to it."""
        import jinja2

        try:
            template = _compile_cached(source) if source is not None else self._template
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat_template: it does not compile: {exc}") from None
        if template is None:
            if not self.plain:
                raise RequestError("messages: this model has no chat template")
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return RenderedChat("\n".join([*lines, "assistant:"]), add_special_tokens=True)
        context = {**(variables or {}), **self._special_tokens, "messages": messages, "add_generation_prompt": True}
        try:
            text = template.render(**context) if source is None else _render_within(template, context)
        except jinja2.TemplateError as exc:
            raise RequestError(f"messages: the chat template rejected them: {exc}") from None
        except RequestError:
            raise
        except Exception as exc:
            if source is None:  # the server's own template: a fault of the server's (a 500 naming it)
                raise
            raise RequestError(f"chat_template: rendering it failed: {type(exc).__name__}: {exc}") from None
        return RenderedChat(text, add_special_tokens=False)


REQUEST_TEMPLATE_SECONDS = 2.0  # a request's own chat template renders within this, or is refused
_CHECK_EVERY = 256  # trace events between clock reads


class _OverBudget(Exception):
    pass


def _render_within(template: Any, context: dict[str, Any]) -> str:
    """template.render(**context), stopped past REQUEST_TEMPLATE_SECONDS (RequestError)."""
    budget = REQUEST_TEMPLATE_SECONDS
    deadline = time.monotonic() + budget
    events = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise _OverBudget()
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return template.render(**context)
    except _OverBudget:
        raise RequestError(f"chat_template: rendering it took longer than {budget:g} s; a request's template "
                           f"must render the messages quickly") from None
    finally:
        sys.settrace(previous)


@functools.lru_cache(maxsize=16)
def _compile_cached(source: str) -> Any:
    """Requests' own templates, compiled once each (the 16 most recent)."""
    return _compile(source)


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

