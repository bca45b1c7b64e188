"""Options classes of the built-in drafters (importable without torch)."""

from __future__ import annotations

import attrs

from servelab.errors import ConfigError
from servelab.options import non_negative_int, positive_int

_positive = positive_int("drafter")
_non_negative = non_negative_int("drafter")


@attrs.frozen(kw_only=True)
class NgramOptions:
    """Prompt lookup: match the sequence's last n tokens, longest n first."""

    num_speculative_tokens: int = attrs.field(default=4, validator=_positive)  # k: most tokens proposed
    max_ngram: int = attrs.field(default=4, validator=_positive)  # longest suffix looked up
    min_ngram: int = attrs.field(default=1, validator=_positive)  # shortest suffix looked up

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"[drafter] min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")


@attrs.frozen(kw_only=True)
class DraftModelOptions:
    """A small model of the target's family, with its own KV cache, drafting k tokens."""

    model: str = "builtin:tiny-draft"  # checkpoint directory or builtin:<name>; same vocabulary as the target
    num_speculative_tokens: int = attrs.field(default=4, validator=_positive)
    # KV blocks of the draft model's own cache; 0: enough for max_num_seqs full-length sequences.
    num_kv_blocks: int = attrs.field(default=0, validator=_non_negative)


@attrs.frozen(kw_only=True)
class MedusaOptions:
    """Medusa-1 heads on the target's last hidden state, verified as a chain of top-1 tokens."""

    # Heads file (medusa.safetensors + medusa_config.json); "": the target checkpoint's directory.
    heads: str = ""
    # k: heads used (at most the number trained); 0: all of them.
    num_speculative_tokens: int = attrs.field(default=0, validator=_non_negative)
