"""What the guest client costs a call: the shim against a raw client, side by side.

Runs as a guest of ``hostcall run`` under the benchmark plan and calls
``noop`` one call at a time (an agent calls tools one after another) through
three clients in turn, for several rounds:

- ``raw``: the least a Python guest can do — one request written in one
  ``sendall`` on a kept-alive socket, the answer read by its
  ``Content-Length`` and its JSON checked. No retries, no deadline, no error
  handling: the floor, not a client anyone should ship.
- ``sync``: ``guest_client.HostClient.call``, as guest code calls it.
- ``async``: ``guest_client.aio.AsyncHostClient.call`` on asyncio's own loop.

For each client and round it reports calls/s, the latency of each call
(p50, p99), this process's CPU per call (``getrusage``) and the window on
``CLOCK_MONOTONIC``, from which the harness reads the supervisor's CPU per
call (:mod:`server_cpu`). One line of JSON on stdout.

``--guest-client DIR`` imports ``guest_client`` from ``DIR`` instead: an
older tree's client, measured against this one's raw floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

#: Calls before the first round, per client: connections open, code warm.
WARM_CALLS: Final = 200
CLIENTS: Final = ("raw", "sync", "async")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class RawClient:
    """One kept-alive connection; one write per request, the body by its length."""

    def __init__(self, environment: Any) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(environment.socket_path)
        headers = {
            **environment.identity_headers(),
            "Content-Type": "application/json",
            "Accept": "application/json",
        }
        self._head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        self._calls = 0

    def call(self, n: int) -> Any:
        self._calls += 1
        body = json.dumps(
            {"call_id": f"raw-{os.getpid()}-{self._calls}", "tool": "noop", "args": {"n": n}}
        ).encode()
        self._sock.sendall(
            f"POST /v1/calls HTTP/1.1\r\nHost: localhost\r\n{self._head}"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        data = b""
        while b"\r\n\r\n" not in data:
            data += self._recv()
        head, _, rest = data.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            rest += self._recv()
        return json.loads(rest)["result"]

    def _recv(self) -> bytes:
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionError("the channel closed the connection")
        return data


class _Window:
    """One client's measured window: its calls' latencies and the CPU spent."""

    def __init__(self, name: str, duration_s: float) -> None:
        self.name = name
        self.latencies: list[int] = []
        self.cpu_start = _cpu_s()
        self.start = time.monotonic()
        self.end = self.start + duration_s

    def calls(self) -> Iterator[int]:
        """Call numbers until the window closes."""
        n = 0
        while time.monotonic() < self.end:
            n += 1
            yield n

    def record(self, n: int, began_ns: int, result: Any) -> None:
        self.latencies.append(time.perf_counter_ns() - began_ns)
        if result != n:
            raise AssertionError(f"{self.name}: noop({n}) answered {result!r}")

    def point(self) -> dict[str, Any]:
        finished = time.monotonic()
        cpu_s = _cpu_s() - self.cpu_start
        latencies = sorted(self.latencies)
        calls = len(latencies)
        return {
            "client": self.name,
            "calls": calls,
            "calls_per_s": round(calls / (finished - self.start), 1),
            "p50_us": round(latencies[calls // 2] / 1000, 1),
            "p99_us": round(latencies[min(calls - 1, calls * 99 // 100)] / 1000, 1),
            "client_cpu_us_per_call": round(cpu_s * 1e6 / calls, 1),
            "window_monotonic": [self.start, finished],
        }


def _measure(name: str, call: Callable[[int], Any], duration_s: float) -> dict[str, Any]:
    window = _Window(name, duration_s)
    for n in window.calls():
        began = time.perf_counter_ns()
        window.record(n, began, call(n))
    return window.point()


async def _measure_async(
    name: str, call: Callable[[int], Awaitable[Any]], duration_s: float
) -> dict[str, Any]:
    window = _Window(name, duration_s)
    for n in window.calls():
        began = time.perf_counter_ns()
        window.record(n, began, await call(n))
    return window.point()


async def _main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    import guest_client
    from guest_client.aio import AsyncHostClient
    from guest_client.env import GuestEnvironment

    environment = GuestEnvironment.from_environ()
    raw = RawClient(environment)
    sync_client = guest_client.HostClient(environment)
    async_client = AsyncHostClient(environment)

    def sync_call(n: int) -> Any:
        return sync_client.call("noop", {"n": n})

    async def async_call(n: int) -> Any:
        return await async_client.call("noop", {"n": n})

    for n in range(WARM_CALLS):
        raw.call(n)
        sync_call(n)
        await async_call(n)
    points = []
    for _ in range(args.rounds):
        # Each round runs the three in turn, so a burst of other load costs
        # all of them alike.
        points.append(_measure("raw", raw.call, args.duration))
        points.append(_measure("sync", sync_call, args.duration))
        points.append(await _measure_async("async", async_call, args.duration))
    sync_client.close()
    await async_client.aclose()
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per client and round")
    parser.add_argument("--guest-client", help="import guest_client from this folder")
    args = parser.parse_args()
    if args.guest_client:
        sys.path.insert(0, args.guest_client)
    points = asyncio.run(_main_async(args))
    print(json.dumps({"points": points}), flush=True)


if __name__ == "__main__":
    main()
