"""OpenAI response bodies and stream chunks, built from a finished or running Generation.

Streams send one chunk per piece of new text, then one chunk per choice carrying its
`finish_reason`, then a chunk with empty `choices` and the `usage` (always sent, as
OpenAI does with `stream_options.include_usage`), then `[DONE]` (added by the SSE layer).
"""

from __future__ import annotations

from typing import Any, AsyncIterator

from servelab.server.generation import Generation


def completion_body(generation: Generation, model: str, token_ids: bool = False) -> dict[str, Any]:
    choices = [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                **(_token_ids(generation, c) if token_ids else {})} for c in generation.choices]
    return {**_header(generation, model, "text_completion"), "choices": choices, "usage": generation.usage()}


async def completion_chunks(generation: Generation, model: str) -> AsyncIterator[dict[str, Any]]:
    header = _header(generation, model, "text_completion")
    async for delta in generation.deltas():
        yield {**header, "choices": [{"index": delta.index, "text": delta.text, "logprobs": None,
                                      "finish_reason": delta.finish_reason}]}
    yield {**header, "choices": [], "usage": generation.usage()}


def chat_body(generation: Generation, model: str, token_ids: bool = False) -> dict[str, Any]:
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                "finish_reason": c.finish_reason, **(_token_ids(generation, c) if token_ids else {})}
               for c in generation.choices]
    return {**_header(generation, model, "chat.completion"), "choices": choices, "usage": generation.usage()}


async def chat_chunks(generation: Generation, model: str) -> AsyncIterator[dict[str, Any]]:
    header = _header(generation, model, "chat.completion.chunk")
    for choice in generation.choices:  # the role comes first, once per choice
        yield {**header, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
    async for delta in generation.deltas():
        content = {"content": delta.text} if delta.text else {}
        yield {**header, "choices": [{"index": delta.index, "delta": content, "logprobs": None,
                                      "finish_reason": delta.finish_reason}]}
    yield {**header, "choices": [], "usage": generation.usage()}


def _token_ids(generation: Generation, choice: Any) -> dict[str, list[int]]:
    return {"prompt_token_ids": generation.prompt_token_ids(choice), "token_ids": list(choice.output.token_ids)}


def _header(generation: Generation, model: str, kind: str) -> dict[str, Any]:
    return {"id": generation.request_id, "object": kind, "created": generation.created, "model": model}
