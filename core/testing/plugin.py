"""The pytest plugin servelab registers (pytest11 entry point `servelab`).

It imports nothing heavy, so it costs nothing in test runs that use no contract:

- `--servelab-max-examples=N`: hypothesis examples per randomised contract test
  (each contract's `max_examples` otherwise);
- `--servelab-random`: draw new random examples every run (by default the randomised
  tests are derandomized: the same examples, so a pass or a failure reproduces);
- `servelab_tiny_checkpoint`: a tiny random Llama checkpoint directory, built once per
  process with `transformers`, for a plugin's own end-to-end tests;
- a header line naming the contracts available.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("servelab", "servelab conformance contracts")
    group.addoption("--servelab-max-examples", dest="servelab_max_examples", type=int, default=None,
                    metavar="N", help="hypothesis examples per randomised servelab contract test")
    group.addoption("--servelab-random", dest="servelab_random", action="store_true", default=False,
                    help="new random examples every run (default: derandomized, the same examples every run)")


def pytest_report_header(config: pytest.Config) -> str:
    return ("servelab conformance contracts: AllocatorContract, SchedulerContract, DrafterContract, "
            "AttentionBackendContract, RouterContract (from servelab.testing)")


@pytest.fixture(scope="session")
def servelab_tiny_checkpoint() -> str:
    """A tiny random Llama (2 layers, vocab 211) saved as a Hugging Face checkpoint."""
    from servelab.testing.e2e import NEEDS_TRANSFORMERS
    from servelab.testing.tiny_model import tiny_checkpoint

    pytest.importorskip("transformers", reason=NEEDS_TRANSFORMERS)

    return tiny_checkpoint()
