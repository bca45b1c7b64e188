"""Serving engines as the simulator runs them: a device profile prices the kernels, an
engine model adds what the engine around them does.

The GPU profiles (hardware.ACCELERATORS) were fitted to TensorRT-LLM: a C++ runtime
whose host work is a fixed 1.5 ms a step, decodes first, prefills mixed into decode
steps. The Python engines people compare against schedule differently and spend host
time that grows with the batch, so a published figure of theirs is reproduced with the
device's kernels and the engine's own model:

- its scheduler and limits (`config`: max_num_seqs, max_num_batched_tokens, block
  size; `scheduler.name = "prefill-alone"`: a step that admits prompts runs them alone,
  and decodes run `num_scheduler_steps` steps between two looks at the queue,
  servelab.bench.sim.prefill_alone);
- its host work (`HostWork`): per scheduler invocation (building the batch and its
  inputs, which vLLM's multi-step scheduling pays once per run of steps) and per step
  (sampling, output processing and detokenisation that do not overlap the device),
  each a fixed part plus a part per sequence in the step;
- how it streams tokens (`delivers_per_run`: vLLM 0.6.0's multi-step scheduling hands
  a run's tokens out when the run ends, so its ITL is one gap per run).

The engines and the reasoning behind each term are in docs/bench.md, "Published engines
under load"."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import attrs

from servelab.bench.sim.cost_model import CostModel, StepCost
from servelab.bench.sim.source import SimSource
from servelab.errors import ConfigError


@attrs.frozen
class HostWork:
    """Host seconds an engine adds to a step the device runs (no overlap with it).

    `schedule_*` is paid at every scheduler invocation: once per step, or once per run
    of `steps_per_schedule` decode steps (spread evenly over the run's steps);
    `step_*` every step. `*_sequence_s` multiplies the sequences in the step."""

    schedule_s: float = 0.0
    schedule_sequence_s: float = 0.0
    step_s: float = 0.0
    step_sequence_s: float = 0.0

    def seconds(self, num_seqs: int, decode_only: bool, steps_per_schedule: int = 1) -> float:
        schedule = self.schedule_s + self.schedule_sequence_s * num_seqs
        if decode_only:
            schedule /= steps_per_schedule
        return schedule + self.step_s + self.step_sequence_s * num_seqs


@attrs.frozen
class ServingEngineModel:
    """One engine release as configuration of the simulated engine."""

    name: str
    description: str
    config: dict[str, Any]  # `--set` overrides: scheduler and limits
    host: HostWork
    num_scheduler_steps: int = 1
    delivers_per_run: bool = False  # tokens streamed at the end of a run of steps, not each step
    # Seconds from a request's arrival at the server to its scheduler, and from its first
    # token to the client (HTTP, tokenisation, the API server's hops): on TTFT and E2E.
    frontend_s: float = 0.0

    def engine_config(self, max_model_len: int) -> dict[str, Any]:
        return {**self.config, "engine.max_model_len": max_model_len,
                "scheduler.num_scheduler_steps": self.num_scheduler_steps}


class EngineCostModel(CostModel):
    """The device profile's kernels with the engine's host work in place of the
    profile's fixed per-step overhead (TensorRT-LLM's, which the profile was fitted with)."""

    def __init__(self, *args: Any, host: HostWork, steps_per_schedule: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.hardware.per_kernel:
            raise ConfigError(f"engine models price host work on top of a GPU profile's kernels; "
                              f"{self.hardware.name} is priced by fitted step terms")
        self.host = host
        self.steps_per_schedule = steps_per_schedule

    def step(self, query_lens: list[int], context_lens: list[int], num_sampled: int,
             adapters: Seq[tuple[int, int, int]] = ()) -> StepCost:
        cost = super().step(query_lens, context_lens, num_sampled, adapters)
        decode_only = sum(query_lens) == len(query_lens)
        host = self.host.seconds(len(query_lens), decode_only, self.steps_per_schedule)
        seconds = cost.seconds - self.hardware.step_overhead_s + host
        return StepCost(cost.flops, cost.bytes, seconds, {**cost.kernel_seconds, "host": host})


class EngineSimSource(SimSource):
    """A SimSource whose steps are priced as `model`'s engine runs them."""

    def __init__(self, *args: Any, model: ServingEngineModel, **kwargs: Any) -> None:
        self.engine_model = model
        super().__init__(*args, **kwargs)

    def _cost_model(self, tensor_parallel: int, kv_cache_dtype: str) -> CostModel:
        return EngineCostModel(self.model_config, self.hardware, self.dtype_bytes, tensor_parallel=tensor_parallel,
                               link=self.link, memory_utilization=self.memory_utilization,
                               kv_cache_dtype=kv_cache_dtype, host=self.engine_model.host,
                               steps_per_schedule=self.engine_model.num_scheduler_steps)


# vLLM 0.6.0 with `--num-scheduler-steps 10 --max-model-len 4096` (its V0 engine): 256
# sequences, and, with chunked prefill off (its default below 32K of context; multi-step
# scheduling could not chunk in 0.6.0), a token budget of max(max_model_len, 2048). A
# step that admits prompts runs them alone, then the batch decodes 10 steps before the
# scheduler runs again; 16-token blocks, recompute preemption. Its host work: building
# the batch and its inputs per scheduler call, and per step the sampler's and the
# output processor's Python work per sequence.
VLLM_060 = ServingEngineModel(
    name="vllm-0.6.0",
    description="vLLM 0.6.0, --num-scheduler-steps 10: prefill steps alone, 10 decode steps a scheduler call, "
                "256 seqs, 4096 tokens a step",
    config={"engine.max_num_seqs": 256, "engine.max_num_batched_tokens": 4096, "engine.block_size": 16,
            "scheduler.name": "prefill-alone"},
    host=HostWork(schedule_s=3e-3, schedule_sequence_s=140e-6, step_s=1e-3, step_sequence_s=70e-6),
    num_scheduler_steps=10, delivers_per_run=True, frontend_s=15e-3)

# SGLang 0.3.0 with `--enable-torch-compile --disable-radix-cache`: prefill has priority
# (a step that admits prompts runs them alone; mixed chunks are off by default), up to
# 16,384 prompt tokens a prefill step and 8,192 a chunk (prompts here are shorter than
# either), one decode step a loop when outputs stream; no overlap of the CPU scheduler
# with the device yet (that came in 0.4).
SGLANG_030 = ServingEngineModel(
    name="sglang-0.3.0",
    description="SGLang 0.3.0: prefill-priority steps alone, 8192-token chunks, one step a scheduler call",
    config={"engine.max_num_seqs": 4096, "engine.max_num_batched_tokens": 8192, "engine.block_size": 16,
            "scheduler.name": "prefill-alone"},
    host=HostWork(schedule_s=0.5e-3, step_s=1e-3, step_sequence_s=70e-6),
    num_scheduler_steps=1, frontend_s=8e-3)

ENGINE_MODELS = {model.name: model for model in (VLLM_060, SGLANG_030)}


def engine_model(name: str) -> ServingEngineModel:
    try:
        return ENGINE_MODELS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown engine model {name!r}; choose {', '.join(ENGINE_MODELS)}") from None
