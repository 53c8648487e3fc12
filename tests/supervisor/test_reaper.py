"""The reaper's thread with real processes: a zombie handed to us late is still reaped.

A sandbox's pid 1 can exit while bubblewrap's monitor is still its parent
and become our child (we are a subreaper) only when the monitor ends. Here a
child of ours (the "monitor") forks a grandchild that exits at once, and
ends when told to: without waiting for it, or (``wait``) after reaping it.
"""

from __future__ import annotations

import os
import queue
import signal
import sys

import pytest

from supervisor.reaper import Reaper
from supervisor.tracking import become_subreaper
from tests.harness import STEP_TIMEOUT_S

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux 5.3)")

# Forks a grandchild that exits 7 at once, says its pid once it has exited
# (WNOWAIT: left a zombie), and ends when its stdin closes: reaping the
# grandchild first if told to ``wait``.
MONITOR = """
import os, sys
pid = os.fork()
if pid == 0:
    os._exit(7)
os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
print(pid, flush=True)
sys.stdin.read()
if sys.argv[1:] == ["wait"]:
    os.waitpid(pid, 0)
"""


def _spawn_monitor(*args: str) -> tuple[int, int, int]:
    """Start MONITOR as our child; returns its pid, its stdin and its stdout."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    pid = os.posix_spawn(
        sys.executable,
        [sys.executable, "-c", MONITOR, *args],
        os.environ,
        file_actions=[
            (os.POSIX_SPAWN_DUP2, stdin_r, 0),
            (os.POSIX_SPAWN_DUP2, stdout_w, 1),
        ],
    )
    os.close(stdin_r)
    os.close(stdout_w)
    return pid, stdin_w, stdout_r


def test_a_zombie_that_becomes_ours_after_it_exited_is_reaped_with_its_status() -> None:
    assert become_subreaper()  # as a supervisor is: orphans come to us
    reaper = Reaper.shared()
    exits: queue.Queue[tuple[str, int | None]] = queue.Queue()

    monitor, monitor_stdin, monitor_stdout = _spawn_monitor()
    with os.fdopen(monitor_stdout) as out:
        grandchild = int(out.readline())
    grandchild_fd = os.pidfd_open(grandchild)
    still_there = os.dup(grandchild_fd)  # the reaper closes the one it is given
    try:
        # The grandchild has exited: its pidfd is readable, but its parent is
        # the monitor, so it is not ours to wait for yet.
        reaper.watch(grandchild, grandchild_fd, lambda code: exits.put(("grandchild", code)))
        # A process watched after it is seen by the reaper in the same pass or
        # a later one: once its exit is reported, the grandchild has been tried.
        marker = os.posix_spawn("/bin/true", ["true"], os.environ)
        reaper.watch(marker, os.pidfd_open(marker), lambda code: exits.put(("marker", code)))
        assert exits.get(timeout=STEP_TIMEOUT_S) == ("marker", 0)
        assert exits.empty(), "a zombie that is not ours yet is neither reaped nor given up"
        signal.pidfd_send_signal(still_there, 0)  # the zombie is still there

        reaper.watch(monitor, os.pidfd_open(monitor), lambda code: exits.put(("monitor", code)))
        os.close(monitor_stdin)  # the monitor ends; the zombie is handed to us
        # Reaped by us (its status is ours to read), and before the monitor's
        # exit is reported: nothing of it is left once its parent is seen gone.
        assert exits.get(timeout=STEP_TIMEOUT_S) == ("grandchild", 7)
        assert exits.get(timeout=STEP_TIMEOUT_S) == ("monitor", 0)
        with pytest.raises(ProcessLookupError):
            signal.pidfd_send_signal(still_there, 0)
    finally:
        os.close(still_there)


def test_a_zombie_its_own_parent_reaps_is_given_up_without_a_status() -> None:
    assert become_subreaper()
    reaper = Reaper.shared()
    exits: queue.Queue[tuple[str, int | None]] = queue.Queue()

    monitor, monitor_stdin, monitor_stdout = _spawn_monitor("wait")
    with os.fdopen(monitor_stdout) as out:
        grandchild = int(out.readline())
    reaper.watch(grandchild, os.pidfd_open(grandchild), lambda c: exits.put(("grandchild", c)))
    reaper.watch(monitor, os.pidfd_open(monitor), lambda code: exits.put(("monitor", code)))
    os.close(monitor_stdin)  # the monitor reaps the zombie, then ends
    # Never ours: no status, and not kept waiting for one.
    assert exits.get(timeout=STEP_TIMEOUT_S) == ("grandchild", None)
    assert exits.get(timeout=STEP_TIMEOUT_S) == ("monitor", 0)
