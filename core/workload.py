"""Seeded synthetic workloads for benchmarks."""

from __future__ import annotations

import random

import attrs


@attrs.frozen
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@attrs.frozen
class SkewedWorkload:
    """Log-normal prompt and output lengths (a few long, many short), random token ids."""

    num_requests: int = 64
    mean_prompt_len: int = 128
    mean_output_len: int = 128
    sigma: float = 0.8
    max_len: int = 512
    seed: int = 0

    def requests(self, vocab_size: int, first_token_id: int = 3) -> list[BenchRequest]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            prompt_len = self._length(rng, self.mean_prompt_len)
            output_len = self._length(rng, self.mean_output_len)
            prompt_len = min(prompt_len, self.max_len - output_len)
            prompt = [rng.randrange(first_token_id, vocab_size) for _ in range(max(prompt_len, 1))]
            out.append(BenchRequest(prompt, output_len))
        return out

    def _length(self, rng: random.Random, mean: int) -> int:
        # Log-normal with the given mean: mu = ln(mean) - sigma^2 / 2.
        import math

        mu = math.log(mean) - self.sigma**2 / 2
        return max(1, min(int(rng.lognormvariate(mu, self.sigma)), self.max_len // 2))
