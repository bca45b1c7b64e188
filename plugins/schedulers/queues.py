"""What the built-in schedulers share lives in the policy kit (`servelab.kit`)."""

from servelab.kit import PlanBuilder, QueueOptions, QueueScheduler, check_whole_prompts_fit

__all__ = ["PlanBuilder", "QueueOptions", "QueueScheduler", "check_whole_prompts_fit"]
