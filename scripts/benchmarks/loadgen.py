"""The load generator: one client stack for every HTTP target of the benchmark.

aiohttp's client on a ``UnixConnector``, on uvloop. For each number of calls
in flight N it opens a pool of N connections, keeps N ``POST /v1/calls`` in
flight (one per connection), warms up, then measures for a fixed time:
completed calls, per-call latency (``perf_counter_ns``), this process's CPU
(``getrusage``), the window's two ends on ``CLOCK_MONOTONIC`` and, given
``--server-pid``, the server process's CPU (``psutil``: all its threads).

Against hostcall it runs as a real guest: the socket, the identity headers and
the credential (from ``HOSTCALL_CREDENTIAL_FD``) come from the environment the
supervisor set, and the supervisor's origin check sees this process. In its
sandbox it cannot see the supervisor, so the server's CPU is measured outside
(:mod:`server_cpu`) over the window reported here. Against the bare echo
server it sends the same requests with stand-in headers of the same size.
Every call has a fresh ``call_id`` and fresh arguments.

The results go to stdout as one line of JSON (``--out``: to a file instead).
stdout is the one way out of a sandbox that needs nothing of the plan: the
host's file system is read-only inside it, and ``hostcall run`` passes its
guest's stdout through to its own.

``--gate`` is for many guests at once: after the warm-up the guest writes one
line (``r``) to stdout and waits for end of file on stdin before it measures,
so that every guest measures the same window.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import aiohttp

#: Upper bound on any single call; a call slower than this is a failed run.
CALL_TIMEOUT_S: Final = 30.0
#: How long workers get to finish their last call after the window closes.
DRAIN_TIMEOUT_S: Final = 30.0
#: Pause after a call that got no answer, so a dead server is not hammered.
ERROR_PAUSE_S: Final = 0.01
#: How long a gated guest waits for the go signal.
GATE_TIMEOUT_S: Final = 300.0
URL: Final = "http://hostcall/v1/calls"
#: Stand-in identity for the echo server: same header names and value sizes.
_ECHO_HEADERS: Final = {
    "Authorization": "Bearer " + "x" * 43,
    "Hostcall-Invocation": "inv_" + "0" * 26,
    "Hostcall-Execution": "exe_" + "0" * 26,
    "Hostcall-Plan": "sha256:" + "0" * 64,
}


@dataclass
class _Window:
    """What the workers of one point share."""

    recording: bool = False
    stop: bool = False
    #: Calls completed inside the window (throughput).
    completed: int = 0
    #: Latencies of the calls both started and completed inside the window: a
    #: call that waited out a slow warm-up does not count as a window's tail.
    latencies_ns: list[int] = field(default_factory=list)
    #: Latencies of every call completed inside the window: used only when the
    #: window is too short for any call to both start and end in it.
    completed_ns: list[int] = field(default_factory=list)
    errors: int = 0
    first_error: str | None = None
    #: When it came (``time.monotonic()``): against the window, or a driver's clock.
    first_error_at: float | None = None
    checked: bool = False


#: One call: returns None when its answer is right, else what is wrong.
#: ``check`` says whether the answer must be checked (the first one is, and
#: every one that is not a plain success).
CallOnce = Callable[[bool], Awaitable["str | None"]]


def server_cpu_reader(pid: int | None) -> Callable[[], float] | None:
    """A function that reads the CPU seconds (user + system, all threads) of ``pid``."""
    if pid is None:
        return None
    import psutil  # only when asked: gated guests stay light

    process = psutil.Process(pid)

    def read() -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    return read


def percentile(sorted_values: list[int], fraction: float) -> int:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


async def _worker(call: CallOnce, window: _Window) -> None:
    while not window.stop:
        inside = window.recording
        started = time.perf_counter_ns()
        try:
            problem = await call(not window.checked)
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:
            # A call that got no answer (timed out, connection lost) is an
            # error of the run, counted and shown, not a crash of the guest.
            problem = f"no answer: {type(exc).__name__}: {exc}"[:300]
            await asyncio.sleep(ERROR_PAUSE_S)
        elapsed = time.perf_counter_ns() - started
        window.checked = True
        if problem is not None:
            # Errors are not throughput: only right answers count as calls.
            window.errors += 1
            if window.first_error is None:
                window.first_error, window.first_error_at = problem, time.monotonic()
        elif window.recording:
            window.completed += 1
            window.completed_ns.append(elapsed)
            if inside:
                window.latencies_ns.append(elapsed)


async def measure(
    call: CallOnce,
    inflight: int,
    *,
    warmup_s: float,
    duration_s: float,
    server_cpu: Callable[[], float] | None,
    gate: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Keep ``inflight`` calls going; after ``warmup_s`` measure for ``duration_s``.

    Throughput counts the calls completed inside the window; CPU is read at
    its two ends, for this process and for the server.
    """
    window = _Window()
    workers = [asyncio.create_task(_worker(call, window)) for _ in range(inflight)]
    try:
        await asyncio.sleep(warmup_s)
        if gate is not None:
            await gate()
        _raise_failed(workers)
        client0 = time.process_time()
        server0 = server_cpu() if server_cpu is not None else None
        opened = time.monotonic()
        started = time.perf_counter()
        window.recording = True
        await asyncio.sleep(duration_s)
        window.recording = False
        seconds = time.perf_counter() - started
        closed = time.monotonic()
        client1 = time.process_time()
        server1 = server_cpu() if server_cpu is not None else None
    finally:
        window.stop = True
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            results = await asyncio.gather(*workers, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    latencies = sorted(window.latencies_ns or window.completed_ns)
    calls = window.completed
    per_call = 1e6 / calls if calls else 0.0
    return {
        "inflight": inflight,
        "calls": calls,
        "errors": window.errors,
        "first_error": window.first_error,
        "first_error_monotonic": window.first_error_at,
        "seconds": round(seconds, 4),
        "window_monotonic": [opened, closed],
        "latencies_of": "started_and_ended_in_window" if window.latencies_ns else "ended_in_window",
        "calls_per_s": round(calls / seconds, 1) if seconds > 0 else 0.0,
        "p50_us": round(percentile(latencies, 0.50) / 1000, 1),
        "p90_us": round(percentile(latencies, 0.90) / 1000, 1),
        "p99_us": round(percentile(latencies, 0.99) / 1000, 1),
        "mean_us": round(sum(latencies) / len(latencies) / 1000, 1) if latencies else 0.0,
        "client_cpu_us_per_call": round((client1 - client0) * per_call, 1),
        "server_cpu_us_per_call": (
            round((server1 - server0) * per_call, 1)
            if server0 is not None and server1 is not None
            else None
        ),
    }


class HttpLoad:
    """``POST /v1/calls`` over aiohttp's client on a Unix socket."""

    def __init__(
        self,
        socket_path: str,
        headers: dict[str, str],
        *,
        check: Callable[[int, bytes, bytes], str | None],
    ) -> None:
        self.socket_path = socket_path
        self.headers = {**headers, "Content-Type": "application/json"}
        self._check = check
        self._ids = itertools.count(1)
        self._prefix = f"b{os.getpid()}-".encode()

    def _body(self, tool: str) -> bytes:
        n = next(self._ids)
        return b'{"call_id":"%s%d","tool":"%s","args":{"n":%d}}' % (
            self._prefix,
            n,
            tool.encode(),
            n,
        )

    def session(self, inflight: int) -> aiohttp.ClientSession:
        """A pool of ``inflight`` connections: one call in flight on each."""
        connector = aiohttp.UnixConnector(path=self.socket_path, limit=inflight)
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        return aiohttp.ClientSession(connector=connector, timeout=timeout)

    def caller(self, session: aiohttp.ClientSession, tool: str) -> CallOnce:
        """One call of ``tool`` through ``session`` (for :func:`measure`)."""

        async def call(check: bool) -> str | None:
            body = self._body(tool)
            async with session.post(URL, data=body, headers=self.headers) as response:
                answer = await response.read()
                status = response.status
            if status != 200 or check:
                return self._check(status, body, answer)
            return None

        return call


def _raise_failed(workers: list[asyncio.Task[None]]) -> None:
    for worker in workers:
        if worker.done() and worker.exception() is not None:
            raise RuntimeError("a worker failed during warm-up") from worker.exception()


def _check_hostcall(status: int, body: bytes, answer: bytes) -> str | None:
    try:
        reply = json.loads(answer)
        sent = json.loads(body)
    except ValueError:
        return f"HTTP {status}: not JSON: {answer[:200]!r}"
    if status != 200 or reply.get("status") != "ok" or reply.get("effect") != "executed":
        return f"HTTP {status}: {answer[:300].decode(errors='replace')}"
    if reply.get("result") != sent["args"]["n"]:
        return f"wrong result {reply.get('result')!r} for n={sent['args']['n']}"
    return None


def _check_echo(status: int, body: bytes, answer: bytes) -> str | None:
    if status != 200 or answer != body:
        return f"HTTP {status}: {answer[:200]!r}"
    return None


async def _wait_for_go() -> None:
    """Tell the driver we are warm (a line on stdout), then wait for EOF on stdin."""
    os.write(1, b"r\n")
    loop = asyncio.get_running_loop()
    eof: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not os.read(0, 4096) and not eof.done():
            eof.set_result(None)

    loop.add_reader(0, readable)
    try:
        async with asyncio.timeout(GATE_TIMEOUT_S):
            await eof
    finally:
        loop.remove_reader(0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["hostcall", "echo"], default="hostcall")
    parser.add_argument("--socket", help="the echo server's socket (hostcall: from the env)")
    parser.add_argument(
        "--server-pid",
        type=int,
        help="pid whose CPU is the server's (not for a sandboxed guest: it cannot see it)",
    )
    add_point_args(parser)
    parser.add_argument("--gate", action="store_true", help="wait for the driver's go")
    return parser


def add_point_args(parser: argparse.ArgumentParser) -> None:
    """The options of every load generator here (this one, ``mcp_client.py``)."""
    parser.add_argument("--tools", default="noop", help="comma-separated tool names")
    parser.add_argument("--inflight", default="1,2,4,8,16,32", help="comma-separated")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds per point")
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per point")
    parser.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")


def point_args(
    tools: str, inflight: Sequence[int], warmup_s: float, duration_s: float
) -> list[str]:
    """Those options on a command line (see :func:`add_point_args`); JSON to stdout."""
    return [
        "--tools",
        tools,
        "--inflight",
        ",".join(map(str, inflight)),
        "--warmup",
        str(warmup_s),
        "--duration",
        str(duration_s),
    ]


def write_result(result: dict[str, Any], out: Path | None) -> None:
    """The JSON as one line on stdout, or atomically into ``out``."""
    text = json.dumps(result)
    if out is None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)


def last_json(stdout: str) -> Any:
    """The JSON a load generator wrote: the last non-empty line of its stdout.

    Raises:
        ValueError: there is none, or it is not JSON.
    """
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("the load generator wrote nothing on stdout")
    return json.loads(lines[-1])


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    if args.target == "hostcall":
        from guest_client.env import GuestEnvironment

        environment = GuestEnvironment.from_environ()
        socket_path, headers = environment.socket_path, environment.identity_headers()
        check = _check_hostcall
    else:
        if not args.socket:
            raise SystemExit("loadgen: --socket is required for --target echo")
        socket_path, headers, check = args.socket, dict(_ECHO_HEADERS), _check_echo
    load = HttpLoad(socket_path, headers, check=check)
    server_cpu = server_cpu_reader(args.server_pid)
    points = []
    for tool in args.tools.split(","):
        for inflight in (int(n) for n in args.inflight.split(",")):
            async with load.session(inflight) as session:
                result = await measure(
                    load.caller(session, tool),
                    inflight,
                    warmup_s=args.warmup,
                    duration_s=args.duration,
                    server_cpu=server_cpu,
                    gate=_wait_for_go if args.gate else None,
                )
            points.append({"tool": tool, **result})
    return {
        "target": args.target,
        "pid": os.getpid(),
        # Whoever started us compares it with its own: a sandboxed guest has its own.
        "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the points given on the command line; their JSON to stdout (or ``--out``)."""
    args = _parser().parse_args(argv)
    import uvloop

    write_result(uvloop.run(_main(args)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
