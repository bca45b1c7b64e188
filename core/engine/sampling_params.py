"""Per-request sampling parameters, with vLLM's names and validation."""

from __future__ import annotations

import functools
import math
from typing import Any

import attrs

from servelab.errors import RequestError

MAX_SEED = 2**64 - 1  # the range torch.Generator.manual_seed takes
MIN_SEED = -(2**63)


def _brief(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _as_bias(value):
    """logit_bias as sorted (token id, bias) pairs: a dict in, hashable and frozen inside."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = value.items()
    try:
        return tuple(sorted((token, bias) for token, bias in value))
    except (TypeError, ValueError):
        raise RequestError(f"logit_bias must map token ids to numbers, got {_brief(value)}") from None


def _as_args(value):
    """extra_args as sorted (name, value) pairs (hashable); read it back with `dict(...)`."""
    if value is None:
        return ()
    if isinstance(value, dict):
        value = value.items()
    try:
        return tuple(sorted(value, key=lambda item: item[0]))
    except (TypeError, ValueError, IndexError, KeyError):
        raise RequestError(f"extra_args must map string names to values, got {_brief(value)}") from None


GREEDY_TEMPERATURE = 1e-5  # below it sampling is greedy (as vLLM): dividing logits by less overflows them
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-5, 1e5  # beyond them the logits overflow to inf or NaN


def _as_temperature(value):
    """A temperature below GREEDY_TEMPERATURE (a denormal one included) means greedy."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < GREEDY_TEMPERATURE:
        return 0.0
    return value


def _as_tuple(value):
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # not a sequence: kept whole, so validation names it
        return (value,)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request's output.

    temperature 0 is greedy. top_k <= 0 (or -1) disables top-k, top_p 1 disables
    top-p, min_p 0 disables min-p. `seed` makes the request reproducible
    regardless of what else shares its batch. `stop` strings and `stop_token_ids`
    end the output with finish_reason "stop"; so does the tokenizer's EOS unless
    `ignore_eos`; the stop string or stop token is left out of the text unless
    `include_stop_str_in_output` (the token ids keep a stop token), and the output's
    `stop_reason` says which one ended it (as vLLM). `n` > 1 samples n completions of the one prompt (its KV is computed
    once and forked); completion i of a seeded request uses seed + i.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = attrs.field(default=1.0, converter=_as_temperature)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_as_bias)
    min_tokens: int = 0
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    structured: Any = None  # a servelab.structured.StructuredOutput
    logits_processors: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    extra_args: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_as_args)
    # The request's SLO: seconds after its arrival by which it should finish (None: none).
    # Policies may read it (a deadline-aware scheduler); the engine enforces nothing.
    deadline: float | None = None

    def __attrs_post_init__(self) -> None:
        self.validate()
        self.is_greedy  # noqa: B018 - worked out now, so the sampler's reads are plain attribute reads

    @functools.cached_property
    def is_greedy(self) -> bool:
        """temperature 0. Cached when the params are made (not a field: the record's fields
        stay the ones a caller passes, and `attrs.asdict` round-trips)."""
        return self.temperature == 0

    def validate(self) -> None:
        """Raise RequestError naming the first invalid field."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {_brief(self.n)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {_brief(self.max_tokens)}")
        if self.deadline is not None and (isinstance(self.deadline, bool) or not isinstance(
                self.deadline, (int, float)) or not math.isfinite(self.deadline) or self.deadline <= 0):
            raise RequestError(f"deadline must be a number of seconds > 0 (or None), got {_brief(self.deadline)}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {_brief(value)}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {_brief(self.temperature)}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {_brief(self.top_p)}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise RequestError(f"top_k must be -1 (disabled) or an integer >= 1, got {_brief(self.top_k)}")
        if not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1], got {_brief(self.min_p)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise RequestError(f"seed must be an integer, got {_brief(self.seed)}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED - (self.n - 1):
            raise RequestError(f"seed must be in [{MIN_SEED}, {MAX_SEED - (self.n - 1)}] (completion i uses "
                               f"seed + i, and n={self.n}), got {_brief(self.seed)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be non-empty strings, got {_brief(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative integers, got {_brief(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise RequestError(f"{name} must be an integer >= 0 (the number of top alternatives), "
                                   f"got {_brief(value)}")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number, got {_brief(value)}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                               f"{MAX_REPETITION_PENALTY:g}] (outside it the logits overflow), "
                               f"got {_brief(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise RequestError(f"{name} must be in [-2, 2], got {_brief(getattr(self, name))}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {_brief(token)}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise RequestError(f"logit_bias values must be numbers in [-100, 100], got {_brief(bias)} "
                                   f"for token {token}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise RequestError(f"min_tokens must be an integer >= 0, got {_brief(self.min_tokens)}")
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise RequestError(f"bad_words must be non-empty strings, got {_brief(self.bad_words)}")
        if any(not isinstance(name, str) or not name for name in self.logits_processors):
            raise RequestError(f"logits_processors must be processor names, got {_brief(self.logits_processors)}")
        if any(not isinstance(name, str) for name, _ in self.extra_args):
            raise RequestError(f"extra_args must have string keys, got {_brief(self.extra_args)}")
        if self.structured is not None and type(self.structured).__name__ != "StructuredOutput":
            raise RequestError(f"structured must be a StructuredOutput (servelab.StructuredOutput.json(schema), "
                               f".regex(pattern), .grammar(ebnf) or .json_object()), got {_brief(self.structured)}")

    @property
    def has_logits_work(self) -> bool:
        """Anything beyond plain sampling: logprobs, or a built-in or named logits processor."""
        return (self.logprobs is not None or self.prompt_logprobs is not None or self.repetition_penalty != 1
                or self.presence_penalty != 0 or self.frequency_penalty != 0 or bool(self.logit_bias)
                or self.min_tokens > 0 or bool(self.bad_words) or self.structured is not None
                or bool(self.logits_processors))
