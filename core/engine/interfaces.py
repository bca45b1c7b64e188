"""The policy contracts, re-exported from one place. Each kind's contract lives in a module
of its own (`servelab.contracts`, one per kind); plugins may import from either.
"""

from servelab.contracts import (adapter_residency, allocator, attention, drafter, eviction, logits_processor, router,
                                runner, scheduler, victim)
from servelab.contracts.adapter_residency import *  # noqa: F401,F403
from servelab.contracts.allocator import *  # noqa: F401,F403
from servelab.contracts.attention import *  # noqa: F401,F403
from servelab.contracts.drafter import *  # noqa: F401,F403
from servelab.contracts.eviction import *  # noqa: F401,F403
from servelab.contracts.logits_processor import *  # noqa: F401,F403
from servelab.contracts.router import *  # noqa: F401,F403
from servelab.contracts.runner import *  # noqa: F401,F403
from servelab.contracts.scheduler import *  # noqa: F401,F403
from servelab.contracts.victim import *  # noqa: F401,F403
from servelab.contracts import kv_transfer  # noqa: E402
from servelab.contracts.kv_transfer import *  # noqa: F401,F403,E402

__all__ = sorted({name for module in (allocator, scheduler, victim, drafter, attention, router, logits_processor,
                                      eviction, runner, kv_transfer, adapter_residency) for name in module.__all__})
