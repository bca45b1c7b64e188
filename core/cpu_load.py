"""How busy the machine's CPUs have been, from Linux's /proc/stat."""

from __future__ import annotations

import os


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, busy being user, nice, system, irq,
    softirq and steal; None where there is no /proc/stat (not Linux)."""
    if not os.path.exists("/proc/stat"):
        return None
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait
