"""Draft-model drafting: a much smaller model of the same vocabulary runs k cheap steps
ahead of the target, batched over the sequences, and proposes its tokens together with
the distributions q it drew them from (the verifier's min(1, p/q) rule needs q).

The draft model has its own KV cache and its own paged allocator. For each sequence it
remembers which tokens its cache holds; at the next proposal it keeps the longest prefix
that the verified sequence still agrees with (rolling the rest back), computes the new
verified tokens in one varlen pass, then decodes k - 1 more steps:

    cache holds   x_0 .. x_{n-1} d_1 .. d_{k-1}      after proposing d_1 .. d_k
    target kept   x_0 .. x_{n-1} d_1 .. d_a t        a drafts accepted, t its own token
    next catch-up computes d_{a}.. t  (1 or 2 tokens), then drafts again

Greedy requests get argmax drafts (q is irrelevant to exact-match verification); sampled
requests draw from q = the draft's distribution filtered by the request's temperature,
top-k, top-p and min-p, with a per-request generator when the request is seeded.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence as Seq

import torch

from servelab.errors import ConfigError
from servelab.interfaces import AllocatorContext, Draft, DrafterContext, Sequence, StepPlan
from servelab.kit import PagedAllocator
from servelab.plugins.drafters.options import DraftModelOptions


class DraftModelDrafter:
    def __init__(self, options: DraftModelOptions | None, context: DrafterContext) -> None:
        self.options = options or DraftModelOptions()
        if context.load_model is None or context.filtered_probs is None:
            raise ConfigError("drafter 'draft-model' needs an engine that loads checkpoints (not the simulator)")
        self.k = self.options.num_speculative_tokens
        self.max_model_len = context.max_model_len
        self.block_size = context.block_size
        blocks_per_seq = -(-(context.max_model_len + self.k) // context.block_size)
        num_blocks = self.options.num_kv_blocks or max(context.num_kv_blocks, blocks_per_seq) + context.max_num_seqs
        self.runner = context.load_model(self.options.model, num_blocks)
        if self.runner.vocab_size != context.vocab_size:
            raise ConfigError(
                f"[drafter] model {self.options.model!r} has a vocabulary of {self.runner.vocab_size} tokens, "
                f"the target {context.vocab_size}: a draft model must share the target's tokenizer")
        self.allocator = PagedAllocator(None, AllocatorContext(num_blocks, context.block_size, context.max_model_len))
        self.filtered_probs = context.filtered_probs
        # Per sequence, the draft cache holds K/V of its first `_verified` tokens (verified,
        # so they never change) followed by the draft tokens `_fed` back into the model.
        self._verified: dict[str, int] = {}
        self._fed: dict[str, list[int]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator(device=self.runner.device).manual_seed(context.seed)

    def release(self, request_id: str) -> None:
        self.allocator.free(request_id)
        self._verified.pop(request_id, None)
        self._fed.pop(request_id, None)
        self._generators.pop(request_id, None)

    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, Draft]:
        # All accepted plus the target's own token must fit max_tokens and max_model_len.
        budget = {seq.request_id: min(self.k, self.max_model_len - seq.num_tokens - 1,
                                      seq.params.max_tokens - len(seq.output_token_ids) - 1) for seq in seqs}
        shadows = [shadow for seq in seqs if budget[seq.request_id] > 0
                   for shadow in [self._catch_up(seq)] if shadow is not None]
        tokens: dict[str, list[int]] = {s.request_id: [] for s in shadows}
        probs: dict[str, list[torch.Tensor]] = {s.request_id: [] for s in shadows}
        by_id = {seq.request_id: seq for seq in seqs}
        active = shadows
        while active:
            logits = self.runner.execute(self.runner.prepare(
                StepPlan(tuple((s, s.num_uncomputed_tokens) for s in active)), self.allocator))
            for shadow in active:
                shadow.num_computed_tokens = shadow.num_tokens
            drafted = self._draw(logits, [by_id[s.request_id] for s in active])
            still = []
            for shadow, (token, q) in zip(active, drafted):
                request_id = shadow.request_id
                tokens[request_id].append(token)
                if q is not None:
                    probs[request_id].append(q)
                self._fed[request_id] = shadow.prompt_token_ids[self._verified[request_id]: shadow.num_computed_tokens]
                if len(tokens[request_id]) < budget[request_id]:
                    shadow.prompt_token_ids.append(token)  # fed back in the next pass
                    if self.allocator.allocate(request_id, shadow.num_tokens):
                        still.append(shadow)
            active = still
        return {request_id: Draft(draft, torch.stack(probs[request_id]) if probs[request_id] else None)
                for request_id, draft in tokens.items() if draft}

    def _catch_up(self, seq: Sequence) -> Sequence | None:
        """A shadow sequence whose uncomputed tokens are what the draft cache lacks of
        `seq`, with KV room allocated; None (holding nothing) if the pool is full."""
        request_id = seq.request_id
        tokens = seq.prompt_token_ids + seq.output_token_ids
        verified, fed = self._verified.get(request_id, 0), self._fed.get(request_id, [])
        cached = verified + len(fed)
        limit = min(cached, len(tokens) - 1)  # the last token is always fed, for its logits
        keep = min(verified, limit)  # only the fed drafts need comparing with what was accepted
        while keep < limit and fed[keep - verified] == tokens[keep]:
            keep += 1
        if keep < cached:
            self.allocator.rollback(request_id, cached - keep)
        if not self.allocator.allocate(request_id, len(tokens)):
            self.release(request_id)
            return None
        if seq.params.seed is not None and request_id not in self._generators:
            self._generators[request_id] = torch.Generator(device=self._default_generator.device).manual_seed(
                seq.params.seed + seq.completion_index)
        shadow = Sequence(request_id, tokens, seq.params, seq.arrival_time)
        shadow.num_computed_tokens = keep
        self._verified[request_id] = len(tokens)  # the first pass below computes all of them
        return shadow

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, Any]]:
        """One draft token per row: argmax for greedy requests, else a sample from q."""
        tokens = logits.argmax(dim=-1)
        rows = [i for i, seq in enumerate(seqs) if not seq.params.is_greedy]
        q_rows: dict[int, torch.Tensor] = {}
        if rows:
            q = self.filtered_probs(logits[torch.tensor(rows, dtype=torch.int64)], [seqs[i].params for i in rows])
            for out, i in enumerate(rows):
                generator = self._generators.get(seqs[i].request_id, self._default_generator)
                tokens[i] = torch.multinomial(q[out], 1, generator=generator)[0]
                q_rows[i] = q[out]
        values = tokens.tolist()
        return [(values[i], q_rows.get(i)) for i in range(len(seqs))]
