"""Token trees end to end: a drafter proposing several branches per sequence (the true
continuation on one of them, at a random place in the node list, wrong tokens around it)
gives greedy output token for token equal to `transformers` (and so to decoding without
speculation) across batch sizes, with prefix caching, chunked prefill and preemption;
the K/V a sequence keeps after verification is what plain decoding writes; nothing
leaks; a backend without tree masks is refused at start."""

from __future__ import annotations

import random

import pytest
import torch

import servelab
from servelab import LLM, ConfigError, SamplingParams
from servelab.interfaces import Draft
from servelab.plugin_types import DrafterPlugin
from servelab.testing import DrafterContract
from servelab.token_tree import tree_error

from test_hf_equivalence import hf_greedy
from test_speculative_decoding import MAX_NEW, VOCAB, spec_prompts


def random_tree(rng: random.Random, truth: list[int], depth: int, vocab: int) -> tuple[list[int], list[int], int]:
    """(tokens, parents, depth of the true path): a tree whose true path follows `truth`
    for a random number of levels (0 included), with wrong siblings and wrong subtrees
    (which sometimes hold the right token at the wrong place), listed parents first in a
    random order, so the true path's nodes are scattered through the list."""
    nodes: list[tuple[int, int]] = []  # (token, parent) in construction order; listed later

    def wrong(avoid: int) -> int:
        token = rng.randrange(3, vocab)
        return token if token != avoid else (token + 1 - 3) % (vocab - 3) + 3

    true_depth = rng.randint(0, min(depth, len(truth)))
    parent = -1
    for level in range(depth):
        right = truth[level] if level < len(truth) else 0
        siblings = [wrong(right) for _ in range(rng.randint(1, 2))]
        if level < true_depth:
            siblings.insert(rng.randint(0, len(siblings)), right)
        ids = []
        for token in siblings:
            nodes.append((token, parent))
            ids.append(len(nodes) - 1)
        for node in ids:  # a wrong branch grows a wrong (or misplaced) child
            if nodes[node][0] != right and rng.random() < 0.5:
                nodes.append((rng.choice([right, wrong(right)]), node))
        if level >= true_depth:
            break
        parent = ids[siblings.index(right)]
    # A random topological order: any node whose parent is listed may come next.
    order: list[int] = []
    listed: set[int] = set()
    pending = list(range(len(nodes)))
    while pending:
        ready = [n for n in pending if nodes[n][1] < 0 or nodes[n][1] in listed]
        pick = rng.choice(ready)
        pending.remove(pick)
        listed.add(pick)
        order.append(pick)
    index = {node: i for i, node in enumerate(order)}
    tokens = [nodes[n][0] for n in order]
    parents = [index[nodes[n][1]] if nodes[n][1] >= 0 else -1 for n in order]
    assert tree_error(parents, len(tokens)) is None
    return tokens, parents, true_depth


def oracle_registry(references: dict[tuple[int, ...], list[int]], depth: int = 4, seed: int = 0):
    """A registry with drafter 'oracle-tree': random trees around the known continuation."""

    class OracleTree:
        proposes_trees = True

        def __init__(self, options, context):
            self.vocab = context.vocab_size
            self.rng = random.Random(seed)
            self.true_depths: list[int] = []

        def propose(self, seqs):
            proposals = {}
            for seq in seqs:
                reference = references[tuple(seq.prompt_token_ids)]
                truth = reference[len(seq.output_token_ids):]
                tokens, parents, true_depth = random_tree(self.rng, truth, depth, self.vocab)
                self.true_depths.append(true_depth)
                proposals[seq.request_id] = Draft(tokens, parents=parents)
            return proposals

    class Plugin:
        @servelab.hookimpl
        def servelab_register_drafters(self):
            return [DrafterPlugin(name="oracle-tree", factory=OracleTree, contract_version=3)]

    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(Plugin())
    return registry


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    path = checkpoint_factory("llama")
    return path, [hf_greedy(path, p, n) for p, n in zip(spec_prompts(), MAX_NEW)]


def run(path: str, references: list[list[int]], prompts: list[list[int]] | None = None, **engine):
    prompts = prompts or spec_prompts()
    by_prompt = {tuple(p): r for p, r in zip(prompts, references)}
    llm = LLM(path, config={"drafter": {"name": "oracle-tree"}}, registry=oracle_registry(by_prompt),
              **{"max_model_len": 128, "block_size": 8, **engine})
    params = [SamplingParams(max_tokens=len(r), temperature=0, ignore_eos=True) for r in references]
    outputs = llm.generate(prompts, params)
    assert llm.engine.allocator.stats().num_used_blocks == 0, "blocks leaked after every request finished"
    return [o.token_ids for o in outputs], llm


SETTINGS = {
    "batch-1": {"max_num_seqs": 1},
    "batch-3": {"max_num_seqs": 3},
    "batch-8": {"max_num_seqs": 8},
    "torch-paged": {"attention.name": "torch-paged"},
    "prefix-cache": {"allocator.name": "radix"},
    # A 7-token budget cuts trees to a prefix of their nodes and chunks prompts around them.
    "chunked-prefill": {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 7},
    # 12 blocks of 8 slots: sequences are preempted and recomputed mid-speculation.
    "tight-pool": {"num_kv_blocks": 12, "max_model_len": 96},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_greedy_tree_speculation_equals_transformers(setting, reference):
    path, expected = reference
    tokens, llm = run(path, expected, **SETTINGS[setting])
    assert tokens == expected
    stats = llm.engine.speculation_stats()
    drafter = llm.engine.speculator.drafter
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    assert max(drafter.true_depths) >= 3, "the true path never ran deep: nothing moved far"
    assert stats.mean_tokens_per_step > 1.5
    if setting == "tight-pool":
        assert llm.engine.scheduler.stats().num_preemptions > 0


def test_greedy_trees_with_a_shared_prefix_hit_the_prefix_cache(reference):
    """Prompts sharing a long prefix: the radix cache serves their common blocks, which
    hold K/V moved into place after tree verification."""
    path, _ = reference
    base = spec_prompts()[0] * 2
    prompts = [base + [5 + i] for i in range(4)]
    expected = [hf_greedy(path, p, 20) for p in prompts]
    tokens, llm = run(path, expected, prompts, **{"allocator.name": "radix", "max_num_seqs": 2})
    assert tokens == expected
    assert llm.engine.allocator.stats().prefix_hit_tokens > 0


def test_kept_kv_equals_plain_decoding(reference):
    """After the run, the cache slots of every computed token of a sequence hold the K/V
    that decoding without drafts writes there (checked mid-generation, at every step)."""
    path, expected = reference
    prompt, truth = spec_prompts()[0], expected[0]
    llm = LLM(path, config={"drafter": {"name": "oracle-tree"}},
              registry=oracle_registry({tuple(prompt): truth}), max_model_len=128, block_size=8)
    plain = LLM(path, max_model_len=128, block_size=8)
    for engine in (llm.engine, plain.engine):
        engine.add_request(prompt, SamplingParams(max_tokens=len(truth), temperature=0, ignore_eos=True), "s")
    compared = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        seq = next(iter(llm.engine.requests.sequences()), None)
        if seq is None:
            break
        # Bring the plain engine to the same number of computed tokens.
        while plain.engine.has_unfinished():
            other = next(iter(plain.engine.requests.sequences()))
            if other.num_computed_tokens >= seq.num_computed_tokens:
                break
            plain.engine.step()
        other = next(iter(plain.engine.requests.sequences()))
        assert other.num_computed_tokens == seq.num_computed_tokens
        n = seq.num_computed_tokens
        blocks = llm.engine.allocator.block_table(seq.request_id)
        assert len(blocks) == -(-n // 8), "rejected drafts' blocks were not rolled back"
        for layer in (0, -1):
            for which in (0, 1):
                mine = _slots(llm.engine.runner.kv_caches[layer][which], blocks, n)
                theirs = _slots(plain.engine.runner.kv_caches[layer][which],
                                plain.engine.allocator.block_table(other.request_id), n)
                torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
        compared += 1
    assert compared > 3
    assert llm.engine.speculation_stats().num_accepted_tokens > 0


def _slots(cache: torch.Tensor, blocks, num_tokens: int) -> torch.Tensor:
    """[kv_heads, num_tokens, head_dim] of a torch-paged layout cache."""
    return cache[:, list(blocks)].reshape(cache.shape[0], -1, cache.shape[-1])[:, :num_tokens]


def test_a_backend_without_tree_masks_is_refused(reference):
    path, expected = reference
    registry = oracle_registry({tuple(p): r for p, r in zip(spec_prompts(), expected)})
    with pytest.raises(ConfigError, match=r"drafter 'oracle-tree' proposes token trees, but attention backend "
                                          r"'sdpa-contiguous' does not support tree masks \(the "
                                          r"TreeAttentionBackend capability"):
        LLM(path, config={"drafter": {"name": "oracle-tree"}}, registry=registry, max_model_len=128,
            **{"attention.name": "sdpa-contiguous", "allocator.name": "naive"})


def test_a_chain_drafter_proposing_a_tree_is_dropped(reference):
    """Parents from a drafter that does not declare trees: the draft is dropped (a
    warning), the tokens are still the target's."""

    class Undeclared:
        def __init__(self, options, context):
            pass

        def propose(self, seqs):
            return {seq.request_id: Draft([5, 6], parents=[-1, -1]) for seq in seqs}

    class Plugin:
        @servelab.hookimpl
        def servelab_register_drafters(self):
            return [DrafterPlugin(name="undeclared", factory=Undeclared)]

    registry = servelab.PluginRegistry.from_entry_points()
    registry.register(Plugin())
    path, expected = reference
    llm = LLM(path, config={"drafter": {"name": "undeclared"}}, registry=registry, max_model_len=128)
    outputs = llm.generate(spec_prompts()[:2], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                for n in MAX_NEW[:2]])
    assert [o.token_ids for o in outputs] == expected[:2]
    assert llm.engine.speculation_stats().num_draft_tokens == 0


def test_logprobs_requests_verify_the_first_branch(reference):
    """A request with logprobs follows one path: it verifies the tree's first branch, and
    its tokens and logprobs are those of decoding without drafts."""
    path, expected = reference
    prompts = spec_prompts()[:2]
    registry = oracle_registry({tuple(p): r for p, r in zip(prompts, expected)})
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in MAX_NEW[:2]]
    llm = LLM(path, config={"drafter": {"name": "oracle-tree"}}, registry=registry, max_model_len=128)
    plain = LLM(path, max_model_len=128)
    got, want = llm.generate(prompts, params), plain.generate(prompts, params)
    assert [o.token_ids for o in got] == expected[:2]
    for a, b in zip(got, want):
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def _second_and_third_tokens(path: str, prompt: list[int], registry, num_requests: int, trees: bool) -> torch.Tensor:
    config = {"drafter": {"name": "oracle-tree"}} if trees else {}
    llm = LLM(path, config=config, registry=registry, max_model_len=128, max_num_seqs=64,
              **{"allocator.name": "radix"})
    # Unseeded: a seeded request is not drafted; the engine's seeded generator draws.
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True) for _ in range(num_requests)]
    outputs = llm.generate([prompt] * num_requests, params)
    if trees:
        stats = llm.engine.speculation_stats()
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert llm.engine.allocator.stats().num_used_blocks == 0
    return torch.tensor([o.token_ids[1] * VOCAB + o.token_ids[2] for o in outputs])


def test_sampled_tree_speculation_keeps_the_target_distribution(checkpoint_factory):
    """Tokens 2 and 3 (the first ones tree verification produces) with trees and without:
    a chi-square test of homogeneity over their joint values, the engine's fixed seed."""
    path = checkpoint_factory("llama")
    start = spec_prompts()[1]
    own = hf_greedy(path, start, 24)
    prompt = start + own + start + own[:2]
    # The oracle's "truth" is the greedy continuation: likely tokens on one branch of each tree.
    registry = oracle_registry({tuple(prompt): hf_greedy(path, prompt, 4)}, depth=2)
    num = 1500
    plain = _second_and_third_tokens(path, prompt, registry, num, trees=False)
    spec = _second_and_third_tokens(path, prompt, registry, num, trees=True)
    values = torch.cat([plain, spec]).unique()
    counts = torch.stack([(plain[:, None] == values).sum(0), (spec[:, None] == values).sum(0)]).double()
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    rare = expected.min(0).values < 5  # pooled, so every expected count is >= 5
    counts = torch.cat([counts[:, ~rare], counts[:, rare].sum(1, keepdim=True)], dim=1)
    expected = counts.sum(0, keepdim=True) * counts.sum(1, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.shape[1] - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))
    assert dof >= 3, "the distribution is too concentrated to test anything"
    assert p_value > 1e-3


# ---------------------------------------------------------------- the drafter contract


class LookupTree:
    """A tree drafter for the contract: below the last token, what followed each of its
    earlier occurrences (one branch per occurrence, most recent first), merged into a tree."""

    proposes_trees = True

    def __init__(self, options, context):
        self.max_model_len = context.max_model_len

    def propose(self, seqs):
        proposals = {}
        for seq in seqs:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            room = min(self.max_model_len - seq.num_tokens, 12)
            nodes, parents, index = [], [], {}
            for i in range(len(tokens) - 2, -1, -1):
                if tokens[i] != tokens[-1]:
                    continue
                parent = -1
                for token in tokens[i + 1: i + 4]:
                    key = (parent, token)
                    if key not in index:
                        if len(nodes) == room:
                            break
                        index[key] = len(nodes)
                        nodes.append(token)
                        parents.append(parent)
                    parent = index[key]
            if nodes:
                proposals[seq.request_id] = Draft(nodes, parents=parents)
        return proposals


class TestLookupTreeContract(DrafterContract):
    factory = LookupTree
    num_speculative_tokens = 3


class BrokenTree(LookupTree):
    def propose(self, seqs):
        return {seq.request_id: Draft([5, 6], parents=[0, -1]) for seq in seqs}


def test_the_contract_refuses_a_malformed_tree():
    from servelab.testing import ContractViolation

    contract = DrafterContract()
    contract._factory, contract._options = BrokenTree, None
    contract.num_speculative_tokens = 3
    with pytest.raises(ContractViolation, match="invariant violated: token trees are well formed: .*parents\\[0\\] = 0"):
        contract.test_repetitive_sequences()
