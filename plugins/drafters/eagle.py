"""EAGLE-style drafting (Li et al. 2024-2025): a one-layer head drafts from the target's
features instead of from tokens alone (servelab.plugins.drafters.eagle_head).

The engine hands the drafter the target's residual stream after a few decoder layers
(EAGLE-3 fuses low, middle and high ones) at every verified position (FeatureDrafter).
The drafter runs each new position through its head once, keeping the head's own K/V per
sequence, so drafting costs one head pass per draft token, never a pass over the context.

Chain mode drafts the head's top-1 token k times. Tree mode (`tree_nodes` > 0) grows a
dynamic tree (EAGLE-2): at each of k depths the `tree_top_k` best nodes so far, by the
product of the head's probabilities along their path, are expanded with their top
`tree_top_k` children each, in one head pass over all of them (under an ancestor mask);
the `tree_nodes` nodes of highest path probability are proposed. Proposals are
deterministic (q is one-hot), so verification is lossless for sampled requests too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence as Seq

import attrs
import torch

from servelab.errors import ConfigError
from servelab.interfaces import Draft, DrafterContext, Sequence
from servelab.plugins.drafters.eagle_head import CONFIG_FILE, HEAD_FILE, HeadConfig, load_head
from servelab.plugins.drafters.options import EagleOptions


@attrs.define
class _HeadCache:
    """One sequence's head state: K/V [kv_heads, n, d] of the positions it read, their
    positions, and the output at the last one (which predicts the next token)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: list[int]
    last_output: torch.Tensor

    @property
    def end(self) -> int:
        return self.positions[-1] + 1


class EagleDrafter:
    def __init__(self, options: EagleOptions | None, context: DrafterContext) -> None:
        self.options = options or EagleOptions()
        target = context.target
        if target is None or target.embed is None:
            raise ConfigError("drafter 'eagle' reads the target model's features and embeddings; "
                              "this engine's runner offers none")
        directory = Path(self.options.heads or target.path or ".")
        if not (directory / HEAD_FILE).is_file() or not (directory / CONFIG_FILE).is_file():
            raise ConfigError(f"drafter 'eagle': no {HEAD_FILE} and {CONFIG_FILE} in {str(directory)!r}; set "
                              f"[drafter] heads to the directory holding a trained head "
                              f"(examples/training/train_eagle_head.py trains one)")
        config = HeadConfig.load(directory)
        if config.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter 'eagle': the head in {str(directory)!r} was trained for hidden size "
                              f"{config.hidden_size}, the target's is {target.hidden_size}")
        if target.num_layers and max(config.feature_layers) >= target.num_layers - 1:
            raise ConfigError(f"drafter 'eagle': the head reads layers {list(config.feature_layers)}, but the "
                              f"target has {target.num_layers} (the last one cannot be read)")
        self.device = target.device or torch.device("cpu")
        self.head = load_head(directory, target.dtype or torch.float32, self.device)
        self.feature_layers = config.feature_layers
        self.embed, self.lm_head = target.embed, target.lm_head
        self.k = self.options.num_speculative_tokens
        self.max_model_len = context.max_model_len
        self._caches: dict[str, _HeadCache] = {}
        self._draft_tokens = self.head.draft_tokens if config.draft_vocab_size else None
        if self._draft_tokens is not None and int(self._draft_tokens.max()) >= context.vocab_size:
            raise ConfigError(f"drafter 'eagle': the head's draft vocabulary holds token ids beyond the target's "
                              f"vocabulary of {context.vocab_size}")

    @property
    def proposes_trees(self) -> bool:
        return self.options.tree_nodes > 0

    # ------------------------------------------------------------------ FeatureDrafter

    @torch.inference_mode()
    def observe(self, request_id: str, start: int, features: torch.Tensor, next_token_ids: Seq[int]) -> None:
        head = self.head
        cache = self._caches.get(request_id)
        if cache is not None and start < cache.end:  # recomputed positions replace the old ones
            keep = sum(1 for p in cache.positions if p < start)
            cache = None if keep == 0 else _HeadCache(cache.keys[:, :keep], cache.values[:, :keep],
                                                      cache.positions[:keep], cache.last_output)
        n = features.shape[0]
        positions = torch.arange(start, start + n, device=self.device)
        tokens = torch.tensor(next_token_ids, dtype=torch.int64, device=self.device)
        u = head.inputs(head.fused(features.to(head.fuse.weight.dtype)), self.embed(tokens))
        q, k, v = head.qkv(u, positions)
        context = 0 if cache is None else cache.keys.shape[1]
        keys = k if cache is None else torch.cat([cache.keys, k], dim=1)
        values = v if cache is None else torch.cat([cache.values, v], dim=1)
        mask = None  # one new position sees every key
        if n > 1:
            mask = torch.ones(n, context + n, dtype=torch.bool, device=self.device)
            mask[:, context:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        h = head.finish(u, head.attend(q, keys, values, mask))
        self._caches[request_id] = _HeadCache(keys, values, (cache.positions if cache else []) + list(
            range(start, start + n)), h[-1])

    def release(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence]) -> Mapping[str, Draft | list[int]]:
        proposals: dict[str, Draft | list[int]] = {}
        chains: list[tuple[str, _HeadCache, int]] = []
        for seq in seqs:
            cache = self._caches.get(seq.request_id)
            # The head must have read every computed position's successor: its last output
            # then predicts the token after the sequence's last one.
            if cache is None or cache.end != seq.num_computed_tokens or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            room = max(0, self.max_model_len - seq.num_tokens)
            if room == 0:
                continue
            if self.proposes_trees:
                proposals[seq.request_id] = self._tree(cache, min(self.k, room), room)
            else:
                chains.append((seq.request_id, cache, min(self.k, room)))
        if chains:
            proposals.update(self._chains(chains))
        return proposals

    def _logprobs(self, outputs: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the draft vocabulary (indices map through `_token_ids`)."""
        head = self.head
        if self._draft_tokens is not None:
            return torch.log_softmax(head.lm_head(head.out_norm(outputs)).float(), dim=-1)
        return torch.log_softmax(self.lm_head(head.out_norm(outputs)), dim=-1)

    def _token_ids(self, indices: torch.Tensor) -> list[int]:
        return (self._draft_tokens[indices] if self._draft_tokens is not None else indices).tolist()

    def _step(self, cache: _HeadCache, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              draft_keys: list[torch.Tensor], draft_values: list[torch.Tensor],
              mask: torch.Tensor | None) -> torch.Tensor:
        """One head pass over new draft inputs (x [m, hidden] the outputs that predicted
        tokens [m]) at `positions`, seeing the context and, by mask [m, earlier drafts + m],
        the earlier drafts' K/V (None: all of them); appends theirs."""
        head = self.head
        u = head.inputs(x, self.embed(tokens))
        q, k, v = head.qkv(u, positions)
        draft_keys.append(k)
        draft_values.append(v)
        keys = torch.cat([cache.keys, *draft_keys], dim=1)
        values = torch.cat([cache.values, *draft_values], dim=1)
        seen = None if mask is None else torch.cat(
            [torch.ones(len(tokens), cache.keys.shape[1], dtype=torch.bool, device=self.device), mask], dim=1)
        return head.finish(u, head.attend(q, keys, values, seen))

    def _chains(self, chains: list[tuple[str, _HeadCache, int]]) -> dict[str, list[int]]:
        """Top-1 chains for several sequences at once: one head pass per depth over all of
        them, their contexts padded to the longest (padding masked out)."""
        head = self.head
        batch = len(chains)
        depth = max(d for _, _, d in chains)
        longest = max(cache.keys.shape[1] for _, cache, _ in chains)
        first = chains[0][1].keys
        context_keys = first.new_zeros(batch, first.shape[0], longest, first.shape[2])
        context_values = torch.zeros_like(context_keys)
        valid = torch.zeros(batch, longest, dtype=torch.bool, device=self.device)
        for row, (_, cache, _) in enumerate(chains):
            n = cache.keys.shape[1]
            context_keys[row, :, :n], context_values[row, :, :n], valid[row, :n] = cache.keys, cache.values, True
        padded = not bool(valid.all())
        ends = torch.tensor([cache.end for _, cache, _ in chains], device=self.device)
        x = torch.stack([cache.last_output for _, cache, _ in chains])
        drafted: list[list[int]] = []
        draft_keys: list[torch.Tensor] = []
        draft_values: list[torch.Tensor] = []
        for d in range(depth):
            indices = self._logprobs(x).argmax(dim=-1)
            tokens = self._draft_tokens[indices] if self._draft_tokens is not None else indices
            drafted.append(tokens.tolist())
            if d + 1 == depth:
                break
            u = head.inputs(x, self.embed(tokens))[:, None, :]  # [B, 1, hidden]
            q, k, v = head.qkv(u, (ends + d)[:, None])
            draft_keys.append(k)
            draft_values.append(v)
            keys = torch.cat([context_keys, *draft_keys], dim=2)
            values = torch.cat([context_values, *draft_values], dim=2)
            mask = None if not padded else torch.cat(
                [valid, valid.new_ones(batch, d + 1)], dim=1)[:, None, None, :]
            x = head.finish(u, head.attend(q, keys, values, mask))[:, 0]
        return {seq_id: [drafted[d][row] for d in range(k)] for row, (seq_id, _, k) in enumerate(chains)}

    def _tree(self, cache: _HeadCache, depth: int, room: int) -> Draft:
        """EAGLE-2's dynamic tree: expand the best `tree_top_k` nodes per depth, keep the best
        `tree_nodes` of all (a node's score is its path's log-probability under the head)."""
        width = self.options.tree_top_k
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        logp = self._logprobs(cache.last_output[None])[0]
        top = logp.topk(min(width, logp.shape[-1]))
        for value, token in zip(top.values.tolist(), self._token_ids(top.indices)):
            tokens.append(token), parents.append(-1), scores.append(value), depths.append(0)
        predicted_by = {i: cache.last_output for i in range(len(tokens))}  # node -> the output that predicted it
        frontier = list(range(len(tokens)))
        expanded: list[int] = []  # nodes with K/V in the head's draft cache, in cache order
        draft_keys: list[torch.Tensor] = []
        draft_values: list[torch.Tensor] = []
        for d in range(1, depth):
            ancestors = [_ancestors(parents, node) for node in frontier]
            mask = torch.zeros(len(frontier), len(expanded) + len(frontier), dtype=torch.bool, device=self.device)
            for row, node_ancestors in enumerate(ancestors):
                for column, node in enumerate(expanded):
                    if node in node_ancestors:
                        mask[row, column] = True
                mask[row, len(expanded) + row] = True
            x = torch.stack([predicted_by[node] for node in frontier])
            positions = torch.tensor([cache.end + depths[node] for node in frontier], device=self.device)
            outputs = self._step(cache, x, torch.tensor([tokens[node] for node in frontier], device=self.device),
                                 positions, draft_keys, draft_values, mask)
            expanded.extend(frontier)
            top = self._logprobs(outputs).topk(min(width, logp.shape[-1]), dim=-1)
            candidates = []
            for row, node in enumerate(frontier):
                for value, token in zip(top.values[row].tolist(), self._token_ids(top.indices[row])):
                    child = len(tokens)
                    tokens.append(token), parents.append(node), scores.append(scores[node] + value)
                    depths.append(d)
                    predicted_by[child] = outputs[row]
                    candidates.append(child)
            frontier = sorted(candidates, key=lambda node: -scores[node])[:width]
        # A child scores at most its parent, so the best nodes (ties: shallower first) are closed under parents.
        chosen = sorted(range(len(tokens)), key=lambda node: (-scores[node], depths[node]))
        chosen = sorted(chosen[: min(self.options.tree_nodes, room)], key=lambda node: (depths[node], -scores[node]))
        index = {node: i for i, node in enumerate(chosen)}
        return Draft([tokens[node] for node in chosen],
                     parents=[-1 if parents[node] < 0 else index[parents[node]] for node in chosen])


def _ancestors(parents: list[int], node: int) -> set[int]:
    found = set()
    node = parents[node]
    while node >= 0:
        found.add(node)
        node = parents[node]
    return found
