"""HTTP/1.1 over the channel's Unix socket for asyncio, with kept-alive connections.

The HTTP itself is `guest_client.http11`'s, the sync transport's too; this
module only moves its bytes on asyncio streams.
"""

from __future__ import annotations

import asyncio

from guest_client.http11 import MAX_HEAD_BYTES, BadResponse, RequestEncoder, response_steps
from guest_client.wire import Response, TransportFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from guest_client.wire import Request

__all__ = ["AsyncUnixTransport", "read_response"]

# Idle connections kept for reuse. Many calls in flight each hold a connection
# of their own; beyond this many, connections close when their call is done.
MAX_IDLE_CONNECTIONS = 16
# How long `aclose()` waits for each idle connection's socket to close.
CLOSE_TIMEOUT_S = 1.0


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """Read one whole response: its status, body, and whether the server
    will close the connection after it.

    Raises:
        BadResponse: The bytes are not a response this client understands.
        asyncio.IncompleteReadError: The connection ended mid-response.
        asyncio.LimitOverrunError: A head or line longer than `MAX_HEAD_BYTES`.
        OSError: The connection broke.
    """
    steps = response_steps()
    step = next(steps)
    try:
        while True:
            if isinstance(step, bytes):
                data = await reader.readuntil(step)
            elif step is None:
                data = await reader.read()
            else:
                data = await reader.readexactly(step)
            step = steps.send(data)
    except StopIteration as stop:
        response: tuple[int, bytes, bool] = stop.value
        return response


class _Connection:
    __slots__ = ("reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = False

    def abort(self) -> None:
        self.writer.transport.abort()


class AsyncUnixTransport:
    """Sends requests to the channel on asyncio streams and reads whole responses.

    Many requests may be in flight at once: each has a connection to itself,
    taken from a pool of idle kept-alive connections or newly opened. A
    request that failed on a reused connection before any byte of the answer
    arrived (the host had closed it while idle) is sent once more on a new
    connection, which is safe because every request the client makes is
    idempotent (a call is keyed by its `call_id`).

    Bound to the event loop of its first request.
    """

    def __init__(self, socket_path: str, headers: Mapping[str, str]) -> None:
        """Args:
        socket_path: The channel's socket.
        headers: Sent on every request (the guest's identity).
        """
        self._socket_path = socket_path
        self._get = RequestEncoder({**headers, "Accept": "application/json"})
        self._post = RequestEncoder(
            {**headers, "Accept": "application/json", "Content-Type": "application/json"}
        )
        self._idle: list[_Connection] = []
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def send(self, request: Request) -> Response:
        """Send `request` and read its response to the end, within `request.timeout`.

        Raises:
            TransportFailure: No complete response arrived.
            RuntimeError: The transport is closed, or used from another loop.
        """
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError("the hostcall client is closed")
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError("an AsyncHostClient is bound to the event loop it was first used on")
        deadline = loop.time() + request.timeout
        connection = self._checkout()
        sent_before = False
        if connection is not None:
            try:
                return await self._exchange(connection, request, deadline)
            except _Stale:
                sent_before = True
        # A new connection is never stale: `_exchange` raises a plain failure.
        return await self._exchange(await self._open(deadline, sent_before), request, deadline)

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when done."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.writer.close()
        for connection in idle:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await connection.writer.wait_closed()
            except (OSError, TimeoutError):
                connection.abort()

    async def _open(self, deadline: float, sent_before: bool) -> _Connection:
        try:
            async with asyncio.timeout_at(deadline):
                reader, writer = await asyncio.open_unix_connection(
                    self._socket_path, limit=MAX_HEAD_BYTES
                )
        except OSError as exc:  # TimeoutError is an OSError
            raise TransportFailure(
                f"cannot connect to {self._socket_path}: {_describe(exc)}",
                request_sent=sent_before,
            ) from exc
        return _Connection(reader, writer)

    async def _exchange(
        self, connection: _Connection, request: Request, deadline: float
    ) -> Response:
        encoder = self._get if request.body is None else self._post
        reused = connection.used
        connection.used = True
        answered = False
        try:
            async with asyncio.timeout_at(deadline):
                connection.writer.write(encoder.encode(request.method, request.path, request.body))
                await connection.writer.drain()
                status, body, will_close = await read_response(connection.reader)
                answered = True
        except _BROKEN as exc:
            connection.abort()
            failure = TransportFailure(
                f"{request.method} {request.path} on {self._socket_path}: {_describe(exc)}",
                request_sent=True,
            )
            if reused and _nothing_read(exc):
                # The host closed the kept-alive connection while it sat idle.
                raise _Stale(failure) from exc
            raise failure from exc
        finally:
            if not answered and not connection.writer.is_closing():
                # Cancelled mid-request: the stream's state is unknown.
                connection.abort()
        if will_close:
            connection.abort()
        else:
            self._checkin(connection)
        return Response(status, body)

    def _checkout(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.reader.at_eof() or connection.writer.is_closing():
                connection.abort()  # The host closed it while it sat idle.
                continue
            return connection
        return None

    def _checkin(self, connection: _Connection) -> None:
        if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(connection)
        else:
            connection.writer.close()


# How an exchange fails when no whole response arrives (TimeoutError is an OSError).
_BROKEN = (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, BadResponse)


class _Stale(Exception):
    """A reused connection failed before the answer began; retry on a new one."""

    def __init__(self, failure: TransportFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _nothing_read(exc: BaseException) -> bool:
    if isinstance(exc, asyncio.IncompleteReadError):
        return not exc.partial
    return isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection closed before the response was complete"
    if isinstance(exc, TimeoutError) and not str(exc):
        return "TimeoutError: timed out"  # As the sync transport words it.
    text = str(exc)
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
