"""Per-request sampling parameters, with vLLM's names and validation."""

from __future__ import annotations

import math

import attrs

from servelab.errors import RequestError

MAX_SEED = 2**64 - 1  # the range torch.Generator.manual_seed takes
MIN_SEED = -(2**63)


def _brief(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _as_tuple(value):
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request's output.

    temperature 0 is greedy. top_k <= 0 (or -1) disables top-k, top_p 1 disables
    top-p, min_p 0 disables min-p. `seed` makes the request reproducible
    regardless of what else shares its batch. `stop` strings and `stop_token_ids`
    end the output with finish_reason "stop"; so does the tokenizer's EOS unless
    `ignore_eos`. `n` > 1 samples n completions of the one prompt (its KV is computed
    once and forked); completion i of a seeded request uses seed + i.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_as_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RequestError naming the first invalid field."""
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise RequestError(f"n must be an integer >= 1, got {_brief(self.n)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {_brief(self.max_tokens)}")
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
