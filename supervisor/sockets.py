"""Unix socket paths of any length.

``sun_path`` holds 108 bytes. A socket whose path is longer is bound and
reached through ``/proc/self/fd/N/NAME``, where N is an ``O_PATH`` descriptor
of its directory: the kernel resolves the rest, so the operator's state dir
may be as deep as it likes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Final

__all__ = ["MAX_SOCKET_PATH", "reachable_path"]

#: ``sun_path`` holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH: Final = 107


@contextlib.contextmanager
def reachable_path(path: Path) -> Iterator[str]:
    """A path string that ``bind()``/``connect()`` accept for ``path``.

    The short form stays valid while the context is open (its directory
    descriptor is held); bind or connect inside it.
    """
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)
