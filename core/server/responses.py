"""OpenAI response bodies and stream chunks, built from a finished or running Generation.

Streams send one chunk per piece of new text, then one chunk per choice carrying its
`finish_reason`, then a chunk with empty `choices` and the `usage` (always sent, as
OpenAI does with `stream_options.include_usage`), then `[DONE]` (added by the SSE layer).

Logprobs take OpenAI's two shapes: completions' `{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}` (with `echo`, the prompt's tokens come first, the first
one scored null) and chat's `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence as Seq

from servelab.server.generation import Choice, Generation


def completion_body(generation: Generation, model: str, token_ids: bool = False) -> dict[str, Any]:
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
        choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                        **(_token_ids(generation, c) if token_ids else {})})
    return {**_header(generation, model, "text_completion"), "choices": choices, "usage": generation.usage()}


async def completion_chunks(generation: Generation, model: str) -> AsyncIterator[dict[str, Any]]:
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
            yield {**header, "choices": [{"index": delta.index, "text": generation.echo_texts[choice.prompt_index],
                                          "logprobs": logprobs, "finish_reason": None}]}
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            continue  # a delta that only carried the prompt's logprobs
        logprobs = None
        if num_top is not None:
            logprobs = completion_logprobs(list(delta.logprobs), num_top, offsets[delta.index])
            offsets[delta.index] += sum(len(t) for t in logprobs["tokens"])
        yield {**header, "choices": [{"index": delta.index, "text": delta.text, "logprobs": logprobs,
                                      "finish_reason": delta.finish_reason}]}
    yield {**header, "choices": [], "usage": generation.usage()}


def chat_body(generation: Generation, model: str, token_ids: bool = False) -> dict[str, Any]:
    num_top = generation.params.logprobs
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(list(zip(c.output.token_ids, c.output.logprobs or ())), num_top)
                if num_top is not None else None,
                "finish_reason": c.finish_reason, **(_token_ids(generation, c) if token_ids else {})}
               for c in generation.choices]
    return {**_header(generation, model, "chat.completion"), "choices": choices, "usage": generation.usage()}


async def chat_chunks(generation: Generation, model: str) -> AsyncIterator[dict[str, Any]]:
    header = _header(generation, model, "chat.completion.chunk")
    num_top = generation.params.logprobs
    for choice in generation.choices:  # the role comes first, once per choice
        yield {**header, "choices": [{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
    async for delta in generation.deltas():
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            continue
        content = {"content": delta.text} if delta.text else {}
        logprobs = chat_logprobs(list(delta.logprobs), num_top) if num_top is not None else None
        yield {**header, "choices": [{"index": delta.index, "delta": content, "logprobs": logprobs,
                                      "finish_reason": delta.finish_reason}]}
    yield {**header, "choices": [], "usage": generation.usage()}


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
