"""The background kernel build stops while other work keeps the CPUs busy, and finishes once
the machine is quiet again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import servelab.plugins.kernels.yielding_build as yielding_build

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="the watchdog reads Linux's /proc")

# Stands in for the compiler: finishes after 1.5 s of CPU time.
NEEDS_CPU = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 1.5:\n    pass\n"


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                text = Path(f"/proc/{entry.name}/stat").read_text()
            except OSError:
                continue
            if int(text[text.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()[0]


def _states_while_busy(watchdog: subprocess.Popen, until: float) -> set[str]:
    """Keep one core busy until `until` (this process is the other work), noting the states
    of the watchdog's build meanwhile."""
    states = set()
    while time.monotonic() < until:
        for child in _children(watchdog.pid):
            try:
                states.add(_state(child))
            except OSError:
                pass
        sum(i * i for i in range(20_000))
    return states


def test_the_build_waits_while_other_work_is_busy_then_finishes(tmp_path):
    lock = tmp_path / "lock"  # the build's lock: kept fresh while the build is stopped
    lock.touch()
    os.utime(lock, (0, 0))
    start = time.monotonic()
    watchdog = subprocess.Popen([sys.executable, yielding_build.__file__, "--keep-fresh", str(lock),
                                 sys.executable, "-c", NEEDS_CPU])
    states = _states_while_busy(watchdog, until=start + 4.0)
    assert watchdog.poll() is None, "the build finished while other work kept a core busy"
    assert "T" in states, f"the build was never stopped (states seen: {states})"
    assert time.time() - lock.stat().st_mtime < 60
    assert watchdog.wait(timeout=300) == 0  # longer if another build runs meanwhile
    assert time.monotonic() - start > 4.0 + yielding_build.QUIET_SECONDS


def test_a_build_that_never_yields_keeps_its_lock_fresh_too(tmp_path):
    """SERVELAB_BUILD_YIELD=0 (a build beside a test suite, at the lowest priority): never
    stopped, and its lock renewed all the same while it runs, for however long the priority
    starves it."""
    lock = tmp_path / "lock"
    lock.touch()
    os.utime(lock, (0, 0))
    watchdog = subprocess.Popen([sys.executable, yielding_build.__file__, "--keep-fresh", str(lock),
                                 sys.executable, "-c", "import time; time.sleep(2)"],
                                env={**os.environ, "SERVELAB_BUILD_YIELD": "0"})
    renewed = False
    while watchdog.poll() is None and not renewed:
        renewed = time.time() - lock.stat().st_mtime < 60
        time.sleep(0.05)
    assert renewed, "the lock went stale while the build ran"
    assert watchdog.wait(timeout=60) == 0


def test_a_stopped_build_whose_library_appears_is_ended_at_once(tmp_path):
    """Another process built the library meanwhile (its lock is gone, the library is there):
    the stopped build has nothing left worth waiting for, so it ends with exit 0 while the
    other work is still busy, and nothing of it stays behind."""
    product = tmp_path / "library.so"
    lock = tmp_path / "lock"  # torch's build lock: absent, the other build released it
    watchdog = subprocess.Popen([sys.executable, yielding_build.__file__, "--keep-fresh", str(lock),
                                 "--product", str(product), sys.executable, "-c", NEEDS_CPU.replace("1.5", "60")])
    children: list[int] = []
    stopped_at = None
    deadline = time.monotonic() + 60
    try:
        while watchdog.poll() is None and time.monotonic() < deadline:  # this process is the other work
            children = children or _children(watchdog.pid)
            if stopped_at is None and children:
                try:
                    if _state(children[0]) == "T":
                        stopped_at = time.monotonic()
                        product.touch()
                except OSError:
                    pass
            sum(i * i for i in range(20_000))
        assert stopped_at is not None, "the build was never stopped"
        assert watchdog.wait(timeout=5) == 0
        assert time.monotonic() - stopped_at < 10  # not when the machine went quiet, nor after its CPU minute
        assert children and not any(Path(f"/proc/{pid}").exists() for pid in children)
    finally:
        if watchdog.poll() is None:  # a failed check leaves no watchdog running
            watchdog.terminate()
            watchdog.wait(timeout=30)


def test_a_stopped_build_holding_its_lock_is_not_ended_by_its_product(tmp_path):
    """The library file exists while the build's lock is held: the linker may be writing it.
    The build stays stopped while the other work is busy."""
    product = tmp_path / "library.so"
    product.touch()
    lock = tmp_path / "lock"
    lock.touch()
    watchdog = subprocess.Popen([sys.executable, yielding_build.__file__, "--keep-fresh", str(lock),
                                 "--product", str(product), sys.executable, "-c", NEEDS_CPU])
    try:
        states = _states_while_busy(watchdog, until=time.monotonic() + 2.0)  # eight of the watchdog's rounds
        assert "T" in states, f"the build was never stopped (states seen: {states})"
        assert watchdog.poll() is None, "the build was ended while its lock was held"
    finally:
        watchdog.terminate()
        watchdog.wait(timeout=30)
