"""servelab as a library logs nothing below WARNING until the application configures
structlog; the CLI's -v/-vv turn on info and debug events. Each case is a fresh
interpreter (structlog's configuration is process-wide), started together."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GENERATE = """
from servelab import LLM, SamplingParams
LLM({checkpoint!r}, max_model_len=64).generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3))
"""
CONFIGURED = """
import logging, sys, structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
                    wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
"""


@pytest.fixture(scope="module")
def runs(llama_checkpoint):
    cli = [sys.executable, "-m", "servelab.cli"]
    generate = ["generate", "--model", "builtin:tiny", "--prompt", "def", "--max-tokens", "2"]
    cases = {
        "library": [sys.executable, "-c", GENERATE.format(checkpoint=llama_checkpoint)],
        "configured": [sys.executable, "-c", CONFIGURED + GENERATE.format(checkpoint=llama_checkpoint)],
        "cli": [*cli, *generate],
        "cli_debug": [*cli, "-vv", *generate],
    }
    processes = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for name, argv in cases.items()}
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=180)
        assert process.returncode == 0, (name, stderr)
        results[name] = (stdout, stderr)
    return results


def test_the_library_is_silent_until_the_application_configures_logging(runs):
    assert runs["library"] == ("", "")


def test_an_application_that_configures_structlog_gets_the_debug_events(runs):
    stdout, stderr = runs["configured"]
    assert "engine.started" in stderr
    assert stderr.count("request.finished") == 2


def test_the_cli_shows_debug_events_only_with_vv(runs):
    assert "request.finished" not in runs["cli"][1]
    assert "request.finished" in runs["cli_debug"][1]


SWAPPED_STDERR_SCRIPT = """
import io, sys
from servelab.logging_setup import configure_logging, get_logger
real, captured = sys.stderr, io.StringIO()
sys.stderr = captured                     # e.g. a test runner capturing output
configure_logging(0)
get_logger("servelab.test").error("first", n=1)
sys.stderr = real
captured.close()                          # the capture ends; logging must not write to it
get_logger("servelab.test").error("second", n=2)
"""


def test_events_go_to_the_current_stderr_after_it_was_replaced():
    run = subprocess.run([sys.executable, "-c", SWAPPED_STDERR_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "second" in run.stderr and "first" not in run.stderr
