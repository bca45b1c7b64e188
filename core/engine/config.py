"""Engine configuration: a TOML file (or the same as a dict) selecting a model and one
policy of each kind by name, with `section.key=value` overrides.

    [engine]
    model = "builtin:tiny"
    max_num_seqs = 64

    [allocator]
    name = "paged"

    [scheduler]
    name = "continuous"

    [attention]
    name = "cpu-paged"

    [router]                  # used by fleets of replicas (servelab bench --replicas)
    name = "prefix-affinity"

    [logits_processors]
    default = ["my-processor"]   # applied to every request (built-ins are chosen per request)

    [logits_processors.my-processor]   # options of an installed logits processor
    strength = 0.5
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Mapping

import attrs

from servelab.defaults import BLOCK_SIZE, MAX_NUM_SEQS
from servelab.errors import ConfigError
from servelab.expert_placement import PLACEMENT_POLICIES
from servelab.pipeline_chunks import CHUNK_SIZINGS
from servelab.kv_sizing import DTYPE_BYTES, KV_CACHE_DTYPES
from servelab.options import positive_int
from servelab.plugin_types import KINDS, PolicyKind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_MODEL = "builtin:tiny"
DTYPES = tuple(DTYPE_BYTES)
# Read off the policy kinds table (servelab.plugin_types.KINDS):
SELECTABLE_KINDS: tuple[PolicyKind, ...] = tuple(k for k in KINDS.values() if k.selectable)
POLICY_SECTIONS = tuple(k.section for k in SELECTABLE_KINDS)  # sections that choose a policy by name
DEFAULT_POLICIES = {k.section: k.default for k in SELECTABLE_KINDS if k.default is not None and not k.optional}
DEFAULT_ROUTER = KINDS["routers"].default
SECTIONS = ("engine", *POLICY_SECTIONS, *(k.section for k in KINDS.values() if not k.selectable and not k.selected_by),
            "kv_offload")
LOGPROBS_MODES = ("raw", "processed")
WEIGHTS = ("dequantize", "int8", "int4")  # `[engine] weights` (servelab.model.quantized_linear)
QUANTIZED_ACTIVATIONS = ("int8", "float")  # `[engine] quantized_activations` (the same)
_MEMORY_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string like "512MiB" / "1.5GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"[engine] kv_cache_memory must be bytes or a size like '512MiB', got {value!r}")
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _MEMORY_UNITS:
        raise ConfigError(f"[engine] kv_cache_memory must be bytes or a size like '512MiB', got {value!r}")
    return int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])


_positive = positive_int("engine", optional=True)


@attrs.frozen(kw_only=True)
class EngineSection:
    """The `[engine]` section."""

    model: str = DEFAULT_MODEL  # checkpoint directory, or "builtin:<name>"
    dtype: str = "float32"
    # How the paged KV cache stores K and V: "auto" in `dtype`; "int8", "fp8_e4m3" or
    # "fp8_e5m2" one byte an element with a float32 scale per (token, KV head) row, so the
    # same kv_cache_memory holds ~2x (bf16) to ~4x (fp32) the tokens (docs/attention.md).
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = attrs.field(default=None, validator=_positive)  # default: min(model's, 2048)
    max_num_seqs: int = attrs.field(default=MAX_NUM_SEQS, validator=_positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive)  # default: max(2048, max_model_len)
    block_size: int = attrs.field(default=BLOCK_SIZE, validator=_positive)
    kv_cache_memory: int = attrs.field(default=512 * 2**20, converter=parse_memory, validator=_positive)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive)  # overrides kv_cache_memory
    seed: int = 0
    # On CPU, pack the decoder's linear weights for oneDNN's matmul kernels at load time
    # (2x+ faster than torch's default here); false keeps torch's default linear.
    prepack_weights: bool = True
    # How the linear layers hold their weights on the CPU: "dequantize" (in `dtype`), or kept
    # as quantized blocks, "int8" (q8_0) or "int4" (q4_1, the LM head q8_0), multiplied by a
    # kernel that widens them as it reads (servelab.model.quantized_linear).
    weights: str = "dequantize"
    # What quantized weights are multiplied by: "int8" (each row of activations quantized per
    # block of 32 to int8, integer dot products: the fast path, as llama.cpp's), or "float"
    # (float32 activations, the blocks widened to float32: exactly the dequantized model's math).
    quantized_activations: str = "int8"
    # On CPU, how many compiled oneDNN kernels (and torch's oneDNN computations) stay cached:
    # one per linear shape and row count, ~0.4-1 MiB of generated code each; an evicted one
    # is rebuilt in ~0.25 ms when its row count comes back (servelab.model.onednn_caches).
    onednn_cache_capacity: int = attrs.field(default=48, validator=_positive)
    # What logprobs report: "raw" (the model's log-softmax, before any logits processor, as
    # vLLM's default) or "processed" (after the request's logits processors, before temperature).
    logprobs_mode: str = "raw"
    max_logprobs: int = attrs.field(default=20, validator=_positive)  # most alternatives a request may ask for
    # Ranks the model is sharded over (Megatron-style tensor parallelism; see README,
    # "Parallelism"); a rank that dies or hangs stops the engine after this many seconds.
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    tensor_parallel_timeout_s: int = attrs.field(default=120, validator=_positive)
    # Ranks a mixture-of-experts model's experts are spread over (docs/parallelism.md; the
    # rest of the model is replicated on each), placed by `expert_placement` (linear,
    # round_robin, balanced: servelab.expert_placement) with `redundant_experts` extra
    # replicas of hot experts, re-placed from measured load every `expert_rebalance_steps`
    # steps (0: never).
    expert_parallel_size: int = attrs.field(default=1, validator=_positive)
    expert_placement: str = "linear"
    redundant_experts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    expert_rebalance_steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # Stages the decoder's layers are split over, one rank each (docs/parallelism.md), and
    # the micro-batches a step's rows are cut into to keep them busy (0: one per stage).
    pipeline_parallel_size: int = attrs.field(default=1, validator=_positive)
    pipeline_micro_batches: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # Batches the engine keeps down the pipeline at once: it plans the next batch (of other
    # sequences) while earlier ones run (0: one per stage; 1: one batch, each step waits
    # for its own).
    pipeline_batches_in_flight: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    # How a step's rows are cut into those micro-batches (servelab.pipeline_chunks): "fixed"
    # (equal row counts) or "equal_time" (about equal FLOPs: a long prompt's later rows,
    # attending to more positions, get smaller pieces).
    pipeline_chunk_sizing: str = "fixed"
    # LoRA adapters (docs/lora.md): requests name one (LoRARequest); `max_loras` adapters sit
    # in the fast pool the forward pass reads, `max_cpu_loras` in host memory (the pool's
    # included; default: max_loras), the rest on disk. A batch runs at most
    # `max_loras_per_batch` adapters (default: max_loras). `[adapter_residency]` chooses
    # which pool adapters make room.
    enable_lora: bool = False
    max_loras: int = attrs.field(default=4, validator=_positive)
    max_cpu_loras: int | None = attrs.field(default=None, validator=_positive)
    max_lora_rank: int = attrs.field(default=64, validator=_positive)
    max_loras_per_batch: int | None = attrs.field(default=None, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"[engine] logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                              f"got {self.logprobs_mode!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"[engine] kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"[engine] dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"[engine] weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ConfigError(f"[engine] quantized_activations must be one of {', '.join(QUANTIZED_ACTIVATIONS)}, "
                              f"got {self.quantized_activations!r}")
        if self.weights != "dequantize" and self.device != "cpu":
            raise ConfigError(f"[engine] weights = {self.weights!r} runs on the CPU only (device is "
                              f"{self.device!r}); use weights = \"dequantize\" there")
        if self.weights != "dequantize" and self.tensor_parallel_size > 1:
            raise ConfigError(f"[engine] weights = {self.weights!r} is not sharded over ranks yet; "
                              f"tensor_parallel_size > 1 takes weights = \"dequantize\"")
        if self.pipeline_chunk_sizing not in CHUNK_SIZINGS:
            raise ConfigError(f"[engine] pipeline_chunk_sizing must be one of {', '.join(CHUNK_SIZINGS)}, "
                              f"got {self.pipeline_chunk_sizing!r}")
        if self.expert_placement not in PLACEMENT_POLICIES:
            raise ConfigError(f"[engine] expert_placement must be one of {', '.join(PLACEMENT_POLICIES)}, "
                              f"got {self.expert_placement!r}")
        parallel = [name for name, size in (("tensor_parallel_size", self.tensor_parallel_size),
                                            ("expert_parallel_size", self.expert_parallel_size),
                                            ("pipeline_parallel_size", self.pipeline_parallel_size)) if size > 1]
        if parallel == ["tensor_parallel_size", "expert_parallel_size"]:
            if self.tensor_parallel_size != self.expert_parallel_size:
                raise ConfigError(f"[engine] tensor_parallel_size={self.tensor_parallel_size} and "
                                  f"expert_parallel_size={self.expert_parallel_size} combine only when equal: the "
                                  f"same ranks split the attention heads and hold the experts")
        elif len(parallel) > 1 and parallel != ["tensor_parallel_size", "pipeline_parallel_size"]:
            raise ConfigError(f"[engine] {' and '.join(parallel)} > 1 do not combine yet; choose one "
                              f"(tensor_parallel_size combines with pipeline_parallel_size, or equals "
                              f"expert_parallel_size)")
        if self.max_loras_per_batch is not None and self.max_loras_per_batch > self.max_loras:
            raise ConfigError(f"[engine] max_loras_per_batch ({self.max_loras_per_batch}) cannot exceed max_loras "
                              f"({self.max_loras}): a batch's adapters must all fit the fast pool")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError(f"[engine] model must be a checkpoint path or builtin:<name>, got {self.model!r}")


def _host_memory(value: int | str) -> int:
    try:
        return parse_memory(value) if value != 0 else 0
    except ConfigError:
        raise ConfigError(f"[kv_offload] host_memory must be bytes or a size like '4GiB', got {value!r}") from None


_non_negative = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class KVOffloadSection:
    """The `[kv_offload]` section: the host KV tier below the device pool (off by default).

    Its size is `host_blocks` blocks of the device pool's block size, or `host_memory`
    bytes (divided like `kv_cache_memory`); `path` memory-maps it from a file instead of
    anonymous host memory. Blocks a prefix cache evicts go down to it, and swap
    preemption (`[scheduler] preemption_mode = "swap"`) keeps victims' KV there."""

    host_blocks: int = attrs.field(default=0)
    host_memory: int = attrs.field(default=0, converter=_host_memory)
    path: str = ""

    def __attrs_post_init__(self) -> None:
        if isinstance(self.host_blocks, bool) or not isinstance(self.host_blocks, int) or self.host_blocks < 0:
            raise ConfigError(f"[kv_offload] host_blocks must be a non-negative integer, got {self.host_blocks!r}")
        if self.host_blocks and self.host_memory:
            raise ConfigError("[kv_offload] takes host_blocks or host_memory, not both")
        if not isinstance(self.path, str):
            raise ConfigError(f"[kv_offload] path must be a file path, got {self.path!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_blocks or self.host_memory)


@attrs.frozen
class PolicySection:
    """A section choosing one policy of its kind: `[allocator]`, `[scheduler]`, ..."""

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)


@attrs.frozen
class LogitsProcessorsSection:
    """The `[logits_processors]` section: processors every request uses, and options per
    processor name (a sub-table each)."""

    default: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    options: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, converter=dict)


def _policy_field(kind: PolicyKind) -> Any:
    if kind.optional:
        return attrs.field(default=None)
    return attrs.field(factory=lambda: PolicySection(kind.default))


@attrs.frozen(kw_only=True, these={
    "engine": attrs.field(factory=EngineSection),
    **{kind.section: _policy_field(kind) for kind in SELECTABLE_KINDS},
    "logits_processors": attrs.field(factory=LogitsProcessorsSection),
    "kv_offload": attrs.field(factory=KVOffloadSection),
})
class EngineConfig:
    """The whole configuration. Build with `from_toml`, `from_dict` or `load`.

    Attributes: `engine` (an EngineSection); one PolicySection per policy kind a config
    selects, named by its section (`allocator`, `scheduler`, `drafter`, `attention`,
    `router`: the rows of servelab.plugin_types.KINDS), which holds the kind's default
    policy, or None for an optional kind the config leaves out (`drafter`: none;
    `router`: fleets use DEFAULT_ROUTER); `logits_processors` (a LogitsProcessorsSection).
    """

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a table of sections, got {type(data).__name__}")
        unknown = set(data) - set(SECTIONS)
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {', '.join(sorted(map(repr, unknown)))}; "
                f"valid sections: {', '.join(SECTIONS)}"
            )
        kwargs: dict[str, Any] = {"engine": _engine_section(data.get("engine", {}))}
        for section in POLICY_SECTIONS:
            if section in data:
                kwargs[section] = _policy_section(section, data[section])
        if "logits_processors" in data:
            kwargs["logits_processors"] = _processors_section(data["logits_processors"])
        if "kv_offload" in data:
            kwargs["kv_offload"] = _kv_offload_section(data["kv_offload"])
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> "EngineConfig":
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, config: "EngineConfig | Mapping[str, Any] | str | Path | None") -> "EngineConfig":
        """Accept an EngineConfig, a dict, a TOML path, or None (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if isinstance(config, (str, Path)):
            return cls.from_toml(config)
        raise ConfigError(f"config must be a path, dict or EngineConfig, got {type(config).__name__}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"engine": attrs.asdict(self.engine)}
        for section in POLICY_SECTIONS:
            policy = getattr(self, section)
            if policy is not None:
                data[section] = {"name": policy.name, **policy.options}
        processors = self.logits_processors
        if processors.default or processors.options:
            data["logits_processors"] = {"default": list(processors.default),
                                         **{name: dict(options) for name, options in processors.options.items()}}
        if self.kv_offload.enabled:
            data["kv_offload"] = attrs.asdict(self.kv_offload)
        return data

    def with_overrides(self, overrides: Mapping[str, Any]) -> "EngineConfig":
        """Apply {"section.key": value} (or {"key": value} for [engine]) overrides."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            section, _, key = dotted.rpartition(".")
            section = section or "engine"
            if section == "logits_processors" or section.startswith("logits_processors."):
                _set_dotted(data, section.split(".") + [key], value)
                continue
            if section not in ("engine", *POLICY_SECTIONS, "kv_offload"):
                raise ConfigError(
                    f"override {dotted!r} names unknown section {section!r}; "
                    f"valid sections: engine, {', '.join(POLICY_SECTIONS)}, kv_offload"
                )
            if section == "kv_offload":
                data.setdefault(section, {})[key] = value
                continue
            if section != "engine" and section not in data and key != "name":
                raise ConfigError(f"override {dotted!r}: set {section}.name first to choose a {section}")
            data.setdefault(section, {})[key] = value
        return EngineConfig.from_dict(data)

    def with_set_options(self, assignments: list[str]) -> "EngineConfig":
        """Apply command-line `section.key=value` strings (values parsed as TOML)."""
        return self.with_overrides(dict(parse_assignment(a) for a in assignments))


def parse_assignment(assignment: str) -> tuple[str, Any]:
    """'engine.max_num_seqs=8' -> ('engine.max_num_seqs', 8); non-TOML values stay strings."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects section.key=value, got {assignment!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def _engine_section(data: Any) -> EngineSection:
    if not isinstance(data, Mapping):
        raise ConfigError("[engine] must be a table")
    valid = [f.name for f in attrs.fields(EngineSection)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key [engine] {unknown[0]!r}; valid keys: {', '.join(valid)}")
    types = {"model": str, "dtype": str, "device": str, "seed": int, "logprobs_mode": str, "weights": str}
    for key, expected in types.items():
        if key in data and (not isinstance(data[key], expected) or isinstance(data[key], bool)):
            raise ConfigError(f"[engine] {key} must be a {expected.__name__}, got {data[key]!r}")
    if "prepack_weights" in data and not isinstance(data["prepack_weights"], bool):
        raise ConfigError(f"[engine] prepack_weights must be true or false, got {data['prepack_weights']!r}")
    return EngineSection(**data)


def _kv_offload_section(data: Any) -> KVOffloadSection:
    if not isinstance(data, Mapping):
        raise ConfigError("[kv_offload] must be a table")
    valid = [f.name for f in attrs.fields(KVOffloadSection)]
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"unknown key [kv_offload] {unknown[0]!r}; valid keys: {', '.join(valid)}")
    return KVOffloadSection(**data)


def _set_dotted(data: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        data = data.setdefault(key, {})
    data[keys[-1]] = value


def _processors_section(data: Any) -> LogitsProcessorsSection:
    if not isinstance(data, Mapping):
        raise ConfigError("[logits_processors] must be a table")
    options = dict(data)
    default = options.pop("default", [])
    if isinstance(default, str):
        default = [default]
    if not isinstance(default, (list, tuple)) or not all(isinstance(name, str) and name for name in default):
        raise ConfigError(f"[logits_processors] default must be a list of processor names, got {default!r}")
    for name, table in options.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"[logits_processors] {name!r} must be a table of options for the processor "
                              f"{name!r} (or 'default', the list of processors every request uses)")
    return LogitsProcessorsSection(tuple(default), options)


def _policy_section(section: str, data: Any) -> PolicySection:
    if isinstance(data, str):
        return PolicySection(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{section}] must be a table with a name")
    options = dict(data)
    name = options.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"[{section}] needs name = \"...\" naming the {section} to use")
    return PolicySection(name, options)


def build_options(options_class: type, values: Mapping[str, Any], section: str, policy: str) -> Any:
    """Instantiate a plugin's attrs options class from config values, naming bad keys."""
    fields = attrs.fields(options_class)
    try:
        attrs.resolve_types(options_class)
    except Exception:  # unresolvable annotations: fall back to the class's own validators
        pass
    valid = [f.name for f in fields]
    for key, value in values.items():
        if key not in valid:
            listing = ", ".join(valid) if valid else "none"
            raise ConfigError(f"unknown option [{section}] {key!r} for {section} {policy!r}; valid options: {listing}")
        expected = next(f.type for f in fields if f.name == key)
        if expected in (int, float, str, bool) and not _is_instance(value, expected):
            raise ConfigError(f"[{section}] {key} must be a {expected.__name__}, got {value!r}")
    try:
        return options_class(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[{section}] invalid options for {section} {policy!r}: {exc}") from None


def _is_instance(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, expected) and not isinstance(value, bool)
