"""What a request must be to be disaggregated, and the two halves it is split into."""

from __future__ import annotations

import attrs

from servelab.errors import RequestError
from servelab.sampling_params import SamplingParams


def check_disaggregable(params: SamplingParams) -> None:
    """RequestError naming what a disaggregated deployment cannot split yet."""
    problems = []
    if params.n != 1:
        problems.append(f"n={params.n} (one completion per request)")
    if attrs.evolve(params, logprobs=None).has_logits_work:  # logprobs are split: each engine's tokens
        problems.append("prompt_logprobs, penalties, logit bias, min_tokens, bad words, structured output or "
                        "logits processors")
    if problems:
        raise RequestError(f"a disaggregated deployment cannot serve a request with {', '.join(problems)} yet; "
                           f"send it to a colocated engine")


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The producer's half: the prefill and the first sampled token."""
    return attrs.evolve(params, max_tokens=1)


def decode_params(params: SamplingParams) -> SamplingParams:
    """The consumer's half: every token after the first."""
    return attrs.evolve(params, max_tokens=params.max_tokens - 1)
