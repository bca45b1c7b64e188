"""The `servelab` command, run as a separate process: plugin listing, generation, and
clean failures (exit code 2, one `servelab: error: ...` line, no traceback).

Each `generate` process spends seconds importing torch, so the `generate` runs are
started together, once per module, and the tests read their results."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "servelab.cli", *args]


def servelab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), capture_output=True, text=True, timeout=60)


def assert_clean_failure(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("servelab: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tokenized_checkpoint(llama_checkpoint, tmp_path_factory):
    """The tiny Llama checkpoint plus a word-level tokenizer.json covering its 211 ids.

    (servelab.model.builtin.train_tokenizer cannot go that small: its byte-level BPE
    starts from 256 byte symbols plus 3 special tokens.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tokenized") / "ckpt"
    shutil.copytree(llama_checkpoint, path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 211)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


def test_plugins_json():
    result = servelab("plugins", "--json")
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert set(listing) == {"allocators", "schedulers", "drafters", "attention", "routers", "logits_processors",
                            "evictors", "victims", "kv_transfers", "adapter_residency"}
    for entries in listing.values():
        for entry in entries:
            assert {"name", "qualified_name", "distribution", "description"} <= set(entry) <= {
                "name", "qualified_name", "distribution", "description", "clash"}
            assert entry["qualified_name"].endswith(":" + entry["name"])
    builtins = {"allocators": "paged", "schedulers": "continuous", "attention": "torch-paged",
                "logits_processors": "structured"}
    for kind, name in builtins.items():
        [entry] = [e for e in listing[kind] if e["name"] == name]
        assert entry["distribution"] == "servelab" and entry["description"]


RESEARCH_PLUGIN = """
import servelab
from servelab.plugin_types import DrafterPlugin, SchedulerPlugin

@servelab.hookimpl
def servelab_register_drafters():
    return [DrafterPlugin(name="suffix", factory="nowhere:Trie", description="a research suffix trie")]

@servelab.hookimpl
def servelab_register_schedulers():
    return [SchedulerPlugin(name="research-fair", factory="nowhere:Fair", description="fair share")]
"""


def test_plugins_shows_a_name_a_package_shares_with_a_builtin(tmp_path):
    """An installed package registering `suffix`, a name servelab's own drafter took later."""
    info = tmp_path / "servelab_research-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: servelab_research\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[servelab.plugins]\nresearch = research_plugin\n")
    (tmp_path / "research_plugin.py").write_text(RESEARCH_PLUGIN)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(command("plugins"), capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["research-fair", "servelab_research"] for line in lines), result.stdout
    assert sum(line.split()[:2] in (["suffix", "*"], ["suffix", "servelab"]) for line in lines) == 0
    assert [line.split()[1] for line in lines if line.split()[:1] == ["suffix*"]] == ["servelab", "servelab_research"]
    clash = lines[lines.index("name clashes (*): select any policy by its qualified name, distribution:name") + 1]
    assert clash.strip() == ("two plugins register the drafter 'suffix': distribution 'servelab' ('servelab:suffix') "
                             "and distribution 'servelab_research' ('servelab-research:suffix'); 'suffix' selects "
                             "'servelab-research:suffix' (a third-party policy over servelab's built-in); select "
                             "the other by its qualified name")


def test_plugins_plain_lists_names():
    result = servelab("plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for header in ("allocators:", "schedulers:", "drafters:", "attention:", "logits_processors:"):
        assert header in lines
    for name in ("paged", "continuous", "torch-paged", "repetition_penalty", "bad_words"):
        assert any(line.split()[:2] == [name, "servelab"] for line in lines), result.stdout


@pytest.fixture(scope="module")
def generate_runs(llama_checkpoint, tokenized_checkpoint, tmp_path_factory):
    """Every `generate` invocation below, run concurrently; results by case name."""
    gpt2 = tmp_path_factory.mktemp("gpt2") / "ckpt"
    shutil.copytree(llama_checkpoint, gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt2 / "config.json").write_text(json.dumps(config))
    missing = tmp_path_factory.mktemp("empty") / "missing"
    prompts_file = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    prompts_file.write_text('w8 w9\n\n"w10\\tw11"\n')
    blank_file = prompts_file.with_name("blank.txt")
    blank_file.write_text("\n  \n")

    cases = {
        "ok": ["--model", tokenized_checkpoint, "--prompt", "w5 w17 w42", "--max-tokens", "6",
               "--set", "engine.max_model_len=64"],
        "no_tokenizer": ["--model", llama_checkpoint, "--prompt", "x"],
        "unknown_plugin": ["--model", llama_checkpoint, "--prompt", "x", "--set", "allocator.name=nope"],
        "bad_engine_value": ["--model", llama_checkpoint, "--prompt", "x", "--set", "engine.max_num_seqs=0"],
        "missing_checkpoint": ["--model", str(missing), "--prompt", "x"],
        "gpt2": ["--model", str(gpt2), "--prompt", "x"],
        "ngram": ["--model", tokenized_checkpoint, "--prompt", "w5 w17 w42 w5 w17 w42 w5 w17 w42 w5",
                  "--max-tokens", "12", "--set", "engine.max_model_len=64", "--set", 'drafter.name="ngram"'],
        "unknown_drafter": ["--model", llama_checkpoint, "--prompt", "x", "--set", 'drafter.name="nope"'],
        "several": ["--model", tokenized_checkpoint, "--prompt", "w5 w17", "--prompt", "w42",
                    "--prompts-file", str(prompts_file), "--max-tokens", "3", "--set", "engine.max_model_len=64"],
        "blank_prompts_file": ["--model", tokenized_checkpoint, "--prompts-file", str(blank_file)],
    }
    processes = {name: subprocess.Popen(command("generate", *args), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                 for name, args in cases.items()}
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return results


def test_generate_streams_text(generate_runs):
    result = generate_runs["ok"]
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    assert words and all(w.startswith("w") for w in words), result.stdout
    summary = re.search(r"\[(\d+) tokens, finish_reason=(\w+)", result.stderr)
    assert summary, result.stderr
    assert len(words) <= int(summary.group(1)) <= 6
    assert summary.group(2) in ("length", "stop")


def test_generate_with_a_drafter_reports_acceptance(generate_runs):
    result = generate_runs["ngram"]
    assert result.returncode == 0, result.stderr
    summary = re.search(r"drafts accepted (\d+)/(\d+), ([\d.]+) tokens per target step", result.stderr)
    assert summary, result.stderr
    assert int(summary.group(1)) <= int(summary.group(2))


def test_unknown_drafter_fails_cleanly(generate_runs):
    line = assert_clean_failure(generate_runs["unknown_drafter"], "unknown drafter 'nope'")
    assert "ngram" in line


def test_text_prompt_without_tokenizer_fails_cleanly(generate_runs):
    assert_clean_failure(generate_runs["no_tokenizer"], "tokenizer")


def test_unknown_plugin_fails_cleanly(generate_runs):
    line = assert_clean_failure(generate_runs["unknown_plugin"], "'nope'")
    assert "paged" in line


def test_bad_engine_value_fails_cleanly(generate_runs):
    assert_clean_failure(generate_runs["bad_engine_value"], "max_num_seqs")


def test_missing_checkpoint_fails_cleanly(generate_runs):
    assert_clean_failure(generate_runs["missing_checkpoint"], "does not exist")


def test_unsupported_architecture_fails_cleanly(generate_runs):
    assert_clean_failure(generate_runs["gpt2"], "unsupported architecture", "gpt2")


def test_argument_errors_exit_2():
    result = servelab("generate")  # --prompt is required; argparse fails before importing torch
    assert result.returncode == 2 and "--prompt" in result.stderr


def test_generate_runs_several_prompts_in_order(generate_runs):
    result = generate_runs["several"]
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("--- prompt")]
    assert headers == ['--- prompt 1/4: "w5 w17"', '--- prompt 2/4: "w42"', '--- prompt 3/4: "w8 w9"',
                       '--- prompt 4/4: "w10\\tw11"']
    assert len(re.findall(r"\[3 tokens, finish_reason=length", result.stderr)) == 4


def test_a_prompts_file_without_prompts_fails_cleanly(generate_runs):
    assert_clean_failure(generate_runs["blank_prompts_file"], "holds no prompt")


@pytest.mark.parametrize("case", ["a-file", "unwritable-inside"])
def test_an_unusable_cache_is_one_line_exit_2_and_leaves_nothing(case, tmp_path, monkeypatch, capsys):
    """SERVELAB_CACHE where the generated built-in model cannot be written: a file in its
    place, or a write failing half-way (here: a directory where a file must go). One line
    naming the cache, exit 2, and no temporary directory left behind."""
    from servelab.cli import main

    cache = tmp_path / "cache"
    if case == "a-file":
        cache.write_text("not a directory")
    else:
        (cache / "tiny-random" / "tokenizer.json").mkdir(parents=True)
    monkeypatch.setenv("SERVELAB_CACHE", str(cache))
    code = main(["generate", "--model", "builtin:tiny-random", "--prompt", "x", "--max-tokens", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("servelab: error: cannot write the built-in model")
    assert str(cache) in err and "SERVELAB_CACHE" in err
    if case != "a-file":
        assert sorted(p.name for p in cache.iterdir()) == ["tiny-random"]  # no tiny-random.tmp<pid>
