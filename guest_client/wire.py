"""The messages between a flow and a transport, and the request encoding.

A flow (see `flows`) yields `Request` and `Sleep` actions; whoever drives it
answers a `Request` with a `Response` or a `TransportFailure`, and a `Sleep`
with None. Transports never interpret bodies; flows never touch sockets.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any, Protocol, TypeAlias

__all__ = [
    "CALLS_PATH",
    "PLAN_PATH",
    "Request",
    "Response",
    "Sleep",
    "TransportFailure",
    "call_path",
    "encode_call",
    "is_call_id",
    "validate_call_id",
]

CALLS_PATH = "/v1/calls"
PLAN_PATH = "/v1/plan"
MAX_CALL_ID_LENGTH = 128
# docs/protocol.md, "Endpoints": a call_id is 1-128 characters of [A-Za-z0-9._:-].
_CALL_ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-"


class Request:
    """One HTTP request to send.

    Attributes:
        method: `GET` or `POST`.
        path: Path and query, already encoded.
        body: JSON bytes for a POST, else None.
        timeout: Seconds the transport may spend on it, connect to last byte.
    """

    __slots__ = ("body", "method", "path", "timeout")

    def __init__(self, method: str, path: str, body: bytes | None, timeout: float) -> None:
        self.method = method
        self.path = path
        self.body = body
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path}, timeout={self.timeout:.3f})"


class Response:
    """One HTTP response, read to the end.

    Attributes:
        status: HTTP status code.
        body: The raw body.
    """

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body

    def __repr__(self) -> str:
        return f"Response({self.status}, {len(self.body)} bytes)"


class Sleep:
    """Wait this many seconds before the flow goes on (a backoff or poll pause).

    Attributes:
        seconds: How long.
    """

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __repr__(self) -> str:
        return f"Sleep({self.seconds:.3f})"


class TransportFailure(Exception):
    """A request got no complete response: no connection, a reset, a timeout.

    Transports raise it; drivers hand it to the flow as a reply, and the flow
    decides whether to retry. The message names the socket and the OS error,
    never a header.

    Attributes:
        request_sent: False only when the failure came before any byte of the
            request left (e.g. connect() refused), so the host cannot have
            acted on it.
    """

    def __init__(self, message: str, *, request_sent: bool) -> None:
        super().__init__(message)
        self.request_sent = request_sent


if TYPE_CHECKING:
    Action: TypeAlias = Request | Sleep
    Reply: TypeAlias = Response | TransportFailure | None

    class Transport(Protocol):
        """What a sync client needs from a transport."""

        def send(self, request: Request) -> Response:
            """Send one request and read its whole response.

            Raises:
                TransportFailure: No complete response arrived.
            """

        def close(self) -> None:
            """Close every connection; later sends may fail."""


def is_call_id(text: str) -> bool:
    """Whether `text` is 1-128 characters of `[A-Za-z0-9._:-]` (docs/protocol.md, "Endpoints")."""
    # strip() takes alphabet characters off both ends: nothing is left only
    # when every character is in the alphabet.
    return 0 < len(text) <= MAX_CALL_ID_LENGTH and not text.strip(_CALL_ID_CHARS)


def validate_call_id(call_id: str) -> str:
    """Check a call_id against docs/protocol.md, "Endpoints" and return it.

    Raises:
        ValueError: It is not 1-128 characters of `[A-Za-z0-9._:-]`.
    """
    if not isinstance(call_id, str) or not is_call_id(call_id):
        raise ValueError(
            f"call_id must be 1-{MAX_CALL_ID_LENGTH} characters of [A-Za-z0-9._:-], not {call_id!r}"
        )
    return call_id


def mint_call_id() -> str:
    """A fresh call_id: `call_` and a uuid4 in hex."""
    import uuid  # Only calls without a call_id of their own need it.

    return f"call_{uuid.uuid4().hex}"


def call_path(call_id: str, wait: float | None = None) -> str:
    """The path of `GET /v1/calls/{call_id}`, with `?wait=` when given.

    The call_id alphabet needs no percent-encoding.
    """
    path = f"{CALLS_PATH}/{validate_call_id(call_id)}"
    if wait is None:
        return path
    seconds = round(float(wait), 3)
    text = str(int(seconds)) if seconds.is_integer() else f"{seconds:.3f}".rstrip("0")
    return f"{path}?wait={text}"


def encode_call(call_id: str, tool: str, args: Mapping[str, Any] | None) -> bytes:
    """The body of `POST /v1/calls`.

    Raises:
        TypeError: `tool` is not a string, `args` not a mapping, or a value
            in `args` is not JSON-serializable.
        ValueError: `tool` is empty, or `args` holds NaN or Infinity.
    """
    import json

    if not isinstance(tool, str):
        raise TypeError(f"tool must be a str, not {type(tool).__name__}")
    if not tool:
        raise ValueError("tool must not be empty")
    if args is None:
        payload: dict[str, Any] = {}
    elif isinstance(args, dict):
        payload = args
    else:
        from collections.abc import Mapping

        if not isinstance(args, Mapping):
            raise TypeError(f"args must be a mapping (a JSON object), not {type(args).__name__}")
        payload = dict(args)
    body = {"call_id": validate_call_id(call_id), "tool": tool, "args": payload}
    # allow_nan=False: the channel refuses NaN/Infinity (docs/protocol.md, "Endpoints"); fail here,
    # with a clear message, instead of after a round trip.
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode("utf-8")
