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


def test_the_build_waits_while_other_work_is_busy_then_finishes(tmp_path):
    lock = tmp_path / "lock"  # the build's lock: kept fresh while the build is stopped
    lock.touch()
    os.utime(lock, (0, 0))
    start = time.monotonic()
    watchdog = subprocess.Popen([sys.executable, yielding_build.__file__, "--keep-fresh", str(lock),
                                 sys.executable, "-c", NEEDS_CPU])
    states = set()
    busy_until = start + 4.0
    while time.monotonic() < busy_until:  # this process is the other work: one busy core
        for child in _children(watchdog.pid):
            try:
                states.add(_state(child))
            except OSError:
                pass
        sum(i * i for i in range(20_000))
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
