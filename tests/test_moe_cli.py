"""`servelab generate` and `servelab serve` run a Mixtral- and a Qwen2-MoE-shaped
checkpoint as transformers does, in one process, under expert parallelism (EP=2) and
under pipeline parallelism (PP=2)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest_server import ServerProcess
from test_moe_models import hf_greedy

PROMPT = [5, 17, 42, 9]


def with_tokenizer(path: str, target: Path) -> str:
    """The checkpoint plus a word-level tokenizer: token i is the word w<i>."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(path, target)
    vocab_size = json.loads((target / "config.json").read_text())["vocab_size"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(target / "tokenizer.json"))
    return str(target)


def words(tokens: list[int]) -> list[str]:
    return [f"w{t}" for t in tokens]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_generate_runs_moe_checkpoints_in_one_process_and_in_parallel(checkpoint_factory, tmp_path, kind):
    """One process, EP=2 and PP=2, side by side."""
    path = with_tokenizer(checkpoint_factory(kind), tmp_path / kind)
    expected = hf_greedy(path, [PROMPT], [8])[0]
    prompt = " ".join(words(PROMPT))
    layouts = {"one": [], "EP=2": ["--expert-parallel-size", "2", "--expert-placement", "round_robin"],
               "PP=2": ["--pipeline-parallel-size", "2"]}
    processes = {name: subprocess.Popen([sys.executable, "-m", "servelab.cli", "generate", "--model", path,
                                         "--prompt", prompt, "--max-tokens", "8", "--set", "engine.max_model_len=64",
                                         *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, args in layouts.items()}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        assert process.returncode == 0, (name, stderr)
        summary = re.search(r"\[(\d+) tokens, finish_reason=(\w+)", stderr)
        generated = stdout.split()
        # the run stops early only at an end-of-sequence token, which the text leaves out
        assert generated == words(expected)[:len(generated)], (name, stdout)
        assert int(summary.group(1)) == 8 or summary.group(2) == "stop", (name, stderr)


@pytest.mark.parametrize("kind, layout", [("mixtral", []), ("mixtral", ["--expert-parallel-size", "2"]),
                                          ("mixtral", ["--pipeline-parallel-size", "2"]),
                                          ("qwen2_moe", ["--expert-parallel-size", "2"]),
                                          ("qwen2_moe", ["--pipeline-parallel-size", "2"])],
                         ids=["mixtral-one", "mixtral-ep2", "mixtral-pp2", "qwen2_moe-ep2", "qwen2_moe-pp2"])
def test_serve_answers_with_transformers_tokens(checkpoint_factory, tmp_path, kind, layout):
    path = with_tokenizer(checkpoint_factory(kind), tmp_path / kind)
    expected = hf_greedy(path, [PROMPT], [6])[0]
    server = ServerProcess(path, "--set", "engine.max_model_len=64", *layout, log_path=tmp_path / "serve.log")
    try:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).json()
        assert reply["choices"][0]["text"].split() == words(expected), reply
        if not layout:
            assert server.metrics()['servelab_expert_load_imbalance{layer="0"}'] >= 1.0
        if "--pipeline-parallel-size" in layout:
            metrics = server.metrics()
            assert 0 < metrics["servelab_pipeline_bubble_fraction"] < 1
            assert all(0 <= metrics[f'servelab_pipeline_stage_bubble_fraction{{stage="{stage}"}}'] < 1
                       for stage in (0, 1))
    finally:
        assert server.terminate() == 0, server.log()
