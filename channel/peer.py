"""Who is on the other end of a Unix socket connection (docs/security.md, S9).

The kernel tells us the peer's pid and uid (``SO_PEERCRED``), the pid as seen
from our own pid namespace, 0 when the peer's process is not visible to us.
Where it offers ``SO_PEERPIDFD`` we also get a pidfd, which pins the process:
after reading something about the pid (its namespace, its ancestry) we check
through the pidfd that the process is still alive, so a pid reused in between
cannot pass for the one that connected.

A connection is looked at once, when it is accepted (:func:`identify_peer`):
the process that connected, its pid namespace, and the *group* its
connections are counted in. A sandboxed guest and everything it starts live
in its sandbox's pid namespace, which they cannot leave; an unsandboxed guest
is started in a session of its own.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any, Final

import psutil

__all__ = [
    "GroupKey",
    "Peer",
    "PeerCredentials",
    "identify_peer",
    "is_in_guest_tree",
    "peer_credentials",
    "peer_pidfd",
    "pid_namespace",
    "still_alive",
]

_UCRED: Final = struct.Struct("3i")
#: Linux >= 6.5; not yet exported by Python's socket module.
SO_PEERPIDFD: Final = 77
#: ``ioctl(2)`` on a namespace file: open its parent namespace (linux/nsfs.h).
_NS_GET_PARENT: Final = 0xB702
#: Linux nests pid namespaces at most 32 deep.
_MAX_PID_NS_DEPTH: Final = 32


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The peer process of a connection as the kernel reported it."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None


#: Where a connection is counted: ``("pidns", inode)`` for a process in a pid
#: namespace below ours (one sandbox), ``("session", sid)`` for one in ours.
GroupKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Peer:
    """The process that opened a connection, as found when it was accepted.

    What the origin check uses cannot change while the connection is open:
    ``SO_PEERCRED`` is fixed at ``connect()``, and a process never changes its
    own pid namespace. (Its session it may; it stays counted where it was.)
    """

    #: As our pid namespace sees it (never 0: such a peer is not accepted).
    pid: int
    uid: int
    #: Inode of its own pid namespace (``readlink /proc/<pid>/ns/pid``).
    pidns: int
    group: GroupKey


def peer_pidfd(sock: Any) -> int | None:
    """A pidfd of the process that connected ``sock``, owned by the caller.

    None where the kernel has no ``SO_PEERPIDFD`` (before Linux 6.5).

    Raises:
        OSError: The kernel has it but gives none (the process is gone).
    """
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            return None
        raise


def peer_credentials(sock: Any, *, pidfd: bool = True) -> PeerCredentials:
    """Read the peer's credentials from a connected Unix socket.

    With ``pidfd`` the caller owns the returned ``pidfd`` and must close it.

    Raises:
        OSError: The peer could not be read, or (with ``pidfd``) is gone.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid=pid, uid=uid, gid=gid, pidfd=peer_pidfd(sock) if pidfd else None)


def pid_namespace(pid: int | str) -> int:
    """Inode of the pid namespace of process ``pid`` (or ``"self"``): the N of
    ``pid:[N]`` that ``readlink /proc/<pid>/ns/pid`` shows.

    Raises:
        OSError: No such process, or we may not inspect it.
    """
    link = os.readlink(f"/proc/{pid}/ns/pid")  # the cheapest way to it
    if not (link.startswith("pid:[") and link.endswith("]") and link[5:-1].isdigit()):
        raise OSError(f"unexpected namespace link {link!r}")
    return int(link[5:-1])


def still_alive(pidfd: int) -> bool:
    """Whether the process a pidfd pins still holds its pid: it runs, or it has
    exited and nobody has reaped it yet (a zombie)."""
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sandbox_namespace(pid: int, pidns: int, own_pidns: int) -> int:
    """The pid namespace just below ours that holds ``pidns``, process ``pid``'s.

    A sandboxed guest that makes pid namespaces of its own (where its sandbox
    lets it) must not get a new group, and with it more connections, for each.
    """
    fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    held = [fd]
    try:
        inode = os.fstat(fd).st_ino
        if inode != pidns:
            raise ProcessLookupError("the peer's pid was reused")
        for _ in range(_MAX_PID_NS_DEPTH):
            # EPERM if the parent is not below ours: then the pid was not ours to see.
            parent = fcntl.ioctl(fd, _NS_GET_PARENT)
            held.append(parent)
            parent_inode = os.fstat(parent).st_ino
            if parent_inode == own_pidns:
                return inode
            fd, inode = parent, parent_inode
    finally:
        for opened in held:
            os.close(opened)
    raise ProcessLookupError("the peer's pid namespace is not below ours")


def identify_peer(sock: socket.socket, own_pidns: int) -> Peer:
    """Who connected ``sock``: its pid, uid, pid namespace and group.

    Costs a few system calls, once per connection. Anything that cannot be
    read or attributed with certainty raises: the caller refuses the peer.

    Raises:
        OSError: The peer is not visible to us (pid 0), is gone, or could not
            be inspected.
    """
    creds = peer_credentials(sock)
    try:
        if creds.pid <= 0:
            raise ProcessLookupError("the peer's process is not visible in our pid namespace")
        pidns = pid_namespace(creds.pid)
        if pidns == own_pidns:
            group = ("session", os.getsid(creds.pid))
        else:
            group = ("pidns", _sandbox_namespace(creds.pid, pidns, own_pidns))
        # What we read may be another process's if the peer exited and its pid
        # was reused meanwhile; the pidfd names the peer itself.
        if creds.pidfd is not None and not still_alive(creds.pidfd):
            raise ProcessLookupError("the peer's process exited")
    finally:
        if creds.pidfd is not None:
            os.close(creds.pidfd)
    return Peer(pid=creds.pid, uid=creds.uid, pidns=pidns, group=group)


def is_in_guest_tree(pid: int, guest_pid: int, pidfd: int | None) -> bool:
    """Whether process ``pid`` is the guest or one of its descendants.

    ``pidfd`` pins ``pid`` (see the module docstring); the caller checks the uid.
    """
    if pid <= 0:
        return False
    if pid == guest_pid:
        # Our own unreaped child: its pid cannot have been reused.
        return True
    try:
        found = any(parent.pid == guest_pid for parent in psutil.Process(pid).parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if found and pidfd is not None:
        # The pidfd names the connecting process itself: if it has exited, the
        # pid we just inspected may already belong to someone else.
        found = still_alive(pidfd)
    return found
