"""`servelab serve` sizes the engine for throughput where the user left a size unset,
and never changes a value the user set (in the config file or with --set)."""

from __future__ import annotations

import pytest

from servelab.cli import parse_args, serving_config
from servelab.config import EngineConfig
from servelab.errors import ConfigError
from servelab.server.serving_defaults import (SERVING_KV_CACHE_MEMORY, SERVING_MAX_NUM_SEQS, explicit_keys,
                                              with_serving_defaults)


def _config(*argv: str) -> EngineConfig:
    return serving_config(parse_args(["serve", *argv]))


def test_unset_sizes_take_the_serving_defaults():
    engine = _config("--model", "builtin:tiny").engine
    assert engine.max_num_seqs == SERVING_MAX_NUM_SEQS
    assert 0 < engine.kv_cache_memory <= SERVING_KV_CACHE_MEMORY
    assert engine.max_num_seqs > EngineConfig().engine.max_num_seqs  # the library's defaults stay small
    assert engine.kv_cache_memory > EngineConfig().engine.kv_cache_memory


def test_a_value_set_with_set_is_kept():
    engine = _config("--model", "builtin:tiny", "--set", "engine.max_num_seqs=8", "--set", "kv_cache_memory=64MiB").engine
    assert engine.max_num_seqs == 8 and engine.kv_cache_memory == 64 * 2**20


def test_a_value_in_the_config_file_is_kept(tmp_path):
    path = tmp_path / "engine.toml"
    path.write_text('[engine]\nmodel = "builtin:tiny"\nmax_num_seqs = 12\nnum_kv_blocks = 300\n')
    config = _config("--config", str(path))
    assert config.engine.max_num_seqs == 12 and config.engine.num_kv_blocks == 300
    assert config.engine.kv_cache_memory == EngineConfig().engine.kv_cache_memory  # num_kv_blocks sizes the pool
    assert explicit_keys(path, ["scheduler.name=static"]) == {"engine.model", "engine.max_num_seqs",
                                                             "engine.num_kv_blocks", "scheduler.name"}


def test_the_pool_is_at_most_a_quarter_of_a_small_machine():
    config = with_serving_defaults(EngineConfig(), explicit=(), total_memory=8 * 2**30)
    assert config.engine.kv_cache_memory == 2 * 2**30


def test_the_model_may_be_given_as_vllm_does():
    assert _config("builtin:tiny").engine.model == "builtin:tiny"
    assert _config("builtin:tiny", "--model", "builtin:tiny").engine.model == "builtin:tiny"
    with pytest.raises(ConfigError, match="two models"):
        _config("builtin:tiny", "--model", "builtin:tiny-random")


@pytest.mark.parametrize("native_bf16, expected", [(True, "bfloat16"), (False, "float32")])
def test_the_server_runs_bfloat16_where_the_cpu_computes_it(native_bf16, expected):
    config = with_serving_defaults(EngineConfig(), explicit=(), native_bf16=native_bf16)
    assert config.engine.dtype == expected
    assert EngineConfig().engine.dtype == "float32"  # the library's default stays float32


def test_a_dtype_the_user_chose_is_kept():
    assert _config("builtin:tiny", "--dtype", "float32").engine.dtype == "float32"
    assert _config("builtin:tiny", "--set", "engine.dtype=float32").engine.dtype == "float32"
    kept = with_serving_defaults(EngineConfig(), explicit={"engine.dtype"}, native_bf16=True)
    assert kept.engine.dtype == "float32"


def test_a_gpu_server_keeps_its_dtype():
    config = EngineConfig().with_overrides({"engine.device": "cuda"})
    assert with_serving_defaults(config, explicit=(), native_bf16=True).engine.dtype == "float32"


def test_this_cpu_is_asked_when_nothing_says():
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert _config("builtin:tiny").engine.dtype == ("bfloat16" if native else "float32")
