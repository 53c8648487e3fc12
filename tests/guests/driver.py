"""A guest that a test drives: commands arrive as JSON lines on stdin.

It speaks raw HTTP/1.1 over the channel's Unix socket with the standard
library only (not guest_client), so tests of the wire protocol do not depend
on the client shim. Each command runs in its own thread, so a test can keep
one request blocked in a handler while it sends others; every answer is one
JSON line carrying the command's ``id``:

    {"id": 1, "op": "request", "method": "POST", "path": "/v1/calls", "body": {...},
     "raw": "...", "headers": {...}, "omit": ["Authorization"]}
    {"id": 2, "op": "burst", "n": 50, "request": {...}}    # n requests at once
    {"id": 3, "op": "spawn_child", "request": {...}}       # made by a grandchild
    {"op": "credential"} / {"op": "pid"} / {"op": "exit", "code": 0}
    {"op": "print", "text": "..."}                         # a line on stderr
    {"op": "send_only", "name": "a", "body": {...}}  # POST /v1/calls, answer unread
    {"op": "hang_up", "name": "a"}     # close that connection, its answer unread
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

SOCKET = os.environ["HOSTCALL_SOCKET"]
if "HOSTCALL_CREDENTIAL" in os.environ:
    CREDENTIAL = os.environ["HOSTCALL_CREDENTIAL"]
else:
    with os.fdopen(int(os.environ["HOSTCALL_CREDENTIAL_FD"]), "rb") as f:
        CREDENTIAL = f.read().decode().strip()
IDENTITY = {
    "Authorization": f"Bearer {CREDENTIAL}",
    "Hostcall-Invocation": os.environ["HOSTCALL_INVOCATION"],
    "Hostcall-Execution": os.environ["HOSTCALL_EXECUTION"],
    "Hostcall-Plan": os.environ["HOSTCALL_PLAN"],
}
_OUT = threading.Lock()


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=60)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self._path)


def request(spec: dict[str, Any]) -> dict[str, Any]:
    headers = {k: v for k, v in IDENTITY.items() if k not in spec.get("omit", ())}
    headers.update(spec.get("headers", {}))
    body: bytes | None = None
    if "raw" in spec:
        body = spec["raw"].encode("utf-8", "surrogateescape")
    elif "body" in spec:
        body = json.dumps(spec["body"]).encode()
    if body is not None and "Content-Type" not in headers:
        headers["Content-Type"] = "application/json"
    conn = UnixConnection(spec.get("socket", SOCKET))
    try:
        conn.request(spec.get("method", "POST"), spec.get("path", "/v1/calls"), body, headers)
        response = conn.getresponse()
        data = response.read()
    except OSError as exc:
        return {"status": None, "error": repr(exc)}
    finally:
        conn.close()
    try:
        parsed: Any = json.loads(data)
    except ValueError:
        parsed = data.decode("utf-8", "replace")
    return {"status": response.status, "body": parsed}


#: Connections whose request was sent and whose answer nobody reads.
_UNREAD: dict[str, UnixConnection] = {}


def send_only(spec: dict[str, Any]) -> dict[str, Any]:
    """Send a whole ``POST /v1/calls`` and keep the connection, unread."""
    conn = UnixConnection(SOCKET)
    headers = {**IDENTITY, "Content-Type": "application/json"}
    conn.request("POST", "/v1/calls", json.dumps(spec["body"]).encode(), headers)
    _UNREAD[spec["name"]] = conn
    return {"sent": True}


def hang_up(name: str) -> dict[str, Any]:
    _UNREAD.pop(name).close()
    return {"closed": True}


def burst(n: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait(timeout=30)
        results[i] = request(spec)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def spawn_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One request made by a grandchild process with this guest's identity."""
    env = dict(os.environ, HOSTCALL_CREDENTIAL=CREDENTIAL)
    child = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    answer: dict[str, Any] = json.loads(child.stdout)
    return answer


def reply(command: dict[str, Any], answer: dict[str, Any]) -> None:
    answer["id"] = command.get("id")
    with _OUT:
        print(json.dumps(answer), flush=True)


def handle(command: dict[str, Any]) -> None:
    op = command["op"]
    if op == "request":
        answer = request(command)
    elif op == "send_only":
        answer = send_only(command)
    elif op == "hang_up":
        answer = hang_up(command["name"])
    elif op == "burst":
        answer = {"responses": burst(command["n"], command["request"])}
    elif op == "spawn_child":
        answer = spawn_child(command["request"])
    elif op == "credential":
        answer = {"credential": CREDENTIAL}
    elif op == "pid":
        answer = {"pid": os.getpid()}
    elif op == "print":  # a line on stderr (stdout carries the answers)
        print(command["text"], file=sys.stderr, flush=True)
        answer = {"printed": True}
    else:
        answer = {"error": f"unknown op {op}"}
    reply(command, answer)


def main() -> None:
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            reply(command, {"bye": True})
            os._exit(command.get("code", 0))
        threading.Thread(target=handle, args=(command,), daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(request(json.loads(sys.argv[2]))), flush=True)
    else:
        main()
