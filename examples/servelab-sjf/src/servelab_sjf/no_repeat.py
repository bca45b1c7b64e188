"""A logits processor: no n-gram occurs twice in prompt + output.

At each step, the tokens that would complete an n-gram already present (the last n - 1
tokens followed by a token that followed them before) are banned, as transformers'
`no_repeat_ngram_size` does. A request selects it by name,
`SamplingParams(logits_processors=["no-repeat-ngram"])`, and may set its own n with
`extra_args={"no_repeat_ngram_size": n}`.
"""

from __future__ import annotations

import attrs

from servelab.errors import ConfigError, RequestError


def _at_least_one(instance, attribute, value):
    if value < 1:
        raise ConfigError(f"[logits_processors] ngram_size must be >= 1, got {value}")


@attrs.frozen(kw_only=True)
class NoRepeatOptions:
    ngram_size: int = attrs.field(default=3, validator=_at_least_one)  # n, unless a request sets its own


@attrs.define
class NoRepeatState:
    n: int
    tokens: list[int]  # prompt + accepted output
    followers: dict[tuple[int, ...], dict[int, int]]  # (n - 1 tokens) -> {next token: occurrences}


class NoRepeatNGram:
    def __init__(self, options, context):
        self.n = (options or NoRepeatOptions()).ngram_size

    def _size(self, params) -> int:
        return int(dict(params.extra_args).get("no_repeat_ngram_size", self.n))

    def validate(self, params):
        if self._size(params) < 1:
            raise RequestError(f"extra_args no_repeat_ngram_size must be >= 1, got {self._size(params)}")

    def new_state(self, request):
        state = NoRepeatState(self._size(request.params), [], {})
        for token in request.prompt_token_ids:
            self.accept(state, token)
        return state

    def apply(self, logits, states):
        for row, state in enumerate(states):
            if len(state.tokens) + 1 < state.n:
                continue
            prefix = tuple(state.tokens[len(state.tokens) - state.n + 1:]) if state.n > 1 else ()
            banned = [token for token, count in state.followers.get(prefix, {}).items() if count]
            if banned:
                logits[row, banned] = float("-inf")
        return logits

    def accept(self, state, token_id):
        state.tokens.append(token_id)
        if len(state.tokens) >= state.n:
            gram = state.tokens[len(state.tokens) - state.n:]
            followers = state.followers.setdefault(tuple(gram[:-1]), {})
            followers[gram[-1]] = followers.get(gram[-1], 0) + 1

    def rollback(self, state, num_tokens):
        for _ in range(num_tokens):
            if len(state.tokens) >= state.n:
                gram = state.tokens[len(state.tokens) - state.n:]
                state.followers[tuple(gram[:-1])][gram[-1]] -= 1
            state.tokens.pop()
