"""The mixture-of-experts seams: the built-in routing (standard, grouped) and placement
(linear, round_robin, balanced) policies pass their contracts, and each contract catches
seeded faulty variants."""

from __future__ import annotations

import pytest
import torch

from servelab.contracts.moe import ExpertPlacement
from servelab.expert_placement import (BalancedPlacement, LinearPlacement, RoundRobinPlacement, placement_policy)
from servelab.model.expert_routing import GroupedTopK, StandardTopK, routing_policy
from servelab.testing.moe import ExpertPlacementContract, ExpertRoutingContract


class TestStandardTopK(ExpertRoutingContract):
    routing = StandardTopK()


class TestGroupedTopK(ExpertRoutingContract):
    routing = GroupedTopK(num_groups=3, topk_groups=2)
    num_groups, topk_groups = 3, 2


class TestLinear(ExpertPlacementContract):
    placement = LinearPlacement()


class TestRoundRobin(ExpertPlacementContract):
    placement = RoundRobinPlacement()


class TestBalanced(ExpertPlacementContract):
    placement = BalancedPlacement()


class TestBalancedWithRedundantExperts(ExpertPlacementContract):
    placement = BalancedPlacement(redundant_experts=2)


# Seeded faulty variants: each must fail its contract.

class NoRenormalisation(StandardTopK):
    def select(self, logits, top_k, normalize):
        return super().select(logits, top_k, False)


class SmallestExperts(StandardTopK):
    def select(self, logits, top_k, normalize):
        return super().select(-logits, top_k, normalize)


class WeightsOfAnotherToken(StandardTopK):
    def select(self, logits, top_k, normalize):
        weights, ids = super().select(logits, top_k, normalize)
        return weights.roll(1, dims=0), ids


class GroupsIgnored(GroupedTopK):
    def select(self, logits, top_k, normalize):
        return StandardTopK().select(logits, top_k, normalize)


class LastExpertDropped(LinearPlacement):
    def place(self, num_experts, ep_size, load=None):
        placed = super().place(num_experts, ep_size, load)
        return ExpertPlacement(num_experts, placed.ranks[:-1] + (placed.ranks[-1][:-1],))


class TwiceOnOneRank(RoundRobinPlacement):
    def place(self, num_experts, ep_size, load=None):
        placed = super().place(num_experts, ep_size, load)
        return ExpertPlacement(num_experts, (placed.ranks[0] + placed.ranks[0][:1],) + placed.ranks[1:])


class AllOnRankZero(LinearPlacement):
    name = "everything-on-zero"

    def place(self, num_experts, ep_size, load=None):
        return ExpertPlacement(num_experts, (tuple(range(num_experts)),) + ((),) * (ep_size - 1))


class LoadBlindBalanced(BalancedPlacement):
    def place(self, num_experts, ep_size, load=None):
        return super().place(num_experts, ep_size, None)


class ShiftedRoundRobin(RoundRobinPlacement):
    def place(self, num_experts, ep_size, load=None):
        ranks = RoundRobinPlacement().place(num_experts, ep_size).ranks
        return ExpertPlacement(num_experts, ranks[1:] + ranks[:1])


class Unstable(LinearPlacement):
    calls = 0

    def place(self, num_experts, ep_size, load=None):
        Unstable.calls += 1
        ranks = super().place(num_experts, ep_size, load).ranks
        return ExpertPlacement(num_experts, ranks if Unstable.calls % 2 else ranks[::-1])


ROUTING_FAULTS = [
    (NoRenormalisation(), 1, 1, "test_chooses_the_reference_experts_and_weights", "weights are the reference's"),
    (SmallestExperts(), 1, 1, "test_chooses_the_reference_experts_and_weights", "chosen experts"),
    (WeightsOfAnotherToken(), 1, 1, "test_chooses_the_reference_experts_and_weights", "weights are the reference's"),
    (GroupsIgnored(3, 1), 3, 1, "test_chooses_the_reference_experts_and_weights", "chosen experts"),
]
PLACEMENT_FAULTS = [
    (LastExpertDropped(), "test_every_expert_is_held_within_capacity_and_never_twice_on_a_rank", "held by no rank"),
    (TwiceOnOneRank(), "test_every_expert_is_held_within_capacity_and_never_twice_on_a_rank", "holds an expert twice"),
    (AllOnRankZero(), "test_every_expert_is_held_within_capacity_and_never_twice_on_a_rank", "over its capacity"),
    (LoadBlindBalanced(), "test_a_load_aware_placement_balances_measured_load", "the busiest rank carries"),
    (ShiftedRoundRobin(), "test_the_named_layouts_are_their_definitions", "round_robin places as its definition"),
    (Unstable(), "test_is_deterministic", "the same inputs give the same placement"),
]


@pytest.mark.parametrize("routing, groups, topk_groups, check, message", ROUTING_FAULTS,
                         ids=[type(f[0]).__name__ for f in ROUTING_FAULTS])
def test_the_routing_contract_catches_seeded_faults(routing, groups, topk_groups, check, message):
    contract = type("Faulty", (ExpertRoutingContract,), {"routing": routing, "num_groups": groups,
                                                        "topk_groups": topk_groups})()
    with pytest.raises(AssertionError, match=message):
        getattr(contract, check)()


@pytest.mark.parametrize("placement, check, message", PLACEMENT_FAULTS,
                         ids=[type(f[0]).__name__ for f in PLACEMENT_FAULTS])
def test_the_placement_contract_catches_seeded_faults(placement, check, message):
    contract = type("Faulty", (ExpertPlacementContract,), {"placement": placement})()
    with pytest.raises(AssertionError, match=message):
        getattr(contract, check)()


def test_balanced_replicates_the_hot_expert_and_beats_linear_on_skewed_load():
    load = [100.0, 90.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]  # the two hot experts are neighbours
    linear = LinearPlacement().place(8, 2)
    balanced = BalancedPlacement(redundant_experts=2).place(8, 2, load)
    assert balanced.replicas(0) == (0, 1) and len(balanced.replicas(1)) == 2
    assert linear.imbalance(load) > 1.7 and balanced.imbalance(load) < 1.05
    assert RoundRobinPlacement().place(8, 2).imbalance(load) < linear.imbalance(load)


def test_replicas_take_rows_in_turn():
    placed = ExpertPlacement(3, ((0, 1), (0, 2)))
    assert [placed.rank_for(0, token) for token in range(4)] == [0, 1, 0, 1]
    assert placed.rank_for(2, 5) == 1


def test_unknown_names_and_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unknown expert placement 'eplb'; known: linear, round_robin, balanced"):
        placement_policy("eplb")
    with pytest.raises(ValueError, match="unknown expert routing 'topp'; known: standard, grouped"):
        routing_policy("topp")
    with pytest.raises(ValueError, match="needs at least as many experts"):
        LinearPlacement().place(3, 4)
    with pytest.raises(ValueError, match="expert load has 2 entries for 3 experts"):
        BalancedPlacement().place(3, 2, [1.0, 2.0])
    with pytest.raises(ValueError, match="do not fall in 4 equal groups"):
        GroupedTopK(4, 2).select(torch.zeros(2, 6), 2, True)
