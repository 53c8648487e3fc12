"""What a sandboxed guest uses, and the limits it may not cross (docs/security.md, S6).

With a cgroup (:mod:`supervisor.cgroups`) the kernel counts and enforces:
memory (including memfd and tmpfs pages, which are in no process's RSS) and
the number of tasks. A memory allocation past the limit makes the kernel kill
a process inside; a fork past the limit fails. Either ends the execution with
``memory_limit`` / ``process_limit`` at the next sample. CPU seconds are the
cgroup's own count, exited processes included, checked every sample.

Without a cgroup the limits are *sampled*: the sandbox's processes are
walked from its pid 1 (nothing leaves a pid namespace, so nothing is missed
but bursts between two samples and memory outside every RSS); the outcome
says ``"limits": "sampled"``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from supervisor.limits import EndReason, Limits
from supervisor.tracking import ProcStat, descendants, rss_bytes

__all__ = ["CgroupCounters", "SandboxTree"]


class CgroupCounters(Protocol):
    """What the sampler reads of an execution's cgroup."""

    def usage(self) -> _Usage: ...


class _Usage(Protocol):
    @property
    def memory_bytes(self) -> int: ...

    @property
    def peak_memory_bytes(self) -> int: ...

    @property
    def tasks(self) -> int: ...

    @property
    def cpu_s(self) -> float | None: ...

    @property
    def oom_kills(self) -> int: ...

    @property
    def task_limit_hits(self) -> int: ...


@dataclass(eq=False)
class SandboxTree:
    """One sandboxed guest as the tree sampler sees it.

    ``init_pid`` is the sandbox's pid 1 (bubblewrap's), which is not the
    guest's and is left out of every count.
    """

    execution_id: str
    init_pid: int
    pidns: int
    limits: Limits
    on_violation: Callable[[EndReason], None]
    cgroup: CgroupCounters | None = None
    #: Whether the cgroup counts CPU time (else it is sampled from /proc).
    cgroup_counts_cpu: bool = False
    peak_rss_bytes: int = 0
    peak_processes: int = 0
    cpu_s: float = 0.0
    peak_open_files: int = 0
    violation: EndReason | None = None
    _pids: list[int] = field(default_factory=list)

    @property
    def needs_snapshot(self) -> bool:
        """Whether a sample needs a pass over ``/proc`` (no cgroup counts CPU)."""
        return (
            self.cgroup is None
            or not self.cgroup_counts_cpu
            or self.limits.max_open_files is not None
        )

    @property
    def limits_kind(self) -> str:
        """How the limits are held: by the kernel, or by sampling."""
        return "cgroup" if self.cgroup is not None else "sampled"

    def sample(self, snapshot: dict[int, ProcStat], children_of: dict[int, list[int]]) -> None:
        """Measure once and check the limits (``snapshot`` may be empty with a cgroup)."""
        if self.cgroup is not None:
            self._from_cgroup(snapshot, children_of)
        else:
            self._from_snapshot(snapshot, children_of)

    def finish(self) -> EndReason | None:
        """A last reading after the guest ended: the kernel's peak memory of a
        guest too short for any sample, and a limit it crossed just before."""
        if self.cgroup is not None:
            self._from_cgroup({}, {}, final=True)
        return self.violation

    def _from_cgroup(
        self,
        snapshot: dict[int, ProcStat],
        children_of: dict[int, list[int]],
        *,
        final: bool = False,
    ) -> None:
        assert self.cgroup is not None
        usage = self.cgroup.usage()
        self.peak_rss_bytes = max(self.peak_rss_bytes, usage.peak_memory_bytes)
        if not final:
            self.peak_processes = max(self.peak_processes, max(0, usage.tasks - 1))
        if usage.cpu_s is not None:
            self.cpu_s = max(self.cpu_s, usage.cpu_s)
        elif snapshot:
            self._cpu_from(snapshot, children_of)
        if usage.oom_kills:
            self._violated("memory_limit")
        elif usage.task_limit_hits and self.limits.max_processes is not None:
            # Only a limit the caller set ends the guest; the default cap merely
            # refuses the fork.
            self._violated("process_limit")
        self._check_cpu()
        if snapshot:
            self._check_files(descendants(self.init_pid, children_of))

    def _from_snapshot(
        self, snapshot: dict[int, ProcStat], children_of: dict[int, list[int]]
    ) -> None:
        members = descendants(self.init_pid, children_of)
        rss = 0
        processes = 0
        for pid in members:
            stat = snapshot.get(pid)
            if stat is None or stat.zombie:
                continue
            processes += 1
            with contextlib.suppress(OSError, ValueError, IndexError):
                rss += rss_bytes(pid)
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.peak_processes = max(self.peak_processes, processes)
        self._cpu_from(snapshot, children_of, members)
        self._check_files(members)
        limits = self.limits
        if limits.memory_bytes is not None and rss > limits.memory_bytes:
            self._violated("memory_limit")
        elif limits.max_processes is not None and processes > limits.max_processes:
            self._violated("process_limit")
        self._check_cpu()

    def _cpu_from(
        self,
        snapshot: dict[int, ProcStat],
        children_of: dict[int, list[int]],
        members: list[int] | None = None,
    ) -> None:
        # Each process's figure holds its own time and that of the children it
        # reaped; every dead process was reaped by pid 1 or a live member, so
        # the sum over pid 1 and the live members counts each exactly once.
        if members is None:
            members = descendants(self.init_pid, children_of)
        total = 0.0
        for pid in [self.init_pid, *members]:
            stat = snapshot.get(pid)
            if stat is not None:
                total += stat.cpu_s
        self.cpu_s = max(self.cpu_s, total)

    def _check_files(self, members: list[int]) -> None:
        """Open descriptors of the whole guest (sampled: no kernel counter exists)."""
        limit = self.limits.max_open_files
        if limit is None:
            return
        total = 0
        for pid in members:
            with contextlib.suppress(OSError):
                total += len(os.listdir(f"/proc/{pid}/fd"))
        self.peak_open_files = max(self.peak_open_files, total)
        if total > limit:
            self._violated("open_files_limit")

    def _check_cpu(self) -> None:
        if self.limits.cpu_s is not None and self.cpu_s > self.limits.cpu_s:
            self._violated("cpu_limit")

    def _violated(self, reason: EndReason) -> None:
        if self.violation is None:
            self.violation = reason
            self.on_violation(reason)
