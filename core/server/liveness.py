"""How often a live engine is heard from, and so the shortest liveness timeout a server takes.

The front end tells a stopped or hung engine process from a busy one by its silence: the
engine's loop sends something at least every HEARTBEAT_SECONDS while work is queued (the
server's engine process, and each `--replicas` replica, whose poll returns as soon as
there is something), and a prefill or decode replica answers its poll at least every
POLL_SECONDS, busy or idle. A `--liveness-timeout` within a beat of those periods would
take healthy engines for silent ones (`/health` 503, replicas out of rotation, prefill
and decode replicas killed), so a shorter one is refused at start.
"""

from __future__ import annotations

HEARTBEAT_SECONDS = 0.5  # while work is queued, an engine's loop sends something at least this often
POLL_SECONDS = 1.0  # a replica's poll returns at the latest after this long, outputs or not
MARGIN = 2.0  # a liveness timeout is at least this many of those periods (a loaded machine delays a beat)


def minimum_liveness_timeout(disaggregated: bool) -> float:
    """The shortest liveness timeout a live engine always meets: prefill and decode
    replicas are heard from every poll, the other engines every heartbeat."""
    return MARGIN * (POLL_SECONDS if disaggregated else HEARTBEAT_SECONDS)
