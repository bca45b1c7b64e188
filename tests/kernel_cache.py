"""What the kernel tests share about the build: whether a compiler is there, and seeding an
empty kernel cache for the build tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


def seed_objects(cache: Path) -> bool:
    """Copy this session's compiled objects (not the library) into the empty cache `cache`:
    a build there then has only the link step left, seconds instead of a minute or more
    beside the rest of the suite. False when the session has none (the build compiles
    everything)."""
    from servelab.plugins.kernels import cpu_build

    built = cpu_build._build_directory()
    name = cpu_build._flags()[0]
    if built is None or not (built / f"{name}.so").is_file():
        return False
    target = cache / name
    target.mkdir(parents=True)
    for path in built.iterdir():
        if path.is_file() and path.suffix != ".so" and path.name != "lock" and not path.name.startswith("servelab-"):
            shutil.copy2(path, target / path.name)  # their times too: ninja sees them up to date
    return True
