"""Guest processes: what every guest gets, and the unsandboxed start and stop (docs/guests.md).

A guest gets its own session and process group, the ``HOSTCALL_*`` variables,
and its credential through an inherited pipe, never argv or (by default) its
environment. Stopping an unsandboxed guest is TERM to the whole tree (which
may have left its group, see :mod:`supervisor.tracking`), a grace period,
then KILL. A sandboxed guest is started and stopped by
:mod:`supervisor.sandbox.start`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final, Literal

import psutil

from supervisor.spawn import GuestProcess, spawn
from supervisor.tracking import GuestTree, is_alive, is_subreaper

__all__ = [
    "STOP_GRACE_S",
    "CredentialTransport",
    "GuestIdentity",
    "credential_fd",
    "guest_environment",
    "launch_guest",
    "stop_tree",
    "wait_exited",
]

logger = logging.getLogger(__name__)

#: Time between SIGTERM and SIGKILL when a guest tree is stopped.
STOP_GRACE_S: Final = 5.0
#: How often the stop loop checks whether the tree is gone.
_STOP_POLL_S: Final = 0.02

CredentialTransport = Literal["fd", "env"]


@dataclass(frozen=True, slots=True)
class GuestIdentity:
    """What a guest is told about itself."""

    #: The channel's socket as the guest sees it; None for a WebAssembly guest.
    socket_path: str | None
    invocation_id: str
    execution_id: str
    plan_hash: str
    #: Tools that wait for approval → their lease (``HOSTCALL_APPROVAL_LEASES``).
    approval_leases: Mapping[str, float] = field(default_factory=dict)


def guest_environment(base: Mapping[str, str], identity: GuestIdentity) -> dict[str, str]:
    """The guest's environment: ``base`` without any ``HOSTCALL_*``, plus ours
    (no ``HOSTCALL_SOCKET`` for a guest without a socket: a WebAssembly one)."""
    env = {k: v for k, v in base.items() if not k.startswith("HOSTCALL_")}
    if identity.socket_path is not None:
        env["HOSTCALL_SOCKET"] = identity.socket_path
    env["HOSTCALL_INVOCATION"] = identity.invocation_id
    env["HOSTCALL_EXECUTION"] = identity.execution_id
    env["HOSTCALL_PLAN"] = identity.plan_hash
    if identity.approval_leases:
        # So the guest client waits as long as a proposal may (guest_client.leases).
        env["HOSTCALL_APPROVAL_LEASES"] = json.dumps(
            dict(identity.approval_leases), separators=(",", ":")
        )
    return env


def credential_fd(
    env: dict[str, str], credential: str, transport: CredentialTransport
) -> int | None:
    """Hand the credential over as ``transport`` says; returns the read end to pass.

    With ``"fd"`` the credential is written into a pipe whose read end the guest
    inherits; ``HOSTCALL_CREDENTIAL_FD`` names it. The write end is closed
    first, so the guest reads to EOF and never blocks.
    """
    if transport == "fd":
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, credential.encode("ascii"))
        finally:
            os.close(write_end)
        env["HOSTCALL_CREDENTIAL_FD"] = str(read_end)
        return read_end
    if transport == "env":
        env["HOSTCALL_CREDENTIAL"] = credential
        return None
    raise ValueError(f"unknown credential transport {transport!r}")


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
) -> GuestProcess:
    """Start a guest without a sandbox, in its own session, with its credential.

    Raises:
        OSError: the command could not be started (e.g. FileNotFoundError).
    """
    if not argv:
        raise ValueError("a guest needs a command to run")
    env = dict(env)
    read_end = credential_fd(env, credential, transport)
    try:
        return await spawn(
            argv,
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=() if read_end is None else (read_end,),
        )
    finally:
        if read_end is not None:
            os.close(read_end)


async def wait_exited(process: GuestProcess) -> int:
    """Wait until the guest process itself has exited; returns its returncode.

    Not for its output pipes to close, which a leftover grandchild can hold
    open forever.
    """
    return await process.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def kill_tree(
    process: GuestProcess,
    tree: GuestTree,
    *,
    grace_s: float = STOP_GRACE_S,
    orphans: Callable[[], list[psutil.Process]] = list,
) -> list[int]:
    """What a stop that failed midway falls back on: SIGKILL the guest's
    process group and every process of its tree it can still find (seen,
    marked with its execution's id, orphaned), each way of finding them
    tried on its own, then wait (bounded) until they are gone and reap
    those that became ours. Returns the pids still alive."""
    found = {p.pid: p for p in tree.seen.values()}
    findings: list[Callable[[], list[psutil.Process]]] = [
        lambda: tree.members(zombies=True),
        lambda: tree.marked_processes(adopted_only=is_subreaper()),
        orphans,
    ]
    for finding in findings:
        with contextlib.suppress(Exception):  # boundary: the next way may still work
            found.update((p.pid, p) for p in finding())
    return await _kill(process, tree, list(found.values()), grace_s)


async def _kill(
    process: GuestProcess, tree: GuestTree, members: list[psutil.Process], grace_s: float
) -> list[int]:
    """SIGKILL the guest's group, the guest and ``members``; wait (bounded)
    until they are gone; reap those that became ours; the pids that survived."""
    for member in members:  # seen: ours to reap once they die
        with contextlib.suppress(psutil.Error):
            tree.seen.setdefault((member.pid, member.create_time()), member)
    _signal_all(process.pid, members, signal.SIGKILL)
    process.kill()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace_s):
            await wait_exited(process)
            while any(is_alive(m) for m in members):  # noqa: ASYNC110 - no event for other pids
                await asyncio.sleep(_STOP_POLL_S)
    _reap_adopted(tree, process.pid)
    survivors = [m.pid for m in members if is_alive(m)]
    if survivors:
        logger.error("processes of %s survived SIGKILL: %s", tree.execution_id, survivors)
    return survivors


def _signal_all(pgid: int, members: list[psutil.Process], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)
    for member in members:
        with contextlib.suppress(psutil.Error):
            member.send_signal(signum)  # psutil checks it is still the same process


def _reap_adopted(tree: GuestTree, pgid: int) -> None:
    """Reap the tree's processes the supervisor adopted as subreaper: those it
    has seen, and any zombie child of ours still in the guest's process group
    (a short-lived orphan the sampler never saw). Never the guest itself — the
    event loop's child watcher reaps that one — and never a child of ours from
    outside the tree."""
    seen = set(tree.seen)
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children():
            if child.pid == tree.root_pid:
                continue
            with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
                ours = (child.pid, child.create_time()) in seen
                if ours or (
                    child.status() == psutil.STATUS_ZOMBIE and os.getpgid(child.pid) == pgid
                ):
                    os.waitpid(child.pid, os.WNOHANG)


async def stop_tree(
    process: GuestProcess,
    tree: GuestTree,
    *,
    grace_s: float = STOP_GRACE_S,
    orphans: Callable[[], list[psutil.Process]] = list,
) -> list[int]:
    """End the guest and everything it started: TERM, ``grace_s``, then KILL.

    Signals the guest's process group and every process of its tree (see
    :mod:`supervisor.tracking`: descendants, processes seen before that left
    the group or were reparented, and those carrying the execution's id).
    Returns the pids still alive afterwards — empty unless something could
    not be killed.
    """
    pgid = process.pid  # start_new_session: the guest leads its own group

    def everyone(*, scan_environments: bool = False) -> list[psutil.Process]:
        for member in tree.members(zombies=True):  # remember zombies: ours to reap later
            with contextlib.suppress(psutil.Error):
                tree.seen.setdefault((member.pid, member.create_time()), member)
        found = {p.pid: p for p in tree.members()}
        if scan_environments:  # a full scan of /proc: at the start and before KILL only
            for marked in [*tree.marked_processes(adopted_only=is_subreaper()), *orphans()]:
                found.setdefault(marked.pid, marked)
        for member in found.values():
            with contextlib.suppress(psutil.Error):
                tree.seen.setdefault((member.pid, member.create_time()), member)
        return list(found.values())

    if (
        process.returncode is not None
        and not _group_alive(pgid)
        and not any(is_alive(p) for p in tree.seen.values())
        and not orphans()
    ):
        return []  # the common case: the guest exited and left nothing behind
    members = everyone(scan_environments=True)
    _signal_all(pgid, members, signal.SIGTERM)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while True:
        members = [m for m in everyone() if is_alive(m)]
        _reap_adopted(tree, pgid)
        if process.returncode is not None and not members and not _group_alive(pgid):
            return []
        if loop.time() >= deadline:
            break
        await asyncio.sleep(_STOP_POLL_S)
    return await _kill(
        process, tree, [m for m in everyone(scan_environments=True) if is_alive(m)], grace_s
    )
