"""The EAGLE-style drafter: its drafting equals the training pass that taught it (the
training-time test's mask is what drafting sees), features observed in chunks or
recomputed after a preemption give the same drafts, the shipped head for `builtin:tiny`
keeps greedy output token for token and is accepted, trees accept more per step than the
chain, and configurations that cannot work are refused by name. (Greedy equality with
transformers on the odd-shaped test checkpoint, under chunked prefill and preemption, is
in test_speculative_decoding.py.)"""

from __future__ import annotations

import pytest
import torch

from servelab import LLM, ConfigError, SamplingParams
from servelab.testing.drafter import decoding_sequence
from servelab.testing.tiny_model import tiny_checkpoint

from test_medusa_tree import embedded_plain, medusa_run  # noqa: F401 (a fixture)
from test_speculative_decoding import eagle_head

HIDDEN = 72  # the "llama" test checkpoint's


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    heads = eagle_head(tmp_path_factory.mktemp("eagle"), tiny_checkpoint("llama"))
    config = {"drafter": {"name": "eagle", "heads": heads, "num_speculative_tokens": 4}}
    return LLM(tiny_checkpoint("llama"), config=config, max_model_len=128).engine.speculator.drafter


def features(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_drafting_equals_the_training_pass(drafter):
    """The chain's j-th draft is the argmax of the training pass's step j at the last row,
    given the same features and the earlier drafts as tokens: training and drafting share
    one head and one attention pattern."""
    tokens = [5, 17, 33, 2, 90, 41, 7, 7, 120, 3]
    n = len(tokens) - 1  # positions 0..n-1 computed; token n is the last, not yet computed
    feats = features(n)
    drafter.observe("a", 0, feats, tokens[1:])
    chain = drafter.propose([decoding_sequence("a", tokens, [])])["a"]
    assert len(chain) == 4
    head = drafter.head
    with torch.inference_mode():
        inputs = torch.tensor([tokens[1:] + chain[:-1]])
        outputs = head.unrolled(head.fused(feats[None]), drafter.embed(inputs[0])[None], depth=4)
        expected = [int(drafter.lm_head(head.out_norm(h[0, -1:])).argmax()) for h in outputs]
    assert chain == expected


def test_chunks_and_recomputation_give_the_same_drafts(drafter):
    tokens = [9, 8, 7, 6, 5, 4, 3, 11, 12, 13, 14, 15]
    n = len(tokens) - 1
    feats = features(n, seed=3)
    seq = decoding_sequence("x", tokens, [])
    drafter.observe("x", 0, feats, tokens[1:])
    whole = drafter.propose([seq])["x"]
    drafter.release("x")
    drafter.observe("x", 0, feats[:4], tokens[1:5])  # a chunked prefill
    drafter.observe("x", 4, feats[4:], tokens[5:])
    assert drafter.propose([seq])["x"] == whole
    drafter.observe("x", 6, features(n - 6, seed=9), tokens[7:])  # a recomputation replaces positions 6..
    drafter.observe("x", 6, feats[6:], tokens[7:])
    assert drafter.propose([seq])["x"] == whole
    drafter.release("x")
    assert drafter.propose([seq]) == {}, "a released sequence has nothing to draft from"


def test_a_batch_drafts_what_each_sequence_drafts_alone(drafter):
    """Chains are drafted for the whole batch in one pass per depth, contexts padded to the
    longest: every sequence's chain equals its chain drafted alone."""
    rows = {f"s{i}": [(7 * i + j) % 200 + 3 for j in range(length)] for i, length in enumerate([3, 11, 6, 20])}
    seqs = [decoding_sequence(seq_id, tokens, []) for seq_id, tokens in rows.items()]
    for i, (seq_id, tokens) in enumerate(rows.items()):
        drafter.observe(seq_id, 0, features(len(tokens) - 1, seed=20 + i), tokens[1:])
    together = drafter.propose(seqs)
    alone = {seq.request_id: drafter.propose([seq])[seq.request_id] for seq in seqs}
    assert together == alone and all(len(chain) == 4 for chain in together.values())
    for seq_id in rows:
        drafter.release(seq_id)


def test_a_sequence_the_head_has_not_caught_up_with_gets_no_draft(drafter):
    tokens = [4, 5, 6, 7, 8]
    drafter.observe("late", 0, features(2), tokens[1:3])  # positions 0, 1 of 4
    assert drafter.propose([decoding_sequence("late", tokens, [])]) == {}


# ---------------------------------------------------------------- the shipped head


@pytest.mark.parametrize("engine", [{}, {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 12},
                                    {"attention.name": "torch-paged", "max_num_seqs": 1},
                                    {"allocator.name": "radix"}],
                         ids=["continuous", "chunked-prefill", "torch-paged-batch-1", "radix"])
def test_shipped_head_keeps_greedy_tokens_and_is_accepted(engine, embedded_plain):
    prompts, expected = embedded_plain
    tokens, chain = medusa_run(prompts, {"name": "eagle"}, **engine)
    assert tokens == expected
    assert chain.acceptance_rate > 0.2, chain  # a trained head, not noise
    tokens, tree = medusa_run(prompts, {"name": "eagle", "tree_nodes": 12}, **engine)
    assert tokens == expected
    assert tree.mean_tokens_per_step >= chain.mean_tokens_per_step, (tree, chain)


def test_sampled_requests_run_with_trees(embedded_plain):
    """Sampling (unseeded: seeded requests are not drafted) with the drafter runs to
    completion with valid tokens and frees every block
    (its distribution is checked for every deterministic drafter in test_tree_verification)."""
    prompts, _ = embedded_plain
    llm = LLM("builtin:tiny", config={"drafter": {"name": "eagle", "tree_nodes": 8}}, max_model_len=256)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True))
    assert all(len(o.token_ids) == 24 for o in outputs)
    assert llm.engine.allocator.stats().num_used_blocks == 0
    assert llm.engine.speculation_stats().num_accepted_tokens > 0


# ---------------------------------------------------------------- refusals


def test_missing_head_is_named(tmp_path):
    with pytest.raises(ConfigError, match="eagle.safetensors and eagle_config.json"):
        LLM(tiny_checkpoint("llama"), config={"drafter": {"name": "eagle", "heads": str(tmp_path)}})


def test_a_head_for_another_model_is_refused(tmp_path):
    heads = eagle_head(tmp_path, tiny_checkpoint("llama-mha"))
    with pytest.raises(ConfigError, match="hidden size 48, the target's is 72"):
        LLM(tiny_checkpoint("llama"), config={"drafter": {"name": "eagle", "heads": heads}})


def test_a_head_reading_the_last_layer_is_refused(tmp_path):
    heads = eagle_head(tmp_path, tiny_checkpoint("llama"), feature_layers=(1,))
    with pytest.raises(ConfigError, match=r"reads layers \[1\], but the target has 2"):
        LLM(tiny_checkpoint("llama"), config={"drafter": {"name": "eagle", "heads": heads}})
