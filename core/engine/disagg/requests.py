"""How a request is split for a disaggregated deployment: into its completions (n > 1),
and each completion into the producer's half and the consumer's."""

from __future__ import annotations

from typing import Sequence as Seq

import attrs

from servelab.errors import RequestError
from servelab.outputs import RequestMetrics, RequestOutput
from servelab.sampling_params import SamplingParams


def completion_params(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of a request of `params.n` completions, as a request of its own:
    n=1, seed + index (the generator one engine gives that completion, so a seeded request
    draws the same tokens), and prompt logprobs on completion 0 alone (they are the
    request's, not a completion's)."""
    return attrs.evolve(params, n=1, seed=None if params.seed is None else params.seed + index,
                        prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def split_completions(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of a request's n completions (`completion_params`)."""
    if params.n == 1:
        return [params]
    return [completion_params(params, i) for i in range(params.n)]


def merged_output(request_id: str, completions: Seq[RequestOutput]) -> RequestOutput:
    """One request's output from its completions' (in order), as one engine gives an n > 1
    request's: completion i's tokens as `outputs[i]`, completion 0's prompt logprobs, the
    first error, the earliest first token and the latest finish."""
    if len(completions) == 1:
        return attrs.evolve(completions[0], request_id=request_id)
    first = completions[0]
    metrics = [c.metrics for c in completions]
    first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
    finishes = [m.finish_time for m in metrics if m.finish_time is not None]
    errors = [c.error for c in completions if c.error is not None]
    return RequestOutput(
        request_id, first.prompt, list(first.prompt_token_ids),
        [attrs.evolve(c.outputs[0], index=i) for i, c in enumerate(completions)],
        RequestMetrics(first.metrics.arrival_time, first.metrics.first_scheduled_time,
                       min(first_tokens, default=None), max(finishes, default=None),
                       *(sum(getattr(m, name) for m in metrics) for name in (
                           "num_preemptions", "num_draft_tokens", "num_accepted_tokens", "num_sampling_steps",
                           "num_discarded_tokens")), num_cached_tokens=first.metrics.num_cached_tokens),
        prompt_logprobs=first.prompt_logprobs, error=errors[0] if errors else None)


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The producer's half of one completion: the prefill and the first sampled token.
    min_tokens counts that token only; a stop string cannot end it when min_tokens > 1
    (one engine looks for stop strings from the min_tokens-th token on)."""
    if params.n != 1:
        raise RequestError(f"a prefill engine runs one completion, got n={params.n}: split the request first "
                           f"(servelab.disagg.requests.split_completions)")
    return attrs.evolve(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                        stop=params.stop if params.min_tokens <= 1 else ())


def decode_params(params: SamplingParams) -> SamplingParams:
    """The consumer's half: every token after the first, which the consumer's engine counts
    as generated (RequestSpec.continues); the prompt's logprobs come from the producer."""
    return attrs.evolve(params, prompt_logprobs=None)

