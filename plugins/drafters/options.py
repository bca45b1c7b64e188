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
    """Medusa-1 heads on the target's last hidden state, verified as a chain of top-1 tokens
    or as a static tree of top-k tokens (tree_nodes > 0)."""

    # Heads file (medusa.safetensors + medusa_config.json); "": the target checkpoint's directory.
    heads: str = ""
    # k: heads used (at most the number trained); 0: all of them.
    num_speculative_tokens: int = attrs.field(default=0, validator=_non_negative)
    # Token-tree mode: the static tree of this many nodes that the heads' measured accuracies
    # (medusa_accuracy.json beside the heads) make most likely to be accepted; 0: the top-1 chain.
    tree_nodes: int = attrs.field(default=0, validator=_non_negative)
    # The most candidates per head a tree considers (its top-k).
    tree_top_k: int = attrs.field(default=8, validator=_positive)


@attrs.frozen(kw_only=True)
class EagleOptions:
    """An EAGLE-style head on the target's fused features: a chain of its top-1 tokens, or
    (tree_nodes > 0) EAGLE-2's dynamic tree ranked by the head's path probabilities."""

    # Head files (eagle.safetensors + eagle_config.json); "": the target checkpoint's directory.
    heads: str = ""
    num_speculative_tokens: int = attrs.field(default=4, validator=_positive)  # k: the chain's length, the tree's depth
    # Tree mode: propose this many nodes of highest path probability; 0: the top-1 chain.
    tree_nodes: int = attrs.field(default=0, validator=_non_negative)
    # Nodes expanded per depth, and children considered per expanded node.
    tree_top_k: int = attrs.field(default=4, validator=_positive)


def _probability(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"[drafter] {attribute.name} must be a probability in [0, 1], got {value!r}")


def _non_negative_number(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"[drafter] {attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class SuffixOptions:
    """Suffix decoding: a suffix trie over each sequence's prompt and output, and one over
    the outputs the engine produced before, proposing their most frequent continuation."""

    num_speculative_tokens: int = attrs.field(default=4, validator=_positive)  # k: most tokens proposed
    # Longest substring the tries hold; a match is at most max_depth - k tokens long, so
    # that k tokens can always follow it. Memory grows with it (one node per token per level).
    max_depth: int = attrs.field(default=16, validator=_positive)
    # Adaptive length: a match of m tokens proposes at most max_spec_factor * m + max_spec_offset.
    max_spec_factor: float = attrs.field(default=1.0, validator=_non_negative_number)
    max_spec_offset: float = attrs.field(default=0.0, validator=_non_negative_number)
    # Stop the chain where its probability (product of count ratios along it) falls below this.
    min_token_prob: float = attrs.field(default=0.1, validator=_probability)
    # Tokens of previous outputs kept in the global cache (oldest outputs evicted first); 0: no global cache.
    cache_tokens: int = attrs.field(default=16384, validator=_non_negative)
    # Token-tree mode: the this-many most probable continuations of the match as a tree; 0: the chain.
    tree_nodes: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.max_depth <= self.num_speculative_tokens:
            raise ConfigError(f"[drafter] max_depth ({self.max_depth}) must exceed num_speculative_tokens "
                              f"({self.num_speculative_tokens}): a match of max_depth - k tokens is followed by k")
