"""The embedded models (builtin:tiny, builtin:tiny-draft, tiny's Medusa heads) and the
tool that trains them (examples/training/train_builtin_models.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.errors import CheckpointError
from servelab.model import builtin

TRAINING_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "training" / "train_builtin_models.py"


def _load_training_tool():
    """The training tool is not part of the installed package: load it from its file."""
    spec = importlib.util.spec_from_file_location("train_builtin_models", TRAINING_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # attrs classes look their module up while being built
    spec.loader.exec_module(module)
    return module


training = _load_training_tool()
MODELS = ("tiny", "tiny-draft")
PROMPTS = ["def fibonacci(n):", "import os\n", "The with statement", "class Stack:\n    def push(self, item):"]
MAX_NEW = 24


def test_assets_are_packaged_and_small():
    total = 0
    for name in MODELS:
        path = builtin.resolve(f"builtin:{name}")
        assert path == builtin.ASSETS / name
        for file in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (path / file).is_file(), f"{name}/{file} is missing"
        total += sum(f.stat().st_size for f in path.iterdir())
    # The models (6 MB in bf16) and their drafters' heads: Medusa's 0.2 MB, EAGLE's 1.1 MB.
    assert total <= 7.5 * 2**20, f"embedded models take {total / 2**20:.2f} MiB"
    tiny = json.loads((builtin.ASSETS / "tiny" / "config.json").read_text())
    draft = json.loads((builtin.ASSETS / "tiny-draft" / "config.json").read_text())
    assert tiny["architectures"] == ["LlamaForCausalLM"] and tiny["model_type"] == "llama"
    assert tiny["head_dim"] == 64 and tiny["num_key_value_heads"] < tiny["num_attention_heads"]
    assert tiny["tie_word_embeddings"] and tiny["torch_dtype"] == "bfloat16"
    assert draft["vocab_size"] == tiny["vocab_size"]
    assert training.num_parameters(draft) * 4 < training.num_parameters(tiny)
    assert (builtin.ASSETS / "tiny" / "tokenizer.json").read_bytes() == \
        (builtin.ASSETS / "tiny-draft" / "tokenizer.json").read_bytes()


def test_unknown_builtin_lists_every_name():
    with pytest.raises(CheckpointError) as info:
        builtin.resolve("builtin:nope")
    for name in ("builtin:tiny", "builtin:tiny-draft", "builtin:tiny-random"):
        assert name in str(info.value)


def test_default_model_is_builtin_tiny():
    from servelab.config import EngineConfig

    assert EngineConfig.load(None).engine.model == "builtin:tiny"


def test_tokenizer_round_trips_text():
    from servelab.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(builtin.ASSETS / "tiny" / "tokenizer.json")
    assert tokenizer.vocab_size == 4096
    assert [tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    for text in ["def f(x):\n    return x ** 2  # square\n", "Ünïcödé — ✓ 数据", "   leading spaces\t\ttabs"]:
        ids = tokenizer.encode(text)
        assert ids[0] == 1 and 1 not in ids[1:] and 0 not in ids
        assert tokenizer.decode(ids) == text
    # Python source compresses: well under one token per character.
    source = TRAINING_SCRIPT.read_text()
    assert len(tokenizer.encode(source, add_special_tokens=False)) < len(source) / 2.5


def _hf_greedy(path: Path, prompt: list[int]) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers(name):
    pytest.importorskip("transformers")
    llm = LLM(f"builtin:{name}", max_model_len=256, dtype="float32")
    prompts = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    path = builtin.resolve(f"builtin:{name}")
    assert [o.token_ids for o in outputs] == [_hf_greedy(path, p) for p in prompts]


def test_tiny_writes_python():
    out = LLM("builtin:tiny", max_model_len=256).generate(
        "def fibonacci(n):", SamplingParams(max_tokens=24, temperature=0))[0]
    assert out.text.strip() and out.text.count("\ufffd") == 0


def _load_target(path: Path) -> training.TrainLlama:
    from safetensors.torch import load_file

    model = training.TrainLlama(json.loads((path / "config.json").read_text()))
    model.load_state_dict({k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()})
    return model.eval()


def _load_medusa(path: Path) -> training.MedusaHeads:
    from safetensors.torch import load_file

    config = json.loads((path / "medusa_config.json").read_text())
    heads = training.MedusaHeads(config["num_heads"], config["hidden_size"])
    tensors = load_file(str(path / "medusa.safetensors"))
    hidden = config["hidden_size"]
    assert sorted(tensors) == sorted(f"medusa_heads.{i}.{kind}" for i in range(config["num_heads"])
                                     for kind in ("weight", "bias"))
    for i in range(config["num_heads"]):
        assert tensors[f"medusa_heads.{i}.weight"].shape == (hidden, hidden)
        assert tensors[f"medusa_heads.{i}.bias"].shape == (hidden,)
    heads.load_state_dict({k: v.float() for k, v in tensors.items()})
    return heads


def test_medusa_heads_beat_chance():
    path = builtin.ASSETS / "tiny"
    config = json.loads((path / "medusa_config.json").read_text())
    assert config == {"num_heads": config["num_heads"], "hidden_size": 192} and config["num_heads"] >= 3
    target, heads = _load_target(path), _load_medusa(path)
    # Four windows of 256 tokens spread over the held-out documents (never trained on).
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    _, val_docs = training.split_documents(training.corpus_documents())
    windows = training.eval_windows(training.token_stream(tokenizer, val_docs), 256, 4)
    accuracy = training.medusa_accuracy(target, heads, windows)
    # Baselines: always guessing the most frequent token, and reusing the target's own
    # next-token guess for the token after it (what an untrained head would do).
    majority = torch.bincount(windows[:, 2:].flatten()).max().item() / windows[:, 2:].numel()
    with torch.no_grad():
        untrained = (target(windows).argmax(-1)[:, :-2] == windows[:, 2:]).float().mean().item()
    # Shipped (CPython 3.11): 0.118 / 0.089 / 0.044; majority 0.035, untrained 0.045.
    assert accuracy[0] > max(2 * majority, 2 * untrained, 0.08), (accuracy, majority, untrained)
    assert accuracy[1] > majority, (accuracy, majority)


TINY_SHAPE = {**training.TINY_CONFIG, "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "torch_dtype": "float32"}


def test_training_runs_end_to_end(tmp_path):
    settings = training.TrainSettings(
        target=TINY_SHAPE, draft={**TINY_SHAPE, "hidden_size": 16}, vocab_size=300, seq_len=32, batch_size=2,
        target_steps=3, draft_steps=2, medusa_steps=2, copy_tune_steps=2, max_chars=60_000, eval_windows=4,
        log_every=1)
    lines: list[str] = []
    metrics = training.train_all(tmp_path, settings, log=lines.append)
    assert any("step 3/3" in line for line in lines)
    for name in MODELS:
        assert metrics[name]["val_loss"] > 0
        out = LLM(str(tmp_path / name), max_model_len=64).generate(
            "import os", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        assert len(out.token_ids) == 5
    assert len(metrics["medusa"]["val_top1"]) == 3
    heads = _load_medusa(tmp_path / "tiny")
    assert len(heads.medusa_heads) == 3
    log = json.loads((tmp_path / "training_log.json").read_text())
    assert log["tiny"]["steps"] == 3 and log["tiny"]["copy_tune"]["steps"] == 2
    assert 0 <= log["tiny-draft"]["copy_tune"]["copy_top1"] <= 1


def test_copy_windows_repeat_a_passage():
    import torch

    windows = training.Batches(torch.arange(10_000), 64, 8, seed=0, copy_fraction=1.0).next()
    for window in windows.tolist():
        # lead-in, passage, passage again: over a stream of consecutive ids the window jumps
        # back once, and what follows the jump repeats the stretch that started at its value.
        jumps = [j for j in range(len(window) - 1) if window[j + 1] != window[j] + 1]
        assert len(jumps) == 1, window
        again = window[jumps[0] + 1:]
        first = window.index(again[0])
        assert window[first:first + len(again)] == again and len(again) >= 16, window
    plain = training.Batches(torch.arange(10_000), 64, 8, seed=0, copy_fraction=0.0).next()
    assert all(row == list(range(row[0], row[0] + 65)) for row in plain.tolist())
