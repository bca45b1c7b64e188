"""Shared fixtures: tiny Hugging Face checkpoints built and saved inside the test run; the
per-test time budget the summary reports against."""

from __future__ import annotations

import gc
import os

import pytest

# The tiny checkpoints come from servelab.testing, built once per process and shared
# with the conformance contracts' end-to-end runs.
from servelab.testing.tiny_model import tiny_checkpoint


def _share_the_cores() -> None:
    """Each pytest-xdist worker's torch takes its share of the cores, not all of them: torch's
    threads wait for one another at every operation, and with two workers' threads on two
    cores they wait for threads that are not running (tests ran 20-50x slower than alone)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))  # and the commands the tests start


_share_the_cores()


@pytest.fixture(scope="session")
def checkpoint_factory():
    """make(kind) -> checkpoint directory of a tiny random model (kinds: servelab.testing.tiny_model.TINY_SHAPES)."""
    return tiny_checkpoint


@pytest.fixture(scope="session")
def llama_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def hf_model(llama_checkpoint):
    """transformers' own model of `llama_checkpoint`, in float32: the reference."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The default attention backend (cpu-paged) uses its C++ kernels only when a start finds
    them cached, and builds them in the background otherwise. Building them once before any
    test makes every engine of the run take the same path (the kernels where a compiler
    exists, the torch path where none does) instead of switching when the build lands."""
    from servelab.plugins.kernels.cpu_build import kernel_build

    kernel_build().wait()


@pytest.fixture(scope="module", autouse=True)
def heap_collected_per_module():
    """Every module starts with a full garbage collection (see `frozen_heap`); nothing stays
    frozen past a module, nor at exit."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def frozen_heap(heap_collected_per_module):
    """Each test starts with every object alive so far frozen out of the garbage collector's
    sight (gc.freeze; unfrozen and collected at the next module's start). An engine's load
    runs a full collection to hand freed memory back (release_freed_memory): in a test
    process that has imported transformers and hypothesis, that walks a few million objects,
    most of a tiny engine's start; frozen, it walks what the test created."""
    gc.collect()
    gc.freeze()


# pytest-xdist hands out modules in collection order (`--dist loadscope`). The slowest
# modules (worker-seconds in `--durations=0`, two busy cores) go first, so that the two
# workers end on short modules and finish together rather than one waiting while the other
# runs a long module it took last; the two that start Ray are kept apart.
RUNS_FIRST = ("test_server_replicas.py", "test_server_compiles.py", "test_moe_cli.py", "test_smollm2.py",
              "test_disaggregated_server.py", "test_sim_fidelity.py", "test_tensor_parallel.py",
              "test_pipeline_parallel.py", "test_kernel_builder.py", "test_cupy_kernels.py")
# The background build's test runs last: its build waits for the other worker to go quiet
# (18-63 s in the middle of the run; at its end the other worker soon has nothing left).
RUNS_LAST = "test_yielding_build.py"


def _start_rank(item) -> int:
    name = item.path.name
    if name == RUNS_LAST:
        return len(RUNS_FIRST) + 1
    return RUNS_FIRST.index(name) if name in RUNS_FIRST else len(RUNS_FIRST)


def pytest_collection_modifyitems(items):
    items.sort(key=_start_rank)  # stable: the rest keep their order


# Each test's setup, call and teardown should fit this budget (seconds) on two busy cores;
# the summary lists the phases over it, slowest first (SERVELAB_TEST_BUDGET_S changes it).
TEST_BUDGET_S = float(os.environ.get("SERVELAB_TEST_BUDGET_S", "15"))
_over_budget: list[tuple[float, str, str]] = []


def pytest_runtest_logreport(report):
    if report.duration > TEST_BUDGET_S:
        _over_budget.append((report.duration, report.when, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    if _over_budget:
        terminalreporter.section(f"over the {TEST_BUDGET_S:g} s per-test budget")
        for duration, when, nodeid in sorted(_over_budget, reverse=True):
            terminalreporter.write_line(f"{duration:7.2f}s {when:<8} {nodeid}")
