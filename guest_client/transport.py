"""HTTP/1.1 over the channel's Unix socket, with kept-alive connections.

The one module of the sync client that touches sockets, which cost
milliseconds to import: the client imports it only when it sends its first
request. The HTTP is `guest_client.http11`'s; this module moves its bytes on
a blocking socket, every operation of an exchange bounded by one deadline.
"""

from __future__ import annotations

import _thread
import os
import socket
import time

from guest_client.http11 import (
    BadResponse,
    ConnectionEnded,
    RequestEncoder,
    ResponseReader,
    StaleConnection,
    describe_error,
)
from guest_client.wire import Response, TransportFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from guest_client.wire import Request

__all__ = ["UnixTransport"]

# Idle connections kept for reuse; more threads than this still work, their
# extra connections are closed after use.
MAX_IDLE_CONNECTIONS = 4
# Bytes asked of the socket per read: a whole answer of the channel, mostly.
RECV_BYTES = 65536
# How a connection the host closed fails on the way out (a send, or a read
# that finds the close before anything else).
_CLOSED_ERRORS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class _Connection:
    """A connected socket and the reader of its responses.

    Every blocking operation ends by `deadline` (a `time.monotonic()` value),
    not each within a timeout of its own: a host that drips its answer a byte
    at a time cannot stretch a request.
    """

    __slots__ = ("deadline", "reader", "sock", "used")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = ResponseReader()
        self.deadline = 0.0
        self.used = False

    def arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def usable(self) -> bool:
        """Whether an idle connection can carry another request: the host
        has neither closed it nor sent anything since its last response."""
        if not self.reader.usable:
            return False
        self.sock.settimeout(0.0)
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read: as it should be
        except OSError:
            return False
        return False  # an end (b"") or bytes nobody asked for

    def exchange(self, data: bytes) -> tuple[int, bytes, bool]:
        """Send a request, read its whole response: its status, body, and
        whether the connection must close after it."""
        self.reader.expect()
        self.arm()
        try:
            self.sock.sendall(data)
        except OSError:
            # The host may have answered and closed before reading all of it
            # (a refusal of a large request): its answer is the outcome, not
            # the failed send.
            response = self._answer_already_here()
            if response is None:
                raise
            return response
        while True:
            response = self.reader.next_response()
            if response is not None:
                return response
            self.arm()
            self.reader.feed(self.sock.recv(RECV_BYTES))

    def _answer_already_here(self) -> tuple[int, bytes, bool] | None:
        """A whole response that arrived before the send failed, if any (the
        connection then closes); what arrived is fed either way, so the
        reader knows whether anything of the answer came."""
        self.sock.settimeout(0.0)
        try:
            while True:
                data = self.sock.recv(RECV_BYTES)
                self.reader.feed(data)
                if not data:
                    break
        except OSError:  # nothing more waiting (BlockingIOError), or a reset
            pass
        try:
            response = self.reader.next_response()
        except (BadResponse, ConnectionEnded):
            return None
        if response is None:
            return None
        status, body, _ = response
        return status, body, True

    def close(self) -> None:
        self.sock.close()


class UnixTransport:
    """Sends requests to the channel and reads whole responses.

    Thread-safe: each request has a connection to itself, taken from a small
    pool of idle kept-alive connections or newly opened. A connection the
    host closes (`Connection: close`, or a kept-alive one that went stale) is
    replaced; a request that failed on a stale connection is sent once more
    on a new one, which is safe because every request the client makes is
    idempotent (a call is keyed by its `call_id`).
    """

    def __init__(self, socket_path: str, headers: Mapping[str, str]) -> None:
        """Args:
        socket_path: The channel's socket.
        headers: Sent on every request (the guest's identity).

        Raises:
            ValueError: A header holds a line break.
        """
        self._socket_path = socket_path
        self._get = RequestEncoder({**headers, "Accept": "application/json"})
        self._post = RequestEncoder(
            {**headers, "Accept": "application/json", "Content-Type": "application/json"}
        )
        self._idle: list[_Connection] = []
        self._lock = _thread.allocate_lock()
        self._closed = False
        self._pid = os.getpid()

    def send(self, request: Request) -> Response:
        """Send `request` and read its response to the end.

        Raises:
            TransportFailure: No complete response arrived.
            RuntimeError: The transport is closed.
        """
        # One deadline for the whole exchange, a resend on a new connection included.
        deadline = time.monotonic() + request.timeout
        data = (self._get if request.body is None else self._post).encode(
            request.method, request.path, request.body
        )
        connection = self._checkout()
        sent_before = False
        if connection is not None:
            try:
                return self._exchange(connection, request, data, deadline)
            except StaleConnection:
                # It may have reached the host before the close: say so if
                # the second try fails before sending anything.
                sent_before = True
        # A new connection is never stale: `_exchange` raises a plain failure.
        return self._exchange(self._open(deadline, sent_before), request, data, deadline)

    def close(self) -> None:
        """Close the idle connections; connections in use close when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _open(self, deadline: float, sent_before: bool) -> _Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection = _Connection(sock)
        connection.deadline = deadline
        try:
            connection.arm()
            sock.connect(self._socket_path)
        except OSError as exc:  # TimeoutError is an OSError
            sock.close()
            raise TransportFailure(
                f"cannot connect to {self._socket_path}: {describe_error(exc)}",
                request_sent=sent_before,
            ) from exc
        except BaseException:
            sock.close()
            raise
        return connection

    def _exchange(
        self, connection: _Connection, request: Request, data: bytes, deadline: float
    ) -> Response:
        reused = connection.used
        connection.used = True
        connection.deadline = deadline
        try:
            status, body, will_close = connection.exchange(data)
        except (OSError, BadResponse, ConnectionEnded) as exc:
            connection.close()
            if reused and not connection.reader.got_any and _closed(exc):
                # The host closed the kept-alive connection while it sat idle.
                raise StaleConnection from exc
            raise TransportFailure(
                f"{request.method} {request.path} on {self._socket_path}: {describe_error(exc)}",
                request_sent=True,
            ) from exc
        except BaseException:
            # Interrupted mid-request (KeyboardInterrupt): the stream's state is unknown.
            connection.close()
            raise
        if will_close:
            connection.close()
        else:
            self._checkin(connection)
        return Response(status, body)

    def _checkout(self) -> _Connection | None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the hostcall client is closed")
            if self._pid != os.getpid():
                # A forked child must not share its parent's sockets; the
                # parent's copies stay open in the parent.
                self._idle = []
                self._pid = os.getpid()
            while self._idle:
                connection = self._idle.pop()
                if connection.usable():
                    return connection
                connection.close()  # the host closed it, or it is out of step
            return None

    def _checkin(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        connection.close()


def _closed(exc: BaseException) -> bool:
    """Whether `exc` is the host's close of the connection."""
    if isinstance(exc, ConnectionEnded):
        return exc.nothing_read
    return isinstance(exc, _CLOSED_ERRORS)
