"""A scripted host: a real HTTP/1.1 server on a real Unix socket, in a thread.

It answers each request with the next entry of its script and records every
request (method, path, headers, body, connection number), so tests can check
what the client sent and how it reacted to what the host answered.
"""

from __future__ import annotations

import http.server
import json
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from guest_client import RetryPolicy

# What a credential looks like: 32 random bytes, base64url without padding.
CREDENTIAL = "q1FAKEcredential-for_TESTS-only0123456789ab"
INVOCATION = "inv_test"
EXECUTION = "exe_test"
PLAN_HASH = "sha256:" + "ab" * 32
# Quick retries so that failure paths finish in milliseconds.
FAST_RETRY = RetryPolicy(attempts=4, backoff_base=0.001, backoff_max=0.005, deadline=5.0)
# Longest any handler blocks on a HANG entry; the fixture releases it sooner.
HANG_LIMIT_S = 10.0

#: The `make_client` fixture: `make(retry=FAST_RETRY, *, sleeps=None)` -> a client.
MakeClient = Callable[..., Any]


@dataclass(frozen=True)
class Reply:
    """Answer with this status and JSON body."""

    status: int
    body: dict[str, Any] | bytes
    connection_close: bool = False  # send `Connection: close`, then close
    close_silently: bool = False  # close after answering, without saying so


@dataclass(frozen=True)
class Drop:
    """Read the request, then close the connection without answering."""


@dataclass(frozen=True)
class Hang:
    """Read the request and never answer (until the host stops)."""


@dataclass
class Recorded:
    """One request as the host received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    connection: int

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Drip:
    """Answer with `reply`, a byte every `interval` seconds."""

    reply: Reply
    interval: float


Entry = Reply | Drop | Hang | Drip | Callable[[Recorded], "Reply | Drop | Hang | Drip"]

DROP = Drop()
HANG = Hang()


@dataclass
class ScriptedHost:
    """The server's state, shared with the handler threads."""

    socket_path: str
    script: list[Entry] = field(default_factory=list)
    default: Entry | None = None  # answers once the script is used up
    requests: list[Recorded] = field(default_factory=list)
    unexpected: list[Recorded] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _connections: int = 0

    def answer(self, *entries: Entry) -> None:
        """Append entries to the script."""
        with self._lock:
            self.script.extend(entries)

    def next_connection(self) -> int:
        with self._lock:
            self._connections += 1
            return self._connections

    def take(self, request: Recorded) -> Entry | None:
        with self._lock:
            self.requests.append(request)
            if self.script:
                return self.script.pop(0)
            if self.default is None:
                self.unexpected.append(request)
            return self.default


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = HANG_LIMIT_S  # an idle kept-alive connection ends by itself
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection_number = self.server.host.next_connection()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # Quiet; and the default needs a TCP client address.

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        recorded = Recorded(
            method=self.command,
            path=self.path,
            headers={name.lower(): value for name, value in self.headers.items()},
            body=body,
            connection=self.connection_number,
        )
        entry = self.server.host.take(recorded)
        if callable(entry):
            entry = entry(recorded)
        if entry is None:
            entry = Reply(599, {"status": "error", "error": {"code": "script_exhausted"}})
        if isinstance(entry, Drop):
            self.close_connection = True
            return
        if isinstance(entry, Hang):
            self.server.host.released.wait(HANG_LIMIT_S)
            self.close_connection = True
            return
        if isinstance(entry, Drip):
            self._drip(entry)
            return
        payload = entry.body if isinstance(entry.body, bytes) else json.dumps(entry.body).encode()
        self.send_response(entry.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if entry.connection_close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        if entry.connection_close or entry.close_silently:
            self.close_connection = True

    def _drip(self, drip: Drip) -> None:
        body = drip.reply.body
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = (
            f"HTTP/1.1 {drip.reply.status} OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        self.close_connection = True
        for i, byte in enumerate(head + payload):
            if i and self.server.host.released.wait(drip.interval):
                return  # the host stops
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return  # the client gave up


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # many clients connect at once in the async tests

    def __init__(self, host: ScriptedHost) -> None:
        self.host = host
        super().__init__(host.socket_path, _Handler)


class RunningHost:
    """Starts and stops a `ScriptedHost` server thread."""

    def __init__(self, host: ScriptedHost) -> None:
        self.host = host
        self._server = _Server(host)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.host.released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def ok(call_id: str, result: Any, *, effect: str = "executed") -> Reply:
    """A 200 for a call."""
    return Reply(
        200,
        {
            "status": "ok",
            "call_id": call_id,
            "tool": "charge",
            "effect": effect,
            "result": result,
            "idempotency_key": "k" * 64,
            "receipt_id": "rcpt_1",
        },
    )


def ambiguous(call_id: str, reason: str, key: str = "k" * 64) -> Reply:
    """A 409 ambiguous for a call."""
    return Reply(
        409,
        {
            "status": "ambiguous",
            "call_id": call_id,
            "effect": "unknown",
            "reason": reason,
            "idempotency_key": key,
        },
    )


def refused(status: int, code: str, call_id: str | None = None, **error: Any) -> Reply:
    """A refusal."""
    return Reply(
        status,
        {
            "status": "refused",
            "call_id": call_id,
            "effect": "none",
            "error": {"code": code, "message": f"refused: {code}", **error},
        },
    )
