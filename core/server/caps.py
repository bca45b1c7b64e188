"""What one request may ask of the server: every per-request quantity has a bound here.

Each is checked at the front end, before the request costs anything proportional to it
(tokenizing, compiling a grammar, a step of the engine), and a request over one gets a
400 naming the limit and its value. `servelab serve --limit NAME=VALUE` changes one;
docs/serving.md lists them next to vLLM's and TGI's equivalents.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from servelab.errors import ServelabError


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ServelabError(f"limit {attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class RequestCaps:
    """The per-request limits (names as `--limit` takes them)."""

    max_sequences: int = attrs.field(default=256, validator=_positive)  # prompts x n
    max_prompts: int = attrs.field(default=256, validator=_positive)  # prompts of one completions request
    max_messages: int = attrs.field(default=1024, validator=_positive)  # chat messages
    max_stop: int = attrs.field(default=64, validator=_positive)  # stop strings
    max_stop_chars: int = attrs.field(default=1024, validator=_positive)  # characters of one stop string
    max_stop_token_ids: int = attrs.field(default=256, validator=_positive)
    max_bad_words: int = attrs.field(default=256, validator=_positive)
    max_bad_word_chars: int = attrs.field(default=256, validator=_positive)  # characters of one bad word
    max_logit_bias: int = attrs.field(default=1024, validator=_positive)  # logit_bias entries
    max_choices: int = attrs.field(default=1024, validator=_positive)  # guided_choice strings, schema enum values
    max_grammar_chars: int = attrs.field(default=65536, validator=_positive)  # schema / regex / EBNF / choices text
    max_schema_depth: int = attrs.field(default=32, validator=_positive)  # nesting of a JSON schema, object or text
    max_logprob_entries: int = attrs.field(default=200_000, validator=_positive)  # see below
    max_logits_processors: int = attrs.field(default=8, validator=_positive)  # names in logits_processors

    # max_logprob_entries bounds the response a request can make the server build:
    # prompts x n x positions (echoed prompt tokens + max_tokens) x (top-k + 1) logprob entries.

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in attrs.fields(cls)]

    def with_settings(self, settings: Iterable[str]) -> "RequestCaps":
        """These caps with NAME=VALUE settings applied (ServelabError for a bad one)."""
        changes = {}
        for setting in settings:
            name, sep, value = setting.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in self.names():
                raise ServelabError(f"--limit takes NAME=VALUE with NAME one of {', '.join(self.names())}; "
                                    f"got {setting!r}")
            try:
                changes[name] = int(value)
            except ValueError:
                raise ServelabError(f"--limit {name}: {value!r} is not an integer") from None
        return attrs.evolve(self, **changes)
