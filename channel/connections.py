"""The channel's connections: whose they are, how many, how long (docs/security.md, S9).

A guest is hostile: it may open connections until the supervisor has no
descriptor left, or open them and send nothing. So the channel accepts its
connections itself and, once per connection, before aiohttp sees it:

- attributes it to a *group* (:func:`channel.peer.identify_peer`): the
  sandbox of the process that connected, or its session when that process
  is in our own pid namespace (an unsandboxed guest). A peer that cannot be
  attributed is refused (403 ``origin_denied``);
- counts it: at most ``per_group`` connections per group, a connection
  counting until it has closed *and* its request has been answered
  (:class:`Slot`), and at most ``total`` open connections in all, by
  default half the soft ``RLIMIT_NOFILE`` (:func:`default_max_connections`),
  so that the other half always stays for the supervisor's own files. A
  connection over either limit is answered 503 ``too_many_connections``
  and closed; the others are unaffected.

Idle connections are closed by aiohttp's keep-alive timer
(:class:`ChannelConnection`).

Why not ``loop.create_unix_server``: when the process is out of descriptors
(EMFILE), asyncio's server logs an error for every backlog slot every second,
and uvloop's (libuv's) accepts and drops every queued connection - and closes
the listening socket for good when libuv's reserve descriptor is gone. Here
accepting pauses for ``ACCEPT_RETRY_S`` and resumes; queued connections wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
from collections.abc import Callable
from http import HTTPStatus
from typing import Final

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from channel.errors import Refusal
from channel.peer import GroupKey, Peer, identify_peer, pid_namespace
from channel.wire import CallReply

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS_PER_GROUP",
    "ChannelConnection",
    "ChannelListener",
    "Slot",
    "default_max_connections",
]

logger = logging.getLogger(__name__)

#: docs/security.md, S9: open connections per execution (one sandbox, or one session).
DEFAULT_MAX_CONNECTIONS_PER_GROUP: Final = 64
#: docs/security.md, S9: a connection waiting this long for a whole request is closed.
DEFAULT_IDLE_TIMEOUT_S: Final = 30.0
#: After an answer sent before the request's body was read (a refusal), how long
#: the rest of the body is read and dropped before the connection is closed
#: (aiohttp's default, 10 s, is for the Internet, not a local socket).
BODY_LINGER_S: Final = 1.0
#: How long accepting pauses when the process is out of descriptors or memory.
ACCEPT_RETRY_S: Final = 0.1
#: Connections taken from the backlog per wake-up: a flood cannot starve the loop.
ACCEPT_BATCH: Final = 64
#: A refused connection stays open this long at most, so that a guest which
#: writes its request before reading can finish writing and read the answer.
REFUSAL_LINGER_S: Final = 1.0
#: Refused connections lingering at once, at most (and at most an eighth of the
#: channel's total); beyond, they are closed straight away.
MAX_LINGERING: Final = 64
#: ``accept()`` failing for want of a resource: wait, then try again.
_STARVED: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def default_max_connections() -> int:
    """Half the soft ``RLIMIT_NOFILE``: the channel's share of the descriptors.

    The other half is the supervisor's own: the effect store, receipts and
    logs, each guest's pipes and pidfds, the admin socket. Read when the
    channel starts, so a supervisor that raises its soft limit first (up to
    the hard one) gets a larger share.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(1, soft // 2)


def _answer(code: str, message: str) -> bytes:
    """A whole HTTP response refusing a connection before any request was read."""
    reply = CallReply.refused(None, Refusal(code, message))
    body = reply.to_bytes()
    head = (
        f"HTTP/1.1 {reply.http_status} {HTTPStatus(reply.http_status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class Slot:
    """One admitted connection's place in the counts.

    It holds its place in the channel's total while the connection is open
    (that count is of descriptors), and in its group's while the connection
    is open *or* a request it sent is still being handled. A request goes on
    when its guest hangs up (a dispatched handler must not be cancelled), so
    without the second rule a guest could send a call, hang up, and open
    another connection in its place, as often as it liked: calls in progress
    per execution would have no bound.
    """

    __slots__ = ("_group_held", "_listener", "_open", "_requests", "peer")

    def __init__(self, listener: ChannelListener, peer: Peer) -> None:
        self._listener = listener
        self._open = True
        self._group_held = True
        self._requests = 0
        self.peer = peer

    def request_started(self) -> None:
        """A request of this connection is being handled."""
        self._requests += 1
        if not self._open:  # aiohttp may start one it read just before the close
            self._listener._orphaned_requests += 1

    def request_ended(self) -> None:
        """That request was answered (or given up)."""
        self._requests -= 1
        if not self._open:
            self._listener._orphaned_requests -= 1
            if not self._requests:
                self._release_group()

    def release(self) -> None:
        """The connection closed (once; later calls do nothing)."""
        if self._open:
            self._open = False
            self._listener._release_connection()
            if self._requests:
                self._listener._orphaned_requests += self._requests
            else:
                self._release_group()

    def _release_group(self) -> None:
        if self._group_held:
            self._group_held = False
            self._listener._release_group(self.peer.group)


class ChannelConnection(RequestHandler):
    """aiohttp's handler of one admitted connection: it knows its peer and
    its slot, and tells the slot when the connection closes.

    The idle timeout is aiohttp's keep-alive timeout, which does what S9 needs:
    it runs from the moment the connection opens or its last response was
    written, and closes the connection if no *whole* request has arrived by
    then, however many bytes of an unfinished one trickled in. A request being
    handled (a long poll) is not idle; its body has a deadline of its own
    (``ChannelServer``).
    """

    __slots__ = ("peer", "slot")

    def __init__(self, manager: web.Server, slot: Slot, *, idle_timeout_s: float) -> None:
        super().__init__(
            manager,
            loop=asyncio.get_running_loop(),
            keepalive_timeout=idle_timeout_s,
            lingering_time=BODY_LINGER_S,
            tcp_keepalive=False,  # a Unix socket
            access_log=None,  # type: ignore[arg-type]  # aiohttp's "no access log"
        )
        self.slot = slot
        self.peer = slot.peer

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            self.slot.release()


class ChannelListener:
    """Accepts connections on a listening socket, attributes and counts them,
    and hands those it admits to ``protocol_factory`` (see the module docstring).

    Args:
        sock: Bound and listening.
        protocol_factory: Builds the protocol of an admitted connection, which
            must call ``slot.release()`` when the connection is lost.
        per_group: Open connections allowed per group.
        total: Open connections allowed in all.

    Raises:
        RuntimeError: ``/proc`` is not that of our pid namespace, so peers
            could not be attributed.
    """

    def __init__(
        self,
        sock: socket.socket,
        protocol_factory: Callable[[Slot], asyncio.BaseProtocol],
        *,
        per_group: int,
        total: int,
    ) -> None:
        self._sock = sock
        self._factory = protocol_factory
        self._per_group = per_group
        self._total = total
        self._loop = asyncio.get_running_loop()
        if os.readlink("/proc/self") != str(os.getpid()):
            # SO_PEERCRED pids are ours; /proc/<pid> would name other processes.
            raise RuntimeError("/proc is not mounted for this process's pid namespace")
        self._own_pidns = pid_namespace("self")
        self._per_group_count: dict[GroupKey, int] = {}
        #: Connections admitted and not yet closed.
        self.open_connections = 0
        #: Requests still being handled whose connection has closed; each
        #: still counts against its group's limit (:class:`Slot`).
        self._orphaned_requests = 0
        self._adopting: set[asyncio.Task[None]] = set()
        self._lingering: dict[int, tuple[socket.socket, asyncio.TimerHandle]] = {}
        self._max_lingering = max(1, min(MAX_LINGERING, total // 8))
        self._retry: asyncio.TimerHandle | None = None
        self._starved = False
        self._group_full = _answer(
            "too_many_connections",
            f"this execution already has {per_group} open connections to the channel",
        )
        self._channel_full = _answer(
            "too_many_connections", "the channel has too many open connections"
        )
        self._starving = _answer(
            "too_many_connections", "the supervisor is out of file descriptors; try again"
        )
        self._unattributed = _answer("origin_denied", "the peer process could not be identified")

    @property
    def orphaned_requests(self) -> int:
        """Requests still being handled whose connection has closed."""
        return self._orphaned_requests

    def start(self) -> None:
        """Start accepting."""
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop accepting and close the listening socket and refused connections.

        Admitted connections are aiohttp's to close.
        """
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
        for fd in list(self._lingering):
            self._end_linger(fd)
        for task in self._adopting:
            task.cancel()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            if self._retry is not None:  # paused meanwhile
                return
            try:
                conn, _address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                self._pause(exc)
                return
            if self._starved:
                self._starved = False
                logger.info("channel: accepting connections again")
            self._admit(conn)

    def _pause(self, exc: OSError) -> None:
        if self._retry is not None:
            return
        if not self._starved:
            self._starved = True
            level = logging.WARNING if exc.errno in _STARVED else logging.ERROR
            logger.log(level, "channel: cannot accept connections (%s); will retry", exc)
        self._loop.remove_reader(self._sock.fileno())
        self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _admit(self, conn: socket.socket) -> None:
        try:
            peer = identify_peer(conn, self._own_pidns)
        except OSError as exc:
            if exc.errno in _STARVED:
                # Not the peer's fault: we had a descriptor for it, not for its pidfd.
                self._refuse(conn, self._starving)
                self._pause(exc)
            else:
                self._refuse(conn, self._unattributed)
            return
        count = self._per_group_count.get(peer.group, 0)
        if count >= self._per_group:
            self._refuse(conn, self._group_full)
            return
        if self.open_connections >= self._total:
            self._refuse(conn, self._channel_full)
            return
        self._per_group_count[peer.group] = count + 1
        self.open_connections += 1
        task = self._loop.create_task(self._adopt(conn, Slot(self, peer)))
        self._adopting.add(task)
        task.add_done_callback(self._adopting.discard)

    async def _adopt(self, conn: socket.socket, slot: Slot) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: self._factory(slot), conn)
        except BaseException:
            slot.release()
            conn.close()  # a no-op if the transport took it and closed it
            raise

    def _release_connection(self) -> None:
        self.open_connections -= 1

    def _release_group(self, group: GroupKey) -> None:
        left = self._per_group_count[group] - 1
        if left:
            self._per_group_count[group] = left
        else:
            del self._per_group_count[group]

    def _refuse(self, conn: socket.socket, answer: bytes) -> None:
        try:
            conn.setblocking(False)
            conn.send(answer)  # a few hundred bytes into an empty buffer
        except OSError:
            conn.close()
            return
        _drain(conn)
        if len(self._lingering) >= self._max_lingering:
            conn.close()
            return
        # Closed when the guest has read the answer and hung up, or after the
        # linger: a guest that had not yet written its request would otherwise
        # fail to write it (EPIPE) and never read the answer waiting for it.
        fd = conn.fileno()
        self._lingering[fd] = (conn, self._loop.call_later(REFUSAL_LINGER_S, self._end_linger, fd))
        self._loop.add_reader(fd, self._end_linger, fd)

    def _end_linger(self, fd: int) -> None:
        entry = self._lingering.pop(fd, None)
        if entry is None:
            return
        conn, timer = entry
        timer.cancel()
        self._loop.remove_reader(fd)
        _drain(conn)
        conn.close()


def _drain(conn: socket.socket) -> None:
    """Read what the peer sent: closing with unread data would reset the
    connection, and a reset can lose the peer the answer it has not read yet."""
    with contextlib.suppress(OSError):
        conn.recv(65536)
