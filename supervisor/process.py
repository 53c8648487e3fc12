"""Guest processes: the only place that starts or stops one (SPEC §3).

A guest gets its own session and process group, the ``HOSTCALL_*`` variables,
and its credential through an inherited pipe, never argv or (by default) its
environment. Stopping is TERM to the whole tree, a grace period, then KILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Final, Literal

import psutil

__all__ = [
    "STOP_GRACE_S",
    "CredentialTransport",
    "GuestIdentity",
    "guest_environment",
    "launch_guest",
    "stop_tree",
]

#: Time between SIGTERM and SIGKILL when a guest tree is stopped.
STOP_GRACE_S: Final = 5.0
#: How often the stop loop checks whether the tree is gone.
_STOP_POLL_S: Final = 0.02

CredentialTransport = Literal["fd", "env"]


@dataclass(frozen=True, slots=True)
class GuestIdentity:
    """What a guest is told about itself."""

    socket_path: str
    invocation_id: str
    execution_id: str
    plan_hash: str


def guest_environment(base: Mapping[str, str], identity: GuestIdentity) -> dict[str, str]:
    """The guest's environment: ``base`` without any ``HOSTCALL_*``, plus ours."""
    env = {k: v for k, v in base.items() if not k.startswith("HOSTCALL_")}
    env["HOSTCALL_SOCKET"] = identity.socket_path
    env["HOSTCALL_INVOCATION"] = identity.invocation_id
    env["HOSTCALL_EXECUTION"] = identity.execution_id
    env["HOSTCALL_PLAN"] = identity.plan_hash
    return env


async def launch_guest(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    credential: str,
    transport: CredentialTransport = "fd",
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
) -> asyncio.subprocess.Process:
    """Start a guest in its own session with its credential.

    With ``transport="fd"`` the credential is written into a pipe whose read
    end the guest inherits; ``HOSTCALL_CREDENTIAL_FD`` names it. The write end
    is closed first, so the guest reads to EOF and never blocks.

    Raises:
        OSError: the command could not be started (e.g. FileNotFoundError).
    """
    if not argv:
        raise ValueError("a guest needs a command to run")
    pass_fds: tuple[int, ...] = ()
    read_end: int | None = None
    env = dict(env)
    if transport == "fd":
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, credential.encode("ascii"))
        finally:
            os.close(write_end)
        env["HOSTCALL_CREDENTIAL_FD"] = str(read_end)
        pass_fds = (read_end,)
    elif transport == "env":
        env["HOSTCALL_CREDENTIAL"] = credential
    else:
        raise ValueError(f"unknown credential transport {transport!r}")
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=pass_fds,
            start_new_session=True,
        )
    finally:
        if read_end is not None:
            os.close(read_end)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_all(pgid: int, members: list[psutil.Process], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
    for member in members:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            member.send_signal(signum)


async def stop_tree(process: asyncio.subprocess.Process, *, grace_s: float = STOP_GRACE_S) -> None:
    """End the guest and everything it started: TERM, ``grace_s``, then KILL.

    The guest's process group is signalled, and so is every descendant found
    while the guest still runs (also those that left the group with
    ``setsid``). Returns once the guest is reaped and the group is empty, or
    after KILL.
    """
    pgid = process.pid  # start_new_session: the guest leads its own group
    members = _tree(process.pid) if process.returncode is None else []
    _signal_all(pgid, members, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while loop.time() < deadline:
        if (
            process.returncode is not None
            and not _group_alive(pgid)
            and not any(_alive(m) for m in members)
        ):
            return
        await asyncio.sleep(_STOP_POLL_S)
    _signal_all(pgid, [m for m in members if _alive(m)], signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await process.wait()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
