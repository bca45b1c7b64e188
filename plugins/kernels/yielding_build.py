"""Run a background build only while the machine is otherwise idle.

A compiler at the lowest CPU priority (SCHED_IDLE) still wrecks an engine beside it on a
small machine: torch's OpenMP threads yield the core at their barriers, the compiler then
runs until the next scheduler tick, and the barrier waits for it. Measured on two cores, a
batch-64 decode step took 186-310 ms beside the build against 11-12 ms alone. So a watchdog
stops the build and every process it started (SIGSTOP) while other processes use more than
half a core, and continues them (SIGCONT) once the others have been quiet for a while.
Linux only (it reads /proc); elsewhere the build just runs.

A program that exits must leave nothing running that nobody asked for, so the watchdog is
bounded every way it can outlive its use: at most one per cache (`--lock PATH`, an flock
held for the build's life; a second watchdog on the same lock exits at once with
EXIT_LOCKED), at most `--deadline` seconds in all and MAX_STOPPED_SECONDS stopped in a row
(a machine that never goes quiet: the build is killed and the next start tries again),
and SIGTERM / SIGINT / SIGHUP kill the build and end the watchdog. SERVELAB_BUILD_YIELD=0
turns the stopping off (a CI machine whose only other work is its own tests). A stopped
build whose product (`--product PATH`, the library) exists while its lock (`--keep-fresh`)
does not is ended at once with exit 0: another process built it meanwhile (the quickstart's
foreground build after the first start left this one behind), and all that is left for
this one is to load it, which no one waits for; stopped, it would otherwise stay until
the machine went quiet.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time

BUSY_CORES = 0.5  # other processes' use that stops the build, in cores
QUIET_SECONDS = 2.0  # how long others must stay under it before the build continues (plus up to a second)
INTERVAL_SECONDS = 0.25
DEADLINE_SECONDS = 1800.0  # the whole build, stopped time included (a build takes about a minute)
MAX_STOPPED_SECONDS = 600.0  # stopped this long in a row: the machine never goes quiet, give up
EXIT_LOCKED = 75  # another watchdog holds the cache's build lock (EX_TEMPFAIL)
EXIT_GAVE_UP = 124  # the deadline passed, or the build stayed stopped too long


def busy_ticks() -> int:
    """Clock ticks all CPUs spent busy since boot (user, nice, system, irq, softirq, steal).
    (servelab.bench.vllm_baseline reads the same line; a plugin imports only servelab's
    public contract, and this watchdog nothing of servelab at all.)"""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


def _stat(pid: int | str) -> list[str] | None:
    """A process's /proc stat fields after its name ([0] state, [1] parent, [11:15] utime stime
    cutime cstime); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:  # exited meanwhile
        return None
    return text[text.rindex(")") + 2:].split()


def _processes() -> dict[int, tuple[int, int]]:
    """Every live process: pid -> (parent pid, clock ticks it and its reaped children used)."""
    found = {}
    for entry in os.scandir("/proc"):
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields is not None:
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


def take_lock(path: str):
    """The open lock file, held (flock) until this process ends; None when another process holds it."""
    import fcntl

    handle = open(path, "a")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return handle


class _Terminated(Exception):
    pass


class _Ending:
    """The ending signals' handler: raises _Terminated, except while the build is being
    started, when it only remembers the signal (raised inside Popen, it would leave the
    build running with no one holding its pid) and `started` raises it once `child` is set."""

    def __init__(self) -> None:
        self.starting = False
        self.pending: int | None = None

    def __call__(self, signum, frame) -> None:
        if self.starting:
            self.pending = signum
        else:
            raise _Terminated(signum)

    def started(self) -> None:
        self.starting = False
        if self.pending is not None:
            raise _Terminated(self.pending)


def _kill_tree(root: int) -> None:
    """The build and everything it started: continued (a stopped process cannot die of
    SIGTERM until then), terminated, and killed if still there a moment later."""
    members = tree(root)[0]
    _signal(members, signal.SIGCONT)
    _signal(members, signal.SIGTERM)
    end = time.monotonic() + 3.0
    while time.monotonic() < end and any(_running(pid) for pid in tree(root)[0] + members):
        time.sleep(0.05)
    _signal(tree(root)[0] + members, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` still runs: not gone, and not a zombie (the build's own process stays
    one until this watchdog reaps it, and its children are handed to init once it dies)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def run_yielding(command: list[str], keep_fresh: str | None = None, lock: str | None = None,
                 deadline: float = DEADLINE_SECONDS, max_stopped: float = MAX_STOPPED_SECONDS,
                 product: str | None = None) -> int:
    """Run `command`, stopped (it and everything it starts) while other work keeps the CPUs
    busy; returns its exit status (EXIT_LOCKED without running it when `lock` is held
    elsewhere, EXIT_GAVE_UP when it was killed for taking too long). `keep_fresh`: a file
    (torch's build lock) whose modification time is renewed while the build runs, stopped or
    starved at the lowest priority for however long, so that no one takes it for the
    leftover of a killed build. `product`: what the build makes; found while the build is
    stopped and `keep_fresh` is absent, the build is ended and 0 returned (see above)."""
    held = take_lock(lock) if lock else None
    if lock and held is None:
        return EXIT_LOCKED
    ending = _Ending()
    previous = {signum: signal.signal(signum, ending) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    child = None
    try:
        ending.starting = True
        child = subprocess.Popen(command, start_new_session=True)
        ending.started()
        return _watch(child, keep_fresh, deadline, max_stopped, product)
    except _Terminated as exc:
        return 128 + exc.args[0]
    finally:
        if child is not None and child.poll() is None:  # leave nothing behind, stopped or running
            _kill_tree(child.pid)
            child.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if held is not None:
            held.close()


def _watch(child: subprocess.Popen, keep_fresh: str | None, deadline: float, max_stopped: float,
           product: str | None) -> int:
    started = time.monotonic()
    yielding = os.path.exists("/proc/stat") and os.environ.get("SERVELAB_BUILD_YIELD", "1") != "0"
    limit = BUSY_CORES * os.sysconf("SC_CLK_TCK") * INTERVAL_SECONDS if yielding else 0
    stopped, quiet_since, stopped_since = False, None, None
    before = (busy_ticks(), tree(child.pid)[1]) if yielding else (0, 0)
    while child.poll() is None:
        time.sleep(INTERVAL_SECONDS)
        now = time.monotonic()
        if now - started > deadline or (stopped_since is not None and now - stopped_since > max_stopped):
            return EXIT_GAVE_UP  # the caller kills the build
        if keep_fresh:  # stopped or starved at the lowest priority, the build is alive: its lock is not stale
            try:
                os.utime(keep_fresh)
            except OSError:  # not taken yet, or gone
                pass
        if not yielding:
            continue
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
            quiet_since = quiet_since or now + random.uniform(0.0, 1.0)
            stopped = now - quiet_since < QUIET_SECONDS
            if not stopped:
                _signal(members, signal.SIGCONT)
        stopped_since = (stopped_since or now) if stopped else None
        if stopped:  # every time: a job started just before the stop is caught by the next
            _signal(members, signal.SIGSTOP)
            # Checked only once stopped since an earlier round (the signal delivered), so the
            # build cannot take the lock between the check and the kill.
            if (product and stopped_since < now and os.path.exists(product)
                    and not (keep_fresh and os.path.exists(keep_fresh))):
                return 0  # built meanwhile: the caller kills the stopped build
    return child.returncode


def main(arguments: list[str]) -> int:
    """yielding_build.py [--keep-fresh PATH] [--lock PATH] [--product PATH] [--deadline S] [--max-stopped S]
    COMMAND..."""
    options = {"--keep-fresh": None, "--lock": None, "--product": None, "--deadline": str(DEADLINE_SECONDS),
               "--max-stopped": str(MAX_STOPPED_SECONDS)}
    while arguments[:1] and arguments[0] in options:
        options[arguments[0]], arguments = arguments[1], arguments[2:]
    return run_yielding(arguments, options["--keep-fresh"], options["--lock"], float(options["--deadline"]),
                        float(options["--max-stopped"]), options["--product"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
