"""Facts about this machine measured in the benchmark's own run.

The machine (CPU, cores, kernel, Python, load), the cost of one ``fsync`` on
the state dir's file system, and how long ``import guest_client`` takes.
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parents[2]
#: Bound on one interpreter start for the import measurement.
IMPORT_TIMEOUT_S: Final = 30.0


def cpu_ticks() -> list[int]:
    """The machine's CPU time so far, by kind (``/proc/stat``'s first line:
    user, nice, system, idle, iowait, irq, softirq, steal); empty if unreadable."""
    try:
        with open("/proc/stat") as stat:
            return [int(field) for field in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """The share of the CPU time between two :func:`cpu_ticks` that the
    hypervisor gave to other guests (steal): a busy host, which no process
    in this machine shows."""
    if len(before) < 8 or len(after) < 8:
        return None
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(spent)
    return round(spent[7] / total, 4) if total else None


def machine() -> dict[str, Any]:
    """CPU model, cores, memory, kernel, Python and library versions, load average."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gb = None
    try:
        match = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        if match:
            memory_gb = round(int(match.group(1)) / 2**20, 1)
    except OSError:
        pass
    versions: dict[str, str | None] = {}
    for name in ("aiohttp", "uvloop", "pydantic", "psutil", "mcp"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": memory_gb,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "packages": versions,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the measured packages had uncommitted changes."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    changed = git("status", "--porcelain", "--", "supervisor", "channel", "guest_client")
    return {
        "commit": git("rev-parse", "--short=12", "HEAD"),
        "subject": git("log", "-1", "--format=%s"),
        "uncommitted_changes": None if changed is None else bool(changed),
    }


def fsync_cost(folder: Path, samples: int) -> dict[str, Any]:
    """Time ``os.fsync`` after appending 200 bytes to a file in ``folder``.

    The same kind of write as a receipt line or a WAL frame, on the same file
    system as the state dir.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fsync-probe"
    line = b"x" * 199 + b"\n"
    times: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for _ in range(samples):
            os.write(fd, line)
            started = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    times.sort()
    return {
        "folder": str(folder),
        "samples": samples,
        "p50_us": round(statistics.median(times) * 1e6, 1),
        "p90_us": round(times[int(0.9 * (len(times) - 1))] * 1e6, 1),
    }


def _run_python(code: str, *flags: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-I", "-S", *flags, "-c", code],
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S,
        check=True,
    )
    return time.perf_counter() - started, done.stderr


def import_time(samples: int) -> dict[str, Any]:
    """``import guest_client`` in a bare interpreter (``-I -S``), two ways.

    Wall clock of the import minus wall clock of ``pass`` (medians of
    interleaved runs), and Python's own ``-X importtime`` total for the package.
    """
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import guest_client"
    empty: list[float] = []
    loaded: list[float] = []
    for _ in range(samples):
        empty.append(_run_python("pass")[0])
        loaded.append(_run_python(code)[0])
    reported: list[int] = []
    for _ in range(max(3, samples // 4)):
        _, stderr = _run_python(code, "-X", "importtime")
        for line in stderr.splitlines():
            parts = [part.strip() for part in line.removeprefix("import time:").split("|")]
            if len(parts) == 3 and parts[2] == "guest_client":
                reported.append(int(parts[1]))
    return {
        "samples": samples,
        "python_pass_ms": round(statistics.median(empty) * 1e3, 2),
        "python_import_ms": round(statistics.median(loaded) * 1e3, 2),
        "wall_ms": round((statistics.median(loaded) - statistics.median(empty)) * 1e3, 2),
        "importtime_ms": round(statistics.median(reported) / 1e3, 2) if reported else None,
    }


#: A plan for the CLI-start measurement's supervisor: one tool, no approvals.
_CLI_PLAN: Final = """
[plan]
name = "cli-start"

[tools.noop]
handler = "bench_tools:noop"
reversibility = "reversible"
"""


def cli_start(samples: int, work: Path) -> dict[str, Any]:
    """How long ``hostcall --help`` and ``hostcall approvals list`` take, whole
    processes: the latter against a running ``hostcall serve``. Side by side
    in the same run: ``python -c pass`` (the floor) and ``python -c "import
    supervisor.supervisor"`` (what every command loaded before the lazy CLI)."""
    hostcall = Path(sys.executable).with_name("hostcall")
    state = work / "cli-start-state"
    plan = work / "cli-start-plan.toml"
    plan.write_text(_CLI_PLAN)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "scripts" / "benchmarks")}
    serve = subprocess.Popen(
        [str(hostcall), "serve", "--plan", str(plan), "--state-dir", str(state),
         "--store", "memory", "--no-sandbox"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        deadline = time.monotonic() + IMPORT_TIMEOUT_S
        while "admin:" not in serve.stderr.readline():
            if time.monotonic() > deadline or serve.poll() is not None:
                raise RuntimeError("hostcall serve did not start")

        def timed(argv: list[str]) -> float:
            started = time.perf_counter()
            subprocess.run(argv, capture_output=True, timeout=IMPORT_TIMEOUT_S, check=True)
            return time.perf_counter() - started

        commands = {
            "python_pass": [sys.executable, "-c", "pass"],
            "import_supervisor": [sys.executable, "-c", "import supervisor.supervisor"],
            "help": [str(hostcall), "--help"],
            "approvals_list": [str(hostcall), "approvals", "list", "--state-dir", str(state)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(samples):
            for name, argv in commands.items():
                times[name].append(timed(argv))
    finally:
        serve.terminate()
        serve.wait(timeout=IMPORT_TIMEOUT_S)
    return {
        "samples": samples,
        **{f"{name}_ms": round(statistics.median(t) * 1e3, 1) for name, t in times.items()},
    }


def thread_hop(samples: int) -> dict[str, Any]:
    """What a sync handler's worker-thread hop costs, alone: ``run_in_executor`` of a
    no-op on uvloop with a pool like the supervisor's (64 threads), one at a time
    and 32 at once, against awaiting an async no-op."""
    import uvloop

    def noop(n: int) -> int:
        return n

    async def anoop(n: int) -> int:
        return n

    async def measure() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(64, "hop") as pool:
            hop: list[int] = []
            direct: list[int] = []
            for n in range(samples):
                started = time.perf_counter_ns()
                await loop.run_in_executor(pool, noop, n)
                hop.append(time.perf_counter_ns() - started)
                started = time.perf_counter_ns()
                await anoop(n)
                direct.append(time.perf_counter_ns() - started)
            rounds = max(1, samples // 32)
            cpu0, began = time.process_time(), time.perf_counter()
            for _ in range(rounds):
                await asyncio.gather(*(loop.run_in_executor(pool, noop, n) for n in range(32)))
            wall = time.perf_counter() - began
            cpu = time.process_time() - cpu0
        return {
            "samples": samples,
            "hop_p50_us": round(statistics.median(hop) / 1e3, 1),
            "async_p50_us": round(statistics.median(direct) / 1e3, 2),
            "hop_32_wall_us_per_call": round(wall * 1e6 / (rounds * 32), 1),
            "hop_32_cpu_us_per_call": round(cpu * 1e6 / (rounds * 32), 1),
        }

    return uvloop.run(measure())
