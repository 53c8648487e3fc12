"""HTTP/1.1 over the channel's Unix socket for asyncio, with kept-alive connections.

`http.client` blocks, so the async client speaks the little HTTP/1.1 it needs
itself: one request at a time per connection, a `Content-Length` or chunked
response body, `Connection: close` honoured (RFC 9112). The parsing lives in
plain functions of bytes; `AsyncUnixTransport` only moves them.
"""

from __future__ import annotations

import asyncio

from guest_client.wire import Response, TransportFailure

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

    from guest_client.wire import Request

__all__ = ["AsyncUnixTransport", "BadResponse", "encode_request", "parse_head", "read_response"]

# Idle connections kept for reuse. Many calls in flight each hold a connection
# of their own; beyond this many, connections close when their call is done.
MAX_IDLE_CONNECTIONS = 16
# A response head (status line and headers) longer than this is not from the
# channel: the host's heads are a few hundred bytes.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# How long `aclose()` waits for each idle connection's socket to close.
CLOSE_TIMEOUT_S = 1.0


class BadResponse(Exception):
    """The bytes on the connection are not an HTTP/1.1 response."""


def encode_request(method: str, path: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
    """The bytes of one HTTP/1.1 request (RFC 9112 section 3).

    Header values come from the guest's environment, which
    `GuestEnvironment` has already checked to be visible ASCII, and from this
    package; a CR or LF in one would split the request, so it is refused.

    Raises:
        ValueError: A header name or value holds a CR or LF.
    """
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]
    for name, value in headers.items():
        if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"Content-Length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body is not None else head


def parse_head(head: bytes) -> tuple[int, bool, dict[str, str]]:
    """Parse a response's status line and header lines.

    Args:
        head: Everything up to and including the blank line.

    Returns:
        The status code, whether the server speaks HTTP/1.0 (so the
        connection closes unless it says keep-alive), and the headers with
        lower-case names (repeated ones joined with ", ").

    Raises:
        BadResponse: It is not an HTTP/1.x response head.
    """
    text = head.decode("latin-1")
    status_line, _, rest = text.partition("\r\n")
    version, _, remainder = status_line.partition(" ")
    code = remainder[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise BadResponse(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    lines = [line for line in rest.split("\r\n") if line]
    if len(lines) > MAX_HEADERS:
        raise BadResponse(f"more than {MAX_HEADERS} header lines")
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise BadResponse(f"malformed header line: {line[:80]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return int(code), version == "HTTP/1.0", headers


def _tokens(value: str | None) -> set[str]:
    return {token.strip().lower() for token in value.split(",")} if value else set()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """Read one whole response: its status, body, and whether the server
    will close the connection after it.

    Raises:
        BadResponse: The bytes are not a response this client understands.
        asyncio.IncompleteReadError: The connection ended mid-response.
        OSError: The connection broke.
    """
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        status, http10, headers = parse_head(head)
        if not 100 <= status < 200:
            break
        # 1xx responses have no body (RFC 9110 section 15.2); the final one follows.
    connection = _tokens(headers.get("connection"))
    will_close = "close" in connection or (http10 and "keep-alive" not in connection)
    encoding = _tokens(headers.get("transfer-encoding"))
    if "chunked" in encoding:
        body = await _read_chunked(reader)
    elif encoding:
        raise BadResponse(f"unsupported transfer-encoding {headers['transfer-encoding']!r}")
    elif "content-length" in headers:
        length_text = headers["content-length"]
        if not length_text.isdigit():
            raise BadResponse(f"bad content-length {length_text!r}")
        body = await reader.readexactly(int(length_text))
    elif status in (204, 304):
        body = b""
    else:
        # Neither length nor chunks: the body runs to the end of the connection.
        body = await reader.read()
        will_close = True
    return status, body, will_close


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size_text = size_line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadResponse(f"bad chunk size {size_text[:20]!r}") from None
        if size < 0:
            raise BadResponse("negative chunk size")
        if size == 0:
            # Trailer fields, if any, end with a blank line.
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass
            return b"".join(chunks)
        chunks.append(await reader.readexactly(size))
        if await reader.readexactly(2) != b"\r\n":
            raise BadResponse("a chunk does not end with CRLF")


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
        self._headers = dict(headers)
        self._headers["Accept"] = "application/json"
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
        headers = self._headers
        if request.body is not None:
            headers = dict(headers)
            headers["Content-Type"] = "application/json"
        reused = connection.used
        connection.used = True
        answered = False
        try:
            async with asyncio.timeout_at(deadline):
                connection.writer.write(
                    encode_request(request.method, request.path, headers, request.body)
                )
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
