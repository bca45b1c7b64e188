"""AdapterResidencyContract: what a LoRA adapter residency policy (kind `adapter_residency`,
`servelab.contracts.adapter_residency`) must do.

    from servelab.testing import AdapterResidencyContract

    class TestMine(AdapterResidencyContract):
        plugin_name = "mine"           # or: factory = MyResidency

Checked on crafted candidate sets and inside the engine's adapter manager
(servelab.lora_manager.LoRAManager) over step sequences with more adapters than slots,
where every step's adapters must be resident, each in a slot of its own, afterwards.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from servelab.interfaces import AdapterResidencyPolicy, ResidencyContext, ResidentAdapter
from servelab.kit.residency import EVICTS_EACH_ONCE, EVICTS_ONLY_CANDIDATES, FREES_THE_SLOTS
from servelab.lora_manager import LoRAManager
from servelab.lora_request import LoRARequest
from servelab.model.lora_adapter import LoRAAdapter, LoRAModule
from servelab.model.lora_layers import LoRAState
from servelab.testing.contract import PolicyContract, check, exercising

DETERMINISTIC = "adapter residency is deterministic: the same candidates give the same choice"
ORDER_FREE = "the choice does not depend on the order candidates come in"
STEP_RESIDENT = "after placement every adapter a step needs is resident, in a slot of its own"
IMPLEMENTS = "implements AdapterResidencyPolicy"


def candidate_sets(seed: int = 0, count: int = 30) -> list[tuple[list[ResidentAdapter], int]]:
    """Candidate lists with every field varied, and how many slots each eviction needs."""
    rng = random.Random(seed)
    sets = []
    for _ in range(count):
        ids = rng.sample(range(1, 40), rng.randint(1, 8))
        candidates = [ResidentAdapter(lora_id=i, name=f"adapter-{i}", loaded=rng.randint(0, 50),
                                      last_used=rng.randint(50, 100), uses=rng.randint(0, 9),
                                      num_waiting=rng.choice((0, 0, 1, 3)), rank=rng.choice((1, 4, 16)),
                                      nbytes=rng.randint(1, 10) * 1024)
                      for i in ids]
        sets.append((candidates, rng.randint(1, len(candidates))))
    return sets


def tiny_adapter(name: str, path: str, config, max_rank: int) -> LoRAAdapter:
    """A one-module adapter (what the manager's loader returns), no file read."""
    module = LoRAModule(torch.zeros(1, config.hidden_size), torch.zeros(config.hidden_size, 1), 1.0)
    return LoRAAdapter(name, Path(path), {(0, "o_proj"): module})


class AdapterResidencyContract(PolicyContract):
    """Invariants (each failure message starts "invariant violated: <name>"):

    - implements AdapterResidencyPolicy
    - adapter residency evicts only candidates (resident adapters the step does not need)
    - adapter residency names each candidate at most once
    - adapter residency frees exactly the slots asked for
    - adapter residency is deterministic, and the choice does not depend on the order
      candidates come in
    - inside the adapter manager, after placement every adapter a step needs is resident,
      in a slot of its own, whatever steps come (more adapters than slots, waiting queues)
    """

    kind = "adapter_residency"

    def context(self, max_loras: int = 3) -> ResidencyContext:
        return ResidencyContext(max_loras=max_loras, max_cpu_loras=2 * max_loras)

    def test_implements_adapter_residency_policy(self):
        policy = self.make(self.context())
        check(isinstance(policy, AdapterResidencyPolicy), IMPLEMENTS, type(policy).__name__)

    def test_choices_name_candidates_once_and_free_the_slots(self):
        policy = self.make(self.context())
        for candidates, needed in candidate_sets():
            with exercising(EVICTS_ONLY_CANDIDATES):
                chosen = list(policy.choose(list(candidates), needed))
            offered = {c.lora_id for c in candidates}
            stray = [i for i in chosen if i not in offered]
            check(not stray, EVICTS_ONLY_CANDIDATES, f"chose {stray}, candidates {sorted(offered)}")
            check(len(set(chosen)) == len(chosen), EVICTS_EACH_ONCE, f"chose {chosen}")
            check(len(chosen) == needed, FREES_THE_SLOTS, f"asked for {needed}, chose {chosen}")

    def test_choices_are_deterministic_and_order_free(self):
        for index, (candidates, needed) in enumerate(candidate_sets(seed=1)):
            first = list(self.make(self.context()).choose(list(candidates), needed))
            again = list(self.make(self.context()).choose(list(candidates), needed))
            check(first == again, DETERMINISTIC, f"{first} then {again}")
            shuffled = list(candidates)
            random.Random(index).shuffle(shuffled)
            reordered = list(self.make(self.context()).choose(shuffled, needed))
            check(sorted(first) == sorted(reordered), ORDER_FREE, f"{first}, then {reordered} for the same candidates "
                                                                  f"reordered")

    def test_every_step_finds_its_adapters_resident(self):
        """Steps over 7 adapters with 1 to 3 slots, the waiting queue varied."""
        from servelab.model.model_config import ModelConfig

        config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 32, "num_attention_heads": 2,
                                        "num_hidden_layers": 1, "intermediate_size": 8, "rms_norm_eps": 1e-5,
                                        "hidden_size": 24})
        rng = random.Random(7)
        for max_loras in (1, 2, 3):
            state = LoRAState(max_loras)
            manager = LoRAManager(config, state, self.make(self.context(max_loras)), max_cpu_loras=max_loras + 1,
                                  max_lora_rank=8, loader=tiny_adapter)
            for lora_id in range(1, 8):
                manager.register(LoRARequest(f"adapter-{lora_id}", lora_id, f"/adapters/{lora_id}"))
            for _ in range(40):
                step = [rng.choice([0, *range(1, 8)]) for _ in range(rng.randint(1, 5))]
                needed = list(dict.fromkeys(i for i in step if i))[:max_loras]
                step = [i if i in needed or not i else 0 for i in step]
                waiting = {rng.randint(1, 7): rng.randint(1, 3)}
                manager.demand = lambda: (waiting, set(waiting))
                with exercising(STEP_RESIDENT):
                    slots = manager.slots_for(step)
                check(all((slot == -1) == (lora_id == 0) for slot, lora_id in zip(slots, step)), STEP_RESIDENT,
                      f"step {step} got slots {slots}")
                by_adapter = {lora_id: slot for lora_id, slot in zip(step, slots) if lora_id}
                check(len(set(by_adapter.values())) == len(by_adapter), STEP_RESIDENT,
                      f"adapters {sorted(by_adapter)} share slots {by_adapter}")
                for lora_id, slot in by_adapter.items():
                    check(state.slots[slot] == dict(manager.host[lora_id].modules), STEP_RESIDENT,
                          f"slot {slot} does not hold adapter {lora_id}")
