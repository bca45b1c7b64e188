"""Run a background build only while the machine is otherwise idle.

A compiler at the lowest CPU priority (SCHED_IDLE) still wrecks an engine beside it on a
small machine: torch's OpenMP threads yield the core at their barriers, the compiler then
runs until the next scheduler tick, and the barrier waits for it. Measured on two cores, a
batch-64 decode step took 186-310 ms beside the build against 11-12 ms alone. So a watchdog
stops the build and every process it started (SIGSTOP) while other processes use more than
half a core, and continues them (SIGCONT) once the others have been quiet for a while.
Linux only (it reads /proc); elsewhere the build just runs.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

BUSY_CORES = 0.5  # other processes' use that stops the build, in cores
QUIET_SECONDS = 2.0  # how long others must stay under it before the build continues (plus up to a second)
INTERVAL_SECONDS = 0.25


def busy_ticks() -> int:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal).
    (servelab.bench.vllm_baseline reads the same line; a plugin imports only servelab's
    public contract, and this watchdog nothing of servelab at all.)"""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _processes() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, clock ticks it and its reaped children used)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                text = stat.read()
        except OSError:  # exited meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # [0] state, [1] parent, [11:15] utime stime cutime cstime
        found[int(entry.name)] = (int(fields[1]), sum(int(value) for value in fields[11:15]))
    return found


def tree(root: int) -> tuple[list[int], int]:
    """`root` and its descendants (the build's driver, ninja, each compiler: ninja puts every
    job in a process group of its own, so the tree is walked, not a group signalled), and
    the clock ticks they used, a reaped child's counted in its parent's."""
    processes = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    members, queue = [], [root] if root in processes else []
    while queue:
        pid = queue.pop()
        members.append(pid)
        queue.extend(children.get(pid, ()))
    return members, sum(processes[pid][1] for pid in members)


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except OSError:  # exited meanwhile
            pass


def run_yielding(command: list[str], keep_fresh: str | None = None) -> int:
    """Run `command`, stopped (it and everything it starts) while other work keeps the CPUs
    busy; returns its exit status. `keep_fresh`: a file (the build's lock) whose modification
    time is renewed while the build is stopped, so that no one takes it for the leftover of
    a killed build."""
    child = subprocess.Popen(command, start_new_session=True)
    if not os.path.exists("/proc/stat"):
        return child.wait()
    limit = BUSY_CORES * os.sysconf("SC_CLK_TCK") * INTERVAL_SECONDS
    stopped, quiet_since = False, None
    before = (busy_ticks(), tree(child.pid)[1])
    try:
        while child.poll() is None:
            time.sleep(INTERVAL_SECONDS)
            members, ours = tree(child.pid)
            busy = busy_ticks()
            others = (busy - before[0]) - (ours - before[1])
            before = (busy, ours)
            if others > limit:
                quiet_since = None
                stopped = True
            elif stopped:
                # Two builds watching each other would stop and resume in step forever: a random
                # wait on top of QUIET_SECONDS lets one of them go first.
                quiet_since = quiet_since or time.monotonic() + random.uniform(0.0, 1.0)
                stopped = time.monotonic() - quiet_since < QUIET_SECONDS
                if not stopped:
                    _signal(members, signal.SIGCONT)
            if stopped:  # every time: a job started just before the stop is caught by the next
                _signal(members, signal.SIGSTOP)
                if keep_fresh:
                    try:
                        os.utime(keep_fresh)
                    except OSError:  # not taken yet, or gone
                        pass
    finally:
        if child.poll() is None:  # this watchdog is going away: leave nothing stopped behind
            _signal(tree(child.pid)[0], signal.SIGCONT)
    return child.returncode


if __name__ == "__main__":  # yielding_build.py [--keep-fresh PATH] COMMAND...
    arguments = sys.argv[1:]
    fresh = None
    if arguments[:1] == ["--keep-fresh"]:
        fresh, arguments = arguments[1], arguments[2:]
    sys.exit(run_yielding(arguments, fresh))
