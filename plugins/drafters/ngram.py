"""N-gram (prompt lookup) drafting: find the sequence's last n tokens earlier in its
prompt or output and propose the k tokens that followed there.

    tokens  ... 5 8 2 9 4 ... 5 8 | ?        suffix (5, 8) seen before
    draft   2 9 4 ...                        what followed it

Longer suffixes are tried first (max_ngram down to min_ngram); among equal matches the
most recent earlier occurrence wins. No model, deterministic (q is one-hot), and strong
on input-grounded text: code edits, quoting, rewriting a passage. Each call scans the
sequence once per suffix length with a vectorised comparison.
"""

from __future__ import annotations

from typing import Mapping, Sequence as Seq

import numpy as np

from servelab.interfaces import DrafterContext, Sequence
from servelab.plugins.drafters.options import NgramOptions


class NgramDrafter:
    def __init__(self, options: NgramOptions | None, context: DrafterContext) -> None:
        self.options = options or NgramOptions()
        self.max_model_len = context.max_model_len

    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, list[int]]:
        proposals = {}
        for seq in seqs:
            draft = self._draft(seq)
            if draft:
                proposals[seq.request_id] = draft
        return proposals

    def _draft(self, seq: Sequence) -> list[int]:
        k = min(self.options.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if k <= 0:
            return []
        tokens = np.asarray(seq.prompt_token_ids + seq.output_token_ids, dtype=np.int64)
        num_tokens = len(tokens)
        for n in range(min(self.options.max_ngram, num_tokens - 1), self.options.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # windows[i] == tokens[i:i + n] for every start i that leaves a token after it.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tokens[start:start + k].tolist()
        return []
