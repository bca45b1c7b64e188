"""Shared fixtures: tiny Hugging Face checkpoints built and saved inside the test run."""

from __future__ import annotations

import pytest

# The tiny checkpoints come from servelab.testing, built once per process and shared
# with the conformance contracts' end-to-end runs.
from servelab.testing.tiny_model import tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint_factory():
    """make(kind) -> checkpoint directory of a tiny random model (kinds: servelab.testing.tiny_model.TINY_SHAPES)."""
    return tiny_checkpoint


@pytest.fixture(scope="session")
def llama_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("llama")


@pytest.fixture(scope="module")
def hf_model(llama_checkpoint):
    """transformers' own model of `llama_checkpoint`, in float32: the reference."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """The default attention backend (cpu-paged) uses its C++ kernels only when a start finds
    them cached, and builds them in the background otherwise. Building them once before any
    test makes every engine of the run take the same path (the kernels where a compiler
    exists, the torch path where none does) instead of switching when the build lands."""
    from servelab.plugins.kernels.cpu_build import kernel_build

    kernel_build().wait()
