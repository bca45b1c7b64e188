"""Medusa with token trees: the static tree is the best one under the accuracy model
(checked against brute force over every tree), the shipped heads' tree mode keeps greedy
output token for token and accepts more per step than the chain, and a missing
accuracy file is a clear error."""

from __future__ import annotations

import itertools
import math

import pytest

from servelab import LLM, ConfigError, SamplingParams
from servelab.plugins.drafters.medusa_tree import best_tree
from servelab.token_tree import tree_error

from test_speculative_decoding import medusa_heads


def node_probability(accuracy, path) -> float:
    return math.prod(accuracy[depth][rank] for depth, rank in enumerate(path))


ACCURACIES = [
    [[0.5, 0.2, 0.1], [0.4, 0.3, 0.05]],
    [[0.3, 0.25, 0.2], [0.9, 0.05, 0.01], [0.5, 0.4, 0.3]],
    [[0.276, 0.12, 0.075], [0.197, 0.094, 0.059]],
]


@pytest.mark.parametrize("accuracy", ACCURACIES)
@pytest.mark.parametrize("num_nodes", [1, 2, 4, 6])
def test_best_tree_is_the_best_tree_of_its_size(accuracy, num_nodes):
    tree = best_tree(accuracy, num_nodes)
    assert len(tree.parents) == num_nodes and tree_error(list(tree.parents), num_nodes) is None
    paths = tree.paths
    assert all(path[:-1] in paths for path in paths if len(path) > 1), "not closed under parents"
    assert all(tree.heads[i] == len(p) - 1 and tree.ranks[i] == p[-1] for i, p in enumerate(paths))
    assert tree.expected_accepted == pytest.approx(sum(node_probability(accuracy, p) for p in paths))
    every = [p for d in range(1, len(accuracy) + 1) for p in itertools.product(range(len(accuracy[0])), repeat=d)]
    best = max(sum(node_probability(accuracy, p) for p in subset)
               for subset in itertools.combinations(every, num_nodes)
               if all(p[:-1] in subset for p in subset if len(p) > 1))
    assert tree.expected_accepted == pytest.approx(best)


@pytest.fixture(scope="module")
def embedded_plain():
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "The with statement", "import os\n",
               "class Point:\n    def __init__(self"]
    llm = LLM("builtin:tiny", max_model_len=256)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    return prompts, [o.token_ids for o in llm.generate(prompts, params)]


def medusa_run(prompts, drafter, **engine):
    llm = LLM("builtin:tiny", config={"drafter": drafter}, max_model_len=256, **engine)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert llm.engine.allocator.stats().num_used_blocks == 0
    return [o.token_ids for o in outputs], llm.engine.speculation_stats()


@pytest.mark.parametrize("engine", [{}, {"scheduler.name": "chunked-prefill", "max_num_batched_tokens": 12},
                                    {"attention.name": "torch-paged", "max_num_seqs": 1}],
                         ids=["continuous", "chunked-prefill", "torch-paged-batch-1"])
def test_shipped_heads_tree_mode_keeps_greedy_tokens(engine, embedded_plain):
    prompts, expected = embedded_plain
    tokens, stats = medusa_run(prompts, {"name": "medusa", "tree_nodes": 16}, **engine)
    assert tokens == expected
    assert stats.num_accepted_tokens > 0


def test_tree_mode_accepts_more_per_step_than_the_chain(embedded_plain):
    prompts, expected = embedded_plain
    chain_tokens, chain = medusa_run(prompts, {"name": "medusa"})
    tree_tokens, tree = medusa_run(prompts, {"name": "medusa", "tree_nodes": 16})
    assert chain_tokens == tree_tokens == expected
    assert tree.mean_tokens_per_step > chain.mean_tokens_per_step, (tree, chain)


def test_tree_mode_without_measured_accuracies_is_a_clear_error(checkpoint_factory, tmp_path):
    heads = medusa_heads(tmp_path, 72)
    with pytest.raises(ConfigError, match=r"medusa_accuracy.json.*does not exist; measure them with "
                                          r"`python examples/measurements/medusa_accuracy.py`"):
        LLM(checkpoint_factory("llama"), config={"drafter": {"name": "medusa", "heads": heads, "tree_nodes": 8}})


def test_tree_mode_with_a_backend_without_tree_masks_is_refused():
    with pytest.raises(ConfigError, match="drafter 'medusa' proposes token trees, but attention backend "
                                          "'sdpa-contiguous' does not support tree masks"):
        LLM("builtin:tiny", config={"drafter": {"name": "medusa", "tree_nodes": 8}}, max_model_len=256,
            **{"attention.name": "sdpa-contiguous", "allocator.name": "naive"})
