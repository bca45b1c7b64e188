"""The file a file-backed host tier maps (`[kv_offload] path`, docs/kv-tiers.md).

Two rules keep the mapping safe:

- One engine a file. The host tier's bookkeeping (which host block holds which prefix)
  lives in the engine's memory, so a second engine mapping the same file would hand out
  the same host blocks and overwrite the first one's KV without either knowing. The file
  is locked (`flock`, exclusive) for as long as the mapping lives; a second engine on the
  same path (another server, another replica) is refused at start, by name.
- Room reserved at start. A sparse file's pages are allocated on first write, and a write
  through a mapping into a filesystem without room is SIGBUS, mid-serving. The whole size
  is allocated before the tier is mapped (`posix_fallocate`, or zeros written where the
  filesystem cannot), so a full disk is a start-up error naming the path.
"""

from __future__ import annotations

import errno
import fcntl
import os

from servelab.errors import ConfigError

_ZEROS = bytes(1 << 20)


def reserve_tier_file(path: str, num_bytes: int) -> int:
    """Open (creating) `path`, lock it for this engine and allocate `num_bytes` in it.
    Returns the open descriptor, which holds the lock: close it when the mapping goes."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise ConfigError(f"[kv_offload] path {path!r} cannot be opened: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"[kv_offload] path {path!r} is in use by another engine: the host tier's "
                              f"bookkeeping is per engine, so each server or replica needs its own file") from None
        _allocate(fd, path, num_bytes)
        os.ftruncate(fd, num_bytes)  # a larger file left from before: cut to the tier's size
    except BaseException:
        os.close(fd)
        raise
    return fd


def _allocate(fd: int, path: str, num_bytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, num_bytes)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise _no_room(path, num_bytes, exc) from None
    try:  # a filesystem without fallocate: write the zeros (the pages then exist)
        written = 0
        while written < num_bytes:
            written += os.pwrite(fd, _ZEROS[: min(len(_ZEROS), num_bytes - written)], written)
        os.fsync(fd)
    except OSError as exc:
        raise _no_room(path, num_bytes, exc) from None


def _no_room(path: str, num_bytes: int, exc: OSError) -> ConfigError:
    return ConfigError(f"[kv_offload] path {path!r}: cannot reserve {num_bytes} bytes for the host tier "
                       f"({exc.strerror}); free space there, lower host_blocks or host_memory, or use another path")
