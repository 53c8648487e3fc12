"""The supervisor protects itself, sandbox or not (SPEC §13, last paragraph).

- **Not dumpable** (``PR_SET_DUMPABLE`` 0): processes of the supervisor's uid
  — an unsandboxed guest among them — can neither ptrace it nor read its
  memory or descriptors through ``/proc``.
- **Enough descriptors**: the soft ``RLIMIT_NOFILE`` is raised to the hard
  limit, so hundreds of guests with their connections, pipes and logs fit
  (the channel caps what each guest may hold; see ``channel.connections``).
- **No descriptor passed on by accident**: every descriptor this process
  inherited (from the shell that started ``hostcall``) is made close-on-exec,
  so a guest gets only what it is meant to (its stdio and credential). A
  folder's descriptor would otherwise let it look up paths outside its
  sandbox's mounts. Descriptors Python opens are close-on-exec already.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import resource
from typing import Final

__all__ = ["close_inherited_on_exec", "is_dumpable", "protect_process"]

logger = logging.getLogger(__name__)

_PR_SET_DUMPABLE: Final = 4
_PR_GET_DUMPABLE: Final = 3


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def close_inherited_on_exec() -> None:
    """Mark every inheritable descriptor but stdio close-on-exec."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in names:
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.set_inheritable(fd, False)


def protect_process() -> None:
    """Make this process non-dumpable, raise its descriptor limit and stop its
    inherited descriptors from reaching guests. Idempotent."""
    close_inherited_on_exec()
    try:
        if _prctl(_PR_SET_DUMPABLE, 0) != 0:
            logger.warning("could not make the supervisor non-dumpable")
    except (OSError, AttributeError):  # not Linux
        logger.warning("could not make the supervisor non-dumpable (no prctl)")
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def is_dumpable() -> bool:
    """Whether this process may be ptraced by its own uid (for tests)."""
    return _prctl(_PR_GET_DUMPABLE) == 1
