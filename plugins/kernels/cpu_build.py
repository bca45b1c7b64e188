"""Building the `cpu-paged` C++ kernels through torch's extension machinery.

The first build compiles cpu_paged.cpp (about a minute on two cores); torch caches the
library (under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), so later starts
only load it. A build runs in a background thread so that an engine can serve on the
torch path meanwhile; without a compiler the build fails once, says so in one log line,
and the torch path keeps serving.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import ModuleType

import structlog
import torch

logger = structlog.get_logger(__name__)
SOURCE = Path(__file__).with_name("cpu_paged.cpp")


def _flags() -> tuple[str, list[str]]:
    """A library name and compiler flags for this CPU's vector unit. The name carries the
    capability so that a cache shared by different machines never loads a wrong build."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    flags = ["-O3", "-fopenmp-simd"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    return f"servelab_cpu_paged_{capability.lower()}", flags


class KernelBuild:
    """One build of the kernels, started at most once; `module()` is None until it is ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._module: ModuleType | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, name="servelab-cpu-paged-build", daemon=True)
                self._thread.start()

    def wait(self, timeout: float | None = None) -> ModuleType | None:
        """Start the build if needed and block until it ends; the module, or None on failure."""
        self.start()
        self._done.wait(timeout)
        return self._module

    def module(self) -> ModuleType | None:
        return self._module

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def _build(self) -> None:
        try:
            from torch.utils import cpp_extension

            name, flags = _flags()
            self._module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=flags, verbose=False)
            logger.info("cpu_paged.kernels_ready", library=name)
        except Exception as exc:  # a missing compiler, headers or ninja: serve on the torch path
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
            logger.warning("cpu_paged.kernels_unavailable", reason=self.error,
                           fallback="torch-paged attention (same results, slower)")
        finally:
            self._done.set()


_BUILD = KernelBuild()


def kernel_build() -> KernelBuild:
    """The process-wide build (every engine and draft model shares one library)."""
    return _BUILD
