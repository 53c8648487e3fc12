"""Starting a guest's first process: the one place that calls ``subprocess.Popen``.

Why not ``asyncio.create_subprocess_exec``: on uvloop (hostcall's default
loop) it forks, and ``fork`` copies the supervisor's page tables while the
event loop waits — tens of milliseconds for a supervisor serving many guests,
during which no call is answered. ``subprocess.Popen`` uses ``vfork`` (the
parent thread waits only until the child has exec'd), closes every
descriptor but the ones passed (``close_fds``), and runs in the event loop's
thread, so the child's parent-death signal (bubblewrap's
``--die-with-parent``) is tied to a thread that lives as long as the
supervisor.

:class:`GuestProcess` gives the result the shape of
``asyncio.subprocess.Process`` (``pid``, ``returncode``, ``stdin``,
``stdout``, ``stderr``, ``wait``, signals): its pipes are asyncio streams, and
its exit is seen on a pidfd and reaped here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import IO, Any

from supervisor.reaper import Reaper

__all__ = ["GuestProcess", "spawn"]


class GuestProcess:
    """A started guest process, for asyncio (see the module docstring)."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        *,
        stdin: asyncio.StreamWriter | None,
        stdout: asyncio.StreamReader | None,
        stderr: asyncio.StreamReader | None,
        transports: Sequence[asyncio.BaseTransport] = (),
    ) -> None:
        self._popen = popen
        self._transports = transports
        self.pid = popen.pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = loop.create_future()
        self._loop = loop
        # Reaped by the process's reaper thread, loop or no loop (see
        # supervisor.reaper); signalled through a pidfd of our own, so a pid
        # reused after the reap is never hit.
        try:
            pidfd = os.pidfd_open(self.pid)
        except OSError:  # no pidfd (Linux < 5.3): ask on a timer instead
            self._signal_fd: int | None = None
            self._poll = loop.call_later(_POLL_S, self._check)
        else:
            self._signal_fd = os.dup(pidfd)
            Reaper.shared().watch(self.pid, pidfd, self._reaped)

    def close_pipes(self) -> None:
        """Close its stdio pipes, for one never handed to a caller (a start
        that failed midway): nobody else would."""
        for transport in self._transports:
            transport.close()

    def _reaped(self, code: int | None) -> None:
        """On the reaper's thread: hand the exit to the loop (if it still runs)."""
        code = 255 if code is None else code  # reaped by someone else: code lost
        self._popen.returncode = code
        with contextlib.suppress(RuntimeError):  # the loop has closed
            self._loop.call_soon_threadsafe(self._settle, code)

    def _settle(self, code: int) -> None:
        self.returncode = code
        if self._signal_fd is not None:
            os.close(self._signal_fd)
            self._signal_fd = None
        if not self._exited.done():
            self._exited.set_result(code)

    def _check(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: the code is lost
            pid, status = self.pid, 255 << 8
        if pid == 0:
            self._poll = self._loop.call_later(_POLL_S, self._check)
            return
        code = os.waitstatus_to_exitcode(status)
        self._popen.returncode = code
        self._settle(code)

    async def wait(self) -> int:
        """Wait until the process itself has exited (not for its pipes to close,
        which a leftover grandchild may hold open forever); its returncode."""
        return await asyncio.shield(self._exited)

    def send_signal(self, signum: int) -> None:
        """Signal it, unless it has been reaped (its pid may be someone else's)."""
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            if self._signal_fd is not None:
                signal.pidfd_send_signal(self._signal_fd, signum)
            else:
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


#: How often the exit is checked where the kernel has no pidfd.
_POLL_S = 0.02


async def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    pass_fds: Sequence[int] = (),
) -> GuestProcess:
    """Start ``argv`` in a session of its own with only ``pass_fds`` (and stdio)
    inherited. ``stdin``/``stdout``/``stderr`` take what ``subprocess`` takes;
    ``subprocess.PIPE`` gives an asyncio stream.

    Raises:
        OSError: the program could not be started.
    """
    # vfork: the loop waits only until the child exec's (see the module docstring).
    popen = subprocess.Popen(  # noqa: ASYNC220
        list(argv),
        env=dict(env),
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        pass_fds=tuple(pass_fds),
        close_fds=True,
        start_new_session=True,
    )
    # Each pipe handed to a transport of the loop is the transport's to close.
    handed: dict[int, asyncio.BaseTransport] = {}
    try:
        writer = await _writer(popen.stdin, handed) if popen.stdin is not None else None
        out = await _reader(popen.stdout, handed) if popen.stdout is not None else None
        err = await _reader(popen.stderr, handed) if popen.stderr is not None else None
    except BaseException:
        popen.kill()
        popen.wait()
        for pipe in (popen.stdin, popen.stdout, popen.stderr):
            if pipe is None:
                continue
            transport = handed.get(pipe.fileno())
            if transport is None:
                pipe.close()
            else:
                transport.close()
        raise
    return GuestProcess(
        popen, stdin=writer, stdout=out, stderr=err, transports=list(handed.values())
    )


async def _reader(
    pipe: IO[bytes], handed: dict[int, asyncio.BaseTransport]
) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(loop=loop)
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe
    )
    handed[pipe.fileno()] = transport
    return reader


async def _writer(
    pipe: IO[bytes], handed: dict[int, asyncio.BaseTransport]
) -> asyncio.StreamWriter:
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop), pipe
    )
    handed[pipe.fileno()] = transport
    return asyncio.StreamWriter(transport, protocol, None, loop)
