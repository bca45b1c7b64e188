"""What one engine step costs on a simulated accelerator, kernel class by kernel class.

A step runs, in order, the decoder's GEMMs over every scheduled token, attention
(prefill attention over each new chunk's causal context, decode attention over each
decoding sequence's whole KV), the fused elementwise kernels (norms, rotary, SiLU, the
KV-cache write), the LM head over the sampled rows and sampling over the vocabulary.
Kernels run one after another, so their times add; each kernel class is its own
roofline, max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth), where GEMMs lose
efficiency at small row counts (tile and wave quantisation). A prefill mixed into a
decode step therefore lengthens the step every decode in it waits for: that is the
interference of mixed batches. LoRA adapters add their shrink and expand (every adapter's
weights read once a step, a multiply-add per weight and row). On top, the host pays a fixed overhead every step and,
unless a decode-only step replays a CUDA graph, the launch of every kernel, which the
device's work hides once it is longer.

Under tensor parallelism every figure is one device's, its shard as
servelab.model.shard_layout splits the model, plus the collectives that join the
devices over a named interconnect (hardware.INTERCONNECTS): an all-reduce of the
activations after the embedding and after each layer's two row-parallel projections,
and the LM head's logits gathered to the device that samples.

Profiles with fitted `terms` (the calibrated CPU) add up per-step, per-sequence,
per-FLOP and per-byte terms instead (see hardware.StepTerms), the form `servelab bench
--calibrate` fits: on a CPU the engine's own work per sequence is a large part of a
step, and nothing overlaps."""

from __future__ import annotations

from typing import Sequence as Seq

import attrs

from servelab.bench.sim.hardware import GIB, Accelerator, Interconnect, interconnect
from servelab.bench.sim.shapes import num_parameters
from servelab.model.shard_layout import check_shardable, local_model_config
from servelab.errors import ConfigError
from servelab.kv_sizing import DTYPE_BYTES, kv_pool_blocks
from servelab.model.model_config import ModelConfig

KV_MEMORY_FRACTION = 0.9  # of the memory left after weights and runtime: TensorRT-LLM's and vLLM's default
KERNELS_PER_LAYER = 12  # norms, QKV, rotary, cache write, attention, O, add+norm, gate/up, SiLU, down, ...
KERNELS_PER_STEP = 8  # embedding, final norm, LM head, sampling
LOGIT_PASSES = 3  # fp32 logits written by the LM head, read by the softmax/argmax and by the sampler
# LoRA: a shrink and an expand over every adapter's rows (Punica's SGMV) for each of a
# layer's four wrapped linears (qkv, o, gate_up, down); adapters held in float32
LORA_KERNELS_PER_LAYER = 8
ADAPTER_BYTES_PER_PARAMETER = 4


def lora_work(adapters: Seq[tuple[int, int, int]]) -> tuple[float, float, float]:
    """Prompt-row FLOPs, decode-row FLOPs and bytes of a step's LoRA updates, adapters given
    as (prompt rows, decode rows, parameters): each adapter's weights read once, and a
    multiply-add per weight for each of its rows (shrink x A^T and expand B)."""
    return (2.0 * sum(prompt * parameters for prompt, _, parameters in adapters),
            2.0 * sum(decode * parameters for _, decode, parameters in adapters),
            float(ADAPTER_BYTES_PER_PARAMETER * sum(parameters for _, _, parameters in adapters)))


@attrs.frozen
class StepCost:
    flops: float
    bytes: float
    seconds: float
    kernel_seconds: dict[str, float] = attrs.field(factory=dict, eq=False)  # device time per kernel class


class CostModel:
    """Step costs of one model shape on one accelerator, and the KV pool it leaves."""

    def __init__(self, shape: ModelConfig, hardware: Accelerator, dtype_bytes: int = DTYPE_BYTES["bfloat16"],
                 tensor_parallel: int = 1, link: Interconnect | None = None,
                 memory_utilization: float = KV_MEMORY_FRACTION, kv_cache_dtype: str = "auto") -> None:
        """`memory_utilization` is the share of the memory weights and runtime leave that
        the KV pool takes; `link` joins the `tensor_parallel` devices (default: the
        accelerator's interconnect); `kv_cache_dtype` (`[engine] kv_cache_dtype`) sizes a KV
        row: the model's dtype, or one byte an element and its scale, which the pool holds
        more of and decode attention reads fewer bytes of (dequantization is taken to be
        fused into the attention kernel, at no extra time)."""
        if shape.moe is not None:  # num_parameters counts one MLP a layer: experts would go unpriced
            raise ConfigError(f"the step cost model prices dense decoders, and this {shape.model_type} shape is a "
                              f"mixture of experts: `servelab size` prices its layouts (docs/parallelism.md, "
                              f"\"Sizing EP and PP layouts\")")
        _check_tensor_parallel(shape, hardware, tensor_parallel)
        if not 0 < memory_utilization <= 1:
            raise ConfigError(f"memory utilisation must be in (0, 1], got {memory_utilization}")
        self.shape = shape
        self.hardware = hardware
        self.dtype_bytes = dtype_bytes
        self.memory_utilization = memory_utilization
        # Under tensor parallelism every figure below is one device's: its shard of the
        # heads, the MLP and the vocabulary (servelab.model.shard_layout), whose kernels run
        # in lockstep with the others', plus the collectives that join them.
        self.tensor_parallel = tensor_parallel
        self.link = link or interconnect(hardware.interconnect)
        local = local_model_config(shape, tensor_parallel)
        self.layer_params, self.head_params = num_parameters(local)
        self.weight_bytes = (self.layer_params + self.head_params) * dtype_bytes  # read every step
        embedding = 0 if shape.tie_word_embeddings else local.vocab_size * shape.hidden_size
        self.resident_weight_bytes = self.weight_bytes + embedding * dtype_bytes  # held in memory
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_bytes_per_token = local.kv_bytes_per_token(dtype_bytes, kv_cache_dtype)
        self.attention_width = shape.num_layers * local.num_heads * shape.head_dim  # q.k and p.v per layer
        self.elementwise_bytes_per_token = _elementwise_bytes_per_token(local, dtype_bytes)
        collectives = 2 * shape.num_layers + 2 if tensor_parallel > 1 else 0
        self.num_kernels = shape.num_layers * KERNELS_PER_LAYER + KERNELS_PER_STEP + collectives

    def step(self, query_lens: list[int], context_lens: list[int], num_sampled: int,
             adapters: Seq[tuple[int, int, int]] = ()) -> StepCost:
        """The cost of one step: `query_lens[i]` new tokens of a sequence whose context
        (those tokens included) is `context_lens[i]`; `num_sampled` rows are sampled;
        `adapters`: (prompt rows, decode rows, parameters) of each LoRA adapter the step runs."""
        num_tokens = sum(query_lens)
        flops, nbytes = self._work(query_lens, context_lens, num_tokens, num_sampled)
        prompt_flops, decode_flops, lora_bytes = lora_work(adapters)
        lora_flops = prompt_flops + decode_flops
        total_flops, total_bytes = sum(flops.values()) + lora_flops, sum(nbytes.values()) + lora_bytes
        hw = self.hardware
        if hw.terms is not None:  # one process on one device: no collectives (_check_tensor_parallel)
            features = self.features(query_lens, context_lens, num_sampled, (flops, nbytes))
            # step_overhead_s: the work between steps a served run adds; admission_s: admitting each
            # request whose prompt starts in this step (latency_check fits both)
            new_prompts = sum(1 for q, c in zip(query_lens, context_lens) if c == q)
            # LoRA's shrink and expand at the rates the fit gives prompt and decode GEMMs,
            # streaming the adapters' weights at the rate it gives decode attention's KV
            lora = (prompt_flops * hw.terms.prefill_gemm_flop_s + decode_flops * hw.terms.decode_gemm_flop_s
                    + lora_bytes * hw.terms.decode_kv_byte_s)
            return StepCost(total_flops, total_bytes,
                            hw.terms.seconds(features) + hw.step_overhead_s + hw.admission_s * new_prompts + lora)
        kernels = self._kernel_seconds(flops, nbytes, num_tokens, num_sampled)
        num_kernels = self.num_kernels
        if adapters:
            rows = sum(prompt + decode for prompt, decode, _ in adapters)
            kernels["lora"] = max(lora_flops / self._gemm_flops_per_s(rows),
                                  lora_bytes / (hw.memory_bandwidth * hw.bandwidth_efficiency))
            num_kernels += LORA_KERNELS_PER_LAYER * self.shape.num_layers
        if self.tensor_parallel > 1:
            kernels["communication"] = self._communication_seconds(num_tokens, num_sampled)
        decode_only = num_tokens == len(query_lens)
        launches = 0.0 if hw.cuda_graphs and decode_only else num_kernels * hw.kernel_launch_s
        seconds = hw.step_overhead_s + max(sum(kernels.values()), launches)  # device work hides async launches
        return StepCost(total_flops, total_bytes, seconds, kernels)

    def features(self, query_lens: list[int], context_lens: list[int], num_sampled: int,
                 work: tuple[dict[str, float], dict[str, float]] | None = None) -> dict[str, float]:
        """The quantities hardware.StepTerms prices (STEP_FEATURES), for one step."""
        num_decode = sum(1 for q in query_lens if q == 1)
        num_tokens = sum(query_lens)
        flops, nbytes = work or self._work(query_lens, context_lens, num_tokens, num_sampled)
        per_token = 2.0 * self.layer_params
        return {"step": 1.0, "sequence": float(len(query_lens)),
                "prefill_gemm_flop": per_token * (num_tokens - num_decode), "decode_gemm_flop": per_token * num_decode,
                "prefill_attention_flop": flops["prefill_attention"], "decode_kv_byte": nbytes["decode_attention"],
                "lm_head_flop": flops["lm_head"]}

    def _work(self, query_lens: list[int], context_lens: list[int], num_tokens: int,
              num_sampled: int) -> tuple[dict[str, float], dict[str, float]]:
        """FLOPs and bytes of each kernel class."""
        decode_context = sum(c for q, c in zip(query_lens, context_lens) if q == 1)
        # Each prefill token attends to the context up to itself: q_len * (ctx - (q_len - 1) / 2) keys.
        prefill_attended = sum(q * (c - (q - 1) / 2) for q, c in zip(query_lens, context_lens) if q > 1)
        prefill_context = sum(c for q, c in zip(query_lens, context_lens) if q > 1)
        kv = self.kv_bytes_per_token
        flops = {"gemm": 2.0 * self.layer_params * num_tokens, "lm_head": 2.0 * self.head_params * num_sampled,
                 "prefill_attention": 4.0 * self.attention_width * prefill_attended,
                 "decode_attention": 4.0 * self.attention_width * decode_context}
        nbytes = {"gemm": self.layer_params * self.dtype_bytes if num_tokens else 0.0,
                  "lm_head": self.head_params * self.dtype_bytes if num_sampled else 0.0,
                  "prefill_attention": kv * prefill_context, "decode_attention": kv * decode_context,
                  "elementwise": (self.elementwise_bytes_per_token + kv) * num_tokens,
                  "sampling": LOGIT_PASSES * 4.0 * self.shape.vocab_size * num_sampled}
        return flops, nbytes

    def _kernel_seconds(self, flops: dict[str, float], nbytes: dict[str, float], num_tokens: int,
                        num_sampled: int) -> dict[str, float]:
        hw = self.hardware
        bandwidth = hw.memory_bandwidth * hw.bandwidth_efficiency
        attention = hw.peak_flops * hw.prefill_attention_efficiency
        kv_bandwidth = hw.memory_bandwidth * hw.kv_read_efficiency
        prefill, decode = "prefill_attention", "decode_attention"
        return {
            "gemm": max(flops["gemm"] / self._gemm_flops_per_s(num_tokens), nbytes["gemm"] / bandwidth),
            "lm_head": max(flops["lm_head"] / self._gemm_flops_per_s(num_sampled), nbytes["lm_head"] / bandwidth),
            prefill: max(flops[prefill] / attention, nbytes[prefill] / kv_bandwidth),
            decode: max(flops[decode] / attention, nbytes[decode] / kv_bandwidth),
            "elementwise": nbytes["elementwise"] / bandwidth,
            "sampling": nbytes["sampling"] / bandwidth,
        }

    def _communication_seconds(self, num_tokens: int, num_sampled: int) -> float:
        """Tensor parallelism's collectives: an all-reduce of the activations after the
        embedding and after each layer's two row-parallel projections, and the LM head's
        float32 logits columns gathered to the device that samples."""
        size = self.tensor_parallel
        if size <= 1 or not num_tokens:
            return 0.0
        activations = num_tokens * self.shape.hidden_size * self.dtype_bytes
        num_all_reduces = 2 * self.shape.num_layers + 1
        seconds = num_all_reduces * self.link.all_reduce_seconds(activations, size)
        if num_sampled:
            seconds += self.link.gather_seconds(num_sampled * 4.0 * self.head_params / self.shape.hidden_size, size)
        return seconds

    def _gemm_flops_per_s(self, rows: int) -> float:
        """Achieved GEMM FLOP/s with `rows` rows: the large-M efficiency, halved at gemm_half_tokens."""
        hw = self.hardware
        return hw.peak_flops * hw.compute_efficiency * rows / (rows + hw.gemm_half_tokens) if rows else 1.0

    def kv_pool_bytes(self) -> float:
        """KV memory as engines size it: a fraction of what weights and the runtime leave."""
        free = self.hardware.memory_bytes - self.hardware.reserved_bytes - self.resident_weight_bytes
        return self.memory_utilization * free

    def kv_blocks(self, block_size: int) -> int:
        """Blocks of `block_size` tokens the KV pool holds; a ConfigError when none fit."""
        blocks = kv_pool_blocks(self.kv_pool_bytes(), self.kv_bytes_per_token, block_size)
        if blocks < 1:
            hw, weights = self.hardware, self.resident_weight_bytes
            # the fewest devices whose shares leave room for KV
            devices = weights * self.tensor_parallel // (hw.memory_bytes - hw.reserved_bytes) + 1
            raise ConfigError(
                f"the model's weights ({weights / GIB:.1f} GiB a device at {self.dtype_bytes} bytes a parameter, "
                f"tensor_parallel_size={self.tensor_parallel}) leave no room for a KV cache on a {hw.name} "
                f"({hw.memory_bytes / GIB:.0f} GiB, {hw.reserved_bytes / GIB:.0f} GiB of it for the runtime); "
                f"serving it takes tensor parallelism over {devices:.0f} or more devices "
                f"(`--set engine.tensor_parallel_size=N`; `servelab size --tp N`), a smaller model shape or an "
                f"accelerator with more memory")
        return blocks


def _check_tensor_parallel(shape: ModelConfig, hardware: Accelerator, size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int):
        raise ConfigError(f"tensor parallelism must be a positive integer, got {size!r}")
    check_shardable(shape, size)
    if size > 1 and not hardware.per_kernel:
        raise ConfigError(f"{hardware.name} is priced by step terms fitted to one process and has no interconnect "
                          f"between devices: simulate tensor parallelism on a GPU profile (h100, h200, a100, l4)")


def _elementwise_bytes_per_token(shape: ModelConfig, dtype_bytes: int) -> float:
    """Activation bytes the fused elementwise kernels move per token over all layers (of
    one device's shard under tensor parallelism): add+RMSNorm twice (read input and
    residual, write both; every device holds the whole hidden state), rotary on q and k
    (read and write), SiLU-and-multiply (read gate and up, write their product)."""
    q = shape.num_heads * shape.head_dim
    k = shape.num_kv_heads * shape.head_dim
    per_layer = 2 * 4 * shape.hidden_size + 2 * (q + k) + 3 * shape.intermediate_size
    return shape.num_layers * per_layer * dtype_bytes
