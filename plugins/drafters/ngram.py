"""N-gram (prompt lookup) drafting: find the sequence's last n tokens earlier in its
prompt or output and propose the k tokens that followed there.

    tokens  ... 5 8 2 9 4 ... 5 8 | ?        suffix (5, 8) seen before
    draft   2 9 4 ...                        what followed it

The longest matching suffix wins (at most max_ngram tokens, at least min_ngram); among
equally long matches the most recent earlier occurrence. No model, deterministic (q is
one-hot), and strong on input-grounded text: code edits, quoting, rewriting a passage.
Candidates are the earlier occurrences of the last token, found with one vectorised
comparison; each is then extended backwards.
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
        if k <= 0 or seq.num_tokens < 2:
            return []
        tokens = seq.prompt_token_ids + seq.output_token_ids
        max_n = min(self.options.max_ngram, len(tokens) - 1)
        # Earlier positions i holding the last token, most recent first.
        candidates = np.flatnonzero(np.asarray(tokens[:-1]) == tokens[-1])[::-1].tolist()
        best_len, best_end = 0, -1
        for i in candidates:
            length = 1
            while length < max_n and i - length >= 0 and tokens[i - length] == tokens[-1 - length]:
                length += 1
            if length > best_len:
                best_len, best_end = length, i
                if length == max_n:
                    break
        if best_len < self.options.min_ngram:
            return []
        return tokens[best_end + 1: best_end + 1 + k]
