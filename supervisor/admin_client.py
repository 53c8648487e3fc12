"""Small clients of the admin socket: a synchronous one for the CLI, an
asynchronous one for the console (which also follows ``GET /v1/events``)."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from supervisor.errors import HostcallError
from supervisor.sockets import reachable_path

if TYPE_CHECKING:
    import asyncio

__all__ = ["AdminClient", "AdminError", "AsyncAdminClient", "SupervisorNotRunning"]

#: Bound on one admin request (a launch waits for the guest to start).
REQUEST_TIMEOUT_S: Final = 60.0


class SupervisorNotRunning(HostcallError):
    """No supervisor serves the admin socket of this state dir."""

    code = "supervisor_not_running"


class AdminError(HostcallError):
    """The admin API refused a request; ``code`` and ``status`` say why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message, code=code)
        self.status = status


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("hostcall-admin", timeout=REQUEST_TIMEOUT_S)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(REQUEST_TIMEOUT_S)
        try:
            with reachable_path(self._path) as connectable:
                sock.connect(connectable)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class AdminClient:
    """Talks to ``<state_dir>/admin.sock``."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "admin.sock"

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; returns the decoded JSON (or text for ``/metrics``).

        Raises:
            SupervisorNotRunning: nothing listens on the socket.
            AdminError: the API answered with an error.
        """
        conn = _UnixConnection(self.path)
        try:
            payload = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if payload is not None else {}
            conn.request(method, path, payload, headers)
            response = conn.getresponse()
            data = response.read()
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise SupervisorNotRunning(
                f"no supervisor is running on {self.path.parent} ({exc.strerror})"
            ) from None
        finally:
            conn.close()
        if response.headers.get_content_type() != "application/json":
            return data.decode()
        decoded = json.loads(data)
        if response.status >= 400:
            raise _error_of(response.status, decoded)
        return decoded


def _error_of(status: int, decoded: Any) -> AdminError:
    error = decoded.get("error", {}) if isinstance(decoded, dict) else {}
    return AdminError(
        status,
        str(error.get("code", "error")),
        str(error.get("message", f"HTTP {status}")),
    )


#: The longest answer :class:`AsyncAdminClient` reads.
MAX_ANSWER: Final = 64 * 2**20


class AsyncAdminClient:
    """Talks to ``<state_dir>/admin.sock`` from an event loop.

    Each request is HTTP/1.0 on a connection of its own: the answer ends
    where the connection does, and an event stream needs no chunk decoding.
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "admin.sock"

    async def _open(
        self, method: str, path: str, body: dict[str, Any] | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, str]:
        """Sends the request; returns the stream, the status and the
        answer's media type, once the head of the answer has been read."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with reachable_path(self.path) as connectable:
                sock.connect(connectable)  # a local socket: at once, or refused
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise SupervisorNotRunning(
                f"no supervisor is running on {self.path.parent} ({exc.strerror})"
            ) from None
        except BaseException:
            sock.close()
            raise
        import asyncio  # here: the CLI's synchronous client must not pay for it

        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**20)
        try:
            payload = json.dumps(body).encode() if body is not None else b""
            head = f"{method} {path} HTTP/1.0\r\nHost: hostcall-admin\r\n"
            if body is not None:
                head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            writer.write(head.encode("ascii") + b"\r\n" + payload)
            await writer.drain()
            status_line = await reader.readline()
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or not parts[1].isdigit():
                raise AdminError(502, "bad_answer", "the admin socket did not answer HTTP")
            media_type = ""
            while line := (await reader.readline()).strip():
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-type":
                    media_type = value.split(b";")[0].strip().lower().decode("latin-1")
        except BaseException:
            writer.close()
            raise
        return reader, writer, int(parts[1]), media_type

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; returns the decoded JSON (or text for ``/metrics``).

        Raises:
            SupervisorNotRunning: nothing listens on the socket.
            AdminError: the API answered with an error.
        """
        import asyncio

        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                reader, writer, status, media_type = await self._open(method, path, body)
                try:
                    data = await _read_to_end(reader)
                finally:
                    writer.close()
        except TimeoutError:
            raise AdminError(504, "timeout", f"the admin API did not answer {path}") from None
        if media_type != "application/json":
            text = data.decode(errors="replace")
            if status >= 400:
                raise AdminError(status, "error", text[:200])
            return text
        try:
            decoded = json.loads(data)
        except ValueError:
            # Never handed on as text: a caller expecting a list or an
            # object would be given a string (this blanked the console).
            raise AdminError(502, "bad_answer", "the admin API's answer is not JSON") from None
        if status >= 400:
            raise _error_of(status, decoded)
        return decoded

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """``GET /v1/events``: each notice as it comes, until the supervisor
        closes the stream.

        Raises:
            SupervisorNotRunning: nothing listens on the socket.
            AdminError: the API refused the stream.
        """
        reader, writer, status, _ = await self._open("GET", "/v1/events", None)
        try:
            if status >= 400:
                raise AdminError(status, "error", "the admin API refused the event stream")
            while line := await reader.readline():
                if line.startswith(b"data: ") and line.strip() != b"data: {}":
                    notice = json.loads(line[6:])
                    if isinstance(notice, dict):
                        yield notice
        finally:
            writer.close()


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    """The whole answer (it ends where the connection does), at most
    :data:`MAX_ANSWER` bytes.

    ``reader.read(n)`` alone would not do: it returns what is buffered,
    and a long answer arrives in many pieces.
    """
    chunks: list[bytes] = []
    size = 0
    while chunk := await reader.read(2**16):
        size += len(chunk)
        if size > MAX_ANSWER:
            message = f"the admin API's answer is over {MAX_ANSWER} bytes"
            raise AdminError(502, "bad_answer", message)
        chunks.append(chunk)
    return b"".join(chunks)
