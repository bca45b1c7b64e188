"""The KV memory hierarchy through `servelab serve`: a quantized cache, the host tier and
swap preemption at once, under concurrent requests that overflow a tight device pool.

Each sequence's tokens depend only on its own K/V (an int8 row is quantized with its own
scale), so the served answers must equal one-at-a-time greedy runs of `LLM` with the same
cache dtype and room to spare: whatever the server swapped out and in, or evicted to the
host and brought back, came back exactly. /metrics must show that those moves happened."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest_server import ServerProcess, served_checkpoint  # noqa: F401 (fixture)
from servelab import LLM, SamplingParams

MAX_TOKENS = 24  # each sequence grows by 3 blocks, to 9: any two decoding together overflow the 16-block pool
VOCAB = 211  # the served checkpoint's word-level tokenizer


def make_prompts() -> list[list[int]]:
    """Four 40-token system prompts, each asked twice with its own tail."""
    rng = random.Random(5)
    systems = [[rng.randrange(3, VOCAB) for _ in range(40)] for _ in range(4)]
    return [system + [rng.randrange(3, VOCAB) for _ in range(2 + i)] for i, system in enumerate(systems * 2)]


@pytest.fixture(scope="module")
def reference(served_checkpoint) -> list[str]:
    llm = LLM(served_checkpoint, max_model_len=128, kv_cache_dtype="int8", max_num_seqs=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [llm.generate([prompt], params)[0].outputs[0].text for prompt in make_prompts()]


def test_int8_cache_host_tier_and_swap_serve_the_same_tokens(served_checkpoint, reference, tmp_path):
    server = ServerProcess(served_checkpoint, "--kv-cache-dtype", "int8", "--set", "engine.max_model_len=128",
                           "--set", "engine.block_size=8", "--set", "engine.num_kv_blocks=16",
                           "--set", "engine.max_num_seqs=8", "--set", 'allocator.name="radix"',
                           "--set", "kv_offload.host_blocks=64", "--set", 'scheduler.preemption_mode="swap"',
                           log_path=tmp_path / "server.log")
    try:
        def complete(prompt: list[int]) -> str:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        for _ in range(2):  # the second round finds the system prompts in the device pool or the host tier
            with ThreadPoolExecutor(len(reference)) as pool:
                assert list(pool.map(complete, make_prompts())) == reference
        metrics = server.wait_metrics(lambda m: m["servelab_requests_running"] == 0)
        assert metrics['servelab_kv_tier_moves{kind="swap_out"}'] > 0
        assert metrics['servelab_kv_tier_moves{kind="swap_in"}'] == metrics['servelab_kv_tier_moves{kind="swap_out"}']
        assert metrics['servelab_kv_tier_moves{kind="offload"}'] > 0
        assert metrics['servelab_kv_tier_moves{kind="load"}'] > 0
        assert metrics['servelab_kv_tier_blocks{state="swapped",tier="host"}'] == 0
        assert metrics['servelab_kv_tier_blocks{state="used",tier="device"}'] == 0
    finally:
        assert server.terminate() == 0, server.log()
