"""Prompt-lookup drafting: when the last tokens of a sequence occurred before, propose
the tokens that followed their most recent earlier occurrence. Free (no model), and
good on text that repeats itself: code edits, summaries quoting their source, lists.

    tokens  ... 5 8 2 9 4 ... 5 8 | ?        last n-gram (5, 8) seen before
    draft   2 9 4                           the k = 3 tokens that followed it

Drafts come from the sequence itself, so they are always in the vocabulary; they never
run past max_model_len.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence as Seq

import attrs

from servelab.errors import ConfigError
from servelab.interfaces import DrafterContext, Sequence


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"[drafter] {attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen(kw_only=True)
class LookupOptions:
    num_speculative_tokens: int = attrs.field(default=3, validator=_positive)  # k: most tokens proposed
    max_ngram: int = attrs.field(default=3, validator=_positive)  # longest suffix looked up (then shorter ones)


class RepeatLookupDrafter:
    """Drafter protocol: propose(seqs) -> {request_id: draft token ids}."""

    def __init__(self, options: LookupOptions | None, context: DrafterContext) -> None:
        self.options = options or LookupOptions()
        self.max_model_len = context.max_model_len

    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, list[int]]:
        return {seq.request_id: self._draft(seq.prompt_token_ids + seq.output_token_ids) for seq in seqs}

    def _draft(self, tokens: list[int]) -> list[int]:
        k = min(self.options.num_speculative_tokens, self.max_model_len - len(tokens))
        if k <= 0:
            return []
        for n in range(min(self.options.max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[start:start + n] == suffix:
                    return tokens[start + n: start + n + k]
        return []
