"""Who is on the other end of a Unix socket connection (SPEC §4.1, origin).

The kernel tells us the peer's pid and uid (``SO_PEERCRED``). Where it offers
``SO_PEERPIDFD`` we also get a pidfd, which pins the process: after walking the
ancestry we check through the pidfd that the process is still the one we
looked at, so a pid reused in between cannot pass as the guest.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any, Final

import psutil

__all__ = ["PeerCredentials", "is_in_guest_tree", "peer_credentials"]

_UCRED: Final = struct.Struct("3i")
#: Linux >= 6.5; not yet exported by Python's socket module.
SO_PEERPIDFD: Final = 77


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The peer process of a connection as the kernel reported it."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None


def peer_credentials(sock: Any, *, pidfd: bool = True) -> PeerCredentials:
    """Read the peer's credentials from a connected Unix socket.

    With ``pidfd`` the caller owns the returned ``pidfd`` and must close it.
    """
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    fd: int | None = None
    if pidfd:
        try:
            fd = int(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
        except OSError:
            fd = None  # an older kernel: pid + start-time check only
    return PeerCredentials(pid=pid, uid=uid, gid=gid, pidfd=fd)


def _still_alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_in_guest_tree(peer: PeerCredentials, guest_pid: int) -> bool:
    """Whether the peer has our uid and is the guest or one of its descendants."""
    if peer.uid != os.getuid() or peer.pid <= 0:
        return False
    if peer.pid == guest_pid:
        # Our own unreaped child: its pid cannot have been reused.
        return True
    try:
        found = any(parent.pid == guest_pid for parent in psutil.Process(peer.pid).parents())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if found and peer.pidfd is not None:
        # The pidfd names the connecting process itself: if it has exited, the
        # pid we just inspected may already belong to someone else.
        found = _still_alive(peer.pidfd)
    return found
