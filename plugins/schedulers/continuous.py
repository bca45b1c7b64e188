"""The continuous scheduler is the kit's (`servelab.kit.ContinuousScheduler`)."""

from servelab.kit import ContinuousOptions, ContinuousScheduler

POLICIES = ("prefill-first", "decode-first")

__all__ = ["POLICIES", "ContinuousOptions", "ContinuousScheduler"]
