"""Prefix-cache lookup statistics shared by the prefix-caching allocators.

A lookup counts once, when the sequence it was made for is admitted (its first
`allocate` succeeds): a refused admission's lookup is forgotten with `free`, so hits
and lookups describe the sequences that actually ran.
"""

from __future__ import annotations


class PrefixLookups:
    """Pending lookups per sequence id, and the totals of admitted ones."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[int, int]] = {}  # seq id -> (hit tokens, looked-up tokens)
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.num_lookups = 0

    def looked_up(self, seq_id: str, hit_tokens: int, num_tokens: int) -> None:
        """`match_prefix` found `hit_tokens` of the `num_tokens` of `seq_id`."""
        self._pending[seq_id] = (hit_tokens, num_tokens)

    def admitted(self, seq_id: str) -> None:
        """`seq_id`'s allocation succeeded: its pending lookup (if any) counts now."""
        lookup = self._pending.pop(seq_id, None)
        if lookup is not None:
            self.hit_tokens += lookup[0]
            self.lookup_tokens += lookup[1]
            self.num_lookups += 1

    def forget(self, seq_id: str) -> None:
        """`seq_id` was freed: a lookup not yet admitted never counts."""
        self._pending.pop(seq_id, None)
