"""Tokenization (and chat-template rendering) on a small thread pool of its own.

It belongs neither on the event loop (it would stall every stream and `/health` while
one long prompt is encoded) nor in the engine (it would stall every step).
Prompts are encoded with the tokenizer's batch call, which runs without the GIL.
(Detokenization: see detokenizer.py.) A failure here is the one
request's: `RequestError` for what the client sent, `CodecFailure` (a 500 naming the
cause) for ours.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence as Seq, TypeVar

from servelab.errors import RequestError, ServelabError
from servelab.server.chat import ChatTemplate

T = TypeVar("T")


class CodecFailure(ServelabError):
    """Tokenizing or detokenizing one request failed for a reason of the server's."""


class TextCodec:
    """Prompts -> token ids, off the event loop and out of the engine."""

    def __init__(self, tokenizer: Any, chat_template: ChatTemplate, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="servelab-codec")

    async def run(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the pool; an unexpected exception becomes CodecFailure."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)
        except (RequestError, CodecFailure):
            raise
        except Exception as exc:
            raise CodecFailure(f"{type(exc).__name__}: {exc}") from exc

    async def encode_prompts(self, prompts: Seq[str | list[int]]) -> list[list[int]]:
        """Token ids of every prompt (token-id prompts are passed through as they are)."""
        texts = [p for p in prompts if isinstance(p, str)]
        if not texts:
            return [list(p) for p in prompts]
        if self.tokenizer is None:
            raise RequestError("prompt: this checkpoint has no tokenizer.json: pass prompts as lists of token ids")
        encoded = iter(await self.run(self.tokenizer.encode_batch, texts))
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    async def decode_prompts(self, prompts: Seq[str | list[int]]) -> list[str]:
        """Each prompt's text: as given, or its token ids decoded ("" without a tokenizer)."""
        if all(isinstance(p, str) for p in prompts) or self.tokenizer is None:
            return [p if isinstance(p, str) else "" for p in prompts]
        return await self.run(lambda: [p if isinstance(p, str) else self.tokenizer.decode(list(p)) for p in prompts])

    async def encode_chat(self, messages: list[dict[str, str]], max_chars: int | None = None,
                          source: str | None = None, variables: dict[str, Any] | None = None) -> list[int]:
        """The chat template (or a request's own, `source`) rendered and tokenized
        (RequestError when the template refuses, or renders more than `max_chars` characters)."""
        if self.tokenizer is None:
            raise RequestError("messages: this checkpoint has no tokenizer.json, so it cannot take chat messages")
        return await self.run(self._render_and_encode, messages, max_chars, source, variables)

    async def render_chat(self, messages: list[dict[str, str]], source: str | None = None,
                          variables: dict[str, Any] | None = None) -> Any:
        """The rendered chat (a RenderedChat), on the pool."""
        return await self.run(self.chat_template.render, messages, source, variables)

    def _render_and_encode(self, messages: list[dict[str, str]], max_chars: int | None = None,
                           source: str | None = None, variables: dict[str, Any] | None = None) -> list[int]:
        rendered = self.chat_template.render(messages, source, variables)
        if max_chars is not None and len(rendered.text) > max_chars:  # a template may add much to each message
            raise RequestError(f"messages: the rendered chat has {len(rendered.text)} characters, more than this "
                               f"server tokenizes ({max_chars})")
        return self.tokenizer.encode_batch([rendered.text], add_special_tokens=rendered.add_special_tokens)[0]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
