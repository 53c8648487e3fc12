"""hostcall side by side with the bare stack and MCP, measured in one run.

    scripts/bench                 # the full run (about four minutes)
    scripts/bench --quick         # seconds: a smoke run, numbers meaningless
    scripts/bench --plot          # also draw docs/bench-throughput.png
    scripts/bench --json out.json --skip mcp,many

Targets, each its own server process, all driven by one load generator
(loadgen.py: aiohttp client, Unix socket, uvloop):

1. ``echo``: a bare aiohttp echo server on a Unix socket (the ceiling);
2. ``hostcall-memory``: ``hostcall run --store memory`` with the load
   generator as its guest (credential from the fd, origin check on, in its
   sandbox as by default);
3. ``hostcall-sqlite``: the same on the durable SQLite store;
   both with an async no-op tool, and again with a sync one (``-sync``);
4. ``mcp-stdio``: the MCP python SDK over stdio, same tools (its own client;
   skipped when ``mcp`` is not installed).

Every load generator writes its results to its stdout; a guest's reaches us
through ``hostcall run``'s. The supervisor's CPU is sampled from here (a
sandboxed guest cannot see it) and read off at each point's window.

The targets are measured in two alternating rounds; each point keeps its
better round, so a burst of other load on the machine costs one round, not
the comparison. The sandbox's cost to calls/s is measured apart, in pairs:
the same guest at 1 and 32 in flight under ``hostcall run`` and ``hostcall
run --no-sandbox`` one right after the other (each pair in the other order
than the one before), the ratio taken within each pair and its median
reported; the unsandboxed runs' best points are the ``-nosandbox`` targets.
The ``busy`` part runs echo, memory and SQLite at 1 and 32 in flight idle
and then with a process spinning on a core (``--burners N``), back to back:
what a busy machine does to each one's server CPU per call. The run also
reports the steal share of ``/proc/stat``: time the hypervisor gave to
other guests, a busy host that no process here shows.
Plus: many guests on one supervisor (sandboxed, and not),
guest launch overhead (sandboxed, and not), fsync cost, ``guest_client``
import time, and what ``guest_client`` costs a call against a raw client
(``client_cost.py``). Prints the tables and the checks of issues 8 and 12, writes
JSON to ``bench-results/bench-<time>.json`` (and ``--json``).
``hotspots.py`` beside this file profiles the supervisor at one point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import loadgen
import report
import system
from server_cpu import CpuTrace, process_cpu

HERE: Final = Path(__file__).resolve().parent
ROOT: Final = HERE.parents[1]
PLAN: Final = HERE / "plan.toml"
LOADGEN: Final = HERE / "loadgen.py"
RESULTS_DIR: Final = ROOT / "bench-results"
DEFAULT_PLOT: Final = ROOT / "docs" / "bench-throughput.png"
#: Added to every child's own expected run time before it is killed.
CHILD_SLACK_S: Final = 120.0
#: Bound on a server process getting ready or going away.
SERVER_START_S: Final = 30.0
SERVER_STOP_S: Final = 10.0
#: ``nosandbox``: every measurement of guests without their sandbox (the pairs too).
PARTS: Final = (
    "echo", "hostcall", "nosandbox", "mcp", "launch", "many", "import", "wasm", "busy", "client"
)  # fmt: skip
#: The ``busy`` part's targets, each run idle and then with a core burnt.
BUSY_TARGETS: Final = ("echo", "hostcall-memory", "hostcall-sqlite")
#: The WebAssembly guest of the ``wasm`` part (its ``bench`` mode), built with ziglang.
AGENT_C: Final = ROOT / "examples" / "guests" / "wasm" / "agent.c"
#: The guest of the ``client`` part: guest_client against a raw client.
CLIENT_COST: Final = HERE / "client_cost.py"
STORES: Final = ("memory", "sqlite")


@dataclass(frozen=True, slots=True)
class Settings:
    """How long and how much to measure."""

    inflight: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    #: The sandbox on against off: pairs of runs, calls in flight, seconds per point.
    pairs: int = 3
    #: Idle/busy pairs of the ``busy`` part (the same calls in flight as the sandbox pairs).
    busy_pairs: int = 2
    #: Processes that each spin on a core in the ``busy`` part's busy runs.
    burners: int = 1
    pair_inflight: tuple[int, ...] = (1, 32)
    pair_duration_s: float = 2.0
    warmup_s: float = 0.5
    duration_s: float = 2.0
    guests: int = 200
    single_inflight: int = 32
    many_warmup_s: float = 1.0
    many_duration_s: float = 3.0
    launch_runs: int = 60
    launch_warm: int = 3
    import_samples: int = 20
    fsync_samples: int = 200
    hop_samples: int = 2000
    rounds: int = 2
    #: The ``client`` part: rounds of the three clients in turn, seconds each.
    client_rounds: int = 5
    client_duration_s: float = 1.0

    @classmethod
    def quick(cls) -> Settings:
        return cls(
            inflight=(1, 32),
            warmup_s=0.05,
            duration_s=0.25,
            guests=3,
            single_inflight=3,
            many_warmup_s=0.1,
            many_duration_s=0.3,
            launch_runs=2,
            launch_warm=1,
            import_samples=2,
            fsync_samples=20,
            hop_samples=64,
            rounds=1,
            pairs=1,
            busy_pairs=1,
            pair_duration_s=0.25,
            client_rounds=1,
            client_duration_s=0.2,
        )

    def point_budget(self, points: int) -> float:
        return points * (self.warmup_s + self.duration_s) + CHILD_SLACK_S


def _say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


class ChildFailed(RuntimeError):
    """A benchmark process exited non-zero or timed out."""


def _child_json(name: str, argv: list[str], timeout_s: float, *, server: bool = False) -> Any:
    """Run one benchmark process (python ``argv``) and read the JSON it printed last.

    ``server``: the process is the server (``hostcall run``) and its stdout
    the load generator's; its CPU is sampled meanwhile, and each point gets
    its server CPU per call from that trace.
    """
    child = subprocess.Popen(
        [sys.executable, *argv],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with CpuTrace(process_cpu(child.pid)) if server else contextlib.nullcontext() as trace:
        try:
            stdout, stderr = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            child.kill()
            child.communicate(timeout=SERVER_STOP_S)
            raise ChildFailed(f"{name} ran over {timeout_s:.0f} s") from exc
    if child.returncode != 0:
        tail = (stderr or stdout).strip().splitlines()[-12:]
        raise ChildFailed(f"exit {child.returncode}: " + " / ".join(tail))
    try:
        result = loadgen.last_json(stdout)
    except ValueError as exc:
        raise ChildFailed(f"{name}: no results on stdout ({exc}): {stdout[-500:]!r}") from exc
    if trace is not None:
        trace.fill(result["points"])
    return result


def _host_json(name: str, argv: list[str], out: Path, timeout_s: float) -> Any:
    """Run ``host.py`` (python ``argv``) and read the JSON it wrote to ``out``."""
    try:
        done = subprocess.run(
            [sys.executable, *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ChildFailed(f"{name} ran over {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        raise ChildFailed(f"exit {done.returncode}: " + " / ".join(tail))
    return json.loads(out.read_text())


def _load_args(
    settings: Settings, tools: str, inflight: tuple[int, ...] | None = None
) -> list[str]:
    return loadgen.point_args(
        tools, inflight or settings.inflight, settings.warmup_s, settings.duration_s
    )


def _points(result: dict[str, Any], tool: str) -> list[dict[str, Any]]:
    return [p for p in result["points"] if p["tool"] == tool]


def hostcall_run_argv(
    state_dir: Path,
    store: str,
    guest: list[str],
    *,
    sandbox: bool = True,
    wasm: Path | None = None,
) -> list[str]:
    """``python -m supervisor.cli run`` (arguments after the interpreter) under
    the benchmark plan, with ``guest`` as its guest (``wasm``: the module, and
    ``guest`` its arguments)."""
    return [
        "-m",
        "supervisor.cli",
        "run",
        "--state-dir",
        str(state_dir),
        "--store",
        store,
        "--plan",
        str(PLAN),
        *([] if sandbox else ["--no-sandbox"]),
        *([] if wasm is None else ["--wasm", str(wasm)]),
        "--",
        *guest,
    ]


def _host(name: str, mode: str, work: Path, timeout_s: float, *options: str) -> dict[str, Any]:
    """``host.py MODE`` on the SQLite store: its JSON."""
    out = work / f"{name}.json"
    argv = [str(HERE / "host.py"), mode, "--state-dir", str(work / f"state-{name}")]
    result: dict[str, Any] = _host_json(
        name, [*argv, "--store", "sqlite", *options, "--out", str(out)], out, timeout_s
    )
    return result


def bench_echo(
    work: Path, settings: Settings, inflight: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """The bare aiohttp echo server in its own process, the load generator in another."""
    inflight = inflight or settings.inflight
    socket_path = work / "echo.sock"
    ready_read, ready_write = os.pipe()
    server = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "echo_server.py"),
            "--socket",
            str(socket_path),
            "--ready-fd",
            str(ready_write),
        ],
        pass_fds=(ready_write,),
        cwd=ROOT,
    )
    os.close(ready_write)
    try:
        readable, _, _ = select.select([ready_read], [], [], SERVER_START_S)
        if not readable or not os.read(ready_read, 1):
            raise ChildFailed("the echo server did not start")
        result = _child_json(
            "the echo load",
            [
                str(LOADGEN),
                "--target",
                "echo",
                "--socket",
                str(socket_path),
                "--server-pid",
                str(server.pid),
                *_load_args(settings, "noop", inflight),
            ],
            settings.point_budget(len(inflight)),
        )
        return {"status": "ok", "points": _points(result, "noop")}
    finally:
        os.close(ready_read)
        server.terminate()
        try:
            server.wait(SERVER_STOP_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(SERVER_STOP_S)


def bench_hostcall(work: Path, settings: Settings, store: str) -> dict[str, dict[str, Any]]:
    """``hostcall run --store STORE`` (sandboxed) with the load generator as its guest."""
    guest = [sys.executable, str(LOADGEN), *_load_args(settings, "noop,noop_sync")]
    result = _child_json(
        f"hostcall run --store {store}",
        hostcall_run_argv(work / f"state-{store}", store, guest),
        settings.point_budget(2 * len(settings.inflight)),
        server=True,
    )
    sandboxed = _in_own_pid_namespace(result)
    return {
        f"hostcall-{store}": {
            "status": "ok",
            "sandboxed": sandboxed,
            "points": _points(result, "noop"),
        },
        f"hostcall-{store}-sync": {
            "status": "ok",
            "sandboxed": sandboxed,
            "points": _points(result, "noop_sync"),
        },
    }


#: A burner: spins until its parent (this benchmark) is gone or its time is up,
#: so that none outlives a benchmark that was killed.
_BURNER: Final = (
    "import os, sys, time\n"
    "parent, end = os.getppid(), time.monotonic() + float(sys.argv[1])\n"
    "while os.getppid() == parent and time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def burning(cores: int, limit_s: float) -> Iterator[Callable[[], float]]:
    """``cores`` processes that each spin on a core, for at most ``limit_s``:
    a busy machine. Yields a reader of the CPU seconds they have used (to
    show they did burn; a burner already gone counts what it had)."""
    burners: list[subprocess.Popen[bytes]] = []
    used: dict[int, float] = {}

    def read() -> float:
        for burner in burners:
            with contextlib.suppress(Exception):  # psutil's errors once it is gone
                used[burner.pid] = process_cpu(burner.pid)()
        return sum(used.values())

    try:
        for _ in range(cores):
            burners.append(
                subprocess.Popen(
                    [sys.executable, "-c", _BURNER, str(limit_s)], stdin=subprocess.DEVNULL
                )
            )
        yield read
    finally:
        for burner in burners:
            burner.kill()
        for burner in burners:
            with contextlib.suppress(subprocess.TimeoutExpired):
                burner.wait(SERVER_STOP_S)


def bench_busy(work: Path, settings: Settings) -> dict[str, Any]:
    """The same targets on an idle machine and then with one core burnt by
    another process, back to back, ``settings.busy_pairs`` times: what a busy
    host does to calls/s, latency and — the point of it — server CPU per call.
    """
    inflight = settings.pair_inflight
    budget = settings.point_budget(len(inflight))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        target: {"idle": [], "busy": []} for target in BUSY_TARGETS
    }
    burnt: list[float] = []

    def measure(target: str, scratch: Path) -> dict[str, Any]:
        if target == "echo":
            return bench_echo(scratch, settings, inflight)
        store = target.removeprefix("hostcall-")
        guest = [sys.executable, str(LOADGEN), *_load_args(settings, "noop", inflight)]
        result = _child_json(
            f"hostcall run --store {store}",
            hostcall_run_argv(scratch / f"state-{store}", store, guest),
            budget,
            server=True,
        )
        return {"status": "ok", "points": _points(result, "noop")}

    for pair in range(settings.busy_pairs):
        for target in BUSY_TARGETS:
            for side in ("idle", "busy"):
                scratch = work / f"busy-{pair}-{target}-{side}"
                scratch.mkdir()
                if side == "idle":
                    runs[target][side].append(measure(target, scratch))
                    continue
                began = time.monotonic()
                with burning(settings.burners, budget) as used:
                    runs[target][side].append(measure(target, scratch))
                    burnt.append(used() / (time.monotonic() - began))
    found: dict[str, Any] = {
        "status": "ok",
        "pairs": settings.busy_pairs,
        "burners": settings.burners,
        "burner_cores_used": round(statistics.median(burnt), 2),
        "inflight": list(inflight),
    }
    for target in BUSY_TARGETS:
        found[target] = {
            side: best_of([{"t": run} for run in runs[target][side]])["t"]
            for side in ("idle", "busy")
        }
        # The check: busy ÷ idle server CPU per call within each pair, median.
        found[target]["cpu_ratio_median"] = {
            str(n): _median_ratio(runs[target]["busy"], runs[target]["idle"], n) for n in inflight
        }
    return found


def _median_ratio(
    above: list[dict[str, Any]], below: list[dict[str, Any]], inflight: int
) -> float | None:
    """Median over the pairs of ``above`` ÷ ``below`` server CPU per call at ``inflight``."""
    ratios = []
    for one, other in zip(above, below, strict=True):
        a = next(p for p in one["points"] if p["inflight"] == inflight)["server_cpu_us_per_call"]
        b = next(p for p in other["points"] if p["inflight"] == inflight)["server_cpu_us_per_call"]
        if a is not None and b:
            ratios.append(a / b)
    return round(statistics.median(ratios), 3) if ratios else None


def _in_own_pid_namespace(result: dict[str, Any]) -> bool:
    """Whether the load generator ran in a pid namespace other than ours (its sandbox's)."""
    return bool(result["pid_namespace"] != os.stat("/proc/self/ns/pid").st_ino)


def bench_pairs(work: Path, settings: Settings) -> dict[str, Any]:
    """The sandbox's cost to calls/s: ``hostcall run`` with the sandbox and
    without, one right after the other, on both stores; the ratio within each pair.

    Two runs seconds apart see the same machine; runs half a minute apart on a
    shared machine may not. Each pair runs in the other order than the one
    before, so a slow drift favours neither side.
    """
    inflight = settings.pair_inflight
    guest_args = loadgen.point_args("noop", inflight, settings.warmup_s, settings.pair_duration_s)
    budget = len(inflight) * (settings.warmup_s + settings.pair_duration_s) + CHILD_SLACK_S
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        store: {"on": [], "off": []} for store in STORES
    }
    for pair in range(settings.pairs):
        for store in STORES:
            for sandbox in (True, False) if pair % 2 == 0 else (False, True):
                side = "on" if sandbox else "off"
                result = _child_json(
                    f"hostcall run{'' if sandbox else ' --no-sandbox'} --store {store}",
                    hostcall_run_argv(
                        work / f"state-pair{pair}-{store}-{side}",
                        store,
                        [sys.executable, str(LOADGEN), *guest_args],
                        sandbox=sandbox,
                    ),
                    budget,
                    server=True,
                )
                if _in_own_pid_namespace(result) is not sandbox:
                    raise ChildFailed(f"the guest's sandbox was not {side} as asked")
                runs[store][side].append(
                    {"status": "ok", "sandboxed": sandbox, "points": _points(result, "noop")}
                )
    found: dict[str, Any] = {"pairs": settings.pairs, "inflight": list(inflight)}
    for store in STORES:
        found[store] = {str(n): _pair_summary(runs[store], n) for n in inflight}
        found[store]["off_best"] = best_of([{"t": run} for run in runs[store]["off"]])["t"]
    return found


def _pair_summary(runs: dict[str, list[dict[str, Any]]], inflight: int) -> dict[str, Any]:
    """One store at one number in flight: each side's figures per pair, and the
    median of the within-pair ratios (on ÷ off)."""

    def at(run: dict[str, Any]) -> dict[str, Any]:
        return next(p for p in run["points"] if p["inflight"] == inflight)

    on, off = [at(r) for r in runs["on"]], [at(r) for r in runs["off"]]
    ratios = [a["calls_per_s"] / b["calls_per_s"] for a, b in zip(on, off, strict=True)]
    cpu = [
        a["server_cpu_us_per_call"] - b["server_cpu_us_per_call"]
        for a, b in zip(on, off, strict=True)
        if a["server_cpu_us_per_call"] is not None and b["server_cpu_us_per_call"] is not None
    ]
    return {
        "on_calls_per_s": [p["calls_per_s"] for p in on],
        "off_calls_per_s": [p["calls_per_s"] for p in off],
        "on_p50_us": [p["p50_us"] for p in on],
        "off_p50_us": [p["p50_us"] for p in off],
        "on_server_cpu_us_per_call": [p["server_cpu_us_per_call"] for p in on],
        "off_server_cpu_us_per_call": [p["server_cpu_us_per_call"] for p in off],
        "errors": sum(p["errors"] for p in on + off),
        "ratios": [round(r, 3) for r in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "server_cpu_diff_median_us": round(statistics.median(cpu), 1) if cpu else None,
    }


def bench_mcp(work: Path, settings: Settings) -> dict[str, Any]:
    """The MCP SDK's stdio client against its stdio server (skipped if not installed)."""
    if importlib.util.find_spec("mcp") is None:
        return {
            "status": "skipped",
            "reason": "the mcp package is not installed (pip install -e '.[bench]')",
        }
    result = _child_json(
        "the MCP client",
        [str(HERE / "mcp_client.py"), *_load_args(settings, "noop")],
        settings.point_budget(len(settings.inflight)),
    )
    return {"status": "ok", "points": _points(result, "noop")}


def bench_launch(work: Path, settings: Settings) -> dict[str, Any]:
    """Guest launch overhead on the default (SQLite) store, sandboxed and not."""
    return _host(
        "launch",
        "launch",
        work,
        CHILD_SLACK_S,
        "--runs",
        str(settings.launch_runs),
        "--warm",
        str(settings.launch_warm),
    )


def bench_many(work: Path, settings: Settings, sandbox: bool = True) -> dict[str, Any]:
    """Many guests on one supervisor (SQLite store) against one guest."""
    return _host(
        "many" if sandbox else "many-nosandbox",
        "many",
        work,
        2 * (settings.many_warmup_s + settings.many_duration_s) + 3 * CHILD_SLACK_S,
        *([] if sandbox else ["--no-sandbox"]),
        "--guests",
        str(settings.guests),
        "--single-inflight",
        str(settings.single_inflight),
        "--warmup",
        str(settings.many_warmup_s),
        "--duration",
        str(settings.many_duration_s),
    )


def bench_wasm(work: Path, settings: Settings) -> dict[str, Any]:
    """WebAssembly guests' calls against a native guest's, one at a time, on
    each store, alternating for ``settings.rounds`` rounds (each side's best kept).

    ``native`` is the load generator (Python, keep-alive HTTP/1.1 over the
    socket, sandboxed); ``wasm`` is C (``agent.c bench``, a module, its i32
    imports); ``wasm_python`` is Python on CPython for WASI (``app.py bench``,
    a component). All at 1 in flight: a WebAssembly guest has one thread.
    """
    from supervisor.wasm_build import build_c, build_python

    guests = {
        "wasm": build_c(AGENT_C, work / "wasm"),
        "wasm_python": build_python(AGENT_C.parent / "python", work / "wasm"),
    }
    found: dict[str, Any] = {"status": "ok", "guests": {
        "native": "scripts/benchmarks/loadgen.py",
        "wasm": "examples/guests/wasm/agent.c",
        "wasm_python": "examples/guests/wasm/python/app.py",
    }}  # fmt: skip
    budget = settings.warmup_s + settings.duration_s + CHILD_SLACK_S
    fields = ("calls_per_s", "p50_us", "p99_us")
    for store in STORES:
        runs: dict[str, list[dict[str, Any]]] = {"native": [], **{name: [] for name in guests}}
        for number in range(settings.rounds):
            state = work / f"state-wasm-{store}-{number}"
            native = _child_json(
                f"native guest, {store}",
                hostcall_run_argv(
                    state,
                    store,
                    [sys.executable, str(LOADGEN), *_load_args(settings, "noop", (1,))],
                ),
                budget,
            )
            runs["native"].append(_points(native, "noop")[0])
            for name, module in guests.items():
                guest = ["bench", "noop", str(settings.duration_s), str(settings.warmup_s)]
                measured = _child_json(
                    f"{name} guest, {store}",
                    hostcall_run_argv(state, store, guest, wasm=module),
                    budget + CHILD_SLACK_S,  # a component's first compile takes ~8 s
                )
                measured["calls_per_s"] = round(measured["calls"] / measured["seconds"], 1)
                runs[name].append(measured)
        best = {
            name: max(found_runs, key=lambda point: point["calls_per_s"])
            for name, found_runs in runs.items()
        }
        found[store] = {
            name: {k: round(point[k], 1) for k in fields} for name, point in best.items()
        }
        for name in guests:
            found[store][f"{name}_calls_per_s_ratio"] = round(
                best[name]["calls_per_s"] / best["native"]["calls_per_s"], 3
            )
            found[store][f"{name}_p50_ratio"] = round(
                best[name]["p50_us"] / best["native"]["p50_us"], 3
            )
    return found


def bench_client(work: Path, settings: Settings) -> dict[str, Any]:
    """What the guest client costs a call, against a raw client on the same
    socket (``client_cost.py``): one sandboxed guest on the memory store, one
    call at a time, the clients in turn each round. Each figure is the
    median over the rounds, and each ratio the median of the rounds' own
    ratios to the raw client."""
    argv = [
        sys.executable,
        str(CLIENT_COST),
        "--rounds",
        str(settings.client_rounds),
        "--duration",
        str(settings.client_duration_s),
    ]
    budget = 3 * settings.client_rounds * settings.client_duration_s + CHILD_SLACK_S
    guest = hostcall_run_argv(work / "state-client", "memory", argv)
    measured = _child_json("guest client", guest, budget, server=True)
    rounds: dict[str, list[dict[str, Any]]] = {}
    for found in measured["points"]:
        rounds.setdefault(found["client"], []).append(found)
    fields = ("calls_per_s", "p50_us", "p99_us", "client_cpu_us_per_call", "server_cpu_us_per_call")
    result: dict[str, Any] = {"status": "ok", "store": "memory", "rounds": settings.client_rounds}
    for client, points in rounds.items():
        result[client] = {
            key: round(statistics.median(p[key] for p in points), 1) for key in fields
        }
    for client in ("sync", "async"):
        for key in ("p50_us", "client_cpu_us_per_call", "server_cpu_us_per_call"):
            result[client][f"{key}_vs_raw"] = round(
                statistics.median(
                    p[key] / raw[key] for p, raw in zip(rounds[client], rounds["raw"], strict=True)
                ),
                3,
            )
    return result


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per target and point, the round with the most calls/s (its latencies with it).

    A target that failed or was skipped in any round is reported as such.
    """
    merged: dict[str, Any] = {}
    for target in rounds[0]:
        entries = [found[target] for found in rounds]
        bad = next((e for e in entries if e.get("status") != "ok"), None)
        if bad is not None:
            merged[target] = bad
            continue
        best: dict[int, dict[str, Any]] = {}
        for number, entry in enumerate(entries, start=1):
            for measured in entry["points"]:
                kept = best.get(measured["inflight"])
                if kept is None or measured["calls_per_s"] > kept["calls_per_s"]:
                    best[measured["inflight"]] = {**measured, "round": number}
        merged[target] = {
            **{k: v for k, v in entries[0].items() if k != "points"},
            "points": [best[n] for n in sorted(best)],
        }
    return merged


def run(settings: Settings, work: Path, skip: set[str]) -> tuple[dict[str, Any], bool]:
    """Measure everything not in ``skip``; returns the results and whether all ran."""
    started = datetime.datetime.now(datetime.UTC)
    results: dict[str, Any] = {
        "schema": "hostcall-bench/2",
        "started_at": started.isoformat(timespec="seconds"),
        "settings": asdict(settings),
        "machine": system.machine(),
        "code": system.code_version(),
        "targets": {},
    }
    ok = True
    ticks = system.cpu_ticks()
    _say(f"fsync cost on {work}")
    results["fsync"] = system.fsync_cost(work / "fsync", settings.fsync_samples)

    def attempt(name: str, measure: Any, *args: Any) -> Any:
        nonlocal ok
        _say(f"measuring {name}")
        began = time.perf_counter()
        try:
            return measure(*args)
        except (ChildFailed, OSError, ValueError, KeyError) as exc:
            ok = False
            _say(f"{name} failed: {exc}")
            return {"status": "failed", "reason": str(exc)[:2000]}
        finally:
            _say(f"{name}: {time.perf_counter() - began:.1f} s")

    rounds: list[dict[str, Any]] = []
    for number in range(settings.rounds):
        found: dict[str, Any] = {}
        scratch = work / f"round-{number + 1}"
        scratch.mkdir()
        label = f" (round {number + 1} of {settings.rounds})" if settings.rounds > 1 else ""
        if "echo" not in skip:
            found["echo"] = attempt("echo" + label, bench_echo, scratch, settings)
        if "hostcall" not in skip:
            for store in STORES:
                measured = attempt(
                    f"hostcall {store}{label}", bench_hostcall, scratch, settings, store
                )
                if measured.get("status") == "failed":
                    measured = {f"hostcall-{store}": measured, f"hostcall-{store}-sync": measured}
                found.update(measured)
        if "mcp" in skip:
            found["mcp-stdio"] = {"status": "skipped", "reason": "--skip mcp"}
        else:
            found["mcp-stdio"] = attempt("mcp" + label, bench_mcp, scratch, settings)
        rounds.append(found)
    targets = results["targets"] = best_of(rounds)
    if settings.rounds > 1:
        results["rounds"] = rounds
    if "hostcall" not in skip and "nosandbox" not in skip:
        scratch = work / "pairs"
        scratch.mkdir()
        pairs = results["sandbox_pairs"] = attempt(
            f"the sandbox on and off, {settings.pairs} pair(s)", bench_pairs, scratch, settings
        )
        for store in STORES:
            targets[f"hostcall-{store}-nosandbox"] = (
                pairs[store]["off_best"] if pairs.get("status") != "failed" else pairs
            )
            for inflight in settings.pair_inflight if pairs.get("status") != "failed" else ():
                if pairs[store][str(inflight)]["errors"]:
                    ok = False
                    _say(f"sandbox pairs, {store} at {inflight}: bad answers")
    if "launch" not in skip:
        results["launch"] = attempt("launch overhead", bench_launch, work, settings)
    if "many" not in skip:
        results["many_guests"] = attempt(
            f"{settings.guests} sandboxed guests", bench_many, work, settings
        )
        if "nosandbox" not in skip:
            results["many_guests_nosandbox"] = attempt(
                f"{settings.guests} guests without the sandbox", bench_many, work, settings, False
            )
    if "import" not in skip:
        results["import_time"] = attempt(
            "guest_client import", system.import_time, settings.import_samples
        )
        results["cli_start"] = attempt(
            "hostcall CLI start", system.cli_start, settings.import_samples, work
        )
    if "wasm" not in skip:
        results["wasm"] = attempt(
            "a WebAssembly guest against a native one", bench_wasm, work, settings
        )
    if "busy" not in skip:
        scratch = work / "busy"
        scratch.mkdir()
        results["busy"] = attempt(
            f"idle against one core burnt, {settings.busy_pairs} pair(s)",
            bench_busy,
            scratch,
            settings,
        )
    if "client" not in skip:
        results["client"] = attempt(
            "guest_client against a raw client", bench_client, work, settings
        )
    results["thread_hop"] = attempt("thread hop", system.thread_hop, settings.hop_samples)
    for target, entry in targets.items():
        for found in entry.get("points", []):
            if found["errors"]:
                ok = False
                _say(f"{target} at {found['inflight']}: {found['errors']} bad answers")
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["machine"]["steal_share"] = system.steal_share(ticks, system.cpu_ticks())
    results["finished_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results["checks"] = report.checks_json(report.checks(results))
    return results, ok


def summary(results: dict[str, Any]) -> str:
    """The human-readable report of one run."""
    machine = results["machine"]
    code = results.get("code", {})
    lines = [
        f"hostcall benchmark {results['started_at']}: {machine['cpu']}, {machine['cores']} cores, "
        f"Linux {machine['kernel']}, Python {machine['python']}, "
        f"load {machine['loadavg_start']} -> {machine.get('loadavg_end')}, "
        f"steal {machine.get('steal_share')} of the CPU time (a busy host)",
        f"code: {code.get('commit')} {code.get('subject')!r}"
        + (" + uncommitted changes" if code.get("uncommitted_changes") else ""),
        "",
        report.table(results),
        "",
        "calls/s (p99 ms) at each number of calls in flight:",
        "",
        report.sweep_table(results),
        "",
        report.checks_table(report.checks(results)),
        "",
        report.pairs_table(results),
        "",
        report.busy_table(results),
        "",
    ]
    fsync = results.get("fsync", {})
    lines.append(f"fsync p50 {fsync.get('p50_us')} µs, p90 {fsync.get('p90_us')} µs")
    launch = results.get("launch") or {}
    if launch.get("status") != "failed" and launch:
        lines.append(
            f"launch /bin/true: bare {launch['bare_p50_ms']} ms p50 (create_subprocess_exec on "
            f"uvloop; subprocess.run: {launch['bare_subprocess_run_p50_ms']} ms); through hostcall:"
        )
        for mode, label in (
            ("sandbox", "sandboxed, launch folder as overlay workdir"),
            ("sandbox_fresh_workdir", "sandboxed, fresh workdir"),
            ("no_sandbox", "no sandbox"),
        ):
            found = launch[mode]
            lines.append(
                f"  {label}: {found['hostcall_p50_ms']} ms (p90 {found['hostcall_p90_ms']}; "
                f"output not captured: {found['hostcall_no_capture_p50_ms']} ms); "
                f"overhead {found['overhead_p50_ms']} ms"
            )
    for key, label in (("many_guests", "sandboxed"), ("many_guests_nosandbox", "unsandboxed")):
        many = results.get(key) or {}
        if many.get("status") == "failed" or not many:
            continue
        crowd = many["many"]
        lines.append(
            f"{many['guests']} {label} guests: {crowd['calls_per_s']} calls/s aggregate vs "
            f"{many['single']['calls_per_s']} for one guest at {many['single']['inflight']} in "
            f"flight; supervisor peak RSS {crowd['supervisor_peak_rss_mb']} MB, "
            f"{crowd['server_cpu_us_per_call']} µs CPU/call; its event loop late by up to "
            f"{crowd['supervisor_loop_lag'].get('max_ms')} ms; guests failed "
            f"{crowd['guests_failed']}, with errors {crowd['guests_with_errors']}"
            + (
                f" (first: {crowd['first_failure'] or crowd['first_error']})"
                if crowd["guests_failed"] or crowd["guests_with_errors"]
                else ""
            )
        )
    wasm = results.get("wasm") or {}
    if wasm.get("status") == "ok":
        for store in STORES:
            found = wasm[store]
            native = found["native"]
            for name, label in (("wasm", "C module"), ("wasm_python", "Python component")):
                lines.append(
                    f"WebAssembly {label} (imports) vs native Python guest (socket), 1 in "
                    f"flight, {store}: {found[name]['calls_per_s']} vs "
                    f"{native['calls_per_s']} calls/s (× {found[name + '_calls_per_s_ratio']}), "
                    f"p50 {found[name]['p50_us']} vs {native['p50_us']} µs "
                    f"(× {found[name + '_p50_ratio']})"
                )
    client = results.get("client") or {}
    if client.get("status") == "ok":
        raw = client["raw"]
        lines.append(
            f"raw client, one call at a time ({client['store']} store, sandboxed): p50 "
            f"{raw['p50_us']} µs, guest CPU {raw['client_cpu_us_per_call']} µs/call, "
            f"server CPU {raw['server_cpu_us_per_call']} µs/call"
        )
        for name, label in (("sync", "HostClient"), ("async", "AsyncHostClient")):
            found = client[name]
            lines.append(
                f"  guest_client {label}: p50 {found['p50_us']} µs (× {found['p50_us_vs_raw']}), "
                f"guest CPU {found['client_cpu_us_per_call']} µs/call "
                f"(× {found['client_cpu_us_per_call_vs_raw']}), server CPU "
                f"{found['server_cpu_us_per_call']} µs/call "
                f"(× {found['server_cpu_us_per_call_vs_raw']})"
            )
    hop = results.get("thread_hop") or {}
    if hop.get("status") != "failed" and hop:
        lines.append(
            f"worker-thread hop alone (run_in_executor of a no-op, uvloop, 64 threads): "
            f"p50 {hop['hop_p50_us']} µs one at a time (async no-op {hop['async_p50_us']} µs); "
            f"32 at once {hop['hop_32_wall_us_per_call']} µs wall and "
            f"{hop['hop_32_cpu_us_per_call']} µs CPU per call"
        )
    imported = results.get("import_time") or {}
    if imported.get("status") != "failed" and imported:
        lines.append(
            f"import guest_client: {imported['wall_ms']} ms wall over a bare interpreter "
            f"(-X importtime: {imported['importtime_ms']} ms)"
        )
    start = results.get("cli_start") or {}
    if start.get("status") != "failed" and start:
        lines.append(
            f"hostcall --help: {start['help_ms']} ms, hostcall approvals list (a running "
            f"supervisor): {start['approvals_list_ms']} ms; python -c pass "
            f"{start['python_pass_ms']} ms, import supervisor.supervisor "
            f"{start['import_supervisor_ms']} ms (whole processes, medians)"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--quick", action="store_true", help="tiny durations: a smoke run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--plot",
        nargs="?",
        type=Path,
        const=DEFAULT_PLOT,
        help=f"draw calls/s and p99 against calls in flight (default {DEFAULT_PLOT})",
    )
    parser.add_argument("--skip", default="", help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--duration", type=float, help="seconds measured per point")
    parser.add_argument("--guests", type=int, help="guests in the many-guests run")
    parser.add_argument(
        "--burners",
        type=int,
        help="processes spinning on a core each in the busy part's busy runs (default 1)",
    )
    parser.add_argument(
        "--pairs", type=int, help="pairs of runs with the sandbox on and off (default 3)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="measure the targets N times, alternating, and keep each point's best round "
        "(default 2; --quick: 1)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="parent of the scratch folder (state dirs, sockets); its file system is the "
        "one whose fsync is measured (default: the system's temp folder)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=RESULTS_DIR,
        help=f"where bench-<time>.json goes (default {RESULTS_DIR})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit 1 if a part failed to run (a missed target is not a failure)."""
    args = _parser().parse_args(argv)
    settings = Settings.quick() if args.quick else Settings()
    overrides: dict[str, Any] = {}
    if args.duration is not None:
        overrides["duration_s"] = overrides["pair_duration_s"] = args.duration
    if args.guests is not None:
        overrides["guests"] = args.guests
    if args.rounds is not None:
        overrides["rounds"] = args.rounds
    if args.burners is not None:
        overrides["burners"] = args.burners
    if args.pairs is not None:
        overrides["pairs"] = args.pairs
    if overrides:
        settings = dataclasses.replace(settings, **overrides)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    unknown = skip - set(PARTS)
    if unknown:
        print(f"bench: unknown part(s) {sorted(unknown)}; parts are {PARTS}", file=sys.stderr)
        return 2
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hostcall-bench-", dir=args.work_dir))
    try:
        results, ok = run(settings, work, skip)
    finally:
        if args.keep:
            _say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["quick"] = args.quick
    print(summary(results))
    started = datetime.datetime.fromisoformat(results["started_at"])
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    paths = [args.results_dir / f"bench-{stamp}.json"]
    if args.json is not None:
        paths.append(args.json)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        _say(f"wrote {path}")
    if args.plot is not None:
        report.plot(results, args.plot)
        _say(f"wrote {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
