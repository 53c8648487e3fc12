"""Reaping the supervisor's children, whatever happens to the event loop.

A guest's first process (bubblewrap's monitor, or the guest itself without a
sandbox) is our child, and so, as a subreaper, is a sandbox's pid 1 once its
monitor has ended. A child that exits is a zombie until someone waits for
it. An event loop's reader on a pidfd would do that only while the loop
runs; a supervisor closed in the middle of a stop (a cancelled run, a test's
loop) would leave zombies behind for the life of the process.

So one daemon thread of the process waits for all of them: it polls their
pidfds, reaps each as it exits, and calls back (the caller hands the result
to its loop). It never waits for a pid it was not given.

A sandbox's pid 1 can exit while it is still the monitor's child: its pidfd
is readable, but it is not ours to wait for yet. bubblewrap's monitor ends
as soon as pid 1 reports the guest's exit status, without waiting for it, so
a moment later the zombie is handed to us. Such a process is kept and tried
again after every reap (the monitor's own hands its children over first) and
every second, until it is ours or its parent has reaped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import ClassVar, Final

from channel.peer import still_alive

__all__ = ["Reaper", "pidfd_exited"]

#: How long the thread sleeps when it has nothing to watch but its wake pipe.
_IDLE_POLL_MS: Final = 60_000
#: How often an exited process that is not ours yet is tried again.
_UNCLAIMED_POLL_MS: Final = 1_000

_OnExit = Callable[[int | None], None]


class Reaper:
    """One thread that reaps the children it is told about (see the module docstring)."""

    _instance: ClassVar[Reaper | None] = None
    _created = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: pidfd -> (pid, callback with the wait status, or None if not ours)
        self._watched: dict[int, tuple[int, _OnExit | None]] = {}
        #: exited, but not our child yet (the reaper's thread only)
        self._unclaimed: dict[int, tuple[int, _OnExit | None]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="hostcall-reaper", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> Reaper:
        """The process's reaper."""
        with cls._created:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def watch(self, pid: int, pidfd: int, on_exit: _OnExit | None = None) -> None:
        """Reap the process ``pidfd`` (which the reaper now owns) pins when it
        exits; then ``on_exit(returncode)`` on the reaper's thread — ``-N`` for
        signal N as ``subprocess`` says it, ``None`` if it was not our child to
        reap (its own parent did). ``pid`` only names it in errors: the wait
        is by pidfd, so a pid reused meanwhile is never waited for."""
        with self._lock:
            self._watched[pidfd] = (pid, on_exit)
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        poller = select.poll()
        registered: set[int] = set()
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with self._lock:
                current = set(self._watched)
            for fd in current - registered:
                poller.register(fd, select.POLLIN)
            registered = current
            timeout_ms = _UNCLAIMED_POLL_MS if self._unclaimed else _IDLE_POLL_MS
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    continue
                poller.unregister(fd)
                registered.discard(fd)
                with self._lock:
                    self._unclaimed[fd] = self._watched.pop(fd)
            if self._unclaimed:
                self._reap_exited()

    def _reap_exited(self) -> None:
        """Reap every exited process that is ours now, then call back for
        each one done with: reaped here, or by its own parent."""
        done: list[tuple[_OnExit | None, int | None]] = []
        for pidfd, (_pid, on_exit) in list(self._unclaimed.items()):
            try:
                # A pidfd is readable once its process has exited: this does not block.
                info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            except ChildProcessError:
                if still_alive(pidfd):
                    continue  # a zombie whose parent lives: ours when that parent ends
                info = None  # reaped by its own parent
            else:
                if info is None:
                    continue  # not exited after all
            del self._unclaimed[pidfd]
            os.close(pidfd)
            returncode: int | None = None
            if info is not None:
                exited = info.si_code == os.CLD_EXITED
                returncode = info.si_status if exited else -info.si_status
            done.append((on_exit, returncode))
        for on_exit, returncode in done:
            if on_exit is not None:
                on_exit(returncode)


async def pidfd_exited(pidfd: int, timeout_s: float) -> bool:
    """Wait (bounded) until the process ``pidfd`` pins has exited; whether it has."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await exited
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(pidfd)
    return True
