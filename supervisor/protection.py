"""The supervisor protects itself, sandbox or not (docs/sandbox.md, last paragraph).

- **Not dumpable** (``PR_SET_DUMPABLE`` 0): processes of the supervisor's uid
  — an unsandboxed guest among them — can neither ptrace it nor read its
  memory or descriptors through ``/proc``. For as long as a supervisor runs
  in the process: when the last one closes, the flag is put back as it was
  (a host program that ran one is then inspectable, and can be told from a
  guest, by another supervisor's admin API again).
- **Enough descriptors**: the soft ``RLIMIT_NOFILE`` is raised to the hard
  limit, so hundreds of guests with their connections, pipes and logs fit
  (the channel caps what each guest may hold; see ``channel.connections``).
- **No descriptor passed on by accident**: every descriptor this process
  inherited (from the shell that started ``hostcall``) is made close-on-exec,
  so a guest gets only what it is meant to (its stdio and credential). A
  folder's descriptor would otherwise let it look up paths outside its
  sandbox's mounts. Descriptors Python opens are close-on-exec already.
- **A log a guest cannot flood**: aiohttp logs every frame its parser
  rejects; those loggers are rate-limited.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import resource
import threading
from typing import Final

__all__ = [
    "RateLimit",
    "close_inherited_on_exec",
    "is_dumpable",
    "limit_noisy_loggers",
    "protect_process",
    "unprotect_process",
]

logger = logging.getLogger(__name__)

#: Loggers a guest can make speak, and how much of them gets through.
NOISY_LOGGERS: Final = ("aiohttp.server", "aiohttp.web", "aiohttp.access")
LOG_BURST: Final = 20
LOG_PERIOD_S: Final = 60.0
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


class _Holders:
    """How many running supervisors protect this process, and whether it was
    dumpable before the first of them did."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.was_dumpable = False


_HOLDERS: Final = _Holders()


def protect_process() -> None:
    """Make this process non-dumpable, raise its descriptor limit and stop its
    inherited descriptors from reaching guests. Each call is undone by one
    :func:`unprotect_process`."""
    close_inherited_on_exec()
    limit_noisy_loggers()
    with _HOLDERS.lock:
        try:
            if _HOLDERS.count == 0:
                _HOLDERS.was_dumpable = is_dumpable()
            if _prctl(_PR_SET_DUMPABLE, 0) != 0:
                logger.warning("could not make the supervisor non-dumpable")
        except (OSError, AttributeError):  # not Linux
            logger.warning("could not make the supervisor non-dumpable (no prctl)")
        _HOLDERS.count += 1
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = 1 << 20
        if soft != resource.RLIM_INFINITY and soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class RateLimit(logging.Filter):
    """Lets at most ``burst`` records through per ``period_s``, then one line
    saying how many were dropped: a guest that sends malformed frames in a
    loop must not fill the supervisor's log (docs/security.md, S9)."""

    def __init__(self, burst: int = LOG_BURST, period_s: float = LOG_PERIOD_S) -> None:
        super().__init__()
        self._burst = burst
        self._period_s = period_s
        self._window = 0.0
        self._passed = 0
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.created - self._window >= self._period_s:
            if self._dropped:
                record.msg = f"({self._dropped} similar messages dropped) {record.msg}"
            self._window, self._passed, self._dropped = record.created, 0, 0
        if self._passed >= self._burst:
            self._dropped += 1
            return False
        self._passed += 1
        return True


def limit_noisy_loggers() -> None:
    """Rate-limit the loggers a guest can make speak (aiohttp's, for frames
    its parser rejects). Idempotent."""
    for name in NOISY_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, RateLimit) for f in target.filters):
            target.addFilter(RateLimit())


def unprotect_process() -> None:
    """One supervisor of this process has closed: when it was the last, the
    process is dumpable again if it was before the first. The descriptor
    limit and close-on-exec flags stay."""
    with _HOLDERS.lock:
        if _HOLDERS.count == 0:
            return
        _HOLDERS.count -= 1
        if _HOLDERS.count == 0 and _HOLDERS.was_dumpable:
            with contextlib.suppress(OSError, AttributeError):
                _prctl(_PR_SET_DUMPABLE, 1)


def is_dumpable() -> bool:
    """Whether this process may be ptraced by its own uid (for tests)."""
    return _prctl(_PR_GET_DUMPABLE) == 1
