"""OpenAI request bodies -> validated records, and OpenAI-style errors.

Every rejection is an `ApiError` whose body is OpenAI's
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the field.
Sampling fields are OpenAI's (penalties, logit_bias, logprobs, echo, top_logprobs,
response_format) plus vLLM's extras (top_k, min_p, seed, stop, stop_token_ids, ignore_eos,
return_token_ids, repetition_penalty, min_tokens, bad_words, include_stop_str_in_output,
structured_outputs and the older guided_json / guided_regex / guided_grammar / guided_choice;
`logits_processors` and `extra_args` select installed third-party processors). No field is
ignored: one servelab cannot honour (suffix, tools, ...) is refused by name, and so is one
it does not know (fields.py lists them all).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import attrs

from servelab.errors import RequestError
from servelab.sampling_params import SamplingParams
from servelab.server.caps import RequestCaps
from servelab.server.fields import field_problem
from servelab.structured import StructuredOutput

MAX_N = 64  # choices per request
UNBOUNDED_MAX_TOKENS = 2**31 - 1  # chat without max_tokens: until the context is full (the engine stops there)
MAX_SEED = 2**64 - 1  # the largest seed a torch generator takes; choice i of a request uses seed + i
MIN_SEED = -(2**63)
_SAMPLING_FIELDS = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "logprobs", "prompt_logprobs", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "logit_bias", "min_tokens", "bad_words", "logits_processors", "extra_args")
# Where a request's structured output came from, to name it in errors.
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_grammar",
                      "guided_choice")
# vLLM's structured_outputs object: its constraint keys (one of them), and the options
# servelab takes at their neutral value only.
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_CONSTRAINT_OPTIONS = {"disable_fallback": (False,), "disable_any_whitespace": (False,),
                       "disable_additional_properties": (False,), "whitespace_pattern": (), "structural_tag": (),
                       "backend": ()}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        message, param = _printable(message), _printable(param)  # it may quote text that is not Unicode
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str | None) -> str | None:
    """`text` with anything UTF-8 cannot carry (a lone surrogate) written as a backslash escape."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def brief(value: Any, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, for quoting a client's value in an error."""
    text = repr(value) if not isinstance(value, str) or len(value) <= 4 * limit else repr(value[: 4 * limit])
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else type(value).__name__
    return f"{text[:limit]}... ({size})"


@attrs.frozen
class PromptBounds:
    """What the served model allows, checked before anything is tokenized."""

    max_model_len: int
    max_prompt_chars: int
    vocab_size: int
    max_logprobs: int = 20  # the engine's max_logprobs
    caps: RequestCaps = RequestCaps()  # the per-request quantity limits


def request_error(exc: RequestError, prompt_field: str, structured_field: str | None = None) -> ApiError:
    """A 400 for an engine RequestError; its message starts with the field it is about."""
    message = str(exc)
    first = re.match(r"[a-z_]*", message).group()  # "temperature must be ...", "n=4 samples ..."
    if first in _SAMPLING_FIELDS or first == "chat_template":
        return bad_request(message, first)
    if message.startswith("structured output"):
        return bad_request(message, structured_field or "response_format")
    if not message.startswith(prompt_field):
        message = f"{prompt_field}: {message}"
    return bad_request(message, prompt_field)


@attrs.frozen
class GenerationRequest:
    """A validated completions or chat request."""

    prompts: tuple[Any, ...]  # strings or token-id lists (completions); rendered chat is filled in later
    params: SamplingParams
    n: int
    stream: bool
    messages: tuple[dict[str, str], ...] = ()  # chat only
    return_token_ids: bool = False  # vLLM's extra: token ids in non-streaming choices
    echo: bool = False  # completions: the prompt comes first in each choice (with its logprobs when asked)
    structured_field: str | None = None  # the body field that asked for structured output
    max_tokens: int | None = None  # as asked; None: until the context is full (chat without a limit)
    include_usage: bool = False  # stream_options.include_usage: a usage chunk ends the stream
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every chunk too
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs field, per choice
    chat_template: str | None = None  # chat: a template sent with the request (if the server trusts them)
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)  # chat: more variables for the template

    @property
    def scoring_only(self) -> bool:
        """max_tokens 0 (completions): the prompt is scored, nothing is generated."""
        return self.max_tokens == 0


def check_model(body: dict[str, Any], served_model: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if model != served_model:
        raise ApiError(404, f"the model {brief(model)} does not exist; this server serves {served_model!r}",
                       "model", "model_not_found")


def parse_completion(body: dict[str, Any], bounds: PromptBounds) -> GenerationRequest:
    """`POST /v1/completions`: prompt is a string, a token-id list, or a list of either."""
    _refuse_unsupported(body, chat=False)
    caps = bounds.caps
    prompts = _prompts(body.get("prompt", _MISSING))
    if len(prompts) > caps.max_prompts:
        raise _over_limit(f"prompt has {len(prompts)} prompts", "max_prompts", caps.max_prompts, "prompt")
    n = _integer(body, "n", 1, minimum=1, maximum=MAX_N)
    _check_sequences(len(prompts), n, caps)
    for prompt in prompts:
        _check_prompt_size(prompt, bounds, "prompt")
    if isinstance(body.get("logprobs"), bool):  # a chat-style `true` (as vLLM: 1); `false`: none
        body = {**body, "logprobs": 1 if body["logprobs"] else None}
    logprobs = _integer(body, "logprobs", None, minimum=0, maximum=bounds.max_logprobs)
    echo = _boolean(body, "echo")
    prompt_logprobs = _integer(body, "prompt_logprobs", None, minimum=0, maximum=bounds.max_logprobs)
    stream = _boolean(body, "stream")
    if prompt_logprobs is not None and stream:
        raise bad_request("prompt_logprobs is answered in non-streaming responses only (with stream: true, "
                          "use echo with logprobs)", "prompt_logprobs", "unsupported")
    # echo with logprobs scores the prompt too, as vLLM does
    scored = [k for k in (logprobs if echo else None, prompt_logprobs) if k is not None]
    extra = {"logprobs": logprobs, "prompt_logprobs": max(scored) if scored else None}
    params, structured_field = _sampling_params(body, 16, n, bounds, extra, allow_zero_tokens=True)
    max_tokens = _integer(body, "max_tokens", 16)
    return GenerationRequest(prompts, params, n, stream, return_token_ids=_boolean(body, "return_token_ids"),
                             echo=echo, structured_field=structured_field, max_tokens=max_tokens,
                             prompt_logprobs=prompt_logprobs, **_stream_options(body, stream))


def check_messages_size(messages: Any, bounds: PromptBounds) -> None:
    """What the template will render, at least (every role and content, and a separator
    each), within the characters this server tokenizes."""
    size = sum(len(m["content"]) + len(m["role"]) + MESSAGE_OVERHEAD_CHARS for m in messages)
    if size > bounds.max_prompt_chars:
        raise bad_request(f"messages have {size} characters (content, roles and {MESSAGE_OVERHEAD_CHARS} a message), "
                          f"more than this server tokenizes ({bounds.max_prompt_chars}, for "
                          f"max_model_len={bounds.max_model_len})", "messages")


def parse_chat(body: dict[str, Any], bounds: PromptBounds) -> GenerationRequest:
    """`POST /v1/chat/completions`: messages are {"role", "content"} with text content."""
    _refuse_unsupported(body, chat=True)
    messages = _messages(body.get("messages", _MISSING), bounds.caps)
    check_messages_size(messages, bounds)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": body["max_completion_tokens"]}
    if body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool):
        raise bad_request("max_tokens must be >= 1 on chat completions (max_tokens 0 scores a prompt: "
                          "/v1/completions with echo and logprobs)", "max_tokens")
    n = _integer(body, "n", 1, minimum=1, maximum=MAX_N)
    _check_sequences(1, n, bounds.caps)
    top_logprobs = _integer(body, "top_logprobs", None, minimum=0, maximum=bounds.max_logprobs)
    wants_logprobs = _boolean(body, "logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    # Chat's default is "until the context is full"; the engine stops at max_model_len.
    extra = {"logprobs": (top_logprobs or 0) if wants_logprobs else None}
    params, structured_field = _sampling_params(body, None, n, bounds, extra)
    max_tokens = None if body.get("max_tokens") is None else params.max_tokens
    stream = _boolean(body, "stream")
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template):
        raise bad_request(f"chat_template must be a non-empty string (a jinja template), got {brief(template)}",
                          "chat_template")
    if template is not None and len(template) > bounds.caps.max_grammar_chars:
        raise _over_limit(f"chat_template is {len(template)} characters", "max_grammar_chars",
                          bounds.caps.max_grammar_chars, "chat_template")
    return GenerationRequest((), params, n, stream, messages, return_token_ids=_boolean(body, "return_token_ids"),
                             structured_field=structured_field, max_tokens=max_tokens, chat_template=template,
                             chat_template_kwargs=_object(body, "chat_template_kwargs"),
                             **_stream_options(body, stream))


def _stream_options(body: dict[str, Any], stream: bool) -> dict[str, bool]:
    """OpenAI's stream_options: include_usage, and vLLM's continuous_usage_stats."""
    options = body.get("stream_options")
    if options is None:
        return {}
    if not stream:
        raise bad_request("stream_options is only for stream: true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request(f"stream_options must be an object, got {brief(options)}", "stream_options")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise bad_request(f"stream_options.{brief(unknown[0])[1:-1]} is not known to this server (it takes "
                          f"include_usage and continuous_usage_stats)", f"stream_options.{unknown[0][:40]}",
                          "unknown_field")
    include = _boolean(options, "include_usage", "stream_options.include_usage")
    continuous = _boolean(options, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    return {"include_usage": include, "continuous_usage": include and continuous}


MESSAGE_OVERHEAD_CHARS = 8  # characters a chat message costs before its content (the template's own text)


def _over_limit(what: str, limit: str, value: int, param: str | None) -> ApiError:
    """A 400 naming the limit a request passed (`servelab serve --limit NAME=VALUE`)."""
    return bad_request(f"{what}, more than this server allows ({limit} = {value})", param, "limit_exceeded")


def _check_sequences(num_prompts: int, n: int, caps: RequestCaps) -> None:
    if num_prompts * n > caps.max_sequences:
        raise _over_limit(f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences", "max_sequences",
                          caps.max_sequences, "n")


def check_response_size(prompt_lengths: list[int], request: GenerationRequest, bounds: PromptBounds) -> None:
    """400 when the logprobs a request asks for would make a response larger than
    max_logprob_entries: prompts x n x positions (echoed prompt + output) x (top-k + 1)."""
    params = request.params
    if params.logprobs is None and params.prompt_logprobs is None:
        return
    entries = 0
    for length in prompt_lengths:
        room = max(0, bounds.max_model_len - length)
        outputs = min(request.max_tokens, room) if request.max_tokens is not None else room
        if params.logprobs is not None:
            entries += request.n * outputs * (params.logprobs + 1)
        if params.prompt_logprobs is not None:
            entries += request.n * length * (params.prompt_logprobs + 1)
    limit = bounds.caps.max_logprob_entries
    if entries > limit:
        field = "top_logprobs" if request.messages else "logprobs"
        raise _over_limit(f"the logprobs asked for come to {entries} entries (prompts x n x positions x "
                          f"(top-k + 1))", "max_logprob_entries", limit, field)


_MISSING = object()


def _check_prompt_size(prompt: str | list[int], bounds: PromptBounds, field: str) -> None:
    """A prompt too long for the context however it tokenizes is refused before tokenization."""
    if isinstance(prompt, str) and len(prompt) > bounds.max_prompt_chars:
        raise bad_request(f"{field} has {len(prompt)} characters, more than this server tokenizes "
                          f"({bounds.max_prompt_chars}, for max_model_len={bounds.max_model_len})", field)
    if isinstance(prompt, list) and len(prompt) > bounds.max_model_len:
        raise bad_request(f"{field} has {len(prompt)} tokens, more than max_model_len={bounds.max_model_len}", field)


def _prompts(prompt: Any) -> tuple[Any, ...]:
    if prompt is _MISSING or prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return (list(prompt),)
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p)) for p in prompt):
        return tuple(prompt)
    raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")


def _messages(messages: Any, caps: RequestCaps) -> tuple[dict[str, str], ...]:
    if messages is _MISSING or not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > caps.max_messages:
        raise _over_limit(f"messages has {len(messages)} messages", "max_messages", caps.max_messages, "messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {brief(role)}", f"{where}.role")
        parsed.append({"role": role, "content": _content(message.get("content"), f"{where}.content")})
    return tuple(parsed)


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where} parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                  f"only text content is supported", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _sampling_params(body: dict[str, Any], default_max_tokens: int | None, n: int, bounds: PromptBounds,
                     extra: dict[str, Any], allow_zero_tokens: bool = False) -> tuple[SamplingParams, str | None]:
    """The request's SamplingParams, and the field that asked for structured output (if any).
    max_tokens 0 (`allow_zero_tokens`, completions) scores the prompt: the engine runs its
    prefill, which samples one token, and the response leaves that token out."""
    caps = bounds.caps
    max_tokens = _integer(body, "max_tokens", default_max_tokens, minimum=0 if allow_zero_tokens else 1)
    if max_tokens == 0:
        if _integer(body, "min_tokens", 0, minimum=0):
            raise bad_request("min_tokens must be 0 with max_tokens 0 (the prompt is scored, nothing generated)",
                              "min_tokens")
        max_tokens = 1
    if max_tokens is not None:  # clipped to the context (and further to each prompt's room, later)
        max_tokens = min(max_tokens, bounds.max_model_len)
    top_k = _integer(body, "top_k", -1)
    if not (top_k in (-1, 0) or 1 <= top_k <= bounds.vocab_size):  # 0 disables it too, as in vLLM
        raise bad_request(f"top_k must be -1 (disabled) or in 1..{bounds.vocab_size} (the vocabulary), "
                          f"got {brief(top_k)}", "top_k")
    values = {
        "temperature": _number(body, "temperature", 1.0),
        "top_p": _number(body, "top_p", 1.0),
        "top_k": top_k,
        "min_p": _number(body, "min_p", 0.0),
        "seed": _seed(body, n),
        "stop": _stop(body.get("stop"), caps),
        "stop_token_ids": _token_ids(body, "stop_token_ids", caps.max_stop_token_ids),
        "ignore_eos": _boolean(body, "ignore_eos"),
        "include_stop_str_in_output": _boolean(body, "include_stop_str_in_output"),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        "logit_bias": _logit_bias(body.get("logit_bias"), caps, bounds.vocab_size),
        "min_tokens": _integer(body, "min_tokens", 0, minimum=0),
        "bad_words": _strings(body, "bad_words", caps.max_bad_words, "max_bad_words", caps.max_bad_word_chars,
                              "max_bad_word_chars"),
        "logits_processors": _strings(body, "logits_processors", caps.max_logits_processors,
                                      "max_logits_processors"),
        "extra_args": _object(body, "extra_args"),
        **extra,
    }
    structured_field, values["structured"] = _structured(body, caps)
    if structured_field is not None:
        _check_structured_conflicts(values, structured_field)
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    else:
        values["max_tokens"] = UNBOUNDED_MAX_TOKENS
    try:
        return SamplingParams(**values), structured_field
    except RequestError as exc:
        raise request_error(exc, "prompt", structured_field) from None


_STRUCTURED_CONFLICTS = {
    "min_tokens": "min_tokens bans the end of the output until it has that many tokens, which a grammar may "
                  "need sooner",
    "bad_words": "bad_words can ban the only tokens the grammar allows",
}


def _check_structured_conflicts(values: dict[str, Any], structured_field: str) -> None:
    """Fields that can leave a grammar no token to allow are refused with it, at admission:
    structured output never returns text that violates its constraint."""
    for name, why in _STRUCTURED_CONFLICTS.items():
        if values.get(name):
            raise bad_request(f"{name} cannot be combined with {structured_field}: {why}", name,
                              "conflicting_fields")


_MAX_TOKEN_ID_DIGITS = 10  # token ids are below 2**31


def _logit_bias(value: Any, caps: RequestCaps, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (keys are strings in JSON)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"logit_bias must be an object mapping token ids to numbers, got {brief(value)}",
                          "logit_bias")
    if len(value) > caps.max_logit_bias:
        raise _over_limit(f"logit_bias has {len(value)} entries", "max_logit_bias", caps.max_logit_bias, "logit_bias")
    bias = {}
    for key, amount in value.items():
        # ASCII digits only: str.isdigit accepts "²", which int() refuses; and a bounded length,
        # because int() refuses more than 4,300 digits (and a token id has at most ten)
        token = key if _is_int(key) else (int(key) if isinstance(key, str) and key.isascii() and key.isdigit()
                                          and len(key) <= _MAX_TOKEN_ID_DIGITS else None)
        if token is None:
            raise bad_request(f"logit_bias keys must be token ids, got {brief(key)}", "logit_bias")
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not -100 <= amount <= 100:
            raise bad_request(f"logit_bias values must be numbers in [-100, 100], got {brief(amount)} for token "
                              f"{token}", "logit_bias")
        bias[token] = float(amount)
    return bias


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {brief(value)}", name)
    return value


def _strings(body: dict[str, Any], name: str, max_count: int, count_limit: str, max_chars: int | None = None,
             chars_limit: str = "") -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request(f"{name} must be a list of non-empty strings, got {brief(value)}", name)
    if len(value) > max_count:
        raise _over_limit(f"{name} has {len(value)} entries", count_limit, max_count, name)
    if max_chars is not None and value:
        longest = max(value, key=len)
        if len(longest) > max_chars:
            raise _over_limit(f"{name} holds a {len(longest)}-character string", chars_limit, max_chars, name)
    return tuple(value)


def _structured(body: dict[str, Any], caps: RequestCaps) -> tuple[str | None, StructuredOutput | None]:
    """OpenAI's response_format, vLLM's structured_outputs, or one of vLLM's older guided_*
    fields (at most one of them)."""
    given = [name for name in _STRUCTURED_FIELDS if body.get(name) is not None
             and not (name == "response_format" and body[name] == {"type": "text"})]
    if "structured_outputs" in given:  # {"json": ...} is checked as guided_json, and so on
        given.remove("structured_outputs")
        given[:0] = _structured_outputs(body["structured_outputs"])
        body = {**body, **{f"structured_outputs.{k}": v for k, v in body["structured_outputs"].items()}}
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(given)}, not several: each constrains the whole output", given[1])
    field = given[0]
    value = body[field]
    if field == "structured_outputs.json_object":
        if value is not True:
            raise bad_request(f"structured_outputs.json_object must be true, got {brief(value)}", field)
        return field, StructuredOutput.json_object()
    _check_structured_size(field, value, caps)
    try:
        if field == "response_format":
            return field, _response_format(value)
        kind = field.rpartition("_")[2] if field.startswith("guided_") else field.rpartition(".")[2]
        if kind == "json":
            if not isinstance(value, (dict, str)):
                raise bad_request(f"{field} must be a JSON schema (an object or its JSON text), got {brief(value)}",
                                  field)
            return field, StructuredOutput.json(value)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad_request(f"{field} must be a non-empty list of strings, got {brief(value)}", field)
            return field, StructuredOutput.regex("|".join(f"({_regex_literal(c)})" for c in value))
        if not isinstance(value, str) or not value:
            raise bad_request(f"{field} must be a non-empty string, got {brief(value)}", field)
        return field, (StructuredOutput.regex(value) if kind == "regex" else StructuredOutput.grammar(value))
    except RequestError as exc:
        raise bad_request(str(exc), field) from None


def _structured_outputs(value: Any) -> list[str]:
    """The constraint fields of vLLM's structured_outputs object, named
    `structured_outputs.json` and so on; unknown keys and unsupported options are 400s."""
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object such as {{\"json\": schema}}, {{\"regex\": ...}}, "
                          f"{{\"choice\": [...]}} or {{\"grammar\": ...}}, got {brief(value)}", "structured_outputs")
    given = []
    for key, item in value.items():
        name = f"structured_outputs.{str(key)[:40]}"
        if key in _CONSTRAINTS:
            if item is not None and item is not False:
                given.append(f"structured_outputs.{key}")
        elif key in _CONSTRAINT_OPTIONS:
            if item is not None and not any(item == a and type(item) is type(a) for a in _CONSTRAINT_OPTIONS[key]):
                raise bad_request(f"{name} is not supported by this server (got {brief(item)})", name, "unsupported")
        else:
            raise bad_request(f"{name} is not a constraint this server knows (structured_outputs takes "
                              f"{', '.join(_CONSTRAINTS)})", name, "unknown_field")
    if not given:
        raise bad_request(f"structured_outputs names no constraint: give one of {', '.join(_CONSTRAINTS)}",
                          "structured_outputs")
    return given


def _check_structured_size(field: str, value: Any, caps: RequestCaps) -> None:
    """The grammar's size bounds its compilation: its text, its choices and enum values."""
    if field.endswith("choice") and isinstance(value, list):
        if len(value) > caps.max_choices:
            raise _over_limit(f"{field} has {len(value)} choices", "max_choices", caps.max_choices, field)
        size = sum(len(c) + 3 for c in value if isinstance(c, str))  # each becomes "(c)|"
    elif isinstance(value, str):
        size = len(value)
    else:
        size = 0
    if size > caps.max_grammar_chars:
        raise _over_limit(f"{field} is {size} characters", "max_grammar_chars", caps.max_grammar_chars, field)
    schema = _schema_of(field, value, caps)
    if schema is not None:  # an object schema, or one sent as text: the same bounds
        size, choices = _schema_size(schema)
        if choices > caps.max_choices:
            raise _over_limit(f"{field} has {choices} enum / const values", "max_choices", caps.max_choices, field)
        if size > caps.max_grammar_chars:
            raise _over_limit(f"{field} is {size} characters", "max_grammar_chars", caps.max_grammar_chars, field)


def _schema_of(field: str, value: Any, caps: RequestCaps) -> Any:
    """The JSON schema `field` holds, parsed when sent as text (after its nesting is found
    within max_schema_depth, so that parsing cannot recurse past it), or None for a regex,
    an EBNF grammar or choices."""
    if field == "response_format":
        spec = value.get("json_schema") if isinstance(value, dict) else None
        value = spec.get("schema") if isinstance(spec, dict) else None
    elif not field.endswith("json"):
        return None
    if isinstance(value, str):
        depth = json_text_depth(value)
        if depth > caps.max_schema_depth:
            raise _over_limit(f"{field} nests {depth} levels deep", "max_schema_depth", caps.max_schema_depth, field)
        try:
            return json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{field} is not valid JSON: {exc}", field) from None
    depth = _object_depth(value)
    if depth > caps.max_schema_depth:
        raise _over_limit(f"{field} nests {depth} levels deep", "max_schema_depth", caps.max_schema_depth, field)
    return value


def json_text_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON text (brackets inside strings not
    counted), found without parsing it: a scan, so any depth is safe to measure."""
    depth = deepest = 0
    for match in _JSON_STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest


_JSON_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def _object_depth(value: Any) -> int:
    deepest = 0
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _schema_size(schema: Any) -> tuple[int, int]:
    """(characters of its JSON text, at least; enum and const values) of a parsed schema,
    without recursion (the body's depth limit already bounds its nesting)."""
    size = choices = 0
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            size += 2 + 4 * len(value)
            for key, item in value.items():
                size += len(key) if isinstance(key, str) else 0
                if key == "enum" and isinstance(item, list):
                    choices += len(item)
                elif key == "const":
                    choices += 1
                pending.append(item)
        elif isinstance(value, list):
            size += 2 + len(value)
            pending.extend(value)
        else:
            size += len(value) if isinstance(value, str) else 4
    return size, choices


def _response_format(value: Any) -> StructuredOutput:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                              "{...}}}", "response_format")
        return StructuredOutput.json(schema)
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {brief(value)}",
                      "response_format")


def _regex_literal(text: str) -> str:
    """`text` as a regex matching itself (xgrammar's regex syntax: escape every metacharacter)."""
    return "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text)


def _integer(body: dict[str, Any], name: str, default: int | None, minimum: int | None = None,
             maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INTEGER:
        value = int(value)  # 4.0, as vLLM takes it (JSON has one number type); 4.5 is refused
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer, got {brief(value)}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be >= {minimum}, got {brief(value)}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"{name} must be <= {maximum}, got {brief(value)}", name)
    return value


_EXACT_FLOAT_INTEGER = 2**53  # beyond it a float no longer holds every integer


def _seed(body: dict[str, Any], n: int) -> int | None:
    seed = _integer(body, "seed", None)
    if seed is not None and not MIN_SEED <= seed <= MAX_SEED - (n - 1):
        raise bad_request(f"seed must be in [{MIN_SEED}, {MAX_SEED - (n - 1)}] (2**64 - 1 - (n - 1): choice i "
                          f"uses seed + i, and n={n}), got {brief(seed)}", "seed")
    return seed


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {brief(value)}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"{name} must be a finite number, got {brief(value)}", name)
    return number


def _boolean(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be true or false, got {brief(value)}", param or name)
    return value


def _stop(value: Any, caps: RequestCaps) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad_request(f"stop must be a non-empty string or a list of them, got {brief(value)}", "stop")
    if len(value) > caps.max_stop:
        raise _over_limit(f"stop has {len(value)} strings", "max_stop", caps.max_stop, "stop")
    longest = max(map(len, value), default=0)
    if longest > caps.max_stop_chars:
        raise _over_limit(f"stop holds a {longest}-character string", "max_stop_chars", caps.max_stop_chars, "stop")
    return tuple(value)


def _token_ids(body: dict[str, Any], name: str, max_count: int) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise bad_request(f"{name} must be a list of non-negative integers, got {brief(value)}", name)
    if len(value) > max_count:
        raise _over_limit(f"{name} has {len(value)} entries", "max_stop_token_ids", max_count, name)
    return tuple(value)


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Fields servelab cannot honour are errors unless they hold their neutral value, and
    fields it does not know are errors too (fields.py)."""
    problem = field_problem(body, chat)
    if problem is not None:
        name, code, message = problem
        raise bad_request(message.format(value=brief(body.get(name)), name=brief(name)), name, code)
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") if body.get("n") is not None else 1):
        raise bad_request(f"best_of is not supported by this server (got {brief(best_of)})", "best_of", "unsupported")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
