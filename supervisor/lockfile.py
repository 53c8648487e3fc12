"""A lock file that names its holder: the state dir's and the SQLite store's
(docs/operations.md). ``flock`` on a file kept open for the holder's life,
released by the kernel when it dies, with its pid written in for the one
refused."""

from __future__ import annotations

import contextlib
import fcntl
import os

__all__ = ["drop_lock", "hold_lock"]


def hold_lock(fd: int) -> str | None:
    """Take the exclusive ``flock`` of the open lock file ``fd`` and write
    this process's pid in it; or, when another process holds it, the pid it
    wrote there (``"unknown"`` if none), and nothing is taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return None


def drop_lock(fd: int) -> None:
    """Let a lock :func:`hold_lock` took go: its pid wiped, its file closed."""
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)
