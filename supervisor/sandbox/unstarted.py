"""Ending a sandbox whose guest must never run: its start failed, was
cancelled, or its execution ended first.

bubblewrap's pid 1 waits on ``--block-fd`` before it runs the command, and
takes the end of that pipe for its go-ahead as much as a byte. The gate
before the guest's program does not (:meth:`~supervisor.sandbox.bwrap.SandboxLaunch.command`):
at the pipe's end it exits, and the guest never runs. Until the guest runs,
pid 1 has no parent-death signal either, so it is killed here, that nothing of
the start outlives it: :func:`never_run` kills bubblewrap and the pid 1 the
start knows of, then whoever else still holds the pipe — a pid 1 bubblewrap
cloned but never reported, the supervisor's child once bubblewrap is gone (it
is a subreaper) — and waits until they are gone. A cancel meanwhile does not
cut that short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import time
from collections.abc import Awaitable
from typing import Final, Protocol

from supervisor.reaper import Reaper, pidfd_exited
from supervisor.spawn import GuestProcess
from supervisor.tracking import proc_snapshot

__all__ = ["KILLED_START_END_TIMEOUT_S", "holds", "never_run", "spawned_since", "uncancelled"]

logger = logging.getLogger(__name__)

#: How long bubblewrap, then the processes holding its block pipe, may each
#: take to end once killed.
KILLED_START_END_TIMEOUT_S: Final = 1.0
#: How often the processes holding a killed start's block pipe are looked for.
HOLDERS_POLL_S: Final = 0.01
#: Slack on a process's start time, which the kernel counts in clock ticks.
_START_SLACK_S: Final = 1.0
_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")


class KnownPid1(Protocol):
    """The sandbox's pid 1, where bubblewrap reported it."""

    def signal(self, signum: int) -> None: ...

    async def wait_gone(self, timeout_s: float) -> bool: ...


def spawned_since() -> int:
    """Now, as a start time of ``/proc/<pid>/stat`` (clock ticks after boot),
    less some slack: every process started from here on is at least this."""
    return int((time.clock_gettime(time.CLOCK_BOOTTIME) - _START_SLACK_S) * _CLOCK_TICKS)


async def never_run(
    block_w: int,
    process: GuestProcess | None,
    pid_1: KnownPid1 | None,
    since: int,
) -> None:
    """Kill what a start that will not let its guest run has started
    (``since``: :func:`spawned_since` before bubblewrap was), close
    ``block_w``, and wait until they are gone. Bounded: one that could not be
    killed meets the gate, which ends it without running the guest."""
    if pid_1 is not None:
        pid_1.signal(signal.SIGKILL)
    if process is not None:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(KILLED_START_END_TIMEOUT_S):
                await process.wait()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + KILLED_START_END_TIMEOUT_S
    killed = {process.pid} if process is not None else set()
    parents = {os.getpid(), *killed}
    exiting: list[int] = []  # pidfds of the holders killed
    try:
        while _read_by_others(block_w):
            # In a thread: with many guests the walk of /proc takes milliseconds.
            for pid in set(await asyncio.to_thread(_holders, block_w, parents, since)) - killed:
                killed.add(pid)
                exiting.extend(_kill_and_reap(pid, block_w))
            if loop.time() >= deadline:  # after one look at least, however late
                if _read_by_others(block_w):
                    logger.warning(
                        "a sandbox's pid 1 could not be killed; "
                        "its gate ends it without running the guest"
                    )
                break
            await asyncio.sleep(HOLDERS_POLL_S)
        os.close(block_w)
        # A process lets go of its descriptors before it has quite exited.
        for pidfd in exiting:
            await pidfd_exited(pidfd, max(0.0, deadline - loop.time()))
        if pid_1 is not None:
            await pid_1.wait_gone(max(0.0, deadline - loop.time()))
    finally:
        for pidfd in exiting:
            os.close(pidfd)


async def uncancelled(awaitable: Awaitable[None]) -> None:
    """Await to its end, cancelled or not: a cancel meanwhile is raised after."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


def _read_by_others(block_w: int) -> bool:
    """Whether a process still holds the read end of the block pipe (ours is closed)."""
    poll = select.poll()
    poll.register(block_w, select.POLLOUT)
    return not any(events & select.POLLERR for _, events in poll.poll(0))


def _holders(block_w: int, parents: set[int], since: int) -> list[int]:
    """Children of ``parents`` started ``since``, that hold the read end of
    the block pipe: a pid 1 is bubblewrap's child, or ours once it is gone.
    (Not every descendant: a guest's thousands of descriptors are not read.)"""
    try:
        snapshot = proc_snapshot()
    except OSError:  # out of descriptors, say: looked for again until the deadline
        return []
    return [
        pid
        for pid, stat in snapshot.items()
        if stat.ppid in parents and stat.start >= since and holds(pid, block_w)
    ]


def holds(pid: int, block_w: int) -> bool:
    """Whether ``pid`` holds a descriptor of the block pipe."""
    pipe = f"pipe:[{os.fstat(block_w).st_ino}]"
    fds = f"/proc/{pid}/fd"
    try:
        return any(_link(f"{fds}/{fd}") == pipe for fd in os.listdir(fds))
    except OSError:
        return False


def _kill_and_reap(pid: int, block_w: int) -> list[int]:
    """SIGKILL ``pid``, and have it reaped once it exits if it is our child;
    a pidfd of it to wait on (none if it had none, or was gone)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already: its pid may be another's now
        return []
    except OSError:  # no pidfd here: by pid, then
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        return []
    if not holds(pid, block_w):
        # Gone since the walk, and its pid taken by another process: the
        # pidfd, opened first, names the process looked at now.
        os.close(pidfd)
        return []
    with contextlib.suppress(OSError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    try:
        mine = os.dup(pidfd)
    finally:
        Reaper.shared().watch(pid, pidfd)
    return [mine]


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None
