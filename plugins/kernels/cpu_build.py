"""Building the `cpu-paged` C++ kernels through torch's extension machinery.

The first build compiles the SOURCES below (about a minute on two cores: only
cpu_bindings.cpp includes pybind11 and torch's Python headers, the costly ones); torch
caches the library (under $TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), so
later starts only load it.
The library's name carries the CPU's vector unit and a digest of the sources, so a cached
library is loaded only where it was built from these very sources for this kind of CPU
(`is_cached`), never rebuilt at start.
The compiler runs in a detached process (this module run as a script),
watched from a background thread, so an engine serves on the torch path meanwhile, and a
process that exits mid-build leaves neither a half-built library nor a held build lock
behind. Without a compiler the build fails once, says so in one log line, and the torch
path keeps serving.

The detached build leaves nothing behind that nobody asked for: at most one builder per
cache (an flock next to the library, taken by the watchdog before anything starts; the
next starts see it held and start nothing), bounded in time, ended by SIGTERM, and never
importing a `servelab/` folder of the directory it was started from (its interpreter
runs without the working directory on sys.path, from the cache's directory).
`python -m servelab.plugins.kernels.cpu_build` is the explicit build step: it builds in
the foreground and returns when the library is ready (exit 0) or could not be built.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

import servelab

logger = servelab.get_logger(__name__)  # silent below WARNING until the application configures logging
SOURCES = [str(Path(__file__).with_name(name))
           for name in ("cpu_bindings.cpp", "cpu_paged.cpp", "cpu_layer_ops.cpp", "cpu_decoder.cpp", "cpu_linear.cpp",
                         "cpu_quant.cpp", "cpu_lora.cpp", "cpu_sampling.cpp", "cpu_moe.cpp")]
HEADERS = [str(Path(__file__).with_name(name)) for name in ("cpu_simd.h", "cpu_panels.h", "cpu_kernels.h")]
STALE_LOCK_SECONDS = 600


def _flags() -> tuple[str, list[str]]:
    """A library name and compiler flags for this CPU's vector unit. The name carries the
    capability, so that a cache shared by different machines never loads a wrong build, and
    a digest of the sources and headers (torch's own rebuild check does not read headers),
    so that a library in the cache was built from exactly these files."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    # -fopenmp: at::parallel_for is a header template; without it the kernel runs on one thread.
    # -ffp-contract=off: no fused multiply-adds the source does not write, so the layer ops
    # round as torch's separate multiplies and adds do.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off"]
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if _has_vnni():  # the int8 dot products (cpu_quant.cpp): one `dpbusd` for maddubs + madd
            flags += ["-mavx512vnni"]
            capability = "AVX512_VNNI"
    digest = hashlib.sha256(b"".join(Path(path).read_bytes() for path in SOURCES + HEADERS)).hexdigest()[:8]
    return f"servelab_cpu_paged_{capability.lower()}_{digest}", flags


def _has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (Linux's /proc/cpuinfo flags), unless
    SERVELAB_CPU_VNNI=0 builds the AVX-512 library without it (what CPUs without it run)."""
    if os.environ.get("SERVELAB_CPU_VNNI", "1") == "0":
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in cpuinfo)
    except OSError:
        return False


class KernelBuild:
    """One build of the kernels, started at most once; `module()` is None until it is ready."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deferred = False
        self._module: ModuleType | None = None
        self.error: str | None = None
        self._done = threading.Event()

    def start(self, background: bool = False) -> None:
        """Begin the build (once per process). A `background` build takes as little from
        other work as the OS allows: one compiler job at the lowest CPU priority."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, args=(background,),
                                                name="servelab-cpu-paged-build", daemon=True)
                self._thread.start()

    def start_later(self, delay_s: float = 60.0) -> None:
        """Build for the next start without competing with this run: a background build
        when this process exits, or after `delay_s` if it is still running then (a server;
        the build then waits whenever the server is busy, see yielding_build). On two cores
        even a lowest-priority compiler beside an engine using both cores slowed the
        quickstart's first `generate` 2-4x: torch's threads wait for each other whenever
        another process holds a core."""
        with self._lock:
            if self._thread is not None or self._deferred:
                return
            self._deferred = True
        timer = threading.Timer(delay_s, self.start, kwargs={"background": True})
        timer.daemon = True
        timer.start()
        atexit.register(self._start_detached)

    def _start_detached(self) -> None:
        """At exit: leave a background build running if none began (it outlives this process)."""
        with self._lock:
            if self._thread is not None:
                return
        try:
            subprocess.Popen(_background_command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=_safe_directory())
        except OSError:  # no interpreter to start at exit: the next start tries again
            pass

    def wait(self) -> ModuleType | None:
        """Start the build if needed and block until it ends; the module, or None on failure.
        A library the cache holds is loaded here, without the build's subprocess (a second
        torch import, seconds on a busy machine)."""
        if self.load_cached() is not None:
            return self._module
        self.start()
        self._done.wait()
        return self._module

    def module(self) -> ModuleType | None:
        return self._module

    def load_cached(self) -> ModuleType | None:
        """The library, loaded now if this machine's cache holds it (no compiling); None
        otherwise, or when loading it fails (one warning)."""
        with self._lock:
            if self._module is None and is_cached():
                try:
                    self._module = load_library()
                except Exception as exc:  # a damaged cache entry: serve on the torch path
                    logger.warning("cpu_paged.cached_library_unusable", reason=str(exc).strip()[-300:],
                                   fallback="torch-paged attention (same results, slower)")
            return self._module

    def _build(self, background: bool) -> None:
        try:
            command = _background_command() if background else [sys.executable, "-c", _BOOTSTRAP]
            compiled = subprocess.run(command, capture_output=True, text=True, start_new_session=True,
                                      stdin=subprocess.DEVNULL, cwd=_safe_directory())
            if background and compiled.returncode == EXIT_LOCKED:
                self.error = "another process is building the kernels"
                logger.info("cpu_paged.build_in_progress_elsewhere", fallback="torch-paged attention")
                return
            if compiled.returncode != 0:
                raise RuntimeError((compiled.stderr.strip() or compiled.stdout.strip() or "build failed")
                                   .splitlines()[-1])
            self._module = load_library()  # built: this only loads it
            logger.info("cpu_paged.kernels_ready", library=_flags()[0])
        except Exception as exc:  # a missing compiler, headers or ninja: serve on the torch path
            self.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ''}"
            logger.warning("cpu_paged.kernels_unavailable", reason=self.error,
                           fallback="torch-paged attention (same results, slower)")
        finally:
            self._done.set()


def is_cached() -> bool:
    """Whether the library for this CPU and these sources is built. (Loading it takes torch's
    build lock for a moment: a lock is no sign of a build. Every process started together,
    tensor-parallel ranks or replicas, sees the same answer.)"""
    from torch.utils import cpp_extension

    name, _ = _flags()
    try:
        directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    except (OSError, AttributeError):
        return False
    return (directory / f"{name}.so").is_file()


def load_library() -> ModuleType:
    """Build (when the cache lacks it) and import the kernels' library in this process.

    A library already in the cache is imported as it is, without torch's build step: that
    step writes its build file with this checkout's source paths, so on a cache another
    checkout of the same sources filled (same name, same digest) it would silently compile
    the whole library again, and the two checkouts would take turns rebuilding it."""
    from torch.utils import cpp_extension

    name, flags = _flags()
    directory = _build_directory()
    if directory is not None and (directory / f"{name}.so").is_file():
        return _import_library(name, directory / f"{name}.so")
    _clear_stale_lock(cpp_extension, name)
    return cpp_extension.load(name=name, sources=SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              verbose=False)


def _import_library(name: str, path: Path) -> ModuleType:
    """Import the built extension module at `path` (what torch's loader does once it has built)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _clear_stale_lock(cpp_extension: ModuleType, name: str) -> None:
    """torch waits forever on the lock file of a build whose process was killed; a build
    takes about a minute, so a lock untouched for STALE_LOCK_SECONDS is such a leftover."""
    try:
        lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
            logger.warning("cpu_paged.stale_build_lock_removed", path=str(lock))
    except (OSError, AttributeError):  # no lock (the usual case), or torch moved its helper
        return


_BUILD = KernelBuild()


def kernel_build() -> KernelBuild:
    """The process-wide build (every engine and draft model shares one library)."""
    return _BUILD


def _watch_for_stale_locks(period: float = 30.0) -> None:
    """While this build waits on another build's lock, clear it once it goes stale (its
    owner was killed), so the wait ends instead of lasting forever."""
    from torch.utils import cpp_extension

    name, _ = _flags()
    while True:
        time.sleep(period)
        _clear_stale_lock(cpp_extension, name)


# The detached build process that KernelBuild starts. A background build yields the cores
# from its first instruction (before it imports torch), runs one compiler job at a time, and
# its compilers inherit that: beside the quickstart's first `generate` on two cores, a build
# at default priority made the command 4x slower (12 s instead of 3). Even so, it is stopped
# outright while other processes keep the CPUs busy (yielding_build, run as a script so that
# it imports nothing of servelab or torch).
# `python -c` puts the working directory first on sys.path, where a `servelab/` checkout
# would shadow the installed package: the bootstrap takes it off before importing anything.
_BOOTSTRAP = ("import os, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.', os.getcwd())]; "
              "import runpy; runpy.run_module('servelab.plugins.kernels.cpu_build', run_name='__main__')")
_BACKGROUND_BOOTSTRAP = """
import os
try:  # Linux: run only on otherwise idle cores
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
os.environ["MAX_JOBS"] = "1"
""" + _BOOTSTRAP


EXIT_LOCKED = 75  # yielding_build.EXIT_LOCKED: another builder holds this cache's lock


def _build_directory() -> Path | None:
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(_flags()[0], verbose=False))
    except (OSError, AttributeError):
        return None


def _safe_directory() -> str:
    """Where build processes run: the library's build directory (never the user's)."""
    directory = _build_directory()
    return str(directory) if directory is not None and directory.is_dir() else "/"


def _background_command() -> list[str]:
    command = [sys.executable, str(Path(__file__).with_name("yielding_build.py"))]
    directory = _build_directory()
    if directory is not None:
        # torch's lock, kept fresh while the build is stopped (so it never looks like a killed
        # build's, STALE_LOCK_SECONDS), the one-builder-per-cache lock, and the library (built
        # meanwhile by another process, a stopped build is ended)
        command += ["--keep-fresh", str(directory / "lock"), "--lock", str(directory / "servelab-builder.lock"),
                    "--product", str(directory / f"{_flags()[0]}.so")]
    return command + [sys.executable, "-c", _BACKGROUND_BOOTSTRAP]


if __name__ == "__main__":
    threading.Thread(target=_watch_for_stale_locks, daemon=True).start()
    load_library()
    print(f"servelab: cpu-paged kernels built: {_flags()[0]}", file=sys.stderr)
