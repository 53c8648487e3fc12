"""HTTP/1.1 over the channel's Unix socket, with kept-alive connections.

The one module that touches sockets and `http.client`, both of which cost
tens of milliseconds to import: the client imports this module only when it
sends its first request.
"""

from __future__ import annotations

import _thread
import http.client
import os
import socket
import time

from guest_client.wire import Response, TransportFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from guest_client.wire import Request

__all__ = ["UnixHTTPConnection", "UnixTransport"]

# Idle connections kept for reuse; more threads than this still work, their
# extra connections are closed after use.
MAX_IDLE_CONNECTIONS = 4
# How a kept-alive connection that the host closed while it sat idle fails on
# reuse (`http.client.RemoteDisconnected` is a `ConnectionResetError`).
_STALE_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


class _DeadlineSocket(socket.socket):
    """A socket whose blocking operations all end by one `deadline` (a
    `time.monotonic()` value), not each within a timeout of its own: a host
    that drips its answer a byte at a time cannot stretch a request."""

    __slots__ = ("deadline",)

    def __init__(self) -> None:
        super().__init__(socket.AF_UNIX, socket.SOCK_STREAM)
        self.deadline: float | None = None

    def _arm(self) -> None:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            self.settimeout(left)

    def connect(self, address: object) -> None:
        self._arm()
        super().connect(address)  # type: ignore[arg-type]

    def sendall(self, data: object, flags: int = 0) -> None:
        self._arm()
        super().sendall(data, flags)  # type: ignore[arg-type]

    def recv_into(self, buffer: object, nbytes: int = 0, flags: int = 0) -> int:
        self._arm()
        return super().recv_into(buffer, nbytes, flags)  # type: ignore[arg-type]

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        self._arm()
        return super().recv(bufsize, flags)


class UnixHTTPConnection(http.client.HTTPConnection):
    """An `http.client.HTTPConnection` to a Unix socket instead of a TCP port.

    Requests carry `Host: localhost`. With `deadline` (a `time.monotonic()`
    value) set, connecting, sending and every read end by it.
    """

    def __init__(self, socket_path: str, timeout: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path
        self.deadline: float | None = None

    def connect(self) -> None:
        """Connect to `socket_path`, within `timeout` and by `deadline`."""
        sock = _DeadlineSocket()
        try:
            sock.settimeout(self.timeout)
            sock.deadline = self.deadline
            sock.connect(self.socket_path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


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
        """
        self._socket_path = socket_path
        self._headers = dict(headers)
        self._idle: list[UnixHTTPConnection] = []
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
        sent_before = False
        connection = self._checkout()
        if connection is not None:
            try:
                return self._exchange(connection, request, deadline)
            except TransportFailure as failure:
                if not isinstance(failure.__cause__, _STALE_ERRORS):
                    raise
                # It may have reached the host before the close: say so if
                # the second try fails before sending anything.
                sent_before = True
        return self._exchange(self._open(deadline, sent_before), request, deadline)

    def close(self) -> None:
        """Close the idle connections; connections in use close when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _open(self, deadline: float, sent_before: bool) -> UnixHTTPConnection:
        connection = UnixHTTPConnection(self._socket_path)
        connection.deadline = deadline
        try:
            connection.connect()
        except OSError as exc:
            connection.close()
            raise TransportFailure(
                f"cannot connect to {self._socket_path}: {_describe(exc)}",
                request_sent=sent_before,
            ) from exc
        return connection

    def _exchange(
        self, connection: UnixHTTPConnection, request: Request, deadline: float
    ) -> Response:
        headers = dict(self._headers)
        headers["Accept"] = "application/json"
        if request.body is not None:
            headers["Content-Type"] = "application/json"
        try:
            connection.deadline = deadline
            if isinstance(connection.sock, _DeadlineSocket):
                connection.sock.deadline = deadline
            connection.request(request.method, request.path, body=request.body, headers=headers)
            raw = connection.getresponse()
            data = raw.read()
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise TransportFailure(
                f"{request.method} {request.path} on {self._socket_path}: {_describe(exc)}",
                request_sent=True,
            ) from exc
        if raw.will_close:
            connection.close()
        else:
            self._checkin(connection)
        return Response(raw.status, data)

    def _checkout(self) -> UnixHTTPConnection | None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the hostcall client is closed")
            if self._pid != os.getpid():
                # A forked child must not share its parent's sockets; the
                # parent's copies stay open in the parent.
                self._idle = []
                self._pid = os.getpid()
            return self._idle.pop() if self._idle else None

    def _checkin(self, connection: UnixHTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        connection.close()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
