"""Starting and stopping a sandboxed guest (docs/sandbox.md).

The process we start is bubblewrap's monitor, whose child becomes pid 1 of the
guest's own pid namespace and starts the command. Nothing of the guest can
leave that namespace, and when its pid 1 dies the kernel kills everything in
it at once: that is the atomic end of the tree. The command waits (bubblewrap's
``--block-fd``, then the gate) until the supervisor has put pid 1 into the
execution's cgroup and written the go-ahead, so no guest code runs outside it,
nor at all if the supervisor dies first.

The go-ahead comes in two parts, and the start ends between them: bubblewrap's
byte lets it go on to the gate, which says it was reached (:mod:`.gate`); only
then does the gate get its line. bubblewrap builds the sandbox's mounts before
it reads its byte, and dies (exit 1, its reason on the guest's stderr) when
one fails — a masked socket unlinked since the masks were chosen. Its exit
status cannot tell that from a guest's ``exit 1``, nor can ``--info-fd`` or
``--json-status-fd`` (each written before the mounts, or only once pid 1 has
ended); the gate's line can, and no code of the guest runs before it is read.
So such a failure is a :class:`SandboxError` of the start, which the launcher
may try again, never the guest's exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Final, Protocol

from supervisor.errors import HostcallError
from supervisor.faults import crash_point
from supervisor.process import (
    STOP_GRACE_S,
    CredentialTransport,
    credential_fd,
    wait_exited,
)
from supervisor.reaper import Reaper, pidfd_exited
from supervisor.sandbox.bwrap import SandboxLaunch
from supervisor.sandbox.gate import (
    BWRAP_GO_AHEAD,
    GATE_GO_AHEAD,
    GATE_REACHED,
    gate_pipe,
    reached_pipe,
)
from supervisor.sandbox.policy import SandboxError
from supervisor.sandbox.unstarted import holds, never_run, spawned_since, uncancelled
from supervisor.spawn import GuestProcess, spawn
from supervisor.tracking import descendants, process_map

__all__ = [
    "SANDBOX_START_TIMEOUT_S",
    "CgroupPort",
    "Sandboxed",
    "StartAbandoned",
    "launch_sandboxed",
    "stop_sandbox",
]

logger = logging.getLogger(__name__)

#: How long bubblewrap may take to report its sandbox's pid 1.
SANDBOX_START_TIMEOUT_S: Final = 30.0
#: How long a sandbox that failed to start may take to say why.
STDERR_TAIL_TIMEOUT_S: Final = 1.0


class StartAbandoned(Exception):
    """The execution ended (a cancel, a fence, the supervisor closing) while
    its guest was being started: the guest was never let run."""

    #: The execution's ``"sandbox"``: what its guest would have run in (the
    #: launcher says; a guest without a sandbox keeps ``"off"``).
    sandbox: Mapping[str, Any] | str = "off"

    def __init__(self) -> None:
        super().__init__("the execution ended before its guest could run")


@dataclass(eq=False)
class Sandboxed:
    """A running sandbox: its pid 1 (pinned by a pidfd) and its pid namespace."""

    init_pid: int
    #: Inode of the guest's pid namespace: the channel's origin check.
    pidns: int
    pidfd: int | None = field(default=None, repr=False)
    #: Held open until the execution has ended: a namespace's inode number is
    #: reused as soon as it is freed, and another sandbox must not get this
    #: one's while the channel still accepts it.
    nsfd: int | None = field(default=None, repr=False)

    def signal(self, signum: int) -> None:
        """Signal pid 1; SIGKILL ends every process of the sandbox at once."""
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signum)
            else:
                os.kill(self.init_pid, signum)

    def members(self) -> list[int]:
        """The sandbox's processes but its pid 1, from one pass over ``/proc``."""
        return descendants(self.init_pid, process_map())

    async def wait_gone(self, timeout_s: float) -> bool:
        """Wait (bounded) until pid 1, and with it every process inside, has ended.

        The kernel kills and reaps a pid namespace's processes before its pid 1
        counts as exited. Reaps pid 1 if it became our child (we are a subreaper
        and bubblewrap's monitor, its parent, ended first).
        """
        gone = True
        if self.pidfd is not None:
            gone = await pidfd_exited(self.pidfd, timeout_s)
            if gone:
                # Ours if the monitor ended first: reap it now rather than when
                # the reaper's thread gets to it, so no zombie outlives the stop.
                # Still the monitor's child otherwise; the reaper takes it over.
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, self.pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 - WNOHANG
        return gone

    def close(self) -> None:
        """Release the pidfd and the namespace. Idempotent.

        (pid 1 itself is the reaper's: it becomes our child when bubblewrap's
        monitor ends first, and is reaped when it exits, whenever that is.)
        """
        for name in ("pidfd", "nsfd"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)


async def launch_sandboxed(
    launch: SandboxLaunch,
    *,
    credential: str,
    transport: CredentialTransport = "fd",
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    join: Callable[[int], None] | None = None,
    ended: asyncio.Event | None = None,
) -> tuple[GuestProcess, Sandboxed]:
    """Start a guest inside its sandbox; returns bubblewrap's monitor and the sandbox.

    bubblewrap reports the pid of the sandbox's pid 1 (``--info-fd``) before it
    runs anything of the guest, then waits on ``--block-fd``: ``join(pid)``
    (the execution's cgroup) runs in between, so the guest's first instruction
    already runs inside it. Returns once the gate, with the whole sandbox
    built, has been given its go-ahead. Once ``ended`` is set (its execution
    ended while bubblewrap built the sandbox), the guest is never let run.

    Raises:
        OSError: bubblewrap could not be started.
        SandboxError: bubblewrap ended before it reported the sandbox or
            before it reached the gate (a mount failed, say), or ``join``
            failed (the sandbox is then killed).
        StartAbandoned: ``ended`` was set first (the sandbox is then killed).
    """
    made: list[int] = []  # closed here should the start fail before spawning
    try:
        if ended is not None and ended.is_set():
            raise StartAbandoned  # before bubblewrap is even spawned
        env = dict(launch.env)
        # The credential is written only once the sandbox is in its cgroup: should
        # the supervisor die before, nothing has it.
        cred_r: int | None = None
        cred_w: int | None = None
        if transport == "fd":
            cred_r, cred_w = os.pipe()
            made += [cred_r, cred_w]
            env["HOSTCALL_CREDENTIAL_FD"] = str(cred_r)
        else:
            credential_fd(env, credential, transport)
        # The options in a memory file, not a pipe: they may be larger than a pipe
        # holds (a mask per Unix socket on the host), and nobody reads them yet.
        args_r = os.memfd_create("hostcall-bwrap-args", os.MFD_CLOEXEC)
        made.append(args_r)
        info_r, info_w = os.pipe()
        made += [info_r, info_w]
        block_r, gate_r, block_w = gate_pipe(launch.gate_group)
        made += [block_r, gate_r, block_w]
        reached_r, reached_w = reached_pipe(launch.gate_group)
        made += [reached_r, reached_w]
        # reached_r is bubblewrap's too (see reached_pipe), and stays ours.
        ours = [info_r, block_w, reached_r, *([] if cred_w is None else [cred_w])]
        # The launch's own descriptors (--bind-fd) are theirs too: closed here
        # once bubblewrap has them, or failed to start.
        theirs = [
            args_r,
            info_w,
            block_r,
            gate_r,
            reached_w,
            *([] if cred_r is None else [cred_r]),
            *launch.pass_fds,
        ]
    except BaseException:
        for fd in made:
            os.close(fd)
        launch.close_fds()  # not yet among theirs
        raise
    since = spawned_since()  # no process of this start is older
    try:
        options = [*launch.options, "--info-fd", str(info_w), "--block-fd", str(block_r)]
        if launch.seccomp is not None:
            filter_fd = os.memfd_create("hostcall-seccomp", os.MFD_CLOEXEC)
            theirs.append(filter_fd)
            _write_all(filter_fd, launch.seccomp)
            os.lseek(filter_fd, 0, os.SEEK_SET)
            options += ["--seccomp", str(filter_fd)]
        _write_all(args_r, b"".join(o.encode() + b"\0" for o in options))
        os.lseek(args_r, 0, os.SEEK_SET)
        process = await spawn(
            [
                str(launch.program),
                *("--args", str(args_r), "--"),
                *launch.command(gate_r, reached_w),
            ],
            env=env,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=[*theirs, reached_r],
        )
    except BaseException:
        for fd in theirs:
            os.close(fd)
        ours.remove(block_w)  # closed by never_run
        try:
            # spawn() killed and reaped bubblewrap if it had started it; a pid 1
            # it cloned first may still wait on the block pipe.
            await uncancelled(never_run(block_w, None, None, since))
        finally:
            for fd in ours:
                os.close(fd)
        raise
    for fd in theirs:
        os.close(fd)
    sandbox: Sandboxed | None = None
    try:
        # One bound for the whole start: the report, the join, the gate.
        deadline = time.monotonic() + SANDBOX_START_TIMEOUT_S

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        sandbox = _sandbox_from(await _read_to_eof(info_r, SANDBOX_START_TIMEOUT_S))
        if ended is not None and ended.is_set():
            raise StartAbandoned
        if join is not None:
            # In a thread: joining a cgroup v1 waits for the kernel (an RCU grace
            # period, ~10 ms) while bubblewrap sets up its mounts meanwhile.
            try:
                async with asyncio.timeout(left()):
                    await asyncio.to_thread(join, sandbox.init_pid)
            except TimeoutError:
                raise SandboxError(
                    f"its cgroup was not joined within {SANDBOX_START_TIMEOUT_S:g} s"
                ) from None
        if ended is not None and ended.is_set():
            raise StartAbandoned
        # The fault harness's crash: once bubblewrap's monitor has let pid 1 go
        # on to wait for us (the monitor then closes its copy of the block pipe).
        # Killed earlier, it leaves pid 1 asleep in bubblewrap for good.
        crash_point("sandbox_joined", ready=lambda: not holds(process.pid, block_w))
        if cred_w is not None:
            _write_all(cred_w, credential.encode("ascii"))
            os.close(cred_w)
            ours.remove(cred_w)
        try:
            os.write(block_w, BWRAP_GO_AHEAD)  # bubblewrap may go on to the gate
        except BrokenPipeError:
            raise SandboxError(
                "bubblewrap ended while it built the sandbox (see the guest's stderr)"
            ) from None
        await _gate_reached(reached_r, left())
        if ended is not None and ended.is_set():
            raise StartAbandoned
        with contextlib.suppress(BrokenPipeError):  # the gate died since: it ran nothing
            os.write(block_w, GATE_GO_AHEAD)  # the guest may run now
    except BaseException as exc:
        # Its pid 1 has no parent-death signal until the guest starts: nothing
        # of it may be left. (The gate never runs the guest on the pipe's end.)
        try:
            ours.remove(block_w)  # closed by never_run
            await uncancelled(never_run(block_w, process, sandbox, since))
            if isinstance(exc, StartAbandoned):
                raise
            if ended is not None and ended.is_set() and isinstance(exc, OSError | HostcallError):
                # What failed once its execution had ended (its cgroup removed by
                # the close, say) is no failure: the guest was not wanted any more.
                raise StartAbandoned from exc
            if isinstance(exc, Exception):  # not a cancel: the sandbox failed to start
                detail = await _stderr_tail(process)
                message = exc.message if isinstance(exc, SandboxError) else str(exc)
                raise SandboxError(f"the sandbox did not start: {message}{detail}") from exc
            raise
        finally:
            if sandbox is not None:
                sandbox.close()
            process.close_pipes()  # the caller never gets it
    finally:
        for fd in ours:
            os.close(fd)
    return process, sandbox


async def _stderr_tail(process: GuestProcess) -> str:
    """What bubblewrap said before it failed (its stderr is the guest's, when piped)."""
    tail = b""
    with contextlib.suppress(TimeoutError, OSError, ValueError):
        async with asyncio.timeout(STDERR_TAIL_TIMEOUT_S):
            if process.stderr is not None:
                tail = await process.stderr.read(4096)
            await process.wait()
    text = tail.decode(errors="replace").strip().splitlines()
    return f" ({text[-1]})" if text else ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def _gate_reached(fd: int, timeout_s: float) -> None:
    """Wait (bounded) until the gate writes :data:`GATE_REACHED` on ``fd``.

    Raises:
        SandboxError: the pipe ended first (bubblewrap died while it built the
            sandbox: every holder of the write end is gone), or the time ran out.
    """
    said = await _read_pipe(fd, timeout_s, "reach the guest's gate", upto=len(GATE_REACHED))
    if said != GATE_REACHED:
        raise SandboxError(
            "bubblewrap ended while it built the sandbox, before the guest's gate "
            "(see the guest's stderr)"
        )


async def _read_to_eof(fd: int, timeout_s: float) -> bytes:
    """bubblewrap's ``--info-fd`` report, read to its end (bounded)."""
    return await _read_pipe(fd, timeout_s, "report its sandbox")


async def _read_pipe(fd: int, timeout_s: float, what: str, *, upto: int | None = None) -> bytes:
    """Read a pipe on the event loop to its end, or until it has ``upto``
    bytes; bounded by ``timeout_s``.

    Raises:
        SandboxError: the time ran out ("bubblewrap did not ``what``").
    """
    os.set_blocking(fd, False)
    loop = asyncio.get_running_loop()
    data = bytearray()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while upto is None or len(data) < upto:
                chunk = os.read(fd, 4096 if upto is None else upto - len(data))
                if not chunk:
                    break
                data.extend(chunk)
        except BlockingIOError:
            return
        except OSError as exc:
            if not done.done():
                done.set_exception(exc)
            return
        if not done.done():
            done.set_result(None)

    readable()  # what is there already counts, however little time is left
    if done.done():
        await done
        return bytes(data)
    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(timeout_s):
            await done
    except TimeoutError:
        raise SandboxError(f"bubblewrap did not {what} within {timeout_s:g} s") from None
    finally:
        loop.remove_reader(fd)
    return bytes(data)


def _sandbox_from(info: bytes) -> Sandboxed:
    if not info.strip():
        raise SandboxError(
            "bubblewrap ended before it started the sandbox (see the guest's stderr)"
        )
    try:
        fields = json.loads(info)
        init_pid = int(fields["child-pid"])
        pidns = int(fields["pid-namespace"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SandboxError(f"unexpected report from bubblewrap: {info[:200]!r}") from exc
    try:
        pidfd: int | None = os.pidfd_open(init_pid)
    except OSError:
        pidfd = None  # an older kernel: signals go by pid (it is a grandchild of ours)
    try:
        nsfd = os.open(f"/proc/{init_pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if pidfd is not None:
            os.close(pidfd)
        raise SandboxError(f"the sandbox's pid 1 is gone: {exc}") from None
    if os.fstat(nsfd).st_ino != pidns:
        os.close(nsfd)
        if pidfd is not None:
            os.close(pidfd)
        raise SandboxError("the sandbox's pid 1 is not the process bubblewrap reported")
    if pidfd is not None:
        # If its monitor ends first, pid 1 becomes our child (we are a
        # subreaper): the reaper then reaps it, loop or no loop.
        try:
            Reaper.shared().watch(init_pid, os.dup(pidfd))
        except BaseException:
            os.close(nsfd)
            os.close(pidfd)
            raise
    return Sandboxed(init_pid, pidns, pidfd, nsfd)


class CgroupPort(Protocol):
    """What stopping a sandbox needs of the execution's cgroup."""

    def pids(self) -> list[int]: ...

    def kill(self) -> None: ...


async def kill_sandbox(
    process: GuestProcess,
    sandbox: Sandboxed,
    *,
    grace_s: float = STOP_GRACE_S,
    cgroup: CgroupPort | None = None,
) -> list[int]:
    """KILL the whole sandbox at once — the cgroup's atomic kill and SIGKILL
    to pid 1, which ends the whole pid namespace — and wait (bounded) until
    it is gone. Its signals cannot fail: a stop that failed midway falls
    back on this. Returns the pids still inside afterwards."""
    if cgroup is not None:
        with contextlib.suppress(OSError):
            cgroup.kill()
    sandbox.signal(signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await wait_exited(process)
    await sandbox.wait_gone(grace_s)
    survivors = cgroup.pids() if cgroup is not None else sandbox.members()
    if survivors:
        logger.error("processes of a sandbox survived SIGKILL: %s", survivors)
    return survivors


async def stop_sandbox(
    process: GuestProcess,
    sandbox: Sandboxed,
    *,
    grace_s: float = STOP_GRACE_S,
    cgroup: CgroupPort | None = None,
) -> list[int]:
    """End a sandboxed guest: TERM to every process inside but pid 1, ``grace_s``,
    then KILL — the cgroup's atomic kill and SIGKILL to pid 1, which ends the
    whole pid namespace at once. With nothing inside but pid 1 (stopped just
    after its launch, before bubblewrap forked the guest) there is nobody to
    be graceful to: KILL at once. Returns the pids still inside afterwards
    (empty unless the kernel refused to kill them).
    """
    if process.returncode is None:
        inside = cgroup.pids() if cgroup is not None else sandbox.members()
        guests = [pid for pid in inside if pid != sandbox.init_pid]
        for pid in guests:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGTERM)
        if guests:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await wait_exited(process)
    if process.returncode is None or not await sandbox.wait_gone(grace_s):
        return await kill_sandbox(process, sandbox, grace_s=grace_s, cgroup=cgroup)
    survivors = cgroup.pids() if cgroup is not None else sandbox.members()
    if survivors:
        logger.error("processes of a sandbox survived SIGKILL: %s", survivors)
    return survivors
