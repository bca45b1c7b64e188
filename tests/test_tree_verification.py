"""Token-tree verification, alone: the emitted tokens follow the target's distribution
whatever the tree and its draft distributions (a chi-square test of the joint of the
first two tokens against the exact product of the target's rows, fixed seeds), a
deliberately wrong rule fails the same test, greedy descends the longest matching root
path, and seeded requests reproduce whatever the batch.

The harness around the rule under test (drawing the trees, building their rows, completing
a one-token step, the control rules) works on all TRIALS trees at once; only `verify`, the
engine's entry point, runs tree by tree."""

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
KIDS = children(SHAPE)  # KIDS[r]: the nodes under row r (row 0 the root, row i + 1 node i)
DEPTH_ONE = [i for i, parent in enumerate(SHAPE) if parent < 0]
P1_ROWS = torch.tensor(P1)


def rows_for(tokens: torch.Tensor) -> torch.Tensor:
    """Logits rows of trees of SHAPE ([trials, nodes] tokens -> [trials, nodes + 1, VOCAB]):
    the root's P0, then each node's row after its root path."""
    rows = logits_for(P_LATER).repeat(len(tokens), len(SHAPE) + 1, 1)
    rows[:, 0] = logits_for(P0)
    rows[:, [i + 1 for i in DEPTH_ONE]] = torch.stack([logits_for(p) for p in P1])[tokens[:, DEPTH_ONE]]
    return rows


def draw_trees(generator: torch.Generator, mode: str, trials: int = TRIALS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`trials` trees of SHAPE ([trials, nodes] tokens): deterministic distinct tokens, or
    siblings drawn from q independently ("iid") or without replacement
    ("without-replacement"), with the q each node was drawn from ([trials, nodes, VOCAB])."""
    if mode == "deterministic":
        return torch.tensor([1, 3, 0, 2, 1, 4]).repeat(trials, 1), None
    if mode == "duplicates":  # a deterministic drafter repeating a sibling: allowed, still lossless
        return torch.tensor([1, 1, 0, 2, 2, 4]).repeat(trials, 1), None
    tokens = torch.empty(trials, len(SHAPE), dtype=torch.int64)
    q = torch.empty(trials, len(SHAPE), VOCAB)
    for row, members in enumerate(KIDS):
        if not members:
            continue
        base = torch.tensor(Q0 if row == 0 else Q1).repeat(trials, 1)
        # multinomial without replacement draws each sibling from q with the earlier ones removed
        drawn = torch.multinomial(base, len(members), replacement=mode == "iid", generator=generator)
        tokens[:, members] = drawn
        left = base.clone()
        for j, node in enumerate(members):
            q[:, node] = left / left.sum(-1, keepdim=True)
            if mode == "without-replacement":
                left.scatter_(1, drawn[:, j:j + 1], 0.0)
    return tokens, q


def verified(tokens: torch.Tensor, q: torch.Tensor | None, seed: int) -> list[list[int]]:
    """One `verify` call over the trees (the engine's entry point): each tree's emitted tokens."""
    trials = len(tokens)
    results = verify(rows_for(tokens).flatten(0, 1), tokens.tolist(), list(q) if q is not None else [None] * trials,
                     [SAMPLED] * trials, [None] * trials, torch.Generator().manual_seed(seed), [SHAPE] * trials)
    return [r.token_ids for r in results]


def first_two(first: torch.Tensor, second: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(first, second) token of each step as one category; a step that emitted one token
    (second -1) is completed by a draw from the target's next row, which is what the next
    step would do."""
    drawn = torch.multinomial(P1_ROWS[first], 1, generator=generator).squeeze(1)
    return first * VOCAB + torch.where(second >= 0, second, drawn)


def leading_tokens(emitted: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's first token and its second (-1 where it emitted one)."""
    return (torch.tensor([tokens[0] for tokens in emitted]),
            torch.tensor([tokens[1] if len(tokens) > 1 else -1 for tokens in emitted]))


def emitted_by_the_engine_rule(mode: str, seed: int = 0) -> torch.Tensor:
    tokens, q = draw_trees(torch.Generator().manual_seed(seed), mode)
    return first_two(*leading_tokens(verified(tokens, q, seed + 1)), torch.Generator().manual_seed(seed + 2))


PADDED_KIDS = torch.tensor([members + [-1] * (len(SHAPE) - len(members)) for members in KIDS])


def _try_children(p: torch.Tensor, row: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The control's step from `row` of each tree: its children tried in order, each
    accepted with probability min(1, p / q) against the unchanged p, else a draw from p.
    (The accepted node, -1 for none; the token emitted.)"""
    everyone = torch.arange(len(tokens))
    chosen = torch.full((len(tokens),), -1)
    for slot in range(PADDED_KIDS.shape[1]):
        child = PADDED_KIDS[row, slot]
        node = child.clamp(min=0)
        token = tokens[everyone, node]
        q_token = q[everyone, node, token] if q is not None else torch.ones(len(tokens))
        accept = (child >= 0) & (chosen < 0) & (torch.rand(len(tokens), generator=generator) * q_token
                                                < p[everyone, token])
        chosen = torch.where(accept, child, chosen)
    final = torch.multinomial(p, 1, generator=generator).squeeze(1)
    return chosen, torch.where(chosen >= 0, tokens[everyone, chosen.clamp(min=0)], final)


def no_residual_rule(p_rows: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The control, on every tree at once: siblings tried against the unchanged p (no
    residual after a rejection), the final token drawn from p. Biased towards drafted
    tokens. Each step's first token and its second (-1 where it emitted one)."""
    everyone = torch.arange(len(tokens))
    chosen, first = _try_children(p_rows[:, 0], torch.zeros(len(tokens), dtype=torch.int64), tokens, q, generator)
    below = chosen + 1  # the accepted node's row (the root's for a rejected step: not used)
    _, second = _try_children(p_rows[everyone, below], below, tokens, q, generator)
    return first, torch.where(chosen >= 0, second, -1)


def emitted_by_the_control(mode: str, seed: int = 0) -> torch.Tensor:
    tokens, q = draw_trees(torch.Generator().manual_seed(seed), mode)
    p_rows = torch.softmax(rows_for(tokens), dim=-1)
    emitted = no_residual_rule(p_rows, tokens, q, torch.Generator().manual_seed(seed + 1))
    return first_two(*emitted, torch.Generator().manual_seed(seed + 2))


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
    tokens, _ = draw_trees(torch.Generator().manual_seed(7), "without-replacement")
    wrong = torch.stack([torch.tensor(Q0 if parent < 0 else Q1) for parent in SHAPE]).repeat(TRIALS, 1, 1)
    emitted = leading_tokens(verified(tokens, wrong, 8))
    observed = torch.bincount(first_two(*emitted, torch.Generator().manual_seed(9)), minlength=VOCAB * VOCAB)
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
