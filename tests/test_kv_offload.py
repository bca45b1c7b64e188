"""The host KV tier ([kv_offload]) and swap preemption: the tier passes its contract, two
deliberately broken tiers are caught with the invariant named, and greedy tokens through
the tier (prefix blocks evicted to the host and brought back; sequences swapped out and
in) equal `transformers`."""

from __future__ import annotations

import random

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import ConfigError
from servelab.kit import HostTier
from servelab.testing import ContractViolation, KVTierContract

BLOCK_SIZE = 8


class TestHostTier(KVTierContract):
    factory = HostTier


class WrongBlockTier(HostTier):
    """Brings a swapped sequence's host blocks back in the wrong order."""

    def swap_in(self, seq_id, device_blocks):
        super().swap_in(seq_id, list(reversed(device_blocks)))


class LeakyTier(HostTier):
    """Forgets to free a swapped sequence's host blocks when it comes back."""

    def swap_in(self, seq_id, device_blocks):
        free_before = list(self._free)
        super().swap_in(seq_id, device_blocks)
        self._free = free_before


class LeakyPrefixTier(HostTier):
    """Loses the host block of a cached prefix block it brings back."""

    def load(self, key, device_block):
        slot = self._cached[key].slot
        super().load(key, device_block)
        self._free.remove(slot)


@pytest.mark.parametrize("broken, test, invariant", [
    (WrongBlockTier, "test_swap_round_trip", "a swapped-in sequence reads exactly the K/V it wrote"),
    (LeakyTier, "test_swap_round_trip", "blocks are conserved in each tier"),
    (LeakyPrefixTier, "test_prefix_blocks_come_back", "blocks are conserved in each tier"),
])
def test_broken_tiers_are_caught(broken, test, invariant):
    class TestBroken(KVTierContract):
        factory = broken

    with pytest.raises(ContractViolation, match=f"invariant violated: {invariant}"):
        getattr(TestBroken(), test)()


def make_prompts(vocab: int = 211) -> list[list[int]]:
    rng = random.Random(11)
    systems = [[rng.randrange(3, vocab) for _ in range(40)] for _ in range(4)]
    return [system + [rng.randrange(3, vocab) for _ in range(3 + i)] for i, system in enumerate(systems * 2)]


MAX_NEW = 6


@pytest.fixture(scope="module")
def reference(hf_model):
    out = []
    for prompt in make_prompts():
        ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("allocator", ["radix", "hash"])
def test_prefix_blocks_come_back_from_the_host_tier(llama_checkpoint, reference, allocator):
    # 16 device blocks hold one 6-block prompt and its output at a time: the four system
    # prompts (5 blocks each) cannot all stay cached on the device, but fit the host tier.
    llm = LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=1,
              **{"allocator.name": allocator, "kv_offload.host_blocks": 32})
    got = [llm.generate([prompt], greedy())[0].token_ids for prompt in make_prompts()]
    assert got == reference
    tier = llm.engine.host_tier.stats()
    assert tier.num_offloads > 0 and tier.host_hit_blocks > 0
    # The second round hits every system prompt's 5 blocks, from one tier or the other.
    assert llm.engine.allocator.stats().prefix_hit_tokens == 4 * 5 * BLOCK_SIZE


def test_without_the_tier_the_same_pool_misses(llama_checkpoint, reference):
    llm = LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=1,
              **{"allocator.name": "radix"})
    got = [llm.generate([prompt], greedy())[0].token_ids for prompt in make_prompts()]
    assert got == reference
    assert llm.engine.allocator.stats().prefix_hit_tokens < 4 * 5 * BLOCK_SIZE


@pytest.mark.parametrize("scheduler, allocator", [("continuous", "paged"), ("chunked-prefill", "radix")])
def test_swap_preemption_matches_transformers(llama_checkpoint, hf_model, scheduler, allocator):
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 211) for _ in range(rng.randint(10, 20))] for _ in range(5)]
    expected = [hf_model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=8, max_num_seqs=5,
              max_num_batched_tokens=64, **{"allocator.name": allocator, "scheduler.name": scheduler,
                                             "scheduler.preemption_mode": "swap", "kv_offload.host_blocks": 24})
    got = [o.token_ids for o in llm.generate(prompts, greedy(16))]
    assert got == expected
    tier = llm.engine.host_tier.stats()
    assert tier.num_swap_outs > 0 and tier.num_swap_ins == tier.num_swap_outs
    assert tier.num_host_swapped == 0 and tier.num_host_free + tier.num_host_cached == tier.num_host_blocks
    assert llm.engine.allocator.stats().num_used_blocks == 0


def test_swap_without_a_tier_is_a_config_error(llama_checkpoint):
    with pytest.raises(ConfigError, match=r"preemption_mode = \"swap\".*\[kv_offload\] host_blocks"):
        LLM(llama_checkpoint, **{"scheduler.preemption_mode": "swap"})


def test_bad_offload_config_is_named(llama_checkpoint):
    with pytest.raises(ConfigError, match=r"\[kv_offload\] host_blocks must be a non-negative integer"):
        LLM(llama_checkpoint, **{"kv_offload.host_blocks": -1})
    with pytest.raises(ConfigError, match=r"unknown key \[kv_offload\] 'blocks'"):
        LLM(llama_checkpoint, **{"kv_offload.blocks": 4})


def test_file_backed_tier(llama_checkpoint, reference, tmp_path):
    path = tmp_path / "kv.bin"
    llm = LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, num_kv_blocks=12, max_num_seqs=1,
              **{"allocator.name": "radix", "kv_offload.host_blocks": 32, "kv_offload.path": str(path)})
    got = [llm.generate([prompt], greedy())[0].token_ids for prompt in make_prompts()]
    assert got == reference
    assert path.stat().st_size > 0 and llm.engine.host_tier.stats().host_hit_blocks > 0


def test_tier_numbers_reach_metrics():
    from servelab.interfaces import AllocatorStats, SchedulerStats, TierStats
    from servelab.server.engine_core import EngineSnapshot
    from servelab.server.metrics import ServerMetrics

    metrics = ServerMetrics()
    tier = TierStats(num_host_blocks=8, num_host_free=5, num_host_cached=2, num_host_swapped=1, block_bytes=100,
                     num_offloads=4, num_loads=3, moves_last_step=2, bytes_last_step=200)
    metrics.observe({}, EngineSnapshot(SchedulerStats(0, 0, 0), AllocatorStats(10, 4, 6), tier=tier))
    text = metrics.render().decode()
    assert 'servelab_kv_tier_blocks{state="swapped",tier="host"} 1.0' in text
    assert 'servelab_kv_tier_moves{kind="offload"} 4.0' in text
    assert "servelab_kv_tier_bytes_moved 700.0" in text


# ---------------------------------------------------------------- the tier's file

def test_a_tier_file_serves_one_engine_at_a_time(llama_checkpoint, tmp_path):
    """A second engine on the same file would hand out the same host blocks: refused by
    name while the first one maps it, accepted once the first is gone."""
    import gc

    options = {"allocator.name": "radix", "kv_offload.host_blocks": 8, "kv_offload.path": str(tmp_path / "kv.bin")}
    first = LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, **options)
    with pytest.raises(ConfigError, match=r"\[kv_offload\] path '.*kv\.bin' is in use by another engine"):
        LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, **options)
    del first
    gc.collect()
    LLM(llama_checkpoint, max_model_len=64, block_size=BLOCK_SIZE, **options)


def test_replicas_get_a_tier_file_each(tmp_path):
    from servelab.config import EngineConfig
    from servelab.server.replicas import replica_configs

    shared = EngineConfig.from_dict({"kv_offload": {"host_blocks": 8, "path": str(tmp_path / "kv.bin")}})
    paths = [config.kv_offload.path for config in replica_configs(shared, 3)]
    assert paths == [str(tmp_path / f"kv.bin.replica{i}") for i in range(3)]
    anonymous = EngineConfig.from_dict({"kv_offload": {"host_blocks": 8}})
    assert replica_configs(anonymous, 2) == [anonymous, anonymous]


def test_the_tier_file_is_allocated_at_start(tmp_path):
    """Not a sparse file: every page exists before the first write through the mapping
    (a write into a hole on a full filesystem is SIGBUS)."""
    from servelab.runner import host_kv_caches

    path = tmp_path / "kv.bin"
    caches = host_kv_caches((2, 64, 4, 16), torch.float32, 2, str(path))
    size = (2 * 64 * 4 * 16) * 4 * 2 * 2  # elements x 4 bytes x (K, V) x 2 layers
    assert path.stat().st_size == size
    assert path.stat().st_blocks * 512 >= size
    assert all(float(cache.abs().sum()) == 0.0 for pair in caches for cache in pair)


def test_a_tier_file_without_room_is_refused_at_start(tmp_path):
    """A filesystem without room for the tier (here: a file size limit below it) is a
    start-up error naming the path, not a SIGBUS later."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import resource, signal, torch
        from servelab.errors import ConfigError
        from servelab.runner import host_kv_caches
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        try:
            host_kv_caches((2, 64, 4, 16), torch.float32, 2, {str(tmp_path / "kv.bin")!r})
        except ConfigError as exc:
            print(exc)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cannot reserve 131072 bytes for the host tier (File too large)" in result.stdout
    assert "kv.bin" in result.stdout
