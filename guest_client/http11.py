"""The little HTTP/1.1 the clients speak to the channel, without I/O.

One request at a time per connection; a response body framed by
`Content-Length`, chunks or the connection's end; `Connection: close` and
HTTP/1.0 honoured (RFC 9112). Both transports use it: the sync one on a
blocking socket, the async one as an asyncio protocol. Each feeds the bytes
it receives to a `ResponseReader` and asks it for the response, so neither
parses anything itself (h11's way). Inside, a generator says what the
response needs next — the bytes up to a separator, an exact number of
bytes, or the rest of the connection.

The standard library's `http.client` would do for the sync client, but it
sends a request's head and body in two writes (two wake-ups of the host per
call) and parses every response's headers with the `email` package: together
about half of the sync client's CPU per call (docs/benchmarks.md, "The guest
client's own cost").
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Generator, Mapping
    from typing import TypeAlias

__all__ = [
    "MAX_HEAD_BYTES",
    "BadResponse",
    "ConnectionEnded",
    "RequestEncoder",
    "ResponseReader",
    "StaleConnection",
    "describe_error",
    "encode_request",
    "parse_head",
]

# A response head (status line and headers) longer than this is not from the
# channel: the host's heads are a few hundred bytes.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# Digits of a length or chunk size: 18 decimal ones are past any real body.
MAX_LENGTH_DIGITS = 18

_HEAD_END = b"\r\n\r\n"
_LINE_END = b"\r\n"
_HEX_DIGITS = b"0123456789abcdefABCDEF"

if TYPE_CHECKING:
    #: What `_response_steps` asks for: a separator (bytes) for the bytes up to
    #: and including it, a count (int) for that many bytes, None for the rest
    #: of the connection.
    Step: TypeAlias = bytes | int | None
    #: Yields steps, is sent their bytes, returns (status, body, will_close).
    ResponseSteps: TypeAlias = Generator[Step, bytes, tuple[int, bytes, bool]]


class BadResponse(Exception):
    """The bytes on the connection are not an HTTP/1.1 response."""


class RequestEncoder:
    """Encodes requests that all carry the same headers (RFC 9112 section 3).

    The headers are checked and encoded once. Their values come from the
    guest's environment, which `GuestEnvironment` has already checked to be
    visible ASCII, and from this package; a CR or LF in one would split the
    request, so it is refused.
    """

    __slots__ = ("_block",)

    def __init__(self, headers: Mapping[str, str]) -> None:
        """Args:
        headers: Sent on every request, after `Host: localhost`.

        Raises:
            ValueError: A header name or value holds a CR or LF.
        """
        lines = ["Host: localhost"]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value:
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}")
        self._block = ("\r\n".join(lines) + "\r\n").encode("latin-1")

    def encode(self, method: str, path: str, body: bytes | None) -> bytes:
        """The bytes of one request: its head and body in one piece, so that
        it leaves in one write.

        `method` and `path` come from this package (a path's `call_id` is
        checked against its alphabet), never from the host.
        """
        start = f"{method} {path} HTTP/1.1\r\n".encode("latin-1")
        if body is None:
            return b"%s%s\r\n" % (start, self._block)
        return b"%s%sContent-Length: %d\r\n\r\n%s" % (start, self._block, len(body), body)


def encode_request(method: str, path: str, headers: Mapping[str, str], body: bytes | None) -> bytes:
    """The bytes of one HTTP/1.1 request; see `RequestEncoder`.

    Raises:
        ValueError: A header name or value holds a CR or LF.
    """
    return RequestEncoder(headers).encode(method, path, body)


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
    code, _, _ = remainder.partition(" ")  # RFC 9112 section 4: 3DIGIT, then SP
    if version not in ("HTTP/1.1", "HTTP/1.0") or not _is_digits(code, 3, 3):
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


class ConnectionEnded(Exception):
    """The connection closed before the response was complete."""

    def __init__(self, nothing_read: bool) -> None:
        super().__init__("the connection closed before the response was complete")
        #: No byte of this response arrived. On a reused kept-alive
        #: connection that is the host having closed it while it sat idle:
        #: the request can be sent again on a new one.
        self.nothing_read = nothing_read


class StaleConnection(Exception):
    """A reused kept-alive connection failed before any byte of its answer
    came: the host had closed it while it sat idle. Raised and caught inside
    a transport, which sends the request once more on a new connection."""


def describe_error(exc: BaseException) -> str:
    """How a transport names what broke an exchange: the exception's type and
    message (from the OS or this package, never a header)."""
    text = str(exc)
    if isinstance(exc, ConnectionEnded):
        return text
    if isinstance(exc, TimeoutError) and not text:
        text = "timed out"  # asyncio's timeouts say nothing; sockets say this
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class ResponseReader:
    """Reads responses out of the bytes a connection receives (h11's way:
    bytes in with `feed`, whole responses out of `next_response`).

    A transport calls `expect` before it sends a request, feeds whatever
    arrives, and asks `next_response` after each feed until it has one.
    Bytes that arrive while no response is expected, or that are left over
    after one, mean the connection is out of step with its requests: it must
    not be used again (`will_close` is set on that response, `usable` is
    False while idle).
    """

    __slots__ = ("_buffer", "_ended", "_got", "_searched", "_step", "_steps")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._ended = False
        #: Whether a byte of the expected response has arrived.
        self._got = False
        #: Where the search for a separator goes on from (nothing before it matched).
        self._searched = 0
        self._steps: ResponseSteps | None = None
        self._step: Step = None

    @property
    def usable(self) -> bool:
        """Idle and clean: nothing arrived since the last response, no end."""
        return self._steps is None and not self._buffer and not self._ended

    @property
    def expecting(self) -> bool:
        """Whether a response is expected (between `expect` and its end)."""
        return self._steps is not None

    @property
    def got_any(self) -> bool:
        """Whether any byte of the expected response has arrived."""
        return self._got

    def expect(self) -> None:
        """A request is about to be sent: read its response next."""
        self._steps = _response_steps()
        self._step = next(self._steps)
        self._got = bool(self._buffer)
        self._searched = 0

    def feed(self, data: bytes) -> None:
        """Bytes the connection received; empty bytes: it reached its end."""
        if data:
            self._buffer += data
            self._got = True
        else:
            self._ended = True

    def next_response(self) -> tuple[int, bytes, bool] | None:
        """The expected response, if all of it has arrived: its status, its
        body, and whether the connection must close after it; else None.

        Raises:
            BadResponse: The bytes are not a response this client understands.
            ConnectionEnded: The connection ended before the response did.
            RuntimeError: No response is expected.
        """
        steps = self._steps
        if steps is None:
            raise RuntimeError("no response is expected")
        while True:
            data = self._take(self._step)
            if data is None:
                if self._ended:
                    self._steps = None
                    raise ConnectionEnded(nothing_read=not self._got)
                return None
            try:
                self._step = steps.send(data)
            except StopIteration as stop:
                self._steps = None
                status, body, will_close = stop.value
                return status, body, will_close or bool(self._buffer)
            except BadResponse:
                # Nothing after a bad response can be trusted to start a new one.
                self._steps = None
                self._ended = True
                raise

    def _take(self, step: Step) -> bytes | None:
        buffer = self._buffer
        if isinstance(step, bytes):
            end = buffer.find(step, self._searched)
            if end < 0:
                # A head ends within MAX_HEAD_BYTES, however its bytes came.
                self._searched = max(0, len(buffer) - len(step) + 1)
                if self._searched > MAX_HEAD_BYTES:
                    raise BadResponse(f"no {step!r} in the first {MAX_HEAD_BYTES} bytes")
                return None
            if end > MAX_HEAD_BYTES:
                raise BadResponse(f"no {step!r} in the first {MAX_HEAD_BYTES} bytes")
            size = end + len(step)
            self._searched = 0
        elif step is None:
            if not self._ended:
                return None
            size = len(buffer)
        elif len(buffer) < step:
            return None
        else:
            size = step
        data = bytes(buffer[:size])
        del buffer[:size]
        return data


def _response_steps() -> ResponseSteps:
    """Read one whole response, step by step; returns its status, its body,
    and whether the server will close the connection after it.

    Raises (from the generator):
        BadResponse: The bytes are not a response this client understands.
    """
    while True:
        head = yield _HEAD_END
        status, http10, headers = parse_head(head)
        if not 100 <= status < 200:
            break
        # 1xx responses have no body (RFC 9110 section 15.2); the final one follows.
    connection = _tokens(headers.get("connection"))
    will_close = "close" in connection or (http10 and "keep-alive" not in connection)
    codings = [token for token in _tokens(headers.get("transfer-encoding")) if token]
    if status in (204, 304):
        # Never a body, whatever the headers say (RFC 9112 section 6.3).
        body = b""
    elif codings == ["chunked"]:
        body = yield from _chunked_steps()
        # A length beside the chunks: a sender that may be out of step
        # (RFC 9112 section 6.3): this connection carries nothing more.
        will_close = will_close or "content-length" in headers
    elif codings:
        raise BadResponse(f"unsupported transfer-encoding {headers['transfer-encoding']!r}")
    elif "content-length" in headers:
        length_text = headers["content-length"]
        if not _is_digits(length_text, 1, MAX_LENGTH_DIGITS):
            raise BadResponse(f"bad content-length {length_text[:40]!r}")
        length = int(length_text)
        body = (yield length) if length else b""
    else:
        # Neither length nor chunks: the body runs to the end of the connection.
        body = yield None
        will_close = True
    return status, body, will_close


def _chunked_steps() -> Generator[Step, bytes, bytes]:
    chunks: list[bytes] = []
    while True:
        size_line = yield _LINE_END
        size_text = size_line.split(b";", 1)[0].strip()
        # Hex digits only: int() would also take a sign, "0x" and underscores.
        if not 0 < len(size_text) <= MAX_LENGTH_DIGITS or size_text.strip(_HEX_DIGITS):
            raise BadResponse(f"bad chunk size {size_text[:20]!r}")
        size = int(size_text, 16)
        if size == 0:
            # Trailer fields, if any, end with a blank line.
            for _ in range(MAX_HEADERS + 1):
                if (yield _LINE_END) == b"\r\n":
                    return b"".join(chunks)
            raise BadResponse(f"more than {MAX_HEADERS} trailer lines")
        chunks.append((yield size))
        if (yield 2) != b"\r\n":
            raise BadResponse("a chunk does not end with CRLF")


def _is_digits(text: str, least: int, most: int) -> bool:
    # str.isdigit() alone would take "²" and other digits int() refuses.
    return least <= len(text) <= most and text.isascii() and text.isdigit()


def _tokens(value: str | None) -> list[str]:
    return [token.strip().lower() for token in value.split(",")] if value else []
