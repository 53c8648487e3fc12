"""The supervisor side of two measurements that need one supervisor process.

``many``: one guest with N calls in flight, then G guests at once, each with
one call in flight, all measuring the same window (they warm up, report
ready on a shared pipe, and start together when the driver closes their
stdin). Aggregate calls/s of the G guests against the single guest's, and the
supervisor's peak RSS, sampled throughout.

``launch``: the cost of starting a guest. ``/bin/true`` run to completion
through :meth:`Supervisor.run` against bare ``asyncio.create_subprocess_exec``
plus ``wait()``, interleaved, on the same event loop (uvloop).

    python host.py many --state-dir D --store sqlite --guests 200 --out many.json
    python host.py launch --state-dir D --store sqlite --runs 50 --out launch.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import psutil
from loadgen import point_args

from supervisor import Plan, Supervisor

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
    """Samples this process's RSS in the background; keeps the peak."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    def sample(self) -> int:
        rss = int(self._process.memory_info().rss)
        self.peak = max(self.peak, rss)
        return rss

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(RSS_SAMPLE_S)

    def start(self) -> None:
        self.peak = 0
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> int:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sample()
        return self.peak


def _loadgen(out: Path, inflight: int, warmup: float, duration: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        str(LOADGEN),
        *point_args(out, "noop", [inflight], warmup, duration),
        *extra,
    ]


async def _wait_ready(fd: int, guests: int) -> None:
    """Read one byte per warm guest from the shared ready pipe."""
    loop = asyncio.get_running_loop()
    seen = 0
    enough: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        nonlocal seen
        data = os.read(fd, 4096)
        seen += len(data)
        if (seen >= guests or not data) and not enough.done():
            enough.set_result(None)

    loop.add_reader(fd, readable)
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await enough
    finally:
        loop.remove_reader(fd)
    if seen < guests:
        raise RuntimeError(f"only {seen} of {guests} guests got ready")


async def many(args: argparse.Namespace) -> dict[str, Any]:
    """One guest at ``--single-inflight``, then ``--guests`` guests at 1 in flight each."""
    plan = Plan.load(PLAN)
    work = Path(args.work)
    rss = RssSampler()
    budget = args.warmup + args.duration + GUEST_SLACK_S
    async with Supervisor(args.state_dir, store=args.store) as sup:
        rss.start()
        single_out = work / "single.json"
        outcome = await sup.run(
            plan,
            _loadgen(
                single_out,
                args.single_inflight,
                args.warmup,
                args.duration,
                "--server-pid",
                str(os.getpid()),
            ),
            stdin=asyncio.subprocess.DEVNULL,
            timeout_s=budget,
        )
        if outcome.exit_status != 0:
            raise RuntimeError(f"the single guest failed: {outcome.executions[-1].describe()}")
        single = json.loads(single_out.read_text())["points"][0]
        single_rss = await rss.stop()

        rss.start()
        go_read, go_write = os.pipe()
        ready_read, ready_write = os.pipe()
        open_fds = {go_read, go_write, ready_read, ready_write}

        def close(fd: int) -> None:
            if fd in open_fds:
                open_fds.discard(fd)
                os.close(fd)

        outs = [work / f"guest-{i}.json" for i in range(args.guests)]
        runs = [
            asyncio.create_task(
                sup.run(
                    plan,
                    _loadgen(out, 1, args.warmup, args.duration, "--gate"),
                    stdin=go_read,
                    stdout=ready_write,
                    timeout_s=budget + READY_TIMEOUT_S,
                )
            )
            for out in outs
        ]
        try:
            await _wait_ready(ready_read, args.guests)
            close(go_read)
            close(ready_write)
            cpu0, started = time.process_time(), time.perf_counter()
            close(go_write)  # every guest sees end of file at once: go
            await asyncio.sleep(args.duration)
            cpu1, seconds = time.process_time(), time.perf_counter() - started
            async with asyncio.timeout(budget):
                outcomes = await asyncio.gather(*runs)
        finally:
            for fd in list(open_fds):
                close(fd)
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        many_rss = await rss.stop()
    failed = [o.executions[-1].describe() for o in outcomes if o.exit_status != 0]
    # A guest that failed or wrote nothing contributes no calls: the aggregate
    # stays honest, and the failures are reported beside it.
    points = [json.loads(out.read_text())["points"][0] for out in outs if out.exists()]
    calls = sum(p["calls"] for p in points)
    total_per_s = sum(p["calls_per_s"] for p in points)
    errors = [p["first_error"] for p in points if p["errors"]]
    return {
        "store": args.store,
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
            "guests_failed": len(failed),
            "first_failure": failed[0] if failed else None,
            "calls_per_s": round(total_per_s, 1),
            "guest_p50_us_median": (
                round(statistics.median(p["p50_us"] for p in points), 1) if points else None
            ),
            "guest_p99_us_max": max((p["p99_us"] for p in points), default=None),
            "slowest_guest_calls_per_s": (
                min(p["calls_per_s"] for p in points) if len(points) == len(outs) else 0.0
            ),
            "server_cpu_us_per_call": round((cpu1 - cpu0) * 1e6 / calls, 1) if calls else None,
            "window_s": round(seconds, 3),
            "supervisor_peak_rss_mb": round(many_rss / 2**20, 1),
        },
        "ratio": round(total_per_s / single["calls_per_s"], 3) if single["calls_per_s"] else None,
        "supervisor_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


async def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Median wall time of ``/bin/true`` through the supervisor and bare, interleaved."""
    plan = Plan.load(PLAN)
    true = shutil.which("true") or "/bin/true"
    devnull = asyncio.subprocess.DEVNULL

    async def bare() -> float:
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            true, stdin=devnull, stdout=devnull, stderr=devnull
        )
        await process.wait()
        return time.perf_counter() - started

    async def hosted(sup: Supervisor, *, captured: bool) -> float:
        started = time.perf_counter()
        # captured: stdout/stderr pumped, logged and passed through, as `hostcall run` does.
        streams: dict[str, Any] = {} if captured else {"stdout": devnull, "stderr": devnull}
        outcome = await sup.run(plan, [true], stdin=devnull, **streams)
        elapsed = time.perf_counter() - started
        if outcome.exit_status != 0:
            raise RuntimeError(f"{true} failed under the supervisor")
        return elapsed

    samples: dict[str, list[float]] = {"bare": [], "hostcall": [], "hostcall_no_capture": []}
    async with Supervisor(args.state_dir, store=args.store) as sup:
        for _ in range(args.warm):
            await bare()
            await hosted(sup, captured=True)
        for _ in range(args.runs):
            samples["bare"].append(await bare())
            samples["hostcall"].append(await hosted(sup, captured=True))
            samples["hostcall_no_capture"].append(await hosted(sup, captured=False))
    medians = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    diffs = [(h - b) * 1e3 for h, b in zip(samples["hostcall"], samples["bare"], strict=True)]
    return {
        "store": args.store,
        "runs": args.runs,
        "command": true,
        "bare_p50_ms": round(medians["bare"], 3),
        "hostcall_p50_ms": round(medians["hostcall"], 3),
        "hostcall_no_capture_p50_ms": round(medians["hostcall_no_capture"], 3),
        "overhead_p50_ms": round(statistics.median(diffs), 3),
        "overhead_no_capture_p50_ms": round(medians["hostcall_no_capture"] - medians["bare"], 3),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for name in ("many", "launch"):
        mode = modes.add_parser(name)
        mode.add_argument("--state-dir", required=True)
        mode.add_argument("--store", default="sqlite")
        mode.add_argument("--out", required=True, type=Path)
    many_mode = modes.choices["many"]
    many_mode.add_argument("--work", required=True, help="folder for the guests' results")
    many_mode.add_argument("--guests", type=int, default=200)
    many_mode.add_argument("--single-inflight", type=int, default=32)
    many_mode.add_argument("--warmup", type=float, default=1.0)
    many_mode.add_argument("--duration", type=float, default=3.0)
    launch_mode = modes.choices["launch"]
    launch_mode.add_argument("--runs", type=int, default=50)
    launch_mode.add_argument("--warm", type=int, default=3)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one mode and write its JSON to ``--out``."""
    args = _parser().parse_args(argv)
    import uvloop

    if args.mode == "many":
        Path(args.work).mkdir(parents=True, exist_ok=True)
    measure = many if args.mode == "many" else launch
    result = uvloop.run(measure(args))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
