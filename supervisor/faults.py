"""Crash points for the fault-injection harness (``scripts/faults``).

Off unless ``HOSTCALL_FAULT`` is set in the supervisor's environment, e.g.
``HOSTCALL_FAULT=after_begin:3`` — SIGKILL this process the 3rd time the
pipeline reaches ``after_begin``. Each point sits where a real crash would
leave a different state behind:

| point | state a crash there leaves |
|---|---|
| ``before_begin`` | nothing recorded: the call never ran |
| ``after_begin`` | a ``pending`` row, the handler not yet called |
| ``in_handler`` | a ``pending`` row, the effect done (the harness's handler calls it) |
| ``after_handler`` | the handler returned; its result not yet committed |
| ``before_reply`` | committed; the guest never got the answer |

Two more points, outside the harness's rotation: ``receipt_journaled``
(reached only on the SQLite store) — a transaction holding receipts has
committed, their lines are not yet in the receipt file; ``sandbox_joined`` —
a sandboxed guest's pid 1 is in its cgroup, the guest not yet let run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Final

__all__ = ["POINTS", "START_POINTS", "STORE_POINTS", "crash_point"]

POINTS: Final = ("before_begin", "after_begin", "in_handler", "after_handler", "before_reply")
STORE_POINTS: Final = ("receipt_journaled",)
START_POINTS: Final = ("sandbox_joined",)
#: How long a crash point waits for its ``ready``.
READY_TIMEOUT_S: Final = 5.0


def _parse(value: str | None) -> tuple[str, int] | None:
    if not value:
        return None
    point, _, nth = value.partition(":")
    if point not in POINTS + STORE_POINTS + START_POINTS:
        known = ", ".join(POINTS + STORE_POINTS + START_POINTS)
        raise ValueError(f"HOSTCALL_FAULT: unknown point {point!r}; one of {known}")
    return point, int(nth or "1")


_ARMED: Final = _parse(os.environ.get("HOSTCALL_FAULT"))
_reached: dict[str, int] = {}


def crash_point(name: str, ready: Callable[[], bool] | None = None) -> None:
    """Die by SIGKILL here if ``HOSTCALL_FAULT`` names this point (and count);
    with ``ready``, once it says so (asked every millisecond, for at most
    :data:`READY_TIMEOUT_S`)."""
    if _ARMED is None or _ARMED[0] != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == _ARMED[1]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while ready is not None and not ready() and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
