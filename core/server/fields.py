"""Every request field the server knows, by endpoint: no field a client sends is ignored
without a word.

A field is honoured (protocol.py reads it), a documented no-op (`user`: an end-user id for
the provider's abuse monitoring, which changes no output), or accepted only at its neutral
value (`use_beam_search: false`, `suffix: ""`): anything else in such a field, and any
field not listed here, is a 400 naming it (`code` "unsupported" or "unknown_field").
docs/serving.md's compatibility table lists the same fields.
"""

from __future__ import annotations

from typing import Any

# Read by protocol.py on both generation endpoints.
COMMON = frozenset({
    "model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "min_tokens", "bad_words", "logits_processors", "extra_args", "stream", "stream_options",
    "response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs",
    "return_token_ids",
})
COMPLETIONS = COMMON | {"prompt", "echo", "logprobs", "prompt_logprobs", "best_of"}
CHAT = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "chat_template",
                 "chat_template_kwargs"}

# Accepted and without effect on the output.
NO_OP = {"user": "an end-user id for the provider's abuse monitoring; it changes no output"}

# Accepted only at the value servelab's behaviour already has (None is always accepted).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"), "function_call": ("none", "auto"),
    "parallel_tool_calls": (),
    "use_beam_search": (False,), "length_penalty": (1, 1.0), "early_stopping": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
    "allowed_token_ids": (), "truncate_prompt_tokens": (), "guided_decoding_backend": (),
    "guided_whitespace_pattern": (), "priority": (0,), "return_tokens_as_token_ids": (False,),
    "store": (False,), "service_tier": ("auto", "default"), "modalities": (["text"],),
}
CHAT_NEUTRAL = {"add_generation_prompt": (True,), "continue_final_message": (False,), "echo": (False,),
                "add_special_tokens": (False,), "prompt_logprobs": ()}
COMPLETIONS_NEUTRAL = {"add_special_tokens": (True,)}


def field_problem(body: dict[str, Any], chat: bool) -> tuple[str, str, str] | None:
    """(field, code, message) for the first field the server would otherwise have to
    ignore (see the module docstring); None when every field is taken."""
    known = CHAT if chat else COMPLETIONS
    neutral = {**NEUTRAL, **(CHAT_NEUTRAL if chat else COMPLETIONS_NEUTRAL)}
    for name, value in body.items():
        if name in known or name in NO_OP:
            continue
        if name in neutral:
            if value is not None and not any(value == a and type(value) is type(a) for a in neutral[name]):
                return name, "unsupported", f"{name} is not supported by this server (got {{value}})"
            continue
        endpoint = "chat completions" if chat else "completions"
        return (str(name)[:80], "unknown_field", f"unknown field {{name}} for {endpoint}: this server does not "
                f"ignore fields it does not know (docs/serving.md lists the ones it takes)")
    return None
