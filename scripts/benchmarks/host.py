"""The supervisor side of two measurements that need one supervisor process.

``many``: one guest with N calls in flight, then G guests at once, each with
one call in flight, all measuring the same window (they warm up, each says
ready on its stdout, and they start together when the driver closes their
shared stdin). Aggregate calls/s of the G guests against the single guest's,
and the supervisor's peak RSS, sampled throughout. Guests are sandboxed
unless ``--no-sandbox``; each one's stdout is a pipe of its own, which carries
its ready line and then its results (a sandboxed guest writes no host file).

``launch``: the cost of starting a guest. ``/bin/true`` run to completion
through :meth:`Supervisor.run` — sandboxed from the launch folder (its
overlay is the working directory), sandboxed from ``/`` (a fresh working
directory), and without a sandbox, each on a supervisor of its own — against
bare ``asyncio.create_subprocess_exec`` plus ``wait()``, on the same event
loop (uvloop): each round runs every way once, in a shuffled order (``--seed``).

    python host.py many --state-dir D --store sqlite --guests 200 --out many.json
    python host.py launch --state-dir D --store sqlite --runs 50 --out launch.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import psutil
from loadgen import last_json, point_args
from server_cpu import CpuTrace

from supervisor import Plan, RunOutcome, Supervisor

HERE: Final = Path(__file__).resolve().parent
PLAN: Final = HERE / "plan.toml"
LOADGEN: Final = HERE / "loadgen.py"
#: How often the supervisor's RSS is sampled.
RSS_SAMPLE_S: Final = 0.05
#: Bound on starting every guest and hearing that it is warm.
READY_TIMEOUT_S: Final = 240.0
#: Bound on one guest's run, beyond its own warm-up and window.
GUEST_SLACK_S: Final = 120.0


class RssSampler:
    """Samples this process's RSS in the background; keeps the peak.

    Also the event loop's lag: how much later than asked each sample woke up.
    A supervisor whose loop stalls answers no guest meanwhile.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.peak = 0
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int:
        rss = int(self._process.memory_info().rss)
        self.peak = max(self.peak, rss)
        return rss

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.sample()
            asked = loop.time() + RSS_SAMPLE_S
            await asyncio.sleep(RSS_SAMPLE_S)
            self.lags.append(loop.time() - asked)

    def start(self) -> None:
        self.peak = 0
        self.lags = []
        self._task = asyncio.create_task(self._run())

    def lag_summary(self) -> dict[str, Any]:
        """The loop's lag while sampling: p50, p99 and worst, in ms."""
        if not self.lags:
            return {"samples": 0}
        ordered = sorted(self.lags)
        return {
            "samples": len(ordered),
            "p50_ms": round(ordered[len(ordered) // 2] * 1e3, 1),
            "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3, 1),
            "max_ms": round(ordered[-1] * 1e3, 1),
        }

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()
        return self.peak


def _loadgen(inflight: int, warmup: float, duration: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(LOADGEN),
        *point_args("noop", [inflight], warmup, duration),
        *extra,
    ]


class GuestOutput:
    """A guest's stdout on a pipe of its own, read on the event loop.

    ``on_first`` runs when the first bytes arrive (a gated guest's ready line).
    Once the guest has ended, :meth:`finish` closes our write end and returns
    everything the guest wrote: nothing else holds the pipe (our descriptors
    are not inherited), so reading it to the end cannot block.
    """

    def __init__(self, on_first: Callable[[], None] | None = None) -> None:
        self._read_fd, self.write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._on_first = on_first
        self._chunks: list[bytes] = []
        self._writer_open = True
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._read_fd, self._readable)

    def _readable(self) -> None:
        try:
            data = os.read(self._read_fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self._loop.remove_reader(self._read_fd)
            return
        if not self._chunks and self._on_first is not None:
            self._on_first()
        self._chunks.append(data)

    @property
    def started_writing(self) -> bool:
        """Whether anything came yet (a gated guest: its ready line)."""
        return bool(self._chunks)

    def close_writer(self) -> None:
        """Close our copy of the write end (idempotent)."""
        if self._writer_open:
            self._writer_open = False
            os.close(self.write_fd)

    def finish(self) -> str:
        """Everything the guest wrote; closes the pipe."""
        self.close_writer()
        self._loop.remove_reader(self._read_fd)
        try:
            while data := os.read(self._read_fd, 65536):
                self._chunks.append(data)
        except BlockingIOError:
            pass  # a process of the guest still holds the pipe: what came is what counts
        finally:
            os.close(self._read_fd)
        return b"".join(self._chunks).decode(errors="replace")


class ReadyCount:
    """Counts guests that said ready; :meth:`wait` until each of ``expected``
    has, or has ended without (a failed guest, reported as such)."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.seen = 0
        self.gone = 0
        self._all = asyncio.get_running_loop().create_future()

    def one(self) -> None:
        self.seen += 1
        self._check()

    def ended_unready(self) -> None:
        self.gone += 1
        self._check()

    def _check(self) -> None:
        if self.seen + self.gone >= self.expected and not self._all.done():
            self._all.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await self._all
        except TimeoutError:
            raise RuntimeError(
                f"only {self.seen} of {self.expected} guests got ready in {timeout_s:g} s"
            ) from None


def _unready_when_ended(
    out: GuestOutput, ready: ReadyCount
) -> Callable[[asyncio.Task[RunOutcome]], None]:
    """A done-callback for a guest's run: it ended without saying ready."""

    def ended(_: asyncio.Task[RunOutcome]) -> None:
        if not out.started_writing:
            ready.ended_unready()

    return ended


def _why(ended: RunOutcome | BaseException) -> str:
    if isinstance(ended, BaseException):
        return f"not started: {type(ended).__name__}: {ended}"[:500]
    return ended.executions[-1].describe()


def _first_point(output: str) -> dict[str, Any] | None:
    """The one point a guest of ``many`` measured, or None if it wrote none."""
    try:
        found: dict[str, Any] = last_json(output)["points"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return found


async def many(args: argparse.Namespace) -> dict[str, Any]:
    """One guest at ``--single-inflight``, then ``--guests`` guests at 1 in flight each."""
    plan = Plan.load(PLAN)
    rss = RssSampler()
    budget = args.warmup + args.duration + GUEST_SLACK_S
    async with Supervisor(args.state_dir, store=args.store, sandbox=args.sandbox) as sup:
        rss.start()
        single_out = GuestOutput()
        try:
            # This process is the server: its CPU over the guest's window.
            with CpuTrace(time.process_time) as cpu:
                outcome = await sup.run(
                    plan,
                    _loadgen(args.single_inflight, args.warmup, args.duration),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=single_out.write_fd,
                    timeout_s=budget,
                )
        finally:
            output = single_out.finish()
        single = _first_point(output)
        if outcome.exit_status != 0 or single is None:
            raise RuntimeError(f"the single guest failed: {outcome.executions[-1].describe()}")
        cpu.fill([single])
        single_rss = await rss.stop()
        sandbox = outcome.executions[-1].sandbox

        rss.start()
        go_read, go_write = os.pipe()
        open_fds = {go_read, go_write}

        def close(fd: int) -> None:
            if fd in open_fds:
                open_fds.discard(fd)
                os.close(fd)

        ready = ReadyCount(args.guests)
        outs = [GuestOutput(ready.one) for _ in range(args.guests)]
        began = time.monotonic()
        runs = [
            asyncio.create_task(
                sup.run(
                    plan,
                    _loadgen(1, args.warmup, args.duration, "--gate"),
                    stdin=go_read,
                    stdout=out.write_fd,
                    timeout_s=budget + READY_TIMEOUT_S,
                )
            )
            for out in outs
        ]
        for run, out in zip(runs, outs, strict=True):
            run.add_done_callback(_unready_when_ended(out, ready))
        try:
            await ready.wait(READY_TIMEOUT_S)
            all_ready = time.monotonic()
            close(go_read)
            cpu0, started = time.process_time(), time.perf_counter()
            close(go_write)  # every guest sees end of file at once: go
            await asyncio.sleep(args.duration)
            cpu1, seconds = time.process_time(), time.perf_counter() - started
            async with asyncio.timeout(budget):
                ended = await asyncio.gather(*runs, return_exceptions=True)
        finally:
            for fd in list(open_fds):
                close(fd)
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            outputs = [out.finish() for out in outs]
        many_rss = await rss.stop()
        lag = rss.lag_summary()
    # A guest that could not be started counts as failed, with the reason.
    failed = [_why(o) for o in ended if isinstance(o, BaseException) or o.exit_status != 0]
    # A guest that failed or wrote nothing contributes no calls: the aggregate
    # stays honest, and the failures are reported beside it.
    found = [_first_point(output) for output in outputs]
    points = [p for p in found if p is not None]
    not_ok = sum(
        1
        for o, p in zip(ended, found, strict=True)
        if isinstance(o, BaseException) or o.exit_status != 0 or p is None or p["errors"]
    )
    calls = sum(p["calls"] for p in points)
    total_per_s = sum(p["calls_per_s"] for p in points)
    errors = [p["first_error"] for p in points if p["errors"]]
    # When the first error of each guest came: while guests were still starting,
    # or once all of them ran.
    erred_at = [p["first_error_monotonic"] - began for p in points if p["errors"]]
    return {
        "store": args.store,
        "sandbox": sandbox if isinstance(sandbox, str) else dict(sandbox),
        "guests": args.guests,
        "single": {
            "inflight": args.single_inflight,
            "calls_per_s": single["calls_per_s"],
            "p50_us": single["p50_us"],
            "p99_us": single["p99_us"],
            "server_cpu_us_per_call": single["server_cpu_us_per_call"],
            "supervisor_peak_rss_mb": round(single_rss / 2**20, 1),
        },
        "many": {
            "inflight_per_guest": 1,
            "calls": calls,
            "errors": sum(p["errors"] for p in points),
            "guests_with_errors": len(errors),
            "first_error": errors[0] if errors else None,
            "all_ready_after_s": round(all_ready - began, 2),
            "first_errors_after_s": sorted(round(t, 2) for t in erred_at)[:20],
            "guests_failed": len(failed),
            # Exited non-zero, wrote no results, or got a wrong answer.
            "guests_not_ok": not_ok,
            "first_failure": failed[0] if failed else None,
            "calls_per_s": round(total_per_s, 1),
            "guest_p50_us_median": (
                round(statistics.median(p["p50_us"] for p in points), 1) if points else None
            ),
            "guest_p99_us_max": max((p["p99_us"] for p in points), default=None),
            "slowest_guest_calls_per_s": (
                min(p["calls_per_s"] for p in points) if len(points) == len(outputs) else 0.0
            ),
            "server_cpu_us_per_call": round((cpu1 - cpu0) * 1e6 / calls, 1) if calls else None,
            "window_s": round(seconds, 3),
            "supervisor_peak_rss_mb": round(many_rss / 2**20, 1),
            # From the first launch to the end: the supervisor's event loop late by.
            "supervisor_loop_lag": lag,
        },
        "ratio": round(total_per_s / single["calls_per_s"], 3) if single["calls_per_s"] else None,
        "supervisor_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


#: The ways a guest is launched in ``launch``: (sandboxed, working directory).
#: From the launch folder the sandbox shows an overlay of it as the guest's
#: working directory; from ``/`` it makes a fresh, empty one.
LAUNCH_MODES: Final = {
    "sandbox": (True, None),
    "sandbox_fresh_workdir": (True, "/"),
    "no_sandbox": (False, None),
}


async def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Median wall time of ``/bin/true`` through the supervisor, sandboxed and not,
    and bare, interleaved."""
    plan = Plan.load(PLAN)
    true = shutil.which("true") or "/bin/true"
    devnull = asyncio.subprocess.DEVNULL
    described: dict[str, Any] = {}

    async def bare() -> float:
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            true, stdin=devnull, stdout=devnull, stderr=devnull
        )
        await process.wait()
        return time.perf_counter() - started

    async def popen() -> float:
        # For comparison: CPython's own spawn (vfork), which uvloop's (fork) is
        # not; blocking, as a host program without asyncio would spawn.
        started = time.perf_counter()
        subprocess.run([true], stdin=devnull, stdout=devnull, stderr=devnull, check=True)  # noqa: ASYNC221
        return time.perf_counter() - started

    async def hosted(mode: str, sup: Supervisor, *, captured: bool) -> float:
        cwd = LAUNCH_MODES[mode][1]
        started = time.perf_counter()
        # captured: stdout/stderr pumped, logged and passed through, as `hostcall run` does.
        streams: dict[str, Any] = {} if captured else {"stdout": devnull, "stderr": devnull}
        outcome = await sup.run(plan, [true], stdin=devnull, cwd=cwd, **streams)
        elapsed = time.perf_counter() - started
        if outcome.exit_status != 0:
            raise RuntimeError(f"{true} failed under the supervisor ({mode})")
        described[mode] = outcome.executions[-1].sandbox
        return elapsed

    samples: dict[str, list[float]] = {"bare": [], "popen": []}
    for mode in LAUNCH_MODES:
        samples[mode] = []
        samples[f"{mode}_no_capture"] = []
    async with contextlib.AsyncExitStack() as stack:
        supervisors: dict[str, Supervisor] = {}
        for mode, (sandboxed, _) in LAUNCH_MODES.items():
            supervisors[mode] = await stack.enter_async_context(
                Supervisor(f"{args.state_dir}-{mode}", store=args.store, sandbox=sandboxed)
            )
        for _ in range(args.warm):
            await bare()
            for mode, sup in supervisors.items():
                await hosted(mode, sup, captured=True)
        # Each round runs every way once, in an order of its own: what runs
        # right after the blocking subprocess.run (or after a sandboxed start)
        # pays for it, and a fixed order would always charge the same way.
        ways: list[tuple[str, Callable[[], Awaitable[float]]]] = [("bare", bare), ("popen", popen)]
        for mode, sup in supervisors.items():
            ways.append((mode, functools.partial(hosted, mode, sup, captured=True)))
            ways.append(
                (f"{mode}_no_capture", functools.partial(hosted, mode, sup, captured=False))
            )
        shuffler = random.Random(args.seed)
        for _ in range(args.runs):
            shuffler.shuffle(ways)
            for name, way in ways:
                samples[name].append(await way())
    medians = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    result: dict[str, Any] = {
        "store": args.store,
        "runs": args.runs,
        "seed": args.seed,
        "command": true,
        "bare_p50_ms": round(medians["bare"], 3),
        "bare_p90_ms": round(_quantile(samples["bare"], 0.9) * 1e3, 3),
        # subprocess.run in the same process, blocking: the spawn without uvloop's fork.
        "bare_subprocess_run_p50_ms": round(medians["popen"], 3),
    }
    for mode in LAUNCH_MODES:
        paired = [(h - b) * 1e3 for h, b in zip(samples[mode], samples["bare"], strict=True)]
        sandbox = described.get(mode)
        result[mode] = {
            "sandbox": sandbox if isinstance(sandbox, str | None) else dict(sandbox),
            "cwd": LAUNCH_MODES[mode][1] or "the launch folder",
            "hostcall_p50_ms": round(medians[mode], 3),
            "hostcall_p90_ms": round(_quantile(samples[mode], 0.9) * 1e3, 3),
            "hostcall_no_capture_p50_ms": round(medians[f"{mode}_no_capture"], 3),
            # p50 through the supervisor minus p50 bare: the checks' figure.
            "overhead_p50_ms": round(medians[mode] - medians["bare"], 3),
            "overhead_no_capture_p50_ms": round(medians[f"{mode}_no_capture"] - medians["bare"], 3),
            # The median of the differences of interleaved pairs.
            "overhead_paired_p50_ms": round(statistics.median(paired), 3),
        }
    return result


def _quantile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for name in ("many", "launch"):
        mode = modes.add_parser(name)
        mode.add_argument("--state-dir", required=True)
        mode.add_argument("--store", default="sqlite")
        mode.add_argument("--out", required=True, type=Path)
    many_mode = modes.choices["many"]
    many_mode.add_argument(
        "--no-sandbox", dest="sandbox", action="store_false", help="guests without a sandbox"
    )
    many_mode.add_argument("--guests", type=int, default=200)
    many_mode.add_argument("--single-inflight", type=int, default=32)
    many_mode.add_argument("--warmup", type=float, default=1.0)
    many_mode.add_argument("--duration", type=float, default=3.0)
    launch_mode = modes.choices["launch"]
    launch_mode.add_argument("--runs", type=int, default=50)
    launch_mode.add_argument("--warm", type=int, default=3)
    launch_mode.add_argument("--seed", type=int, default=0, help="of each round's order")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one mode and write its JSON to ``--out``."""
    args = _parser().parse_args(argv)
    import uvloop

    measure = many if args.mode == "many" else launch
    result = uvloop.run(measure(args))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
