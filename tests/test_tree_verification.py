"""Token-tree verification, alone: the emitted tokens follow the target's distribution
whatever the tree and its draft distributions (a chi-square test of the joint of the
first two tokens against the exact product of the target's rows, fixed seeds), a
deliberately wrong rule fails the same test, greedy descends the longest matching root
path, and seeded requests reproduce whatever the batch."""

from __future__ import annotations

import itertools

import pytest
import torch

from servelab.sampling_params import SamplingParams
from servelab.token_tree import children
from servelab.tree_verification import verify_tree_greedy
from servelab.verification import verify

from test_verification import P_VALUE, chi_square_p_value, logits_for

VOCAB = 5
TRIALS = 12_000
SAMPLED = SamplingParams(temperature=1.0)

# The target: P0 at the root, P1[x] after token x. Zeros where a wrong rule would emit.
P0 = [0.35, 0.05, 0.3, 0.0, 0.3]
P1 = [[0.1, 0.4, 0.1, 0.2, 0.2], [0.6, 0.0, 0.2, 0.1, 0.1], [0.05, 0.05, 0.3, 0.3, 0.3],
      [0.2, 0.2, 0.2, 0.2, 0.2], [0.0, 0.5, 0.0, 0.5, 0.0]]
EXPECTED = torch.tensor([P0[x] * P1[x][y] for x, y in itertools.product(range(VOCAB), repeat=2)])
P_LATER = [0.2] * VOCAB  # after two tokens: any fixed distribution (only the first two are tested)

# Draft distributions q at the root and below, peaked where p is not (to break wrong rules).
Q0 = [0.1, 0.5, 0.1, 0.2, 0.1]  # puts mass on token 3, which P0 never emits
Q1 = [0.5, 0.1, 0.1, 0.1, 0.2]

# A tree shape: parents of each node (root children 0, 1, 2; two under 0, one under 1).
SHAPE = [-1, -1, -1, 0, 0, 1]


def rows_for(tokens: list[int], parents: list[int]) -> torch.Tensor:
    """Logits rows of one tree: the root's P0, then each node's row after its root path."""
    rows = [logits_for(P0)]
    for i, parent in enumerate(parents):
        depth_one = parent < 0
        rows.append(logits_for(P1[tokens[i]] if depth_one else P_LATER))
    return torch.stack(rows)


def draw_tree(generator: torch.Generator, mode: str) -> tuple[list[int], list[int], torch.Tensor | None]:
    """A tree of SHAPE: deterministic distinct tokens, or siblings drawn from q
    independently ("iid") or without replacement ("without-replacement"), with the q each
    node was drawn from."""
    if mode == "deterministic":
        return [1, 3, 0, 2, 1, 4], SHAPE, None
    if mode == "duplicates":  # a deterministic drafter repeating a sibling: allowed, still lossless
        return [1, 1, 0, 2, 2, 4], SHAPE, None
    tokens, probs = [], []
    kids = children(SHAPE)
    by_node: dict[int, int] = {}
    for row, members in enumerate(kids):
        base = torch.tensor(Q0 if row == 0 else Q1)
        q = base.clone()
        for node in members:
            token = int(torch.multinomial(q, 1, generator=generator))
            by_node[node] = token
            probs.append((node, q.clone()))
            if mode == "without-replacement":
                q[token] = 0.0
                q /= q.sum()
    tokens = [by_node[i] for i in range(len(SHAPE))]
    q_rows = torch.stack([q for _, q in sorted(probs, key=lambda item: item[0])])
    return tokens, SHAPE, q_rows


def first_two(emitted: list[int], generator: torch.Generator) -> int:
    """(first, second) token as one category; a step that emitted one token is completed
    by a draw from the target's next row, which is what the next step would do."""
    first = emitted[0]
    second = emitted[1] if len(emitted) > 1 else int(torch.multinomial(torch.tensor(P1[first]), 1,
                                                                        generator=generator))
    return first * VOCAB + second


def emitted_by_the_engine_rule(mode: str, seed: int = 0) -> torch.Tensor:
    """One `verify` call over TRIALS trees (the engine's entry point)."""
    generator = torch.Generator().manual_seed(seed)
    trees = [draw_tree(generator, mode) for _ in range(TRIALS)]
    logits = torch.cat([rows_for(tokens, parents) for tokens, parents, _ in trees])
    results = verify(logits, [t for t, _, _ in trees], [q for _, _, q in trees], [SAMPLED] * TRIALS,
                     [None] * TRIALS, torch.Generator().manual_seed(seed + 1), [p for _, p, _ in trees])
    completion = torch.Generator().manual_seed(seed + 2)
    return torch.tensor([first_two(r.token_ids, completion) for r in results])


def no_residual_rule(p_rows, tokens, parents, q, generator) -> list[int]:
    """The control: siblings tried against the unchanged p (no residual after a rejection),
    the final token drawn from p. Biased towards drafted tokens."""
    kids = children(parents)
    row, emitted = 0, []
    p = p_rows[0]
    while True:
        for child in kids[row]:
            token = tokens[child]
            q_token = float(q[child][token]) if q is not None else 1.0
            if float(torch.rand((), generator=generator)) * q_token < float(p[token]):
                emitted.append(token)
                row = child + 1
                p = p_rows[row]
                break
        else:
            return emitted + [int(torch.multinomial(p, 1, generator=generator))]


def emitted_by_the_control(mode: str, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    draws = torch.Generator().manual_seed(seed + 1)
    completion = torch.Generator().manual_seed(seed + 2)
    out = []
    for _ in range(TRIALS):
        tokens, parents, q = draw_tree(generator, mode)
        p_rows = torch.softmax(rows_for(tokens, parents), dim=-1)
        out.append(first_two(no_residual_rule(p_rows, tokens, parents, q, draws), completion))
    return torch.tensor(out)


@pytest.mark.parametrize("mode", ["deterministic", "duplicates", "iid", "without-replacement"])
def test_first_two_tokens_follow_the_target(mode):
    observed = torch.bincount(emitted_by_the_engine_rule(mode), minlength=VOCAB * VOCAB)
    assert chi_square_p_value(observed, EXPECTED) > P_VALUE


@pytest.mark.parametrize("mode", ["deterministic", "iid"])
def test_the_check_detects_a_rule_without_the_residual(mode):
    """Guard on the guard: the same harness with the residual step left out fails."""
    observed = torch.bincount(emitted_by_the_control(mode), minlength=VOCAB * VOCAB)
    support = EXPECTED > 0
    if observed[~support].sum():  # emitted a token the target never emits: caught outright
        return
    assert chi_square_p_value(observed, EXPECTED) < P_VALUE


def test_without_replacement_siblings_need_their_own_q():
    """Declaring the base q for siblings drawn without replacement (instead of the
    renormalised q each was drawn from) is not lossless, and the test sees it."""
    generator = torch.Generator().manual_seed(7)
    trees = []
    for _ in range(TRIALS):
        tokens, parents, q = draw_tree(generator, "without-replacement")
        kids = children(parents)
        wrong = q.clone()
        for row, members in enumerate(kids):
            for node in members:
                wrong[node] = torch.tensor(Q0 if row == 0 else Q1)
        trees.append((tokens, parents, wrong))
    logits = torch.cat([rows_for(tokens, parents) for tokens, parents, _ in trees])
    results = verify(logits, [t for t, _, _ in trees], [q for _, _, q in trees], [SAMPLED] * TRIALS,
                     [None] * TRIALS, torch.Generator().manual_seed(8), [p for _, p, _ in trees])
    completion = torch.Generator().manual_seed(9)
    observed = torch.bincount(torch.tensor([first_two(r.token_ids, completion) for r in results]),
                              minlength=VOCAB * VOCAB)
    assert chi_square_p_value(observed, EXPECTED) < P_VALUE


def test_greedy_descends_the_longest_matching_root_path():
    # Root children: 0 -> token 4, 1 -> token 2 (the argmax), 2 -> token 2 (a duplicate,
    # never reached); under node 1: node 3 -> token 0, node 4 -> token 1 (the argmax).
    tokens, parents = [4, 2, 2, 0, 1, 3], [-1, -1, -1, 1, 1, 4]
    argmax = [2, 9, 1, 9, 9, 3, 7]  # row r + 1 is node r's; rows of unvisited nodes do not matter
    emitted, path = verify_tree_greedy(argmax, tokens, parents)
    assert path == (1, 4, 5) and emitted == [2, 1, 3, 7]  # all the way down, then the leaf's argmax
    emitted, path = verify_tree_greedy([3] + argmax[1:], tokens, parents)
    assert path == () and emitted == [3]


def test_greedy_tree_through_verify_matches_its_chain_for_a_chain():
    """A chain given as parents verifies exactly as the chain rule does."""
    torch.manual_seed(0)
    logits = torch.randn(4, 7)
    argmax = logits.argmax(-1).tolist()
    drafts = [argmax[0], argmax[1], (argmax[2] + 1) % 7]
    greedy = SamplingParams(temperature=0)
    as_chain = verify(logits, [drafts], [None], [greedy], [None])[0]
    as_tree = verify(logits, [drafts], [None], [greedy], [None], draft_parents=[[-1, 0, 1]])[0]
    assert as_tree.token_ids == as_chain.token_ids and as_tree.path == (0, 1)


def test_seeded_trees_reproduce_whatever_the_batch():
    params = SamplingParams(temperature=1.0, seed=5)
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    tree = ([1, 2, 3, 1], [-1, -1, 0, 2])
    alone = verify(logits, [tree[0]], [None], [params], [torch.Generator().manual_seed(5)], None, [tree[1]])
    other = torch.randn(4, 7)
    batched = verify(torch.cat([other, logits]), [[0, 3, 1], tree[0]], [None, None],
                     [SamplingParams(temperature=1.0), params],
                     [torch.Generator().manual_seed(9), torch.Generator().manual_seed(5)], None, [None, tree[1]])
    assert batched[1] == alone[0]
