"""The guest's view of the file system, as a list of bubblewrap mount options.

docs/sandbox.md, "What it has": a read-only view of the host's file system with the
state dir and the plan's ``hide`` list absent; every path the command
resolves through readable and executable for the guest's uid; an empty
private ``/tmp``; a writable working directory, fresh per execution unless the
plan names one; the plan's ``read_only`` and ``read_write`` paths; and the
channel socket at a fixed path.

bubblewrap applies mounts in order, a later one covering what an earlier one
showed beneath its mount point. :class:`Layout` keeps the same model while it
adds options, so it can ask "does the guest see this host path here?" before
deciding to bind or mask it. Order of the layers:

1. ``/`` read-only; fresh ``/dev``, ``/proc``, ``/tmp``, ``/var/tmp``, ``/run``
   and ``/dev/shm`` (the host's temporary and runtime folders hold other
   programs' files and sockets);
2. when the guest's uid cannot search a folder on the way to something the
   command needs (``/root`` for a supervisor running as root), an empty
   folder over it, then the needed paths bound back;
3. the command's paths that are not visible yet (a script under ``/tmp``);
4. the plan's ``read_only`` and ``read_write`` paths;
5. the working directory;
6. ``/run/hostcall`` with the channel socket, read-only;
7. masks last, so that nothing bound above can show them: the state dir,
   the ``hide`` list, and every Unix socket bound on the host that the guest
   could otherwise connect to (a read-only mount does not stop ``connect()``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from supervisor.sandbox.paths import Account, is_dir, is_within

__all__ = ["GUEST_RUN_DIR", "GUEST_SOCKET", "GUEST_WORKDIR", "Layout"]

#: Where hostcall's own things live inside every sandbox.
GUEST_RUN_DIR: Final = Path("/run/hostcall")
#: ``HOSTCALL_SOCKET`` as the guest sees it (docs/guests.md: the path inside).
GUEST_SOCKET: Final = GUEST_RUN_DIR / "channel.sock"
#: The fresh working directory, when the launch folder cannot be shown.
GUEST_WORKDIR: Final = GUEST_RUN_DIR / "work"
#: Host folders replaced by empty ones: temporary and runtime files of others.
_PRIVATE_DIRS: Final = (Path("/tmp"), Path("/var/tmp"), Path("/run"))

_Kind = Literal["host", "fresh"]


@dataclass(slots=True)
class _Mount:
    dest: Path
    kind: _Kind


@dataclass
class Layout:
    """Builds bubblewrap's mount options for one guest.

    ``account`` is the uid and gid the guest runs as (outside the sandbox);
    ``builder`` the account bubblewrap itself mounts with: root, or the
    supervisor's own uid when the guest is started in a user namespace.
    """

    account: Account
    builder_is_root: bool
    tmpfs_size: int | None = None
    args: list[str] = field(default_factory=list)
    _mounts: list[_Mount] = field(default_factory=list)
    #: Host paths exposed, for the outcome report and tests.
    exposed: list[Path] = field(default_factory=list)
    masked: list[Path] = field(default_factory=list)

    # -- the model -------------------------------------------------------

    def _governing(self, path: Path) -> _Mount | None:
        for mount in reversed(self._mounts):
            if is_within(path, mount.dest):
                return mount
        return None

    def shows(self, path: Path) -> bool:
        """Whether the guest sees the host's ``path`` at ``path`` (if it may search there)."""
        mount = self._governing(path)
        return mount is not None and mount.kind == "host"

    def reachable(self, path: Path) -> bool:
        """Whether the guest's uid can search every folder on the way to ``path``."""
        for ancestor in reversed(path.parents):
            mount = self._governing(ancestor)
            if mount is None or mount.kind == "fresh":
                continue  # made by bubblewrap: searchable (0755 or 1777)
            try:
                st = os.stat(ancestor)
            except OSError:
                return False
            if not self.account.may(st, 1):
                return False
        return True

    def _builder_can_reach(self, path: Path) -> bool:
        """bubblewrap resolves host paths as its own uid: root reaches anything."""
        if self.builder_is_root:
            return True
        try:
            os.stat(path)
        except OSError:
            return False
        return True

    # -- options ---------------------------------------------------------

    def _tmpfs(self, dest: Path, perms: int) -> None:
        if self.tmpfs_size is not None:
            self.args += ["--size", str(self.tmpfs_size)]
        self.args += ["--perms", f"{perms:04o}", "--tmpfs", str(dest)]
        self._mounts.append(_Mount(dest, "fresh"))

    def base(self, *, private_dirs: Iterable[Path] = _PRIVATE_DIRS) -> None:
        """Layer 1: the host read-only, fresh system and temporary folders."""
        self.args += ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
        # The memory of bubblewrap's pid 1, which a guest of its uid (every
        # guest of a supervisor that is not root) could write with a plain
        # open(): seccomp refuses ptrace and process_vm_writev, not open. It
        # would clear pid 1's parent-death signal and outlive a SIGKILLed
        # supervisor (docs/security.md, F25). Masked before pid 1 forks the
        # guest, by the device it cannot open for writing (nodev).
        for memory in ("/proc/1/mem", "/proc/1/task/1/mem"):
            self.args += ["--ro-bind", "/dev/null", memory]
        self._mounts += [
            _Mount(Path("/"), "host"),
            _Mount(Path("/dev"), "fresh"),
            _Mount(Path("/proc"), "fresh"),
        ]
        self._tmpfs(Path("/dev/shm"), 0o1777)
        for folder in private_dirs:
            if os.path.isdir(folder) and not os.path.islink(folder):
                self._tmpfs(folder, 0o1777 if folder != Path("/run") else 0o755)

    def expose(self, paths: Sequence[Path]) -> None:
        """Layers 2 and 3: make each path readable where the guest looks for it.

        Folders the guest's uid cannot search are covered by empty ones first
        (possible only when bubblewrap runs as root; a supervisor that is not
        root runs its guest as itself), then every path not yet visible is
        bound read-only at its own place.
        """
        wanted = sorted({p for p in paths if os.path.lexists(p)}, key=lambda p: len(p.parts))
        if self.builder_is_root:
            for path in wanted:
                for ancestor in reversed(path.parents):
                    if not self.shows(ancestor):
                        break
                    try:
                        st = os.stat(ancestor)
                    except OSError:
                        break
                    if not self.account.may(st, 1):
                        self._tmpfs(ancestor, 0o755)
                        break
        for path in wanted:
            if not self._builder_can_reach(path):
                continue  # the guest, being the same uid, cannot reach it either
            if os.path.islink(path):
                self._links(path)  # its target is wanted too (a hop of its own)
            elif not (self.shows(path) and self.reachable(path)):
                self.bind(path, writable=False)

    def bind(self, path: Path, *, writable: bool, held: tuple[int, Path] | None = None) -> None:
        """Bind a host path at its own place; ``held``, a descriptor of it and
        its real path as they were checked, is mounted instead of the name:
        then no folder swapped on the way since moves the mount or its source.

        Mounted where it really is (bubblewrap would resolve a symlink in the
        source but mount at the link's own place, where masks computed for the
        real place would not cover it), with the links on the way recreated
        where the guest would not otherwise see them.
        """
        real = Path(os.path.realpath(path)) if held is None else held[1]
        self._parents(real)
        if held is not None:
            kind = "--bind-fd" if writable else "--ro-bind-fd"
            self.args += [kind, str(held[0]), str(real)]
        else:
            self.args += ["--bind" if writable else "--ro-bind", str(real), str(real)]
        self._mounts.append(_Mount(real, "host"))
        self.exposed.append(real)
        if real != path:
            self._links(path)

    def _links(self, path: Path) -> None:
        """The host's symlinks on the way to ``path`` (and ``path`` itself),
        made inside where the guest does not see the host's own."""
        for prefix in [*reversed(path.parents), path]:
            if os.path.islink(prefix) and not self.shows(prefix):
                self._parents(prefix)
                self.args += ["--symlink", os.readlink(prefix), str(prefix)]
                self._mounts.append(_Mount(prefix, "fresh"))

    def _parents(self, path: Path) -> None:
        """Folders bubblewrap makes on the way to a mount point inside a fresh
        one: searchable by the guest (bubblewrap would make them 0700)."""
        for ancestor in reversed(path.parents):
            mount = self._governing(ancestor)
            if mount is not None and mount.kind == "fresh" and mount.dest != ancestor:
                self.args += ["--perms", "0755", "--dir", str(ancestor)]

    def workdir_overlay(self, path: Path) -> None:
        """The launch folder as the working directory: its files shown, writes kept
        in a fresh tmpfs that disappears with the sandbox."""
        self.args += ["--overlay-src", str(path), "--tmp-overlay", str(path)]
        if self.builder_is_root:
            # The overlay's top belongs to root: let the guest's uid create files.
            self.args += ["--chmod", "0777", str(path)]
        self._mounts.append(_Mount(path, "host"))
        self.exposed.append(path)

    def _run_dir(self) -> None:
        if not any(m.dest == GUEST_RUN_DIR for m in self._mounts):
            self._tmpfs(GUEST_RUN_DIR, 0o755)

    def fresh_workdir(self) -> Path:
        """An empty writable working directory that disappears with the sandbox."""
        self._run_dir()
        # Its own mount, so that making /run/hostcall read-only leaves it writable.
        self._tmpfs(GUEST_WORKDIR, 0o777 if self.builder_is_root else 0o700)
        return GUEST_WORKDIR

    def socket(self, host_socket: Path) -> Path:
        """Layer 6: the channel socket at its fixed place; ``/run/hostcall`` read-only."""
        self._run_dir()
        self.args += ["--ro-bind", str(host_socket), str(GUEST_SOCKET)]
        self.args += ["--remount-ro", str(GUEST_RUN_DIR)]
        return GUEST_SOCKET

    def mask(self, paths: Iterable[Path]) -> None:
        """Layer 7: make each path empty and read-only where the guest would see it."""
        for path in sorted(set(paths), key=lambda p: len(p.parts)):
            # A symlink is not masked itself (a mount would land on its target):
            # callers pass real paths too.
            if os.path.islink(path) or not os.path.lexists(path) or not self.shows(path):
                continue
            if not self._builder_can_reach(path):
                continue
            if self.builder_is_root is False and not self.reachable(path):
                continue
            if is_dir(path):
                self._tmpfs(path, 0o755)
                self.args += ["--remount-ro", str(path)]
            else:
                # Any non-folder (file, socket, fifo): covered by /dev/null on a
                # nodev mount, so opening it fails and connecting is impossible.
                self.args += ["--ro-bind", "/dev/null", str(path)]
                self._mounts.append(_Mount(path, "fresh"))
            self.masked.append(path)
