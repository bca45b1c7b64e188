"""servelab's built-in policies. Each subpackage is an ordinary plugin module,
registered through the distribution's `servelab.plugins` entry points."""

import sys


def _refuse_shadowed_servelab() -> None:
    """Python started beside a folder named `servelab` (a clone's default name) imports that
    folder as an empty namespace package: `servelab.plugins` still resolves to the installed
    package, but servelab's own `__init__` never ran, and the first `servelab.hookimpl` would
    fail with "module 'servelab' has no attribute 'hookimpl'". Name the folder instead."""
    package = sys.modules.get("servelab")
    spec = package.__spec__ if package is not None else None
    if spec is not None and spec.origin is None and "hookimpl" not in vars(package):
        folders = ", ".join(map(str, spec.submodule_search_locations or ()))
        raise ImportError(f"'import servelab' found the folder {folders} (a folder named servelab with no "
                          f"__init__.py, on sys.path ahead of the installed package), not servelab itself: run "
                          f"Python from another directory, or rename that folder")


_refuse_shadowed_servelab()
