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

from guest_client.http11 import MAX_HEAD_BYTES, BadResponse, RequestEncoder, response_steps
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


class _Ended(Exception):
    """The connection closed before the response was complete."""

    def __init__(self, nothing_read: bool) -> None:
        super().__init__("the connection closed before the response was complete")
        #: No byte of this response arrived: a kept-alive connection the host
        #: had closed while it sat idle.
        self.nothing_read = nothing_read


class _Connection:
    """A connected socket and the bytes read from it but not yet used.

    Every blocking operation ends by `deadline` (a `time.monotonic()` value),
    not each within a timeout of its own: a host that drips its answer a byte
    at a time cannot stretch a request.
    """

    __slots__ = ("buffer", "deadline", "got", "sock", "used")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()
        self.deadline = 0.0
        #: Whether any byte of the current response has arrived.
        self.got = False
        self.used = False

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def send(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)

    def _fill(self) -> None:
        self._arm()
        data = self.sock.recv(RECV_BYTES)
        if not data:
            raise _Ended(nothing_read=not self.got)
        self.got = True
        self.buffer += data

    def _take(self, size: int) -> bytes:
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def until(self, separator: bytes) -> bytes:
        """The bytes up to and including `separator`."""
        start = 0
        while True:
            end = self.buffer.find(separator, start)
            if 0 <= end <= MAX_HEAD_BYTES:
                return self._take(end + len(separator))
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise BadResponse(f"no {separator!r} in the first {MAX_HEAD_BYTES} bytes")
            start = max(0, len(self.buffer) - len(separator) + 1)
            self._fill()

    def exactly(self, size: int) -> bytes:
        """The next `size` bytes."""
        while len(self.buffer) < size:
            self._fill()
        return self._take(size)

    def to_end(self) -> bytes:
        """Every byte until the host closes the connection."""
        while True:
            try:
                self._fill()
            except _Ended:
                return self._take(len(self.buffer))

    def read_response(self) -> tuple[int, bytes, bool]:
        """One whole response: its status, body, and whether the connection
        must close after it."""
        self.got = bool(self.buffer)
        steps = response_steps()
        step = next(steps)
        try:
            while True:
                if isinstance(step, bytes):
                    data = self.until(step)
                elif step is None:
                    data = self.to_end()
                else:
                    data = self.exactly(step)
                step = steps.send(data)
        except StopIteration as stop:
            status, body, will_close = stop.value
        # Bytes past the response were never asked for: the connection is out
        # of step with its requests, so it is not used again.
        return status, body, will_close or bool(self.buffer)

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
            except _Stale:
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
            connection._arm()
            sock.connect(self._socket_path)
        except OSError as exc:  # TimeoutError is an OSError
            sock.close()
            raise TransportFailure(
                f"cannot connect to {self._socket_path}: {_describe(exc)}",
                request_sent=sent_before,
            ) from exc
        return connection

    def _exchange(
        self, connection: _Connection, request: Request, data: bytes, deadline: float
    ) -> Response:
        reused = connection.used
        connection.used = True
        connection.deadline = deadline
        try:
            connection.send(data)
            status, body, will_close = connection.read_response()
        except (OSError, BadResponse, _Ended) as exc:
            connection.close()
            failure = TransportFailure(
                f"{request.method} {request.path} on {self._socket_path}: {_describe(exc)}",
                request_sent=True,
            )
            if reused and _nothing_read(exc):
                # The host closed the kept-alive connection while it sat idle.
                raise _Stale(failure) from exc
            raise failure from exc
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
            return self._idle.pop() if self._idle else None

    def _checkin(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(connection)
                return
        connection.close()


class _Stale(Exception):
    """A reused connection failed before the answer began; retry on a new one."""

    def __init__(self, failure: TransportFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _nothing_read(exc: BaseException) -> bool:
    if isinstance(exc, _Ended):
        return exc.nothing_read
    return isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, _Ended):
        return str(exc)
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
