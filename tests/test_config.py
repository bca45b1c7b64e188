"""Config composition (TOML, dict, `section.key=value` overrides) and the errors a bad
config gives: each names the offending key, and is raised before the engine starts."""

from __future__ import annotations

import attrs
import pytest

import servelab
from servelab import LLM, ConfigError, EngineConfig, PluginError, PluginRegistry
from servelab.config import PolicySection, parse_assignment
from servelab.engine_setup import resolve_limits
from servelab.model.model_config import ModelConfig
from servelab.plugin_types import AllocatorPlugin

TOML = """
[engine]
model = "some/checkpoint"
dtype = "bfloat16"
max_num_seqs = 8
block_size = 32
kv_cache_memory = "64MiB"

[allocator]
name = "paged"

[scheduler]
name = "continuous"

[drafter]
name = "ngram"
k = 3
"""

DICT = {
    "engine": {"model": "some/checkpoint", "dtype": "bfloat16", "max_num_seqs": 8, "block_size": 32,
               "kv_cache_memory": 64 * 2**20},
    "allocator": {"name": "paged"},
    "scheduler": "continuous",  # a bare name is shorthand for a table with only `name`
    "drafter": {"name": "ngram", "k": 3},
}


def test_toml_file_and_dict_give_the_same_config(tmp_path):
    path = tmp_path / "servelab.toml"
    path.write_text(TOML)
    from_file = EngineConfig.from_toml(path)
    assert from_file == EngineConfig.from_dict(DICT)
    assert EngineConfig.load(str(path)) == EngineConfig.load(path) == EngineConfig.load(DICT) == from_file
    assert from_file.engine.kv_cache_memory == 64 * 2**20
    assert from_file.drafter == PolicySection("ngram", {"k": 3})
    assert from_file.attention.name == "cpu-paged"  # unspecified sections keep their defaults
    assert EngineConfig.from_dict(from_file.to_dict()) == from_file


def test_load_rejects_missing_or_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        EngineConfig.load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine\nmax_num_seqs = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        EngineConfig.load(bad)
    with pytest.raises(ConfigError):
        EngineConfig.load(42)


def test_set_options_parse_values_as_toml():
    config = EngineConfig().with_set_options([
        "engine.max_num_seqs=8", "scheduler.name=continuous", "block_size=32", "engine.model=/ckpt/dir",
        "engine.kv_cache_memory=1GiB", 'engine.device="cuda:1"', "drafter.name=ngram", "drafter.k=4",
    ])
    assert config.engine.max_num_seqs == 8 and config.engine.block_size == 32
    assert config.scheduler.name == "continuous"
    assert config.engine.model == "/ckpt/dir"  # not TOML: stays a string
    assert config.engine.kv_cache_memory == 2**30
    assert config.engine.device == "cuda:1"
    assert config.drafter == PolicySection("ngram", {"k": 4})
    assert parse_assignment("a.b = 2.5") == ("a.b", 2.5)
    assert parse_assignment("a.b=true") == ("a.b", True)
    assert parse_assignment("a.b=[1, 2]") == ("a.b", [1, 2])
    assert EngineConfig().with_set_options([]) == EngineConfig()


@pytest.mark.parametrize("assignment, key", [
    ("engine.max_num_seqs=eight", "max_num_seqs"),
    ("engine.max_num_seqs=0", "max_num_seqs"),
    ("engine.nonsense=1", "nonsense"),
    ("cache.size=1", "cache"),
    ("drafter.k=3", "drafter.name"),  # options for a drafter before choosing one
    ("max_num_seqs", "max_num_seqs"),  # no '='
])
def test_bad_set_options_name_the_key(assignment, key):
    with pytest.raises(ConfigError, match=key):
        EngineConfig().with_set_options([assignment])


@pytest.mark.parametrize("data, key", [
    ({"cache": {}}, "'cache'"),
    ({"engine": {"max_num_seq": 8}}, "'max_num_seq'"),
    ({"engine": {"model": 3}}, "model"),
    ({"engine": {"seed": "zero"}}, "seed"),
    ({"engine": {"dtype": 16}}, "dtype"),
    ({"engine": {"dtype": "float64"}}, "dtype"),
    ({"engine": {"max_num_seqs": 0}}, "max_num_seqs"),
    ({"engine": {"max_num_seqs": True}}, "max_num_seqs"),
    ({"engine": {"block_size": -16}}, "block_size"),
    ({"engine": {"max_model_len": 0}}, "max_model_len"),
    ({"engine": {"max_num_batched_tokens": 1.5}}, "max_num_batched_tokens"),
    ({"engine": {"num_kv_blocks": 0}}, "num_kv_blocks"),
    ({"engine": {"kv_cache_memory": "lots"}}, "kv_cache_memory"),
    ({"engine": {"kv_cache_memory": "12 parsecs"}}, "kv_cache_memory"),
    ({"engine": {"kv_cache_memory": True}}, "kv_cache_memory"),
    ({"engine": {"kv_cache_memory": 0}}, "kv_cache_memory"),
    ({"engine": {"kv_cache_memory": -1}}, "kv_cache_memory"),
    ({"engine": {"kv_cache_memory": "0MiB"}}, "kv_cache_memory"),
    ({"engine": []}, "engine"),
    ({"scheduler": {"max_wait": 3}}, r"\[scheduler\] needs name"),
    ({"allocator": {"name": ""}}, r"\[allocator\] needs name"),
    ({"attention": 7}, r"\[attention\]"),
])
def test_invalid_config_names_the_key(data, key):
    with pytest.raises(ConfigError, match=key):
        EngineConfig.from_dict(data)


def test_unknown_engine_key_lists_valid_keys():
    with pytest.raises(ConfigError) as excinfo:
        EngineConfig.from_dict({"engine": {"max_batch": 4}})
    message = str(excinfo.value)
    assert "'max_batch'" in message
    for valid in ("max_num_seqs", "max_model_len", "kv_cache_memory", "block_size"):
        assert valid in message


def test_memory_sizes():
    sizes = {"512MiB": 512 * 2**20, "1.5GB": 1_500_000_000, "2048": 2048, "4 KiB": 4096}
    for text, expected in sizes.items():
        assert EngineConfig.from_dict({"engine": {"kv_cache_memory": text}}).engine.kv_cache_memory == expected


# ---------------------------------------------------------------- plugin options and names via LLM


@attrs.frozen
class TunedOptions:
    watermark: float = 0.0
    label: str = "default"
    strict: bool = False


class Recorder:
    """A registry of its own holding this plugin: an allocator with options that wraps
    the built-in paged allocator, and an observer of whether the engine ever started."""

    def __init__(self) -> None:
        self.registry = PluginRegistry.from_entry_points()
        self.paged = self.registry.select("allocators", "paged").plugin.load_factory()
        self.options = []
        self.started = []
        self.registry.register(self, distribution="tuned-dist")

    def make(self, options, context):
        self.options.append(options)
        return self.paged(options, context)

    @servelab.hookimpl
    def servelab_register_allocators(self):
        return [AllocatorPlugin(name="tuned", factory=self.make, options=TunedOptions)]

    @servelab.hookimpl
    def servelab_engine_started(self, engine):
        self.started.append(engine)


@pytest.fixture
def recorder():
    return Recorder()


def test_plugin_options_reach_the_factory(llama_checkpoint, recorder):
    llm = LLM(llama_checkpoint, registry=recorder.registry, max_model_len=64,
              **{"allocator.name": "tuned", "allocator.watermark": 1, "allocator.label": "x"})
    assert recorder.options == [TunedOptions(watermark=1, label="x")]
    assert recorder.started == [llm.engine]


@pytest.mark.parametrize("options, message", [
    ({"allocator.nonsense": 1}, r"unknown option \[allocator\] 'nonsense' for allocator 'tuned'; "
                                r"valid options: watermark, label, strict"),
    ({"allocator.watermark": "high"}, r"\[allocator\] watermark must be a float"),
    ({"allocator.label": 3}, r"\[allocator\] label must be a str"),
    ({"allocator.strict": 1}, r"\[allocator\] strict must be a bool"),
])
def test_bad_plugin_options_are_config_errors(llama_checkpoint, recorder, options, message):
    with pytest.raises(ConfigError, match=message):
        LLM(llama_checkpoint, registry=recorder.registry, **{"allocator.name": "tuned", **options})
    assert recorder.options == [] and recorder.started == []


def test_option_for_a_plugin_without_options(llama_checkpoint, recorder):
    with pytest.raises(ConfigError, match=r"\[allocator\] 'chunk'.*valid options: none"):
        LLM(llama_checkpoint, registry=recorder.registry, **{"allocator.chunk": 8})
    assert recorder.started == []


def test_unknown_allocator_lists_installed_ones(tmp_path, recorder):
    # Names are checked before the checkpoint is even opened: the path does not exist.
    with pytest.raises(PluginError, match="'nope'") as excinfo:
        LLM(str(tmp_path / "no-such-checkpoint"), registry=recorder.registry, **{"allocator.name": "nope"})
    assert "paged (servelab)" in str(excinfo.value)
    assert "tuned (tuned-dist)" in str(excinfo.value)
    with pytest.raises(PluginError, match="paged \\(servelab\\)"):
        LLM(str(tmp_path / "no-such-checkpoint"), **{"allocator.name": "nope"})


# ---------------------------------------------------------------- engine limits


def model_config(**overrides) -> ModelConfig:
    raw = dict(model_type="llama", vocab_size=211, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, head_dim=12, max_position_embeddings=256)
    return ModelConfig.from_dict({**raw, **overrides})


def test_limits_default_from_the_model():
    limits = resolve_limits(EngineConfig().engine, model_config())
    assert limits.max_model_len == 256
    assert limits.max_num_batched_tokens == 2048
    # 512 MiB holds far more than 64 sequences x 16 blocks of 16 tokens: capped there.
    assert limits.num_kv_blocks == 64 * 16
    small = EngineConfig.from_dict({"engine": {"kv_cache_memory": "96KiB", "max_model_len": 64}}).engine
    # 2 layers x 2 kv heads x 12 dims x (K, V) x 4 bytes x 16 tokens = 6144 bytes per block
    assert resolve_limits(small, model_config()).num_kv_blocks == 16


@pytest.mark.parametrize("engine, message", [
    ({"max_model_len": 512}, "max_model_len=512 exceeds the model's max_position_embeddings=256"),
    ({"max_model_len": 64, "num_kv_blocks": 3}, "fewer than max_model_len=64"),
    ({"max_model_len": 64, "kv_cache_memory": "8KiB"}, "kv_cache_memory"),
])
def test_limit_errors(engine, message):
    with pytest.raises(ConfigError, match=message):
        resolve_limits(EngineConfig.from_dict({"engine": engine}).engine, model_config())


def test_sliding_window_shorter_than_max_model_len():
    config = model_config(sliding_window=32, use_sliding_window=True)
    with pytest.raises(ConfigError, match="sliding_window=32"):
        resolve_limits(EngineConfig.from_dict({"engine": {"max_model_len": 64}}).engine, config)
    assert resolve_limits(EngineConfig.from_dict({"engine": {"max_model_len": 32}}).engine, config).max_model_len == 32


@pytest.mark.parametrize("engine, message", [
    ({"max_model_len": 512}, "max_position_embeddings"),
    ({"max_model_len": 64, "num_kv_blocks": 2}, "num_kv_blocks"),
    ({"max_model_len": 64, "max_num_batched_tokens": 32}, r"max_num_batched_tokens \(32\).*max_model_len \(64\)"),
])
def test_limit_errors_stop_the_engine_before_it_starts(llama_checkpoint, recorder, engine, message):
    with pytest.raises(ConfigError, match=message):
        LLM(llama_checkpoint, registry=recorder.registry, **engine)
    assert recorder.started == []
