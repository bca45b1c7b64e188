"""How a request's rows become tokens, decided once at intake.

The sampling stage reads a request's recipe instead of flags set and cleared along the
way: a batch of plain requests is sampled in one call; the rest take the paths their
recipe names. What changes over a request's life (whether its first token was sampled
yet) is read off its sequences, never stored beside them.
"""

from __future__ import annotations

import attrs

from servelab.sampling_params import SamplingParams


@attrs.frozen
class SamplingRecipe:
    forks: bool = False  # n > 1: all n first tokens come from the one row of its prompt
    logits_work: bool = False  # logits processors run on its rows, or it wants logprobs
    scores_prompt: bool = False  # prompt logprobs: its prompt rows are scored
    seeded: bool = False  # its sequences sample with generators of their own

    @property
    def plain(self) -> bool:
        """One row per sequence, sampled with the engine's generator and nothing else."""
        return not (self.forks or self.logits_work or self.scores_prompt or self.seeded)

    @property
    def one_path(self) -> bool:
        """Processors and logprobs follow one path of tokens: a token tree verifies its
        first branch only."""
        return self.logits_work


def recipe_of(params: SamplingParams, default_processors: bool) -> SamplingRecipe:
    """The recipe of a request with `params`, when the engine's default logits processors
    (`default_processors`) apply to every request or not."""
    return SamplingRecipe(forks=params.n > 1, logits_work=params.has_logits_work or default_processors,
                          scores_prompt=params.prompt_logprobs is not None, seeded=params.seed is not None)
