"""Options classes of the built-in attention backends (importable without torch)."""

import attrs

from servelab.errors import ConfigError
from servelab.options import boolean, non_negative_int, number_at_least, one_of, positive_int

_positive = positive_int("attention")


def _true_false_or_auto(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not (isinstance(value, bool) or value == "auto"):
        raise ConfigError(f"[attention] {attribute.name} must be true, false or \"auto\", got {value!r}")


@attrs.frozen
class TorchPagedOptions:
    """How `torch-paged` groups a step's sequences: bigger groups mean fewer calls, smaller
    ones less padding and a gathered K/V that stays in the CPU's cache."""

    decode_group_size: int = attrs.field(default=64, validator=_positive)  # sequences per decode group, at most
    # Padded context tokens per decode group, at most (a longer sequence sits alone). The
    # gathered K and V of a group take tokens * kv_heads * head_dim * 2 * dtype size bytes.
    decode_group_tokens: int = attrs.field(default=2048, validator=_positive)
    prefill_group_size: int = attrs.field(default=16, validator=_positive)  # per multi-token group, at most
    # A multi-token group's padded query x context area stays within this factor of the
    # area its sequences need, and within prefill_group_area (query x context pairs).
    prefill_padding: float = attrs.field(default=1.25, validator=number_at_least("attention", 1.0))
    prefill_group_area: int = attrs.field(default=1 << 20, validator=_positive)


@attrs.frozen
class CupyPagedOptions:
    """Split-K in `cupy-paged`: a long context is cut into partitions of `partition_size`
    keys attended by separate CUDA blocks, then merged. "auto" splits only when a step has
    too few (sequence, KV head) blocks to fill the GPU; "always" and "never" force it."""

    partition_size: int = attrs.field(default=512, validator=_positive)  # keys per partition
    split_k: str = attrs.field(default="auto", validator=one_of("attention", ("auto", "always", "never")))


@attrs.frozen
class CpuPagedOptions:
    """`cpu-paged`: which rows the C++ kernel attends, and when its build happens.

    build: "cached" (default) uses the kernels from the first step when this machine's cache
    already holds them, and otherwise serves the whole run on the torch-paged path (never
    switching mid-run) and builds them for the next start when the process exits (or
    after a minute of serving), at the lowest CPU priority and paused while other work is
    busy; "background" builds right away (the same way) and switches to the kernels at the
    first step after the build lands; "wait" blocks the engine's start until the kernels
    are built (or fail); "never" always takes the torch-paged path (for comparisons).
    layer_ops: the model runs its norms, rotary and SiLU-and-multiply on the library's
    fused ops once it is ready (false: torch's ops). native_decoder: with layer_ops, a step
    whose every row the kernel attends runs the whole decoder in one native call (false:
    the model's Python loop over layers; the results are identical). panel_linears: once
    the library is ready, the model's linear layers (float32 and bfloat16, packed for
    oneDNN or, where it packs no bfloat16, plain) move to its own matmul, weights repacked
    and the other copy freed; "auto" (the default) moves float32 layers always and
    bfloat16 ones unless oneDNN computes bfloat16 on AMX tiles here (then they stay on
    oneDNN, several times faster for batches); true moves every dtype the library takes,
    false none (they stay on oneDNN or torch's linear). native_experts: once a MoE model's
    experts sit on the library's panels, each sparse block runs its routed experts in one
    native call (false: servelab.model.moe.grouped_experts over the same panels; the results
    are identical). The prefill_* options are
    torch-paged's, for the rows longer than max_kernel_query_len (0, the default: the kernel
    attends every row, prompts on its tiled path; a positive limit sends longer rows to
    torch-paged's scaled_dot_product_attention, and such steps to the Python loop).
    """

    max_kernel_query_len: int = attrs.field(default=0, validator=non_negative_int("attention"))
    build: str = attrs.field(default="cached",
                             validator=one_of("attention", ("cached", "background", "wait", "never")))
    layer_ops: bool = attrs.field(default=True, validator=boolean("attention"))
    native_decoder: bool = attrs.field(default=True, validator=boolean("attention"))
    panel_linears: bool | str = attrs.field(default="auto", validator=_true_false_or_auto)
    native_experts: bool = attrs.field(default=True, validator=boolean("attention"))
    prefill_group_size: int = attrs.field(default=16, validator=_positive)
    prefill_padding: float = attrs.field(default=1.25, validator=number_at_least("attention", 1.0))
    prefill_group_area: int = attrs.field(default=1 << 20, validator=_positive)
