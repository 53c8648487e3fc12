"""The supervisor protects itself, sandbox or not (SPEC §13, last paragraph).

- **Not dumpable** (``PR_SET_DUMPABLE`` 0): processes of the supervisor's uid
  — an unsandboxed guest among them — can neither ptrace it nor read its
  memory or descriptors through ``/proc``.
- **Enough descriptors**: the soft ``RLIMIT_NOFILE`` is raised to the hard
  limit, so hundreds of guests with their connections, pipes and logs fit
  (the channel caps what each guest may hold; see ``channel.connections``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import resource
from typing import Final

__all__ = ["is_dumpable", "protect_process"]

logger = logging.getLogger(__name__)

_PR_SET_DUMPABLE: Final = 4
_PR_GET_DUMPABLE: Final = 3


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def protect_process() -> None:
    """Make this process non-dumpable and raise its descriptor limit. Idempotent."""
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
