"""The simulator's stand-ins for the model runner and the wall clock."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import attrs
import torch

from servelab.bench.sim.cost_model import ADAPTER_BYTES_PER_PARAMETER, CostModel
from servelab.interfaces import KVAllocator, Runner, SlotMovingRunner, StepPlan, TieredRunner, sampling_rows


class VirtualClock:
    """Seconds of simulated time; only the simulated runner moves it forward."""

    def __init__(self) -> None:
        self.now = 0.0
        self.idled = False  # the engine waited for an arrival since the last step (advance_to moved it)
        self.idle_seconds = 0.0  # how long it waited

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, when: float) -> None:
        if when > self.now:
            self.idle_seconds = (self.idle_seconds if self.idled else 0.0) + when - self.now
            self.now = when
            self.idled = True


@attrs.frozen
class SimInputs:
    query_lens: list[int]
    context_lens: list[int]
    sampled_seq_rows: list[int]
    num_logits_rows: list[int]  # per sampled sequence: 1 + its scheduled drafts
    prompt_logits: tuple = ()  # the simulator scores no prompts
    adapters: tuple[tuple[int, int, int], ...] = ()  # (prompt rows, decode rows, parameters) of each adapter run
    adapter_parameters_loaded: int = 0  # parameters of the adapters put into the fast pool for this step


def plan_shape(plan: StepPlan) -> SimInputs:
    """What the cost model needs from a plan: tokens and context per sequence, sampled rows."""
    scheduled = plan.scheduled
    query_lens = [num_new for _, num_new in scheduled]
    context_lens = [seq.num_computed_tokens + num_new for seq, num_new in scheduled]
    sampled, num_rows = sampling_rows(plan)
    return SimInputs(query_lens, context_lens, sampled, num_rows)


class SimRunner(Runner, TieredRunner, SlotMovingRunner):
    """Costs each step with the roofline and returns all-zero logits over a one-token
    vocabulary, so greedy sampling yields token 0 and every policy runs unchanged. Token
    trees run too: the tree's nodes are scheduled tokens the cost model charges, and
    moving the accepted path's K/V slots (`move_slots`) is a few rows within the device's
    memory, not modelled.

    LoRA adapters (`[engine] enable_lora`) run through the engine's own adapter manager and
    residency policy over adapters read as shapes (lora_adapter.adapter_shapes): a step
    pays its adapters' shrink and expand, and first the loads of those its residency
    policy had to put into the fast pool, over the host link; reading an adapter from disk
    moves the clock when the manager reads it (Accelerator.adapter_read_*)."""

    device = torch.device("cpu")
    supports_prompt_logprobs = False
    vocab_size = 1
    lora: Any = None  # the engine's LoRAManager, set by servelab.lora_setup.attach_lora

    def __init__(self, cost_model: CostModel, clock: VirtualClock, block_bytes: float = 0.0,
                 host_link: Any = None, host_memory_bytes: float = 0.0) -> None:
        self.cost_model = cost_model
        self.clock = clock
        self.total_seconds = 0.0
        self.block_bytes = block_bytes  # one KV block, every layer's K and V
        self.host_link = host_link  # Interconnect between the device and the host tier
        self.host_memory_bytes = host_memory_bytes
        self._offload_seconds = 0.0  # this step's offloads, overlapped with its forward
        self.move_seconds = 0.0  # link time the steps waited for, in total
        self._noise = random.Random(0)  # draws of the profile's step residuals: the same every run

    def attach_host_tier(self, num_host_blocks: int, path: str | None) -> None:
        """The host tier costs link time; its capacity must fit the profile's host memory."""
        from servelab.errors import ConfigError

        need = num_host_blocks * self.block_bytes
        if self.host_link is None or need > self.host_memory_bytes:
            raise ConfigError(f"[kv_offload] asks for {need / 2**30:.1f} GiB of host KV tier; this accelerator "
                              f"profile allows {self.host_memory_bytes / 2**30:.1f} GiB: lower host_blocks or "
                              f"host_memory")

    def move_blocks(self, moves: Any) -> None:
        """Loads (host -> device) must land before the step reads them: the step waits for
        them. Offloads copy out while the step computes (asynchronous copies on a GPU);
        only the part longer than the forward delays it."""
        loads = sum(move.kind == "load" for move in moves)
        offloads = sum(move.kind == "offload" for move in moves)
        link = self.host_link
        if loads:
            seconds = link.latency_s + loads * self.block_bytes / link.bus_bandwidth
            self.clock.advance(seconds)
            self.total_seconds += seconds
            self.move_seconds += seconds
        if offloads:
            self._offload_seconds += link.latency_s + offloads * self.block_bytes / link.bus_bandwidth

    @property
    def model_config(self) -> Any:
        return self.cost_model.shape

    def load_adapter(self, name: str, path: str, config: Any, max_rank: int) -> Any:
        """An adapter's shapes, read from its config alone; the clock moves by what reading
        its weights would take (the manager reads on the thread that admits requests)."""
        from servelab.model.lora_adapter import adapter_shapes

        adapter = adapter_shapes(name, path, config, max_rank)
        hardware = self.cost_model.hardware
        seconds = (2 * len(adapter.modules) * hardware.adapter_read_tensor_s
                   + adapter.nbytes / hardware.adapter_read_bandwidth)
        self.clock.advance(seconds)
        self.total_seconds += seconds
        return adapter

    def prepare(self, plan: StepPlan, allocator: KVAllocator, prompt_logprobs: bool = False) -> SimInputs:
        shape = plan_shape(plan)
        lora_ids = [seq.lora_id for seq, _ in plan.scheduled]
        if self.lora is None or not any(lora_ids):
            return shape
        slots = self.lora.slots_for(lora_ids)  # the residency policy places the step's adapters
        prompt_rows: Counter[int] = Counter()
        decode_rows: Counter[int] = Counter()
        for slot, num_new in zip(slots, shape.query_lens):
            if slot >= 0:
                (decode_rows if num_new == 1 else prompt_rows)[slot] += num_new
        used = sorted(set(prompt_rows) | set(decode_rows))
        parameters = {slot: _parameters(self.lora.state.slots[slot]) for slot in used}
        loaded = sum(parameters[self.lora.slot_of[i]] for i in set(lora_ids) - {None, 0}
                     if self.lora.loaded[i] == self.lora.tick)
        return attrs.evolve(shape, adapters=tuple((prompt_rows[slot], decode_rows[slot], parameters[slot])
                                                  for slot in used),
                            adapter_parameters_loaded=loaded)

    def execute(self, inputs: SimInputs) -> torch.Tensor:
        if inputs.adapter_parameters_loaded:  # the adapters must be in the pool before the step reads them
            link = self.host_link
            seconds = link.latency_s + ADAPTER_BYTES_PER_PARAMETER * inputs.adapter_parameters_loaded / link.bus_bandwidth
            self.clock.advance(seconds)
            self.total_seconds += seconds
            self.move_seconds += seconds
        cost = self.cost_model.step(inputs.query_lens, inputs.context_lens, len(inputs.sampled_seq_rows),
                                    inputs.adapters)
        hardware = self.cost_model.hardware
        noise = hardware.step_noise_s
        step_seconds = max(0.0, cost.seconds + self._noise.choice(noise)) if noise else cost.seconds
        if self.clock.idled:  # the first step after a wait pays the profile's wake-up
            step_seconds += hardware.wake_after(self.clock.idle_seconds, self._noise)
            self.clock.idled = False
        seconds = max(step_seconds, self._offload_seconds)
        self.move_seconds += seconds - step_seconds
        self._offload_seconds = 0.0
        self.clock.advance(seconds)
        self.total_seconds += seconds
        return torch.zeros(sum(inputs.num_logits_rows), 1)

    def execute_with_hidden(self, inputs: SimInputs) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("the simulator has no hidden states: drafters that read them cannot be simulated")

    def copy_blocks(self, copies: Any) -> None:
        """Copy-on-write copies cost nothing worth modelling here."""

    def move_slots(self, moves: Any) -> None:
        """An accepted tree path's K/V moving into place: nothing to move, nor worth costing."""

    def close(self) -> None:
        """Nothing to release."""


def _parameters(modules: Any) -> int:
    """Parameters of one adapter in the fast pool (its modules' A and B)."""
    return sum(module.lora_a.numel() + module.lora_b.numel() for module in modules.values())
