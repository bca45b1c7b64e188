"""The detached kernel builder leaves nothing behind that nobody asked for: one builder per
cache, bounded in time, ended by SIGTERM, never importing a `servelab/` folder from the
directory it was started in, and the library built once it exits."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import servelab.plugins.kernels.yielding_build as yielding_build
from kernel_cache import seed_objects

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the watchdog reads Linux's /proc")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


def _wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _watchdog(tmp_path: Path, *options: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, yielding_build.__file__, *options, *SLEEPER],
                            env={**os.environ, "SERVELAB_BUILD_YIELD": "0"})


def _build_children(watchdog: subprocess.Popen) -> list[int]:
    assert _wait_until(lambda: len(yielding_build.tree(watchdog.pid)[0]) > 1, 10)
    return yielding_build.tree(watchdog.pid)[0][1:]


def test_a_second_builder_on_the_same_cache_exits_at_once(tmp_path):
    lock = str(tmp_path / "builder.lock")
    first = _watchdog(tmp_path, "--lock", lock)
    try:
        _build_children(first)
        start = time.monotonic()
        second = _watchdog(tmp_path, "--lock", lock)
        assert second.wait(timeout=10) == yielding_build.EXIT_LOCKED
        assert time.monotonic() - start < 5
    finally:
        first.terminate()
        first.wait(timeout=10)


def test_sigterm_ends_the_builder_and_its_build(tmp_path):
    watchdog = _watchdog(tmp_path, "--lock", str(tmp_path / "builder.lock"))
    children = _build_children(watchdog)
    watchdog.send_signal(signal.SIGTERM)
    assert watchdog.wait(timeout=10) == 128 + signal.SIGTERM
    assert _wait_until(lambda: not any(_alive(pid) for pid in children), 15), "the build outlived its watchdog"
    # the lock went with it: the next builder takes it
    again = _watchdog(tmp_path, "--lock", str(tmp_path / "builder.lock"))
    try:
        _build_children(again)
    finally:
        again.terminate()
        again.wait(timeout=10)


def test_a_build_past_its_deadline_is_killed(tmp_path):
    watchdog = _watchdog(tmp_path, "--deadline", "1")
    children = _build_children(watchdog)
    assert watchdog.wait(timeout=15) == yielding_build.EXIT_GAVE_UP
    assert _wait_until(lambda: not any(_alive(pid) for pid in children), 5)


def _builders(marker: str) -> list[int]:
    """Live watchdogs whose command line names `marker` (this test's cache)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                command = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "yielding_build.py" in command and marker in command and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.slow
def test_ten_starts_on_a_cold_cache_leave_one_builder_that_builds_the_library(tmp_path):
    """Ten `servelab generate` runs at once from a folder holding a broken `servelab/`
    package, on a kernel cache without the library: afterwards at most one builder is
    alive, and once it exits the library is in the cache. (The session's compiled objects
    are copied in first, so the builder links rather than compiles.)"""
    cache = tmp_path / "torch-extensions"
    work = tmp_path / "work"
    (work / "servelab").mkdir(parents=True)
    (work / "servelab" / "__init__.py").write_text("raise ImportError('the checkout in the working directory')\n")
    seed_objects(cache)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache), "SERVELAB_BUILD_YIELD": "0",
           "OMP_NUM_THREADS": "1"}
    command = [str(Path(sys.executable).with_name("servelab")), "generate", "--prompt", "def f(x):",
               "--max-tokens", "1", "--set", "engine.max_model_len=64"]
    if not Path(command[0]).exists():
        pytest.skip("the servelab command is not installed beside this interpreter")
    runs = [subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for _ in range(10)]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err.decode()[-2000:]
    libraries = lambda: list(cache.rglob("servelab_cpu_paged_*.so"))  # noqa: E731
    # every start left a builder at its exit: all but one find the cache's lock taken and end
    assert _wait_until(lambda: len(_builders(str(cache))) <= 1, 10), f"{_builders(str(cache))} builders alive"
    assert _builders(str(cache)) or libraries(), "no builder was left to build the kernels for the next start"
    assert _wait_until(lambda: not _builders(str(cache)), 600), "the builder did not finish within 10 minutes"
    assert len(libraries()) == 1, f"no library in the cache after the build: {list(cache.rglob('*'))[:20]}"
    # and the next start takes the native path, saying so
    run = subprocess.run([command[0], "-v", *command[1:]], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cpu-paged C++ kernels" in run.stderr + run.stdout
    assert not _builders(str(cache))


def test_a_cached_library_is_imported_without_torch_s_build_step(monkeypatch):
    """A library in the cache loads as it is: torch's build step would write this checkout's
    source paths into the cache's build file, and rebuild a library another checkout of the
    same sources built (the two would take turns rebuilding it, silently, at every start)."""
    import servelab.plugins.kernels.cpu_build as cpu_build
    from torch.utils import cpp_extension

    if not cpu_build.is_cached():
        pytest.skip("the kernels are not built on this machine")

    def no_build(*args, **kwargs):
        raise AssertionError("torch's build step ran for a cached library")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    module = cpu_build.load_library()
    assert module.__name__ == cpu_build._flags()[0]
    assert Path(module.__file__).parent == cpu_build._build_directory()


def test_a_signal_while_the_build_starts_ends_it_once_its_pid_is_held():
    """SIGTERM that lands while Popen is still returning is held, not raised there (which
    would leave the build running with no one holding its pid), and ends the watchdog as
    soon as the child is named."""
    ending = yielding_build._Ending()
    ending.starting = True
    ending(signal.SIGTERM, None)  # held
    with pytest.raises(yielding_build._Terminated) as ended:
        ending.started()
    assert ended.value.args == (signal.SIGTERM,)
    with pytest.raises(yielding_build._Terminated):
        ending(signal.SIGINT, None)  # once started, at once
