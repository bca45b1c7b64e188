"""OpenAI response bodies and stream chunks, built from a finished or running Generation.

Streams send one chunk per token (per `stream_interval` tokens) of new text, then one
chunk per choice carrying its `finish_reason`, then, only when the client asked with
`stream_options.include_usage`, a chunk with empty `choices` and the `usage` (as OpenAI
and vLLM do), then `[DONE]` (added by the SSE layer). `continuous_usage_stats` puts the
usage so far on every chunk too. Each choice says which stop string or stop token
ended it (`stop_reason`, as vLLM).

Logprobs take OpenAI's two shapes: completions' `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}` (with `echo`, the prompt's tokens come first, the first
one scored null) and chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence as Seq

from servelab.server.generation import Choice, Generation
from servelab.server.protocol import GenerationRequest


def completion_body(generation: Generation, model: str, request: GenerationRequest) -> dict[str, Any]:
    choices = []
    for c in generation.choices:
        text = c.text
        logprobs = None
        if generation.params.logprobs is not None:
            pairs = list(zip(c.output.token_ids, c.output.logprobs or ()))
            prompt_pairs = _prompt_pairs(generation, c) if generation.echo_texts is not None else []
            logprobs = completion_logprobs(prompt_pairs + pairs, generation.params.logprobs)
        if generation.echo_texts is not None:
            text = generation.echo_texts[c.prompt_index] + text
        choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.output.stop_reason,
                  **(_token_ids(generation, c) if request.return_token_ids else {})}
        if request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(generation, c, request.prompt_logprobs)
        choices.append(choice)
    return {**_header(generation, model, "text_completion"), "choices": choices, "usage": generation.usage()}


def vllm_prompt_logprobs(generation: Generation, choice: Choice, num_top: int) -> list[Any]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {"token id": {logprob,
    rank, decoded_token}} for the token itself and the num_top most likely."""
    result: list[Any] = []
    for token_id, position in _prompt_pairs(generation, choice):
        if position is None:
            result.append(None)
            continue
        result.append({str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                       for t, lp in _top(position, num_top, token_id)})
    return result


class _Usage:
    """A stream's usage: at its end (include_usage) and on every chunk (continuous_usage_stats)."""

    def __init__(self, generation: Generation, request: GenerationRequest) -> None:
        self.generation = generation
        self.final = request.include_usage
        self.continuous = request.continuous_usage
        self.prompt_tokens = sum(len(p) for p in generation.prompts)
        self.completion_tokens = 0

    def chunk(self, chunk: dict[str, Any], num_tokens: int = 0) -> dict[str, Any]:
        self.completion_tokens += num_tokens
        if self.continuous:
            chunk["usage"] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                              "total_tokens": self.prompt_tokens + self.completion_tokens}
        return chunk

    def last(self, header: dict[str, Any]) -> list[dict[str, Any]]:
        return [{**header, "choices": [], "usage": self.generation.usage()}] if self.final else []


async def completion_chunks(generation: Generation, model: str,
                            request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
    usage = _Usage(generation, request)
    header = _header(generation, model, "text_completion")
    num_top = generation.params.logprobs
    echoing = generation.echo_texts is not None
    waits_for_prompt = echoing and generation.params.prompt_logprobs is not None
    offsets = {c.index: 0 for c in generation.choices}
    echoed: set[int] = set()
    async for delta in generation.deltas():
        choice = generation.choices[delta.index]
        if echoing and delta.index not in echoed and (
                not waits_for_prompt or delta.prompt_logprobs is not None or delta.finish_reason is not None):
            echoed.add(delta.index)
            logprobs = None
            if num_top is not None:
                scored = delta.prompt_logprobs if delta.prompt_logprobs is not None else generation.prompt_logprobs(
                    choice)
                pairs = list(zip(generation.prompt_token_ids(choice), scored or ()))
                logprobs = completion_logprobs(pairs, num_top, offsets[delta.index])
                offsets[delta.index] += sum(len(t) for t in logprobs["tokens"])
            yield usage.chunk({**header, "choices": [{"index": delta.index,
                                                      "text": generation.echo_texts[choice.prompt_index],
                                                      "logprobs": logprobs, "finish_reason": None}]})
        if not delta.num_tokens and delta.finish_reason is None:
            continue  # a delta that only carried the prompt's logprobs
        logprobs = None
        if num_top is not None:
            logprobs = completion_logprobs(list(delta.logprobs), num_top, offsets[delta.index])
            offsets[delta.index] += sum(len(t) for t in logprobs["tokens"])
        end = {"stop_reason": delta.stop_reason} if delta.finish_reason is not None else {}
        yield usage.chunk({**header, "choices": [{"index": delta.index, "text": delta.text, "logprobs": logprobs,
                                                  "finish_reason": delta.finish_reason, **end}]}, delta.num_tokens)
    for chunk in usage.last(header):
        yield chunk


def chat_body(generation: Generation, model: str, request: GenerationRequest) -> dict[str, Any]:
    num_top = generation.params.logprobs
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(list(zip(c.output.token_ids, c.output.logprobs or ())), num_top)
                if num_top is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.output.stop_reason,
                **(_token_ids(generation, c) if request.return_token_ids else {})}
               for c in generation.choices]
    return {**_header(generation, model, "chat.completion"), "choices": choices, "usage": generation.usage()}


async def chat_chunks(generation: Generation, model: str, request: GenerationRequest) -> AsyncIterator[dict[str, Any]]:
    usage = _Usage(generation, request)
    header = _header(generation, model, "chat.completion.chunk")
    num_top = generation.params.logprobs
    for choice in generation.choices:  # the role comes first, once per choice
        yield usage.chunk({**header, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
    async for delta in generation.deltas():
        if not delta.num_tokens and delta.finish_reason is None:
            continue
        content = {"content": delta.text} if delta.text else {}
        logprobs = chat_logprobs(list(delta.logprobs), num_top) if num_top is not None else None
        end = {"stop_reason": delta.stop_reason} if delta.finish_reason is not None else {}
        yield usage.chunk({**header, "choices": [{"index": delta.index, "delta": content, "logprobs": logprobs,
                                                  "finish_reason": delta.finish_reason, **end}]}, delta.num_tokens)
    for chunk in usage.last(header):
        yield chunk


# ---------------------------------------------------------------- logprobs shapes


def completion_logprobs(pairs: Seq[tuple[int, Any]], num_top: int, offset: int = 0) -> dict[str, list]:
    """OpenAI completions logprobs of (token id, {token id: Logprob} or None) pairs;
    `offset` is the text offset of the first token."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for token_id, position in pairs:
        if position is None:  # the prompt's first token: nothing scored it
            text = ""
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = position[token_id]
            text = chosen.decoded_token or ""
            token_logprobs.append(_finite(chosen.logprob))
            top_logprobs.append({lp.decoded_token or "": _finite(lp.logprob)
                                 for _, lp in _top(position, num_top, token_id)})
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def chat_logprobs(pairs: Seq[tuple[int, Any]], num_top: int) -> dict[str, list]:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, position in pairs:
        chosen = position[token_id]
        content.append({**_chat_entry(chosen),
                        "top_logprobs": [_chat_entry(lp) for _, lp in _top(position, num_top)]})
    return {"content": content}


def _top(position: dict[int, Any], num_top: int, chosen: int | None = None) -> list[tuple[int, Any]]:
    """The num_top most likely entries by rank (completions also keep the chosen token, as vLLM)."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    top = [(t, lp) for t, lp in ranked if lp.rank <= num_top][:num_top]
    if chosen is not None and all(t != chosen for t, _ in top):
        top.append((chosen, position[chosen]))
    return top


def _chat_entry(logprob: Any) -> dict[str, Any]:
    text = logprob.decoded_token or ""
    return {"token": text, "logprob": _finite(logprob.logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    """JSON has no -Infinity: a banned token's logprob is written as -9999.0, as vLLM does."""
    return max(logprob, -9999.0)


def _prompt_pairs(generation: Generation, choice: Choice) -> list[tuple[int, Any]]:
    scored = generation.prompt_logprobs(choice) or [None] * len(generation.prompt_token_ids(choice))
    return list(zip(generation.prompt_token_ids(choice), scored))


def _token_ids(generation: Generation, choice: Any) -> dict[str, list[int]]:
    return {"prompt_token_ids": generation.prompt_token_ids(choice), "token_ids": list(choice.output.token_ids)}


def _header(generation: Generation, model: str, kind: str) -> dict[str, Any]:
    return {"id": generation.request_id, "object": kind, "created": generation.created, "model": model}
