"""A small synchronous client of the admin socket, for the CLI."""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any, Final

from supervisor.errors import HostcallError
from supervisor.sockets import reachable_path

__all__ = ["AdminClient", "AdminError", "SupervisorNotRunning"]

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
            error = decoded.get("error", {}) if isinstance(decoded, dict) else {}
            raise AdminError(
                response.status,
                str(error.get("code", "error")),
                str(error.get("message", f"HTTP {response.status}")),
            )
        return decoded
