"""What the engine holds every plan to, before anything of it runs: a plan that breaks
an invariant fails the step with PolicyViolation naming it (as the scheduler contract
names it), instead of corrupting a sequence or hanging the engine."""

from __future__ import annotations

from typing import Any

from servelab.errors import PolicyViolation
from servelab.interfaces import StepPlan
from servelab.request import RequestTable
from servelab.sequence import SequenceStatus

SCHEDULED_ONCE = "a sequence is scheduled at most once per step"
KNOWN_SEQUENCES = "only queued, unfinished sequences are scheduled"
TOKEN_COUNT = "each scheduled sequence processes between 1 and its uncomputed tokens"
HELD = "a sequence in a batch still in flight is not scheduled"
PROGRESS = "no progress: an empty plan while requests are unfinished"
FINISHED = SequenceStatus.FINISHED
MAX_EMPTY_PLANS = 10_000  # a scheduler may wait a while (for its clock), not forever


class PlanCheck:
    def __init__(self, requests: RequestTable, scheduler: Any, scheduler_name: str) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.scheduler_name = scheduler_name
        self._empty_plans = 0  # consecutive empty plans while requests wait

    def check(self, plan: StepPlan, in_flight: set[int] | None = None) -> None:
        """Fail the step with PolicyViolation naming the invariant when the scheduler's plan
        schedules a sequence twice, a finished or unknown one, one in a batch still in flight
        (`in_flight`: their id()s), or more tokens than it has uncomputed, or when it stalls
        (empty plans while requests wait and no batch is in flight), before anything runs."""
        name = self.scheduler_name
        seen: set[int] = set()
        holds = self.requests.holds
        for seq, num_new in plan.scheduled:  # every scheduled sequence, every step: kept lean
            key = id(seq)
            if key in seen:
                raise PolicyViolation(SCHEDULED_ONCE, f"scheduler {name!r} planned {seq.request_id} twice")
            seen.add(key)
            if in_flight and key in in_flight:
                raise PolicyViolation(HELD, f"scheduler {name!r} planned {seq.request_id}, whose batch is still "
                                            f"in flight (it was held with hold_in_flight)")
            if not holds(seq):
                raise PolicyViolation(KNOWN_SEQUENCES, f"scheduler {name!r} planned {seq.request_id}, not in flight")
            if seq.status is FINISHED or seq.finish_reason is not None:
                raise PolicyViolation(KNOWN_SEQUENCES, f"scheduler {name!r} planned {seq.request_id}, which finished "
                                                       f"({seq.finish_reason or seq.status.value})")
            if not 1 <= num_new <= seq.num_uncomputed_tokens:
                raise PolicyViolation(TOKEN_COUNT, f"scheduler {name!r} planned {num_new} tokens for {seq.request_id}, "
                                                   f"which has {seq.num_uncomputed_tokens} uncomputed")
        stalled = (plan.is_empty and not in_flight and not self.requests.has_preparing()
                   and self.scheduler.has_unfinished())
        self._empty_plans = self._empty_plans + 1 if stalled else 0
        if self._empty_plans > MAX_EMPTY_PLANS:
            waiting = [s.request_id for s in self.requests.sequences() if not s.is_finished][:8]
            raise PolicyViolation(PROGRESS, f"scheduler {name!r} returned {self._empty_plans} empty plans in a row "
                                            f"while {', '.join(waiting)} wait")
