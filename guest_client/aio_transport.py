"""HTTP/1.1 over the channel's Unix socket for asyncio, with kept-alive connections.

The HTTP itself is `guest_client.http11`'s, the sync transport's too: each
connection is an asyncio protocol that feeds what it receives to a
`ResponseReader`, so bytes that arrive while it sits idle are seen.
"""

from __future__ import annotations

import asyncio

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

__all__ = ["AsyncUnixTransport"]

# Idle connections kept for reuse. Many calls in flight each hold a connection
# of their own; beyond this many, connections close when their call is done.
MAX_IDLE_CONNECTIONS = 16
# How long `aclose()` waits for each idle connection's socket to close.
CLOSE_TIMEOUT_S = 1.0


class _Connection(asyncio.Protocol):
    """One connection to the channel: it sends a request and feeds the
    answer to its reader, one exchange at a time."""

    def __init__(self) -> None:
        self.reader = ResponseReader()
        self.transport: asyncio.Transport | None = None
        self.used = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if isinstance(transport, asyncio.Transport):  # always, for a Unix socket
            self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.reader.expecting:
            # Bytes nobody asked for: the connection is out of step and is
            # never used again, and they must not pile up while it sits idle.
            self.abort()
            return
        self.reader.feed(data)
        self._wake()

    def eof_received(self) -> bool:
        self.reader.feed(b"")
        self._wake()
        return False  # close our end too

    def connection_lost(self, exc: Exception | None) -> None:
        # A reset after part of the answer still leaves that part fed: the
        # reader's end says whether anything of the response arrived.
        self.reader.feed(b"")
        self._wake()
        if not self.closed.done():
            self.closed.set_result(None)

    # The exchange

    @property
    def usable(self) -> bool:
        """Whether an idle connection can carry another request."""
        return self.transport is not None and not self.transport.is_closing() and self.reader.usable

    async def exchange(self, data: bytes) -> tuple[int, bytes, bool]:
        """Send a request, read its whole response: its status, body, and
        whether the connection must close after it.

        Raises:
            BadResponse: The answer is not a response this client understands.
            ConnectionEnded: The connection ended before the response did.
        """
        if self.transport is None:
            raise ConnectionEnded(nothing_read=True)
        self.reader.expect()
        self.transport.write(data)
        while True:
            response = self.reader.next_response()
            if response is not None:
                return response
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class AsyncUnixTransport:
    """Sends requests to the channel and reads whole responses.

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

        Raises:
            ValueError: A header holds a line break.
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
        data = (self._get if request.body is None else self._post).encode(
            request.method, request.path, request.body
        )
        connection = self._checkout()
        sent_before = False
        if connection is not None:
            try:
                return await self._exchange(connection, request, data, deadline)
            except StaleConnection:
                sent_before = True
        # A new connection is never stale: `_exchange` raises a plain failure.
        return await self._exchange(
            await self._open(deadline, sent_before), request, data, deadline
        )

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when done."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()
        for connection in idle:
            try:
                async with asyncio.timeout(CLOSE_TIMEOUT_S):
                    await asyncio.shield(connection.closed)
            except TimeoutError:
                connection.abort()

    async def _open(self, deadline: float, sent_before: bool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_unix_connection(_Connection, self._socket_path)
        except OSError as exc:  # TimeoutError is an OSError
            raise TransportFailure(
                f"cannot connect to {self._socket_path}: {describe_error(exc)}",
                request_sent=sent_before,
            ) from exc
        return connection

    async def _exchange(
        self, connection: _Connection, request: Request, data: bytes, deadline: float
    ) -> Response:
        reused = connection.used
        connection.used = True
        answered = False
        try:
            async with asyncio.timeout_at(deadline):
                status, body, will_close = await connection.exchange(data)
                answered = True
        except (OSError, BadResponse, ConnectionEnded) as exc:  # TimeoutError is an OSError
            connection.abort()
            if reused and isinstance(exc, ConnectionEnded) and exc.nothing_read:
                # The host closed the kept-alive connection while it sat idle.
                raise StaleConnection from exc
            raise TransportFailure(
                f"{request.method} {request.path} on {self._socket_path}: {describe_error(exc)}",
                request_sent=True,
            ) from exc
        finally:
            if not answered:
                # Cancelled or failed mid-request: the stream's state is unknown.
                connection.abort()
        if will_close:
            connection.abort()
        else:
            self._checkin(connection)
        return Response(status, body)

    def _checkout(self) -> _Connection | None:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
            connection.abort()  # the host closed it, or it is out of step
        return None

    def _checkin(self, connection: _Connection) -> None:
        if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
            self._idle.append(connection)
        else:
            connection.close()
