"""A sequence's output text, decoded once and incrementally, and the stop strings in it.

One component for both sides: the engine uses it to find stop strings, the server to
stream text. Each `append` decodes a window of the last few tokens (vLLM's prefix and
read offsets), not the whole output, so a token costs O(1) however long the output is;
text that ends in an incomplete UTF-8 sequence waits for the token that completes it.

Stop strings are matched where a new token can complete them only: the characters it
added, reached back into by the longest stop string. The output is cut before the stop
string that ends first (the longest of those that end at the same character).
"""

from __future__ import annotations

from typing import Any, Sequence as Seq


class IncrementalText:
    """The text of a growing list of token ids."""

    def __init__(self, tokenizer: Any, stop: Seq[str] = ()) -> None:
        self._tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # the window decoded is token_ids[prefix_offset:] ...
        self._read_offset = 0  # ... of which those before read_offset are already in `text`
        self._stops = frozenset(s for s in stop if s)
        self._stop_lengths = sorted({len(s) for s in self._stops}, reverse=True)
        self.longest_stop = self._stop_lengths[0] if self._stop_lengths else 0
        self.stop_at: int | None = None  # where the stop string that ended the text begins
        self.stop_string: str | None = None  # which one it was

    def append(self, token_ids: Seq[int]) -> str:
        """Add tokens; return the text they completed (empty while a character is incomplete)."""
        self.token_ids.extend(token_ids)
        window = self.token_ids[self._prefix_offset:]
        decode = self._tokenizer.decode
        known = decode(window[: self._read_offset - self._prefix_offset])
        text = decode(window)
        if len(text) <= len(known) or text.endswith("\ufffd"):
            return ""
        delta = text[len(known):]
        self.text += delta
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return delta

    def find_stop(self, num_new_chars: int) -> int | None:
        """Where the first stop string completed by the last `num_new_chars` characters
        begins, or None. Also remembered in `stop_at`."""
        if not self._stops or num_new_chars <= 0:
            return None
        text, stops = self.text, self._stops
        for end in range(len(text) - num_new_chars + 1, len(text) + 1):
            for length in self._stop_lengths:
                if length <= end and text[end - length: end] in stops:
                    self.stop_at = end - length
                    self.stop_string = text[self.stop_at: end]
                    return self.stop_at
        return None

    @property
    def stop_text(self) -> str | None:
        """The text before the stop string that ended it; None when none did."""
        return self.text[: self.stop_at] if self.stop_at is not None else None

    @property
    def text_through_stop(self) -> str | None:
        """The text up to the end of the stop string that ended it; None when none did."""
        return self.text[: self.stop_at + len(self.stop_string)] if self.stop_at is not None else None
