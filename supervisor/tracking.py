"""Tracking the process tree of every live guest.

A guest may start children, leave its process group with ``setsid``, or
double-fork a daemon that is reparented away from it. hostcall keeps hold of
all of them three ways:

- the supervisor is a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``):
  an orphaned descendant is reparented to the supervisor, not to init, so it
  stays in our process tree;
- a sampler walks each guest's tree every :data:`SAMPLE_INTERVAL_S`,
  remembering every process it saw (pid and start time, so a reused pid is
  not mistaken for it) and measuring CPU, RSS, processes and open files for
  the limits and the outcome report;
- every guest process inherits ``HOSTCALL_EXECUTION``; at stop time
  processes carrying the execution's id are found by their environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import psutil

from supervisor.limits import EndReason, Limits

__all__ = [
    "SAMPLE_INTERVAL_S",
    "GuestTree",
    "Sampled",
    "TreeTracker",
    "become_subreaper",
    "descendants",
    "is_alive",
    "is_subreaper",
    "pid_namespace",
    "process_map",
]

logger = logging.getLogger(__name__)

#: How often each live guest's tree is measured.
SAMPLE_INTERVAL_S: Final = 0.1
#: With many guests at once, sample less often: one /proc pass costs ~5-10 ms.
BUSY_SAMPLE_INTERVAL_S: Final = 0.5
BUSY_TREES: Final = 20
_PR_SET_CHILD_SUBREAPER: Final = 36
_PR_GET_CHILD_SUBREAPER: Final = 37

_Key = tuple[int, float]  # (pid, create_time): a process, not a reusable number


def _prctl() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux). Idempotent."""
    try:
        return bool(_prctl()(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):  # not Linux, or no prctl
        return False


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (the kernel says; no state of ours)."""
    flag = ctypes.c_int(0)
    try:
        ok = _prctl()(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    return ok and flag.value != 0


def _key(process: psutil.Process) -> _Key:
    return process.pid, process.create_time()


@dataclass(eq=False)
class GuestTree:
    """Everything one execution's guest started, and what it has used."""

    execution_id: str
    root_pid: int
    limits: Limits
    on_violation: Callable[[EndReason], None]
    seen: dict[_Key, psutil.Process] = field(default_factory=dict)
    cpu_by_process: dict[_Key, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    peak_processes: int = 0
    peak_open_files: int = 0
    violation: EndReason | None = None
    #: When the guest started (psutil's clock): orphans born earlier are not its.
    started_at: float = 0.0
    #: pid -> (start time in clock ticks, key in ``seen``) of the live members:
    #: lets a sample recognise known processes from one read of their stat.
    _ident: dict[int, tuple[int, _Key]] = field(default_factory=dict)
    _indexed: set[_Key] = field(default_factory=set)

    @property
    def cpu_s(self) -> float:
        """CPU seconds (user + system) used by the tree, as last sampled."""
        return sum(self.cpu_by_process.values())

    def members(
        self, children_of: dict[int, list[int]] | None = None, *, zombies: bool = False
    ) -> list[psutil.Process]:
        """The live processes of the tree: the root, every process seen before
        that is still the same process (also those that left the group or were
        reparented), and all their descendants now."""
        if children_of is None:
            children_of = process_map()
        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.Error):
            found[self.root_pid] = psutil.Process(self.root_pid)
        for process in self.seen.values():
            # is_running() also compares the start time: a reused pid is not it.
            if process.pid not in found and is_alive(process):
                found[process.pid] = process
        stack = list(found)
        while stack:
            for child in children_of.get(stack.pop(), ()):
                if child not in found:
                    with contextlib.suppress(psutil.Error):
                        found[child] = psutil.Process(child)
                        stack.append(child)
        if zombies:  # exited but not yet reaped: still ours to reap once adopted
            return [p for p in found.values() if _exists(p)]
        return [p for p in found.values() if is_alive(p)]

    def sample(self, snapshot: dict[int, ProcStat], children_of: dict[int, list[int]]) -> None:
        """Measure the tree once from one :func:`proc_snapshot` and check the limits.

        A process already known costs nothing beyond its line in the snapshot;
        psutil is asked once per new process (for its key in ``seen``)."""
        self._index_seen(snapshot)
        found: dict[int, ProcStat] = {}
        root = snapshot.get(self.root_pid)
        if root is not None:
            found[self.root_pid] = root
        for pid, (start, key) in list(self._ident.items()):
            stat = snapshot.get(pid)
            if stat is None or stat.start != start:
                del self._ident[pid]  # gone; its pid may be someone else's now
                if stat is None:  # or only missed by this pass: look again next time
                    self._indexed.discard(key)
            else:
                found.setdefault(pid, stat)
        stack = list(found)
        while stack:
            for child in children_of.get(stack.pop(), ()):
                if child not in found:
                    found[child] = snapshot[child]
                    stack.append(child)
        rss = 0
        open_files = 0
        processes = 0
        for pid, stat in found.items():
            known = self._ident.get(pid)
            if known is None or known[0] != stat.start:
                try:
                    process = psutil.Process(pid)
                    key = _key(process)
                except psutil.Error:
                    continue  # exited since the snapshot
                self.seen.setdefault(key, process)
                self._indexed.add(key)
                self._ident[pid] = known = (stat.start, key)
            if stat.zombie:
                continue  # remembered (ours to reap), not measured
            with contextlib.suppress(OSError, ValueError, IndexError):
                rss += rss_bytes(pid)
            processes += 1
            key = known[1]
            self.cpu_by_process[key] = max(stat.cpu_s, self.cpu_by_process.get(key, 0.0))
            if self.limits.max_open_files is not None:
                with contextlib.suppress(OSError):
                    open_files += len(os.listdir(f"/proc/{pid}/fd"))
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss)
        self.peak_processes = max(self.peak_processes, processes)
        self.peak_open_files = max(self.peak_open_files, open_files)
        self._check(rss, processes, open_files)

    def _index_seen(self, snapshot: dict[int, ProcStat]) -> None:
        """Processes put in ``seen`` from outside a sample (adopted orphans,
        the stop path): find their line in the snapshot, once."""
        for key in self.seen.keys() - self._indexed:
            alive = _exists(self.seen[key])  # the same process, not a reused pid
            stat = snapshot.get(key[0])
            if alive and stat is not None:
                self._ident.setdefault(key[0], (stat.start, key))
            if stat is not None or not alive:  # else: missed this pass, look again next
                self._indexed.add(key)

    def _check(self, rss: int, processes: int, open_files: int) -> None:
        if self.violation is not None:
            return
        limits = self.limits
        reason: EndReason | None = None
        if limits.memory_bytes is not None and rss > limits.memory_bytes:
            reason = "memory_limit"
        elif limits.cpu_s is not None and self.cpu_s > limits.cpu_s:
            reason = "cpu_limit"
        elif limits.max_processes is not None and processes > limits.max_processes:
            reason = "process_limit"
        elif limits.max_open_files is not None and open_files > limits.max_open_files:
            reason = "open_files_limit"
        if reason is not None:
            self.violation = reason
            self.on_violation(reason)

    def marked_processes(self, *, adopted_only: bool) -> list[psutil.Process]:
        """Processes of our uid whose environment names this execution.

        With ``adopted_only`` (the supervisor is a subreaper) only our own
        children are read: an orphan of the tree can only have been
        reparented to us.
        """
        marker = f"HOSTCALL_EXECUTION={self.execution_id}".encode()
        uid = os.getuid()
        me = os.getpid()
        candidates = (
            psutil.Process(me).children() if adopted_only else psutil.process_iter(["uids"])
        )
        found = []
        for process in candidates:
            try:
                if process.pid in (me, self.root_pid) or process.uids().real != uid:
                    continue
                with open(f"/proc/{process.pid}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(process)
            except (OSError, psutil.Error, AttributeError):
                continue
        return found


def _is_adopted(process: psutil.Process) -> bool:
    """A child of ours in another session that we did not launch as a guest.

    Guests are launched in sessions of their own and are never "adopted";
    every other child of ours outside our session came to us as an orphan.
    """
    try:
        return (
            process.ppid() == os.getpid()
            and os.getsid(process.pid) != os.getsid(0)
            and process.pid not in _guest_roots
        )
    except (psutil.Error, OSError):
        return False


def _child_pids() -> list[int]:
    """This process's children, from ``/proc/self/task/*/children`` (no full scan)."""
    pids: list[int] = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:  # no CONFIG_PROC_CHILDREN: the slow way
        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process().children()]
    return pids


def _adopted_children(pids: Iterable[int] | None = None) -> list[psutil.Process]:
    """Our children (``pids``, else read now) that came to us as orphans. The
    cheap checks first: a guest root or a child in our session needs no
    psutil object."""
    own_session = os.getsid(0)
    found = []
    for pid in _child_pids() if pids is None else pids:
        if pid in _guest_roots:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(pid) != own_session:
                child = psutil.Process(pid)
                if _is_adopted(child):
                    found.append(child)
    return found


#: Pids of the guest roots every tracker of this process launched: children of
#: this process (a fact of the process, as its children are), so that an
#: orphan it adopted is never mistaken for a guest it launched.
_guest_roots: set[int] = set()


@dataclass(frozen=True, slots=True)
class ProcStat:
    """One process, from one read of ``/proc/<pid>/stat``."""

    ppid: int
    zombie: bool
    #: CPU seconds, user + system, its own and its reaped children's.
    cpu_s: float
    #: Start time in clock ticks after boot: with the pid, names one process.
    start: int


_CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
_PAGE_SIZE: Final = os.sysconf("SC_PAGE_SIZE")


def proc_snapshot() -> dict[int, ProcStat]:
    """Every process on the machine, one small read each (no psutil objects)."""
    snapshot: dict[int, ProcStat] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            # "pid (comm) state ppid …": comm may hold spaces and parentheses.
            raw = _read(f"/proc/{name}/stat")
            fields = raw[raw.rindex(b")") + 2 :].split()
            snapshot[int(name)] = ProcStat(
                ppid=int(fields[1]),
                zombie=fields[0] in (b"Z", b"X"),
                cpu_s=sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS,
                start=int(fields[19]),
            )
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return snapshot


def rss_bytes(pid: int) -> int:
    """Resident memory as psutil reads it (``statm``: exact where ``stat``'s may lag).

    Raises:
        OSError: the process is gone.
    """
    return int(_read(f"/proc/{pid}/statm").split()[1]) * _PAGE_SIZE


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def descendants(pid: int, children_of: dict[int, list[int]]) -> list[int]:
    """Every descendant of ``pid`` in a :func:`process_map` (not ``pid`` itself)."""
    found: list[int] = []
    stack = list(children_of.get(pid, ()))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children_of.get(child, ()))
    return found


def process_map(snapshot: dict[int, ProcStat] | None = None) -> dict[int, list[int]]:
    """Every process's children, from one pass over ``/proc``."""
    children_of: dict[int, list[int]] = {}
    for pid, stat in (proc_snapshot() if snapshot is None else snapshot).items():
        children_of.setdefault(stat.ppid, []).append(pid)
    return children_of


def _exists(process: psutil.Process) -> bool:
    try:
        return process.is_running()
    except psutil.Error:
        return False


def is_alive(process: psutil.Process) -> bool:
    """Whether ``process`` (that very process: pid and start time) runs, not a zombie."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Sampled(Protocol):
    """A sandboxed guest as the sampler drives it (``sandbox.usage.SandboxTree``)."""

    execution_id: str
    init_pid: int
    pidns: int

    @property
    def needs_snapshot(self) -> bool: ...

    def sample(self, snapshot: dict[int, ProcStat], children_of: dict[int, list[int]]) -> None: ...


def pid_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s pid namespace, or None if it cannot be read."""
    try:
        link = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    digits = link.removeprefix("pid:[").removesuffix("]")
    return int(digits) if digits.isdigit() else None


class TreeTracker:
    """Samples every tracked guest on one timer: unsandboxed trees and sandboxes."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._trees: dict[str, GuestTree] = {}
        self._sandboxes: dict[str, Sampled] = {}
        self._monitors: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._failures = 0

    def track(
        self,
        execution_id: str,
        root_pid: int,
        limits: Limits,
        on_violation: Callable[[EndReason], None],
    ) -> GuestTree:
        """Start sampling an unsandboxed guest's tree."""
        tree = GuestTree(execution_id, root_pid, limits, on_violation)
        with contextlib.suppress(psutil.Error):
            tree.started_at = psutil.Process(root_pid).create_time()
        _guest_roots.add(root_pid)
        self._trees[execution_id] = tree  # first sampled on the next tick, not here
        self._start()
        return tree

    def track_sandbox(self, sandbox: Sampled, monitor_pid: int) -> None:
        """Start sampling a sandboxed guest; ``monitor_pid`` is bubblewrap's monitor,
        our child, which the event loop's child watcher reaps."""
        _guest_roots.add(monitor_pid)
        self._sandboxes[sandbox.execution_id] = sandbox
        self._monitors[sandbox.execution_id] = monitor_pid
        self._start()

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="hostcall-tree-sampler")

    def owner_of(self, pid: int) -> str | None:
        """The execution whose guest holds process ``pid``, or None when it is
        certainly no guest's.

        A process belongs to a sandbox if it lives in the sandbox's pid
        namespace (which nothing leaves). It belongs to an unsandboxed tree if
        the tree's root is among its ancestors, if the tree has seen it (or an
        ancestor) before, or if its environment carries an execution's id.

        This process itself (its console, a host program calling its own
        admin API) is no guest's: it is told by its pid, since it is not
        dumpable and, to any uid but root, its own ``/proc`` files are not
        readable.

        Raises:
            LookupError: the process cannot be attributed (gone, unreadable,
                in another pid namespace): callers refuse it (fail closed).
        """
        if pid == os.getpid():
            return None
        pidns = pid_namespace(pid)
        if pidns is None:
            raise LookupError(f"cannot read the pid namespace of {pid}")
        for sandbox in self._sandboxes.values():
            if pidns == sandbox.pidns:
                return sandbox.execution_id
        if pidns != pid_namespace(os.getpid()):
            raise LookupError(f"process {pid} lives in another pid namespace")
        try:
            process = psutil.Process(pid)
            lineage = [process, *process.parents()]
            keys = {_key(member) for member in lineage}
        except psutil.Error as exc:
            raise LookupError(f"cannot read the ancestry of {pid}: {exc}") from None
        for tree in self._trees.values():
            if tree.root_pid in {m.pid for m in lineage} or keys & tree.seen.keys():
                return tree.execution_id
        if self.adopted(pid):
            return "(an orphan adopted from a guest)"
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError as exc:
            raise LookupError(f"cannot read the environment of {pid}: {exc}") from None
        for entry in environ.split(b"\0"):
            if entry.startswith(b"HOSTCALL_EXECUTION="):
                return entry.split(b"=", 1)[1].decode(errors="replace")
        return None

    def orphans_of(
        self, tree: GuestTree, adopted: list[psutil.Process] | None = None
    ) -> list[psutil.Process]:
        """Processes adopted by this supervisor (as subreaper) that belong to
        ``tree``: they stayed in its guest's session, or they left every
        session and ``tree`` is the only guest running (a double-forked daemon
        that scrubbed its environment can be traced no other way)."""
        found = []
        for child in _adopted_children() if adopted is None else adopted:
            with contextlib.suppress(psutil.Error, OSError):
                sid = os.getsid(child.pid)
                if sid == tree.root_pid or (
                    list(self._trees.values()) == [tree] and child.create_time() >= tree.started_at
                ):
                    found.append(child)
        return found

    def adopted(self, pid: int) -> bool:
        """Whether ``pid`` descends from a process this supervisor adopted."""
        with contextlib.suppress(psutil.Error):
            lineage = [psutil.Process(pid), *psutil.Process(pid).parents()]
            me = os.getpid()
            for below, above in itertools.pairwise(lineage):
                if above.pid == me:
                    return _is_adopted(below)
        return False

    def untrack(self, execution_id: str) -> None:
        """Stop sampling (the guest has been stopped)."""
        tree = self._trees.pop(execution_id, None)
        if tree is not None:
            _guest_roots.discard(tree.root_pid)
        self._sandboxes.pop(execution_id, None)
        monitor = self._monitors.pop(execution_id, None)
        if monitor is not None:
            _guest_roots.discard(monitor)

    async def _run(self) -> None:
        while self._trees or self._sandboxes:
            busy = len(self._trees) + len(self._sandboxes) > BUSY_TREES
            await asyncio.sleep(max(self.interval_s, BUSY_SAMPLE_INTERVAL_S if busy else 0.0))
            try:
                self.sample_all()
            except Exception:
                # Boundary: EMFILE, a /proc read that fails, anything a guest can
                # provoke: skip this tick, never stop sampling (docs/sandbox.md).
                self._failures += 1
                if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                    logger.exception("a sample of the guests failed (%d so far)", self._failures)

    def sample_all(self) -> None:
        """One pass for every guest: adopt orphans, reap adopted zombies, measure,
        check limits. ``/proc`` is read only when some guest needs it."""
        snapshot: dict[int, ProcStat] = {}
        children_of: dict[int, list[int]] = {}
        if self._trees or any(s.needs_snapshot for s in self._sandboxes.values()):
            snapshot = proc_snapshot()
            children_of = process_map(snapshot)
        if self._trees:
            ours = children_of.get(os.getpid(), [])
            self._reap_adopted_zombies(ours, snapshot)
            adopted = _adopted_children(ours)
            for tree in list(self._trees.values()):
                for orphan in self.orphans_of(tree, adopted):
                    with contextlib.suppress(psutil.Error):
                        tree.seen.setdefault(_key(orphan), orphan)
                try:
                    tree.sample(snapshot, children_of)
                except Exception:  # boundary: one odd process must not stop the sampler
                    logger.exception("sampling the tree of %s failed", tree.execution_id)
        for sandbox in list(self._sandboxes.values()):
            try:
                sandbox.sample(snapshot, children_of)
            except Exception:  # boundary: as above
                logger.exception("sampling the sandbox of %s failed", sandbox.execution_id)

    def _reap_adopted_zombies(self, ours: list[int], snapshot: dict[int, ProcStat]) -> None:
        """Reap, as they appear, zombies a guest tree left to us as subreaper.

        Only processes of a tree (seen by it, or still in its guest's session):
        never a guest root (the event loop's child watcher reaps those) and
        never another child of this process.
        """
        for pid in ours:
            stat = snapshot.get(pid)
            if pid in _guest_roots or stat is None or not stat.zombie:
                continue
            try:
                sid = os.getsid(pid)
            except OSError:
                continue
            for tree in self._trees.values():
                if sid == tree.root_pid or any(key[0] == pid for key in tree.seen):
                    with contextlib.suppress(ChildProcessError, OSError):
                        os.waitpid(pid, os.WNOHANG)
                    break

    async def close(self) -> None:
        """Stop the sampler."""
        self._trees.clear()
        self._sandboxes.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
