"""Dynamic speculation length: how many drafts each decoding sequence gets this step,
from the batch's size and a running estimate of each sequence's acceptance.

The cost model is one line: a target step over N tokens costs a + b * N, so it runs
T expected tokens at the rate T / (r + N) with r = a / b (`overhead_tokens`: how many
tokens' compute one step's fixed cost is worth). Drafting one more token for a sequence
that already has j drafts adds p^(j+1) expected tokens (its (j+1)-th draft is reached
and accepted with probability p^(j+1), p its per-token acceptance) and one token of
compute, so it pays exactly when p^(j+1) * (r + N) > T. Starting from every sequence at
j = 0 (T = N = the number of decoding sequences), draft slots are granted best gain
first while they pay: at batch 1 a sequence drafts while p^(j+1) > 1 / (r + 1 + j)-ish,
at batch 16 only the sequences whose drafts are likely accepted draft at all, and a
sequence granted nothing is not asked for drafts (the drafter's cost is saved too).

p per sequence: accepted drafts over drafts tried (a draft is tried when every earlier
one was accepted: the geometric model's estimate), both sums decayed by `decay` each
step and shrunk towards the engine-wide estimate (itself shrunk towards `prior`) with
`prior_weight` pseudo-trials. Decay also lets a sequence that stopped drafting try again:
its estimate drifts back to the engine-wide one, and that one back to the prior.
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence as Seq

import attrs

from servelab.errors import ConfigError

_KEYS_DOC = "dynamic_length, dynamic_overhead_tokens, dynamic_prior, dynamic_prior_weight, dynamic_decay"


@attrs.frozen(kw_only=True)
class SpeculationLengthOptions:
    """The `[drafter]` keys the engine reads itself, for every drafter (`dynamic_*`)."""

    dynamic_length: bool = False
    dynamic_overhead_tokens: float = 16.0  # r = a / b of the step's cost a + b * tokens
    dynamic_prior: float = 0.5  # acceptance assumed before any draft was verified
    dynamic_prior_weight: float = 2.0  # pseudo-trials of the prior (and of the engine-wide estimate)
    dynamic_decay: float = 0.9  # per step, on every acceptance sum

    def __attrs_post_init__(self) -> None:
        values = attrs.asdict(self)
        for name in ("dynamic_overhead_tokens", "dynamic_prior", "dynamic_prior_weight", "dynamic_decay"):
            value = values[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"[drafter] {name} must be a number, got {value!r}")
        if not isinstance(self.dynamic_length, bool):
            raise ConfigError(f"[drafter] dynamic_length must be true or false, got {self.dynamic_length!r}")
        if self.dynamic_overhead_tokens < 0:
            raise ConfigError(f"[drafter] dynamic_overhead_tokens must be >= 0, got {self.dynamic_overhead_tokens}")
        if not 0 < self.dynamic_prior < 1:
            raise ConfigError(f"[drafter] dynamic_prior must be in (0, 1), got {self.dynamic_prior}")
        if self.dynamic_prior_weight <= 0:
            raise ConfigError(f"[drafter] dynamic_prior_weight must be > 0, got {self.dynamic_prior_weight}")
        if not 0 < self.dynamic_decay <= 1:
            raise ConfigError(f"[drafter] dynamic_decay must be in (0, 1], got {self.dynamic_decay}")


def split_length_options(values: Mapping[str, object]) -> tuple[SpeculationLengthOptions, dict[str, object]]:
    """The `[drafter]` section's engine keys (`dynamic_*`) and the drafter's own keys."""
    ours = {key: value for key, value in values.items() if key.startswith("dynamic_")}
    fields = {f.name for f in attrs.fields(SpeculationLengthOptions)}
    unknown = sorted(set(ours) - fields)
    if unknown:
        raise ConfigError(f"unknown option [drafter] {unknown[0]!r}: the engine's speculation-length keys are "
                          f"{_KEYS_DOC}")
    return SpeculationLengthOptions(**ours), {k: v for k, v in values.items() if k not in ours}


class DynamicLength:
    """Per step: draft budgets per sequence; after verification: the acceptance seen."""

    def __init__(self, options: SpeculationLengthOptions) -> None:
        self.options = options
        self._seq: dict[str, list[float]] = {}  # seq id -> [accepted, tried], decayed
        self._all = [0.0, 0.0]
        self.longest_draft: int | None = None  # longest draft the drafter returned (its k, in effect)

    def acceptance(self, seq_id: str | None = None) -> float:
        o = self.options
        w = o.dynamic_prior_weight
        engine_wide = (self._all[0] + w * o.dynamic_prior) / (self._all[1] + w)
        if seq_id is None or seq_id not in self._seq:
            return engine_wide
        accepted, tried = self._seq[seq_id]
        return (accepted + w * engine_wide) / (tried + w)

    def budgets(self, rooms: Mapping[str, int]) -> dict[str, int]:
        """Drafts each sequence may have this step (0: do not ask), at most its room."""
        self._decay()
        overhead = self.options.dynamic_overhead_tokens
        tokens = expected = float(len(rooms))
        cap = self.longest_draft
        granted = {seq_id: 0 for seq_id in rooms}
        heap = []
        for seq_id, room in rooms.items():
            limit = room if cap is None else min(room, max(cap, 1))
            if limit > 0:
                p = self.acceptance(seq_id)
                heap.append((-p, seq_id, p, limit))
        heapq.heapify(heap)
        while heap:
            neg_gain, seq_id, p, limit = heapq.heappop(heap)
            gain = -neg_gain
            if gain * (overhead + tokens) <= expected:
                break  # the best remaining draft slot costs more than it brings: so do all others
            expected += gain
            tokens += 1
            granted[seq_id] += 1
            if granted[seq_id] < limit:
                heapq.heappush(heap, (-gain * p, seq_id, p, limit))
        return granted

    def proposed(self, length: int) -> None:
        if self.longest_draft is None or length > self.longest_draft:
            self.longest_draft = length

    def observe(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """`num_drafts` verified, the first `num_accepted` of them accepted."""
        if num_drafts <= 0:
            return
        tried = num_accepted + (1 if num_accepted < num_drafts else 0)
        mine = self._seq.setdefault(seq_id, [0.0, 0.0])
        for sums in (mine, self._all):
            sums[0] += num_accepted
            sums[1] += tried

    def forget(self, seq_id: str) -> None:
        self._seq.pop(seq_id, None)

    def _decay(self) -> None:
        decay = self.options.dynamic_decay
        if decay == 1:
            return
        for sums in self._seq.values():
            sums[0] *= decay
            sums[1] *= decay
        self._all[0] *= decay
        self._all[1] *= decay


__all__ = ["DynamicLength", "SpeculationLengthOptions", "split_length_options"]
