"""A cgroup per guest execution: kernel-counted limits and an atomic stop (docs/security.md, S5/S6).

The kernel charges every page of a guest's tree (anonymous, memfd, tmpfs: also
pages in no process's RSS) and every task to its cgroup and refuses what would
cross a limit, so no burst between samples gets through. The stop cannot be
outrun by a fork: ``cgroup.kill``, or freeze, SIGKILL every member, thaw.

- v2: a non-root cgroup with processes may not enable controllers for its
  children, so the supervisor moves itself into :data:`SUPERVISOR_LEAF` — only
  if no other process shares its cgroup — and then enables ``+memory +pids``.
  CPU accounting needs no controller: every cgroup has ``cpu.stat``.
- v1: the memory and pids (required), cpuacct and freezer hierarchies.

And, where the cpu controller is ours to use (v2: delegated; v1: its
hierarchy writable), CPU *weights*: the base of all guests weighs as much
as the supervisor's own cgroup (v2) or one of its threads (v1), and each
execution as much as any other. Without them every runnable guest process
weighs as much as the supervisor's event loop, so 200 guests starting, or
one guest forking spinners up to its task cap, leave the channel a sliver
of the CPU (docs/security.md, S9).

On disk: ``<own cgroup>/hostcall-<pid>-<n>/<execution>``, one base per
:class:`CgroupHost`. The next host kills what is left in the base of a dead
pid and removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

__all__ = ["CgroupError", "CgroupFs", "CgroupHost", "CgroupUsage", "ExecutionCgroup"]

logger = logging.getLogger(__name__)

#: How often a wait re-reads kernel state that offers no event to wait on.
POLL_INTERVAL_S: Final = 0.005
#: How long ``kill`` waits for the freezer to settle before killing anyway.
FREEZE_TIMEOUT_S: Final = 1.0
#: How long ``close`` and stale-base cleanup wait for killed members to leave.
CLEANUP_TIMEOUT_S: Final = 5.0
#: The v2 leaf the supervisor moves itself into (see the module docstring).
SUPERVISOR_LEAF: Final = "hostcall-supervisor"

_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # one path component
_BASE: Final = re.compile(r"hostcall-([0-9]+)-[0-9]+")
_REQUIRED: Final = ("memory", "pids")
#: v1 role -> the controller whose hierarchy serves it; the "cpu" role is
#: accounting, "weight" the CPU share (see the module docstring).
_V1_ROLES: Final = {
    "memory": "memory",
    "pids": "pids",
    "cpu": "cpuacct",
    "freezer": "freezer",
    "weight": "cpu",
}
_V2_ROLES: Final = ("memory", "pids", "cpu")  # all served by the one directory
_serial = itertools.count()

# Usage field -> (role, file, key in a "key value" file or None for a bare number).
_Reads = Mapping[str, tuple[str, str, str | None]]
_READS: Final[Mapping[str, _Reads]] = {
    "cgroup-v1": {
        "memory_bytes": ("memory", "memory.usage_in_bytes", None),
        "peak_memory_bytes": ("memory", "memory.max_usage_in_bytes", None),
        "oom_kills": ("memory", "memory.oom_control", "oom_kill"),
        "tasks": ("pids", "pids.current", None),
        "task_limit_hits": ("pids", "pids.events", "max"),
        "cpu": ("cpu", "cpuacct.usage", None),
    },
    "cgroup-v2": {
        "memory_bytes": ("memory", "memory.current", None),
        "peak_memory_bytes": ("memory", "memory.peak", None),  # Linux 5.19+
        "oom_kills": ("memory", "memory.events", "oom_kill"),
        "tasks": ("pids", "pids.current", None),
        "task_limit_hits": ("pids", "pids.events", "max"),
        "cpu": ("cpu", "cpu.stat", "usage_usec"),
    },
}
_CPU_SCALE: Final = {"cgroup-v1": 1e-9, "cgroup-v2": 1e-6}  # cpuacct: ns, cpu.stat: µs
#: kind -> (role, control file, (thawed, frozen) values, state file, line once frozen).
#: v1 reads FREEZING until every task has stopped.
_FREEZER: Final = {
    "cgroup-v1": ("freezer", "freezer.state", ("THAWED", "FROZEN"), "freezer.state", "FROZEN"),
    "cgroup-v2": ("pids", "cgroup.freeze", ("0", "1"), "cgroup.events", "frozen 1"),
}


class CgroupError(OSError):
    """A cgroup could not be created, limited or joined (the kernel's error is
    the ``__cause__``); the caller falls back to sampling."""


class CgroupFs(Protocol):
    """The writes that change cgroups: ``mkdir`` (the kernel fills the new cgroup
    with control files), ``rmdir`` (an empty cgroup) and ``write`` (a control
    file). A seam so that tests can model the kernel's rules on plain files;
    reads are plain file reads."""

    def mkdir(self, path: str) -> None: ...
    def rmdir(self, path: str) -> None: ...
    def write(self, path: str, text: str) -> None: ...


def _open(path: str, flags: int) -> int:
    # O_NOFOLLOW: a symlink planted where a control file belongs is never used.
    # Never O_CREAT: a control file exists, or its controller is not there.
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def _read(path: str) -> str:
    with open(_open(path, os.O_RDONLY), "rb", buffering=0) as file:
        return file.read().decode()


class _KernelFs:
    def mkdir(self, path: str) -> None:
        os.mkdir(path)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def write(self, path: str, text: str) -> None:
        with open(_open(path, os.O_WRONLY), "wb", buffering=0) as file:
            file.write(text.encode())


_KERNEL: Final = _KernelFs()


@dataclass(frozen=True, slots=True)
class CgroupUsage:
    """What an execution's cgroup has used, as the kernel counts it.

    ``tasks`` counts threads as well as processes (the pids controller limits
    tasks). ``cpu_s`` includes members that have exited; ``None`` where the
    host has no CPU accounting. ``oom_kills`` counts processes the kernel
    killed for the memory limit; ``task_limit_hits`` forks refused by the task
    limit.
    """

    memory_bytes: int = 0
    peak_memory_bytes: int = 0
    tasks: int = 0
    cpu_s: float | None = None
    oom_kills: int = 0
    task_limit_hits: int = 0


def _field(text: str, key: str | None) -> int:
    if key is None:
        return int(text)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise ValueError(f"no {key!r} in {text!r}")


def _wait(until: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``until`` — only for kernel state that has no event to wait on."""
    deadline = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
    return True


class ExecutionCgroup:
    """One execution's cgroup (a directory per hierarchy); see :meth:`CgroupHost.create`."""

    def __init__(self, kind: str, dirs: Mapping[str, str], fs: CgroupFs = _KERNEL) -> None:
        self.kind = kind
        self._dirs = dict(dirs)  # role -> directory
        self._fs = fs
        self._last = CgroupUsage()
        # v1's cpu hierarchy, when it serves only the CPU share: a process
        # that cannot join it (a realtime one: the kernel would need realtime
        # time granted to the group) runs without its weight, not at all.
        shared = {d for role, d in self._dirs.items() if role != "weight"}
        self._optional = {self._dirs["weight"]} - shared if "weight" in self._dirs else set()

    @property
    def paths(self) -> tuple[str, ...]:
        """The cgroup's directory in every hierarchy it uses."""
        return tuple(dict.fromkeys(self._dirs.values()))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup in every hierarchy.

        Raises:
            CgroupError: the kernel refused (the process is gone, no permission).
        """
        for path in self.paths:
            try:
                self._fs.write(os.path.join(path, "cgroup.procs"), str(pid))
            except OSError as error:
                if path in self._optional:
                    logger.info("%d runs without its CPU weight: %s", pid, error)
                    continue
                raise CgroupError(error.errno, f"cannot add {pid} to {path}: {error}") from error

    def usage(self) -> CgroupUsage:
        """The kernel's counters. Never raises: a counter that cannot be read
        (EMFILE, a file absent, the cgroup removed) keeps its last value."""
        now: dict[str, int] = {}
        for name, (role, filename, key) in _READS[self.kind].items():
            if role in self._dirs:
                with contextlib.suppress(OSError, ValueError):
                    now[name] = _field(_read(os.path.join(self._dirs[role], filename)), key)
        last, cpu = self._last, now.get("cpu")
        memory = now.get("memory_bytes", last.memory_bytes)
        self._last = CgroupUsage(
            memory_bytes=memory,
            # Also the highest value seen: v2 before Linux 5.19 has no memory.peak.
            peak_memory_bytes=max(now.get("peak_memory_bytes", 0), memory, last.peak_memory_bytes),
            tasks=now.get("tasks", last.tasks),
            cpu_s=last.cpu_s if cpu is None else cpu * _CPU_SCALE[self.kind],
            oom_kills=now.get("oom_kills", last.oom_kills),
            task_limit_hits=now.get("task_limit_hits", last.task_limit_hits),
        )
        return self._last

    def pids(self) -> list[int]:
        """The processes in the cgroup (pids as the supervisor sees them).

        Raises:
            CgroupError: the member list cannot be read.
        """
        found: set[int] = set()
        for path in self.paths:  # v1: all hierarchies, in case an add() failed half-way
            try:
                found.update(map(int, _read(os.path.join(path, "cgroup.procs")).split()))
            except FileNotFoundError:
                continue  # removed already, so it had no members
            except OSError as error:
                raise CgroupError(error.errno, f"cannot list {path}: {error}") from error
        return sorted(found)

    def signal(self, signum: int) -> None:
        """Send ``signum`` to every process in the cgroup, skipping ones gone.

        Unless the cgroup is frozen, a pid may be reused between the list and
        the signal; to end the tree use :meth:`kill`.
        """
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup so that none can fork a child that
        escapes. Returns when the signals are sent; :meth:`remove` waits for
        the members to be gone.

        Raises:
            CgroupError: the member list cannot be read (v1, or v2 before 5.14).
        """
        if self.kind == "cgroup-v2":
            kill_file = os.path.join(self._dirs["pids"], "cgroup.kill")
            if os.path.lexists(kill_file):  # Linux 5.14+: the kernel does it all
                self._fs.write(kill_file, "1")
                return
        frozen = self._freeze()
        try:
            self.signal(signal.SIGKILL)  # v1: frozen members die once thawed
        finally:
            with contextlib.suppress(OSError, KeyError):
                role, control, (thawed, _), _, _ = _FREEZER[self.kind]
                self._fs.write(os.path.join(self._dirs[role], control), thawed)
        if not frozen:
            # No freezer, or it did not settle: a fork may have slipped between the
            # list and the signals. Killed tasks cannot fork, so repeating converges.
            _wait(self._kill_round, FREEZE_TIMEOUT_S)

    def _kill_round(self) -> bool:
        self.signal(signal.SIGKILL)
        return self.empty()

    def _freeze(self) -> bool:
        """Whether the cgroup froze (within :data:`FREEZE_TIMEOUT_S`)."""
        role, control, (_, value), events, settled = _FREEZER[self.kind]
        if role not in self._dirs:
            return False
        directory = self._dirs[role]

        def frozen() -> bool:
            with contextlib.suppress(OSError):
                return settled in _read(os.path.join(directory, events)).splitlines()
            return False

        try:
            self._fs.write(os.path.join(directory, control), value)
        except OSError:
            return False
        return _wait(frozen, FREEZE_TIMEOUT_S)

    def empty(self) -> bool:
        """Whether no process is in the cgroup (zombies do not count; a removed
        cgroup is empty); ``False`` when that cannot be read."""
        try:
            if self.kind == "cgroup-v2":
                return "populated 0" in _read(os.path.join(self._dirs["pids"], "cgroup.events"))
            return not self.pids()
        except FileNotFoundError:
            return True
        except OSError:  # CgroupError included
            return False

    def _try_remove(self) -> bool:
        if not self.empty():
            return False
        try:
            for path in self.paths:
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rmdir(path)
        except OSError:  # e.g. EBUSY for a moment after the last member left
            return False
        return True

    async def remove(self, timeout_s: float) -> bool:
        """Wait until the cgroup is empty, then remove its directories.

        Returns:
            Whether it was removed within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while not self._try_remove():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(POLL_INTERVAL_S)
        return True


class CgroupHost:
    """What this supervisor process can do with cgroups; one per supervisor.

    ``kind`` is ``"cgroup-v2"`` or ``"cgroup-v1"``: the execution's ``"limits"``.
    """

    def __init__(self, kind: str, bases: Mapping[str, str], fs: CgroupFs = _KERNEL) -> None:
        self.kind = kind
        self._bases = dict(bases)  # role -> this host's base directory
        self._fs = fs

    @classmethod
    def detect(
        cls,
        *,
        proc_cgroup: str = "/proc/self/cgroup",
        mountinfo: str = "/proc/self/mountinfo",
        fs: CgroupFs = _KERNEL,
    ) -> CgroupHost | None:
        """Make this process's base cgroup: v2 where memory and pids are delegated
        to us, else v1; ``None`` where neither works (the caller samples).
        Stale bases of dead supervisors are cleared first. The arguments exist
        for tests on a fake tree."""
        try:
            lines = [line.split(":", 2) for line in _read(proc_cgroup).splitlines()]
            # "hierarchy:controllers:path"; the v2 line is "0::path".
            paths = {ctrl: path for _, ctrls, path in lines for ctrl in ctrls.split(",")}
            mounts = _parse_mountinfo(_read(mountinfo))
        except (OSError, ValueError):
            return None
        own = _own_dir(mounts, "cgroup2", None, paths[""]) if "" in paths else None
        try:
            container = None if own is None else _v2_container(own, fs)
        except (OSError, ValueError) as error:
            logger.info("no cgroup-v2 at %s: %s", own, error)
            container = None
        if container and (host := cls._open("cgroup-v2", dict.fromkeys(_V2_ROLES, container), fs)):
            return host
        containers = {}
        for role, controller in _V1_ROLES.items():
            own = _own_dir(mounts, "cgroup", controller, paths.get(controller))
            if own is not None and os.path.isdir(own):
                containers[role] = own
        if all(role in containers for role in _REQUIRED):
            return cls._open("cgroup-v1", containers, fs)
        return None

    @classmethod
    def _open(cls, kind: str, containers: Mapping[str, str], fs: CgroupFs) -> CgroupHost | None:
        name = f"hostcall-{os.getpid()}-{next(_serial)}"
        host = cls(kind, {role: os.path.join(c, name) for role, c in containers.items()}, fs)
        host._remove_stale(containers)
        made: set[str] = set()
        for role, base in list(host._bases.items()):
            try:
                if base not in made:  # v2: one directory serves every role
                    fs.mkdir(base)
                    made.add(base)
                    if kind == "cgroup-v2":  # no process is in the base: it may enable
                        fs.write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
                        _enable_cpu_weights(base, fs)
            except OSError as error:
                if role in _REQUIRED:
                    logger.info("no %s cgroup at %s: %s", kind, base, error)
                    host.close()
                    return None
                del host._bases[role]  # do without CPU accounting or the freezer
        return host

    def create(
        self, name: str, *, memory_bytes: int | None, max_tasks: int | None
    ) -> ExecutionCgroup:
        """Create the cgroup ``name`` with its limits set, before any process joins.

        The memory limit includes swap (nothing may be swapped out to stay
        under it); ``max_tasks`` counts threads as well as processes.

        Raises:
            ValueError: ``name`` is not ``[A-Za-z0-9_][A-Za-z0-9_.-]*`` (≤128).
            CgroupError: the kernel refused the directory or a limit.
        """
        if not _NAME.fullmatch(name):
            raise ValueError(f"invalid cgroup name {name!r}")
        dirs = {role: os.path.join(base, name) for role, base in self._bases.items()}
        cgroup = ExecutionCgroup(self.kind, dirs, self._fs)
        made: list[str] = []
        try:
            for path in cgroup.paths:
                self._fs.mkdir(path)
                made.append(path)
            self._limit(dirs["memory"], dirs["pids"], memory_bytes, max_tasks)
        except OSError as error:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    self._fs.rmdir(path)
            raise CgroupError(error.errno, f"cannot create cgroup {name!r}: {error}") from error
        return cgroup

    def _limit(self, memory: str, pids: str, memory_bytes: int | None, tasks: int | None) -> None:
        if memory_bytes is not None:
            if self.kind == "cgroup-v2":
                self._fs.write(os.path.join(memory, "memory.max"), str(memory_bytes))
                swap, swap_limit = os.path.join(memory, "memory.swap.max"), "0"
            else:
                # The leaf's own limit binds its members whatever memory.use_hierarchy says.
                self._fs.write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
                # TCP buffers are charged to a v1 cgroup only once it has a limit
                # of their own, and apart from the rest (v2 counts them in
                # memory.max): without one, a guest hoarding loopback TCP took
                # gigabytes under a 64 MB limit (docs/security.md, F26).
                tcp = os.path.join(memory, "memory.kmem.tcp.limit_in_bytes")
                if os.path.lexists(tcp):
                    self._fs.write(tcp, str(memory_bytes))
                swap = os.path.join(memory, "memory.memsw.limit_in_bytes")  # memory + swap
                swap_limit = str(memory_bytes)
            if os.path.lexists(swap):  # only with swap accounting
                self._fs.write(swap, swap_limit)
        if tasks is not None:
            self._fs.write(os.path.join(pids, "pids.max"), str(tasks))

    def close(self) -> None:
        """Kill what is left in this host's cgroups and remove them and its base."""
        self._clear(self._bases)

    def _remove_stale(self, containers: Mapping[str, str]) -> None:
        for bases in _subdirs(containers, _dead_base).values():
            logger.info("clearing the stale cgroup %s", bases)
            self._clear(bases)

    def _clear(self, bases: Mapping[str, str]) -> None:
        for dirs in _subdirs(bases, lambda name: True).values():
            cgroup = ExecutionCgroup(self.kind, dirs, self._fs)
            with contextlib.suppress(OSError):
                cgroup.kill()
            if not _wait(cgroup._try_remove, CLEANUP_TIMEOUT_S):
                logger.warning("cgroup %s keeps processes; left in place", cgroup.paths)
        for base in set(bases.values()):
            with contextlib.suppress(OSError):
                self._fs.rmdir(base)


def _subdirs(parents: Mapping[str, str], keep: Callable[[str], bool]) -> dict[str, dict[str, str]]:
    """name -> role -> path of the directories (never symlinks) in each role's parent."""
    found: dict[str, dict[str, str]] = {}
    for role, parent in parents.items():
        with contextlib.suppress(OSError), os.scandir(parent) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and keep(entry.name):
                    found.setdefault(entry.name, {})[role] = entry.path
    return found


def _dead_base(name: str) -> bool:
    """Whether ``name`` is the base of a supervisor whose process is gone."""
    match = _BASE.fullmatch(name)
    return match is not None and not os.path.exists(f"/proc/{match[1]}")


_Mount = tuple[str, str, str, frozenset[str]]  # hierarchy dir mounted, point, fstype, options


def _parse_mountinfo(text: str) -> list[_Mount]:
    def unescape(field: str) -> str:  # mountinfo writes space, tab, \ and newline as \ooo
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)

    mounts = []
    for line in text.splitlines():
        # "id parent dev root point options [optional...] - fstype source super-options"
        left, dash, right = line.partition(" - ")
        fields, tail = left.split(" "), right.split(" ")
        if dash and len(fields) >= 5 and len(tail) >= 3:
            options = frozenset(tail[2].split(","))  # v1: the controllers
            mounts.append((unescape(fields[3]), unescape(fields[4]), tail[0], options))
    return mounts


def _own_dir(
    mounts: list[_Mount], fstype: str, controller: str | None, path: str | None
) -> str | None:
    """Where cgroup ``path`` of a hierarchy is on disk, through a mount that shows it."""
    for root, point, kind, options in mounts:
        if path and kind == fstype and (controller is None or controller in options):
            relative = os.path.relpath(path, root)
            if relative != ".." and not relative.startswith("../"):
                return os.path.normpath(os.path.join(point, relative))
    return None


def _v2_container(own: str, fs: CgroupFs) -> str | None:
    """The v2 cgroup under which children get memory and pids, prepared if we may."""
    parent = os.path.dirname(own)
    if os.path.basename(own) == SUPERVISOR_LEAF and _has(parent, "cgroup.subtree_control"):
        _enable_cpu_weights(parent, fs)
        return parent  # we, or an earlier supervisor of this cgroup, moved here already
    if not _has(own, "cgroup.controllers"):
        return None
    # The real root cgroup (it has no cgroup.type) is exempt from the rule.
    if os.path.lexists(os.path.join(own, "cgroup.type")):
        if _read(os.path.join(own, "cgroup.procs")).split() != [str(os.getpid())]:
            return None  # others live here: they would block enabling controllers
        leaf = os.path.join(own, SUPERVISOR_LEAF)
        with contextlib.suppress(FileExistsError):
            fs.mkdir(leaf)
        fs.write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
    if not _has(own, "cgroup.subtree_control"):
        fs.write(os.path.join(own, "cgroup.subtree_control"), "+memory +pids")
    _enable_cpu_weights(own, fs)
    return own


def _enable_cpu_weights(directory: str, fs: CgroupFs) -> None:
    """Give ``directory``'s children CPU weights, where the cpu controller is
    delegated (v2). Best effort: without it every process weighs the same."""
    try:
        if "cpu" in _read(os.path.join(directory, "cgroup.subtree_control")).split():
            return
        if "cpu" not in _read(os.path.join(directory, "cgroup.controllers")).split():
            return
        fs.write(os.path.join(directory, "cgroup.subtree_control"), "+cpu")
    except OSError as error:  # e.g. EINVAL: a realtime process in the subtree
        logger.info("no CPU weights under %s: %s", directory, error)


def _has(directory: str, listing: str) -> bool:
    """Whether the controller list ``listing`` in ``directory`` has memory and pids."""
    return set(_REQUIRED) <= set(_read(os.path.join(directory, listing)).split())
