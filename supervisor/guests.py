"""Starting, measuring and ending one guest, with or without its sandbox.

:class:`GuestLauncher` holds what a supervisor found out once (can this host
give a sandbox, and cgroups?) and starts each execution's guest:

- **sandboxed** (the default, docs/sandbox.md): bubblewrap builds the sandbox
  (:mod:`supervisor.sandbox`), the guest joins the execution's cgroup before
  its first instruction (:mod:`supervisor.cgroups`), and the kernel ends all
  of it at once when its pid namespace's pid 1 dies;
- **unsandboxed** (``--no-sandbox``): the guest runs as the supervisor's uid in
  a session of its own, its tree tracked by sampling (:mod:`supervisor.tracking`).

:class:`RunningGuest` is what the supervisor holds while it runs: the process,
how it is measured, and how it is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

from supervisor.cgroups import CgroupHost, ExecutionCgroup
from supervisor.limits import EndReason, Limits
from supervisor.outcomes import ExecutionOutcome
from supervisor.process import CredentialTransport, kill_tree, launch_guest, stop_tree
from supervisor.sandbox import (
    SandboxError,
    SandboxHost,
    SandboxLaunch,
    SandboxPolicy,
    trusted_paths,
)
from supervisor.sandbox.start import (
    Sandboxed,
    StartAbandoned,
    kill_sandbox,
    launch_sandboxed,
    stop_sandbox,
)
from supervisor.sandbox.usage import SandboxTree
from supervisor.spawn import GuestProcess
from supervisor.tracking import GuestTree, TreeTracker

__all__ = ["CGROUP_REMOVE_TIMEOUT_S", "GuestLauncher", "RunningGuest"]

logger = logging.getLogger(__name__)

#: How long an ended execution's cgroup may take to empty before it is left.
CGROUP_REMOVE_TIMEOUT_S: Final = 5.0
#: Builds of a sandbox before its failure to start is the launch's error.
SANDBOX_ATTEMPTS: Final = 2
#: Builds in all, counting those that failed as a socket they masked
#: vanished meanwhile (another program unlinked it): those do not count
#: towards SANDBOX_ATTEMPTS, and the next build masks its folder whole.
SANDBOX_BUILDS: Final = 6
#: Tasks a sandboxed guest with a cgroup may have when no --max-procs says
#: otherwise: forks past it fail (a fork bomb cannot take the host's pids).
DEFAULT_MAX_TASKS: Final = 4096
#: Distinct sandbox descriptions a launcher shares among its guests.
_DESCRIPTIONS_KEPT: Final = 64


@dataclass(eq=False)
class RunningGuest:
    """One execution's guest while it runs, and what it used once it ended."""

    execution_id: str
    process: GuestProcess
    tree: GuestTree | SandboxTree
    #: ``"off"``, or the sandbox's namespaces and how its limits are held.
    sandbox: Mapping[str, Any] | str
    _launcher: GuestLauncher
    _sandboxed: Sandboxed | None = None
    _cgroup: ExecutionCgroup | None = None

    @property
    def pidns(self) -> int | None:
        """The guest's pid namespace (sandboxed only)."""
        return self._sandboxed.pidns if self._sandboxed is not None else None

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the whole guest."""
        return self.tree.cpu_s

    @property
    def peak_memory_bytes(self) -> int:
        """Peak memory: the cgroup's own count, else the sampled RSS of the tree."""
        return self.tree.peak_rss_bytes

    @property
    def peak_processes(self) -> int:
        """Most processes (tasks, with a cgroup) the guest had at once, as
        sampled; at least its own, which a guest ended before the first
        sample was not counted in."""
        return max(1, self.tree.peak_processes)

    async def stop(self, grace_s: float) -> None:
        """End every process of the guest (TERM, ``grace_s``, KILL) and release
        what it held. Returns once nothing of it is alive."""
        launcher = self._launcher
        try:
            await self._end(grace_s, graceful=True)
        except BaseException:
            # It failed (or was cancelled) perhaps before its KILL: nothing
            # of an ended execution may run on (S5), so kill it all at once
            # and wait until it is gone, still tracked (its zombies reaped).
            with contextlib.suppress(Exception):  # boundary: its own error goes on
                await self._end(grace_s, graceful=False)
            raise
        finally:
            launcher.tracker.untrack(self.execution_id)
            if isinstance(self.tree, SandboxTree):
                self.tree.finish()
            if self._sandboxed is not None:
                self._sandboxed.close()
            if self._cgroup is not None:
                with contextlib.suppress(OSError):
                    await self._cgroup.remove(CGROUP_REMOVE_TIMEOUT_S)

    async def _end(self, grace_s: float, *, graceful: bool) -> None:
        """TERM, ``grace_s``, KILL (``graceful``), or KILL at once; either
        way until nothing of it is alive (bounded)."""
        if self._sandboxed is not None:
            end_sandbox = stop_sandbox if graceful else kill_sandbox
            await end_sandbox(self.process, self._sandboxed, grace_s=grace_s, cgroup=self._cgroup)
            return
        tree, tracker = self.tree, self._launcher.tracker
        assert isinstance(tree, GuestTree)
        end_tree = stop_tree if graceful else kill_tree
        await end_tree(
            self.process, tree, grace_s=grace_s, orphans=lambda: tracker.orphans_of(tree)
        )

    def limit_crossed(self) -> EndReason | None:
        """The limit the guest crossed, if any (also one the kernel refused
        just before it exited)."""
        return self.tree.violation

    def outcome(
        self, reason: EndReason, duration_s: float, calls: Mapping[str, int]
    ) -> ExecutionOutcome:
        """How it ended (once :meth:`stop` returned) and what it used."""
        returncode = self.process.returncode
        signum = -returncode if returncode is not None and returncode < 0 else None
        if self.sandbox != "off" and returncode is not None and 128 < returncode <= 128 + 64:
            # bubblewrap reports a guest ended by signal N as 128+N, as a shell does.
            signum, returncode = returncode - 128, None
        crossed = self.limit_crossed()
        if reason in ("exited", "signalled") and crossed is not None:
            # The kernel refused memory or a fork just before the guest ended.
            reason = crossed
        if reason == "exited" and signum is not None:
            reason = "signalled"
        return ExecutionOutcome(
            execution_id=self.execution_id,
            exit_code=returncode if returncode is not None and returncode >= 0 else None,
            signal=signum,
            reason=reason,
            duration_s=duration_s,
            cpu_s=self.cpu_s,
            peak_rss_bytes=self.peak_memory_bytes or None,
            peak_processes=self.peak_processes,
            calls=calls,
            sandbox=self.sandbox,
        )


def _check_command(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> None:
    """Fail as ``exec`` would, before building a sandbox for a command that cannot run.

    Raises:
        FileNotFoundError: no such program (on the guest's ``PATH``).
        PermissionError: it exists but is not executable.
    """
    if not argv:
        raise ValueError("a guest needs a command to run")
    program = argv[0]
    if "/" not in program:
        if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        return
    path = Path(program) if os.path.isabs(program) else cwd / program
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if path.is_dir() or not os.access(path, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


class GuestLauncher:
    """Starts guests for one supervisor (see the module docstring)."""

    def __init__(
        self,
        tracker: TreeTracker,
        *,
        sandbox: SandboxHost | None,
        cgroups: CgroupHost | None,
        state_dir: Path,
        socket_path: Path,
        hidden: Sequence[Path] = (),
        credential_transport: CredentialTransport = "fd",
    ) -> None:
        self.tracker = tracker
        self.sandbox = sandbox
        self.cgroups = cgroups
        self._state_dir = state_dir
        self._socket_path = socket_path
        self._hidden = tuple(hidden)
        self._transport: CredentialTransport = credential_transport
        self._trusted: dict[str, list[Path]] = {}
        #: Sandbox descriptions by content: most of this launcher's guests have
        #: the same one, and every ended execution keeps its own (bounded).
        self._descriptions: dict[str, Mapping[str, Any]] = {}

    def _shared(self, description: Mapping[str, Any]) -> Mapping[str, Any]:
        """One object for every equal description (never changed once made):
        an ended execution keeps it, ten thousand of them at most."""
        key = json.dumps(description, sort_keys=True, default=str)
        shared = self._descriptions.get(key)
        if shared is not None:
            return shared
        if len(self._descriptions) < _DESCRIPTIONS_KEPT:
            self._descriptions[key] = description
        return description

    def _trusted_for(self, plan_key: str, plan_path: Path | None) -> list[Path]:
        found = self._trusted.get(plan_key)
        if found is None:
            extra = [self._state_dir, *([plan_path] if plan_path is not None else [])]
            found = self._trusted[plan_key] = trusted_paths(extra)
        return found

    async def start(
        self,
        execution_id: str,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        credential: str,
        limits: Limits,
        on_violation: Callable[[EndReason], None],
        policy: SandboxPolicy,
        plan_key: str,
        plan_path: Path | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        ended: asyncio.Event | None = None,
    ) -> RunningGuest:
        """Start one execution's guest; returns once its first instruction may run.
        Once ``ended`` is set (the execution ended meanwhile), the guest is not
        started, or a sandbox being built never lets it run.

        Raises:
            OSError: the command could not be started (unsandboxed), or
                bubblewrap could not (sandboxed).
            SandboxError: the sandbox cannot be built as the plan asks.
            StartAbandoned: ``ended`` was set before the guest could run.
        """
        if self.sandbox is None:
            if ended is not None and ended.is_set():
                raise StartAbandoned
            process = await launch_guest(
                argv,
                env=env,
                credential=credential,
                transport=self._transport,
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
            )
            tree = self.tracker.track(execution_id, process.pid, limits, on_violation)
            return RunningGuest(execution_id, process, tree, "off", self)
        _check_command(argv, env, Path(cwd) if cwd is not None else Path.cwd())
        failures = 0
        churned: frozenset[Path] = frozenset()
        for build in range(1, SANDBOX_BUILDS + 1):
            launch = self.sandbox.build(
                policy,
                argv=argv,
                env=env,
                cwd=Path(cwd) if cwd is not None else Path.cwd(),
                state_dir=self._state_dir,
                socket=self._socket_path,
                hidden=self._hidden,
                trusted=self._trusted_for(plan_key, plan_path) if policy.writable else (),
                tmpfs_size=limits.memory_bytes,
                # Sampled, a memory limit could not see writes to an overlay.
                overlay=self.cgroups is not None or limits.memory_bytes is None,
                mask_whole=churned,
            )
            try:
                return await self._start_sandboxed(
                    execution_id,
                    launch,
                    credential=credential,
                    limits=limits,
                    on_violation=on_violation,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    ended=ended,
                )
            except SandboxError as exc:
                # A socket masked a moment ago may be gone by the time bubblewrap
                # mounts over it (its owner unlinked it), which bubblewrap cannot
                # do: build it anew, that socket's folder masked whole.
                vanished = launch.vanished_socket_folders(str(exc)) - churned
                if not vanished:  # none, or none it has not tried to mask whole
                    failures += 1
                if failures == SANDBOX_ATTEMPTS or build == SANDBOX_BUILDS:
                    raise
                churned |= vanished
                logger.warning("the sandbox of %s did not start (%s); again", execution_id, exc)
        raise AssertionError("unreachable")

    def _cgroup_for(self, execution_id: str, limits: Limits) -> ExecutionCgroup | None:
        """The execution's cgroup, or None where there is none (its limits sampled)."""
        if self.cgroups is None:
            return None
        try:
            return self.cgroups.create(
                execution_id,
                memory_bytes=limits.memory_bytes,
                # bubblewrap's pid 1 counts too. Without a limit of its own a
                # guest still may not take the machine's every pid.
                max_tasks=(limits.max_processes + 1 if limits.max_processes else DEFAULT_MAX_TASKS),
            )
        except OSError as exc:
            # Detected at start-up but refused now: sample this one, and say so.
            logger.warning("no cgroup for %s (%s): its limits are sampled", execution_id, exc)
            return None

    async def _start_sandboxed(
        self,
        execution_id: str,
        launch: SandboxLaunch,
        *,
        credential: str,
        limits: Limits,
        on_violation: Callable[[EndReason], None],
        stdin: int | IO[Any] | None,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
        ended: asyncio.Event | None,
    ) -> RunningGuest:
        try:
            cgroup = self._cgroup_for(execution_id, limits)
        except BaseException:
            launch.close_fds()  # launch_sandboxed never took them
            raise
        description = self._shared(
            {**launch.description, "limits": cgroup.kind if cgroup is not None else "sampled"}
        )
        try:
            process, sandboxed = await launch_sandboxed(
                launch,
                credential=credential,
                transport=self._transport,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                join=cgroup.add if cgroup is not None else None,
                ended=ended,
            )
        except BaseException as exc:
            if cgroup is not None:
                with contextlib.suppress(OSError):
                    cgroup.kill()
                with contextlib.suppress(OSError):
                    await cgroup.remove(CGROUP_REMOVE_TIMEOUT_S)
            if isinstance(exc, StartAbandoned):
                exc.sandbox = description
            raise
        sandbox_tree = SandboxTree(
            execution_id,
            sandboxed.init_pid,
            sandboxed.pidns,
            limits,
            on_violation,
            cgroup=cgroup,
            cgroup_counts_cpu=cgroup is not None and cgroup.usage().cpu_s is not None,
        )
        self.tracker.track_sandbox(sandbox_tree, process.pid)
        return RunningGuest(
            execution_id, process, sandbox_tree, description, self, sandboxed, cgroup
        )
