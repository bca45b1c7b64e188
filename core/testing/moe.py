"""Conformance contracts of the mixture-of-experts seams (`servelab.contracts.moe`).

    from servelab.testing.moe import ExpertRoutingContract, ExpertPlacementContract

    class TestMyRouting(ExpertRoutingContract):
        routing = MyTopK()                 # num_groups / topk_groups for a grouped one

    class TestMyPlacement(ExpertPlacementContract):
        placement = MyPlacement()

Routing is checked against `reference_top_k`, the per-token definition; placement against
its invariants, the plain definitions of `linear` and `round_robin` where the policy
names itself so, and, for a policy that places by load, a brute-force optimum.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from servelab.contracts.moe import (PLACEMENT_CONTRACT_VERSION, ROUTING_CONTRACT_VERSION, ExpertPlacementPolicy,
                                    ExpertRouting)
from servelab.expert_placement import capacity, optimal_max_load, reference_linear, reference_round_robin
from servelab.model.expert_routing import reference_top_k

# (tokens, experts, top_k): odd expert counts, top-k 1 and 3, a single token
ROUTING_CASES = [(1, 5, 1), (7, 6, 2), (33, 9, 3), (16, 12, 4), (5, 3, 3)]
# (experts, ranks, redundant)
PLACEMENT_CASES = [(5, 2, 0), (7, 3, 0), (8, 4, 0), (9, 2, 1), (6, 3, 3), (12, 5, 2), (3, 3, 0)]
# The bound a load-aware placement keeps against the best one without replicas
# (greedy heaviest-first reaches 4/3 of it on identical ranks)
LOAD_BOUND = 4 / 3


def _fail(what: str, version: int, seam: str) -> str:
    return f"{what} (expert {seam} contract version {version})"


class ExpertRoutingContract:
    routing: Any = None
    num_groups = 1
    topk_groups = 1

    def _cases(self):
        for tokens, experts, top_k in ROUTING_CASES:
            if experts % self.num_groups or top_k > experts // self.num_groups * self.topk_groups:
                continue
            generator = torch.Generator().manual_seed(tokens * 100 + experts)
            for normalize in (False, True):
                yield torch.randn(tokens, experts, generator=generator) * 2, top_k, normalize

    def test_implements_the_protocol(self):
        assert isinstance(self.routing, ExpertRouting), _fail("implements ExpertRouting", ROUTING_CONTRACT_VERSION,
                                                              "routing")

    def test_chooses_the_reference_experts_and_weights(self):
        for logits, top_k, normalize in self._cases():
            weights, ids = self.routing.select(logits, top_k, normalize)
            assert tuple(ids.shape) == tuple(weights.shape) == (logits.shape[0], top_k), _fail(
                f"weights and ids are [tokens, top_k={top_k}]", ROUTING_CONTRACT_VERSION, "routing")
            ref_weights, ref_ids = reference_top_k(logits, top_k, normalize, self.num_groups, self.topk_groups)
            assert ids.tolist() == ref_ids, _fail(f"the chosen experts (top_k={top_k}, {logits.shape[1]} experts) "
                                                  f"are the reference's, largest first", ROUTING_CONTRACT_VERSION,
                                                  "routing")
            torch.testing.assert_close(weights.double(), torch.tensor(ref_weights, dtype=torch.double),
                                       rtol=1e-5, atol=1e-6,
                                       msg=_fail(f"the weights are the reference's (normalize={normalize})",
                                                 ROUTING_CONTRACT_VERSION, "routing"))

    def test_is_deterministic(self):
        for logits, top_k, normalize in self._cases():
            first, again = self.routing.select(logits, top_k, normalize), self.routing.select(logits, top_k, normalize)
            assert torch.equal(first[1], again[1]) and torch.equal(first[0], again[0]), _fail(
                "the same logits give the same routing", ROUTING_CONTRACT_VERSION, "routing")


class ExpertPlacementContract:
    placement: Any = None

    def _place(self, experts: int, ranks: int, load=None):
        return self.placement.place(experts, ranks, load)

    def _loads(self, experts: int, seed: int) -> list[float]:
        rng = random.Random(seed)
        return [rng.paretovariate(1.2) * 10 for _ in range(experts)]  # skewed, as real routers are

    def test_implements_the_protocol(self):
        assert isinstance(self.placement, ExpertPlacementPolicy), _fail(
            "implements ExpertPlacementPolicy", PLACEMENT_CONTRACT_VERSION, "placement")

    def test_every_expert_is_held_within_capacity_and_never_twice_on_a_rank(self):
        for experts, ranks, _ in PLACEMENT_CASES:
            for load in (None, self._loads(experts, experts * ranks)):
                placed = self._place(experts, ranks, load)
                assert placed.ep_size == ranks and placed.num_experts == experts, _fail(
                    f"a placement over {ranks} ranks of {experts} experts", PLACEMENT_CONTRACT_VERSION, "placement")
                room = capacity(experts, ranks, self.placement.redundant_experts)
                for rank, held in enumerate(placed.ranks):
                    assert len(set(held)) == len(held), _fail(f"rank {rank} holds an expert twice: {held}",
                                                              PLACEMENT_CONTRACT_VERSION, "placement")
                    assert len(held) <= room, _fail(f"rank {rank} holds {len(held)} experts, over its capacity "
                                                    f"{room}", PLACEMENT_CONTRACT_VERSION, "placement")
                    assert all(0 <= e < experts for e in held), _fail(f"rank {rank} holds an unknown expert",
                                                                      PLACEMENT_CONTRACT_VERSION, "placement")
                missing = [e for e in range(experts) if not placed.replicas(e)]
                assert not missing, _fail(f"experts {missing} are held by no rank", PLACEMENT_CONTRACT_VERSION,
                                          "placement")

    def test_is_deterministic(self):
        for experts, ranks, _ in PLACEMENT_CASES:
            load = self._loads(experts, 7)
            assert self._place(experts, ranks, load) == self._place(experts, ranks, list(load)), _fail(
                "the same inputs give the same placement", PLACEMENT_CONTRACT_VERSION, "placement")

    def test_the_named_layouts_are_their_definitions(self):
        reference = {"linear": reference_linear, "round_robin": reference_round_robin}.get(self.placement.name)
        if reference is None:
            return
        for experts, ranks, _ in PLACEMENT_CASES:
            placed = self._place(experts, ranks, self._loads(experts, 1))
            assert [list(held) for held in placed.ranks] == reference(experts, ranks), _fail(
                f"{self.placement.name} places as its definition", PLACEMENT_CONTRACT_VERSION, "placement")

    def test_a_load_aware_placement_balances_measured_load(self):
        """Within LOAD_BOUND of the best placement without replicas (brute force), and never
        busier than `linear` on the same load."""
        if not self.placement.uses_load:
            return
        for seed in range(12):
            experts, ranks = 4 + seed % 4, 2 + seed % 2
            load = self._loads(experts, seed)
            placed = self._place(experts, ranks, load)
            busiest = max(placed.rank_loads(load))
            best = optimal_max_load(load, ranks)
            assert busiest <= LOAD_BOUND * best + 1e-9, _fail(
                f"the busiest rank carries {busiest:.2f}, over {LOAD_BOUND:.2f} x the best placement's {best:.2f} "
                f"(load {[round(x, 2) for x in load]})", PLACEMENT_CONTRACT_VERSION, "placement")
            linear = [list(held) for held in reference_linear(experts, ranks)]
            linear_busiest = max(sum(load[e] for e in held) for held in linear)
            assert busiest <= linear_busiest + 1e-9, _fail(
                "a load-aware placement is never busier than linear's", PLACEMENT_CONTRACT_VERSION, "placement")
