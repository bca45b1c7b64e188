"""vLLM's `/tokenize` and `/detokenize` bodies -> validated records.

`/tokenize` takes `{"prompt": text}` or `{"messages": [...]}` (rendered with the chat
template first), with `add_special_tokens` (default true, as vLLM) and
`return_token_strs`; `/detokenize` takes `{"tokens": [ids]}`. Every other field is a 400
naming it, as on the generation endpoints.
"""

from __future__ import annotations

from typing import Any

import attrs

from servelab.server.protocol import (PromptBounds, _check_prompt_size, _messages, bad_request, brief,
                                      check_messages_size)

_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                              "chat_template", "add_generation_prompt"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


@attrs.frozen
class TokenizeRequest:
    prompt: str | None
    messages: list[dict[str, str]] | None
    add_special_tokens: bool
    return_token_strs: bool
    chat_template: str | None


def parse_tokenize(body: dict[str, Any], bounds: PromptBounds) -> TokenizeRequest:
    _refuse_unknown(body, _TOKENIZE_FIELDS, "/tokenize")
    if body.get("add_generation_prompt") not in (None, True):
        raise bad_request("add_generation_prompt: only true is supported (the template is rendered for the "
                          "assistant's turn)", "add_generation_prompt", "unsupported")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("give prompt (a string) or messages, one of them", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string, got {brief(prompt)}", "prompt")
        _check_prompt_size(prompt, bounds, "prompt")
    parsed_messages = list(_messages(messages, bounds.caps)) if messages is not None else None
    if parsed_messages is not None:  # the bound chat applies: tokenizing is the cost either way
        check_messages_size(parsed_messages, bounds)
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise bad_request(f"chat_template must be a string, got {brief(template)}", "chat_template")
    return TokenizeRequest(prompt, parsed_messages, _flag(body, "add_special_tokens", True),
                           _flag(body, "return_token_strs", False), template)


def parse_detokenize(body: dict[str, Any], bounds: PromptBounds) -> list[int]:
    _refuse_unknown(body, _DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request(f"tokens must be a list of token ids, got {brief(tokens)}", "tokens")
    if len(tokens) > bounds.max_model_len:
        raise bad_request(f"tokens has {len(tokens)} ids, more than max_model_len={bounds.max_model_len}", "tokens")
    bad = [t for t in tokens if not 0 <= t < bounds.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {bounds.vocab_size})", "tokens")
    return tokens


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {brief(value)}", name)
    return value


def _refuse_unknown(body: dict[str, Any], known: frozenset[str], path: str) -> None:
    for name in body:
        if name not in known:
            raise bad_request(f"unknown field {brief(name)} for {path}", str(name)[:80], "unknown_field")
