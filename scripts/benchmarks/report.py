"""Turning one run's results into the checks of issues 8 and 12, a table and a plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

#: The targets in the order they are shown; the label says what each one is.
#: hostcall's guests run in their sandbox unless the name ends in ``-nosandbox``.
TARGETS: Final = {
    "echo": "bare aiohttp echo (ceiling)",
    "hostcall-memory": "hostcall, memory store",
    "hostcall-memory-nosandbox": "hostcall, memory store, no sandbox",
    "hostcall-sqlite": "hostcall, SQLite store",
    "hostcall-sqlite-nosandbox": "hostcall, SQLite store, no sandbox",
    "hostcall-memory-sync": "hostcall, memory, sync handler",
    "hostcall-sqlite-sync": "hostcall, SQLite, sync handler",
    "mcp-stdio": "MCP python SDK, stdio",
}
#: Limit of every "sandbox on ÷ off" throughput check (issue 12).
SANDBOX_RATIO: Final = 0.95
#: One colour per server; a sync handler is the same colour, dashed; no sandbox, crosses.
_COLOURS: Final = {
    "echo": "tab:blue",
    "hostcall-memory": "tab:orange",
    "hostcall-sqlite": "tab:green",
    "mcp-stdio": "tab:brown",
}
#: The two points the table and the checks use.
TABLE_POINTS: Final = (1, 32)


@dataclass(frozen=True, slots=True)
class Check:
    """One target of issue 8 or 12: a measured value against its limit."""

    name: str
    what: str
    value: float | None
    limit: float | None
    op: str  # ">=" or "<="
    passed: bool | None  # None: could not be measured (a target was skipped)
    note: str = ""

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return "n/a"
        return "PASS" if self.passed else "MISS"


def point(results: dict[str, Any], target: str, inflight: int) -> dict[str, Any] | None:
    """The measured point of ``target`` at ``inflight`` calls in flight, if any."""
    entry = results["targets"].get(target)
    if not entry or entry.get("status") != "ok":
        return None
    for found in entry["points"]:
        if found["inflight"] == inflight:
            return dict(found)
    return None


def _field(results: dict[str, Any], target: str, inflight: int, key: str) -> float | None:
    found = point(results, target, inflight)
    return None if found is None else found.get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _check(
    name: str, what: str, value: float | None, limit: float | None, op: str, note: str = ""
) -> Check:
    if value is None or limit is None:
        passed = None
    else:
        passed = value >= limit if op == ">=" else value <= limit
    return Check(name, what, value, limit, op, passed, note)


def checks(results: dict[str, Any]) -> list[Check]:
    """Every target of issues 8 and 12, plus informational ratios (``limit`` None)."""

    def rate(target: str, inflight: int) -> float | None:
        return _field(results, target, inflight, "calls_per_s")

    def p50(target: str, inflight: int) -> float | None:
        return _field(results, target, inflight, "p50_us")

    fsync = results.get("fsync", {}).get("p50_us")
    added = _diff(p50("hostcall-sqlite", 1), p50("hostcall-memory", 1))
    mcp_note = ""
    if results["targets"].get("mcp-stdio", {}).get("status") != "ok":
        mcp_note = "MCP skipped: " + results["targets"].get("mcp-stdio", {}).get("reason", "")
    many = results.get("many_guests") or {}
    many_off = results.get("many_guests_nosandbox") or {}
    launch = results.get("launch") or {}
    guests = many.get("guests", results.get("settings", {}).get("guests", "?"))
    many_note = (
        f"{many['store']} store; 1 guest at {many['single']['inflight']} in flight, "
        "each of the many at 1"
        if "single" in many
        else "not measured"
    )
    pairs = results.get("sandbox_pairs") or {}
    pairs_note = (
        f"median of {pairs['pairs']} back-to-back pair(s)" if "pairs" in pairs else "not measured"
    )
    launch_note = (
        f"{launch['store']} store, output captured as `hostcall run` does"
        if "store" in launch
        else "not measured"
    )
    found = [
        _check(
            "sqlite32_vs_echo32",
            "32 in flight: SQLite store ÷ bare echo (calls/s)",
            _ratio(rate("hostcall-sqlite", 32), rate("echo", 32)),
            0.5,
            ">=",
        ),
        _check(
            "memory1_vs_echo1",
            "1 in flight: memory store ÷ bare echo (calls/s)",
            _ratio(rate("hostcall-memory", 1), rate("echo", 1)),
            0.6,
            ">=",
        ),
        _check(
            "sqlite1_added_p50_us",
            "1 in flight: p50 SQLite − p50 memory (µs) ≤ 2 fsyncs + 100 µs",
            added,
            None if fsync is None else round(2 * fsync + 100, 1),
            "<=",
            f"fsync p50 {fsync} µs" if fsync is not None else "",
        ),
        _check(
            "sqlite1_vs_mcp1",
            "1 in flight: SQLite store ÷ MCP stdio (calls/s)",
            _ratio(rate("hostcall-sqlite", 1), rate("mcp-stdio", 1)),
            1.0,
            ">=",
            mcp_note,
        ),
        _check(
            "memory1_server_cpu_us",
            "1 in flight, memory store: server CPU per call (µs)",
            _field(results, "hostcall-memory", 1, "server_cpu_us_per_call"),
            100.0,
            "<=",
        ),
        _check(
            "memory1_cpu_vs_echo1",
            "1 in flight: server CPU per call, memory store ÷ bare echo (proposed target)",
            _ratio(
                _field(results, "hostcall-memory", 1, "server_cpu_us_per_call"),
                _field(results, "echo", 1, "server_cpu_us_per_call"),
            ),
            2.5,
            "<=",
            "measures the code, not the hour: docs/benchmarks.md",
        ),
        _check(
            "sqlite32_vs_memory32",
            "32 in flight: SQLite store ÷ memory store (calls/s)",
            _ratio(rate("hostcall-sqlite", 32), rate("hostcall-memory", 32)),
            0.8,
            ">=",
        ),
        _check(
            "many_vs_single",
            f"{guests} sandboxed guests ÷ 1 guest (aggregate calls/s)",
            many.get("ratio"),
            0.8,
            ">=",
            many_note,
        ),
        _check(
            "many_rss_mb",
            f"supervisor peak RSS with {guests} sandboxed guests (MB)",
            many.get("many", {}).get("supervisor_peak_rss_mb"),
            150.0,
            "<=",
        ),
        _check(
            "many_not_ok",
            f"sandboxed guests of {guests} that failed or got a wrong answer",
            many.get("many", {}).get("guests_not_ok"),
            0,
            "<=",
        ),
        _check(
            "cli_help_ms",
            "hostcall --help, whole process (ms)",
            (results.get("cli_start") or {}).get("help_ms"),
            150.0,
            "<=",
        ),
        _check(
            "cli_approvals_list_ms",
            "hostcall approvals list against a running supervisor, whole process (ms)",
            (results.get("cli_start") or {}).get("approvals_list_ms"),
            150.0,
            "<=",
        ),
        _check(
            "launch_overhead_ms",
            "launch overhead, no sandbox: p50 − p50 of bare create_subprocess_exec (ms)",
            launch.get("no_sandbox", {}).get("overhead_p50_ms"),
            5.0,
            "<=",
            launch_note,
        ),
        _check(
            "launch_overhead_sandbox_ms",
            "launch overhead, sandboxed: p50 − p50 of bare create_subprocess_exec (ms)",
            launch.get("sandbox", {}).get("overhead_p50_ms"),
            15.0,
            "<=",
            launch_note + ("; workdir: overlay of the launch folder" if "store" in launch else ""),
        ),
        *(
            _check(
                f"{store}{inflight}_sandbox_vs_off",
                f"{inflight} in flight, {label} store: sandbox on ÷ off (calls/s)",
                _pair(results, store, inflight, "ratio_median"),
                SANDBOX_RATIO,
                ">=",
                pairs_note,
            )
            for store, label in (("memory", "memory"), ("sqlite", "SQLite"))
            for inflight in TABLE_POINTS
        ),
    ]
    busy = [
        _check(
            f"busy_cpu_{store}{inflight}",
            f"one core burnt ÷ idle: server CPU per call, {store} store, {inflight} in flight",
            _busy_cpu(results, f"hostcall-{store}", inflight),
            BUSY_CPU_RATIO,
            "<=",
        )
        for store in ("memory", "sqlite")
        for inflight in TABLE_POINTS
    ]
    info = [
        # Issue 8's, beyond any server here (docs/benchmarks.md): 10 × MCP is
        # more than the bare echo does, 3 × MCP is 0.85 × the echo.
        _check(
            "sqlite32_vs_mcp32",
            "32 in flight: SQLite store ÷ MCP stdio (calls/s; issue 8 asked ≥ 10)",
            _ratio(rate("hostcall-sqlite", 32), rate("mcp-stdio", 32)),
            None,
            ">=",
            mcp_note,
        ),
        _check(
            "memory1_vs_mcp1",
            "1 in flight: memory store ÷ MCP stdio (calls/s; issue 8 asked ≥ 3)",
            _ratio(rate("hostcall-memory", 1), rate("mcp-stdio", 1)),
            None,
            ">=",
            mcp_note,
        ),
        *(
            _check(
                f"busy_cpu_echo{inflight}",
                f"one core burnt ÷ idle: server CPU per call, bare echo, {inflight} in flight",
                _busy_cpu(results, "echo", inflight),
                None,
                "<=",
            )
            for inflight in TABLE_POINTS
        ),
        _check(
            "busy_sqlite32_vs_echo32",
            "one core burnt: SQLite store ÷ bare echo, 32 in flight (calls/s)",
            _ratio(
                _busy(results, "hostcall-sqlite", "busy", 32, "calls_per_s"),
                _busy(results, "echo", "busy", 32, "calls_per_s"),
            ),
            None,
            ">=",
        ),
        _check(
            "busy_sqlite1_added_p50_us",
            "one core burnt: p50 SQLite − p50 memory, 1 in flight (µs)",
            _diff(
                _busy(results, "hostcall-sqlite", "busy", 1, "p50_us"),
                _busy(results, "hostcall-memory", "busy", 1, "p50_us"),
            ),
            None,
            "<=",
        ),
        _check(
            "sync_hop_p50_us",
            "worker-thread hop: p50 sync − p50 async handler, memory, 1 in flight (µs)",
            _diff(p50("hostcall-memory-sync", 1), p50("hostcall-memory", 1)),
            None,
            "<=",
        ),
        _check(
            "sync_hop_cpu_us",
            "worker-thread hop: server CPU/call sync − async, memory, 32 in flight (µs)",
            _diff(
                _field(results, "hostcall-memory-sync", 32, "server_cpu_us_per_call"),
                _field(results, "hostcall-memory", 32, "server_cpu_us_per_call"),
            ),
            None,
            "<=",
        ),
        _check(
            "sync32_vs_async32",
            "32 in flight, memory: sync handler ÷ async handler (calls/s)",
            _ratio(rate("hostcall-memory-sync", 32), rate("hostcall-memory", 32)),
            None,
            ">=",
        ),
        _check(
            "sqlite_sync32_vs_async32",
            "32 in flight, SQLite: sync handler ÷ async handler (calls/s)",
            _ratio(rate("hostcall-sqlite-sync", 32), rate("hostcall-sqlite", 32)),
            None,
            ">=",
        ),
        _check(
            "launch_overhead_sandbox_fresh_ms",
            "launch overhead, sandboxed, fresh workdir (from /): p50 − p50 bare (ms)",
            launch.get("sandbox_fresh_workdir", {}).get("overhead_p50_ms"),
            None,
            "<=",
        ),
        *(
            _check(
                f"{store}{inflight}_server_cpu_sandbox_minus_off",
                f"{inflight} in flight, {store}: server CPU/call, sandbox on − off (µs, "
                "median of the pairs)",
                _pair(results, store, inflight, "server_cpu_diff_median_us"),
                None,
                "<=",
            )
            for store in ("memory", "sqlite")
            for inflight in TABLE_POINTS
        ),
        _check(
            "many_vs_single_nosandbox",
            f"{guests} guests without the sandbox ÷ 1 guest (aggregate calls/s)",
            many_off.get("ratio"),
            None,
            ">=",
        ),
        _check(
            "many_rss_mb_nosandbox",
            f"supervisor peak RSS with {guests} guests without the sandbox (MB)",
            many_off.get("many", {}).get("supervisor_peak_rss_mb"),
            None,
            "<=",
        ),
    ]
    return found + busy + info


def _busy_cpu(results: dict[str, Any], target: str, inflight: int) -> float | None:
    """Busy ÷ idle server CPU per call of ``target``: the median within the pairs."""
    busy = results.get("busy") or {}
    if busy.get("status") != "ok":
        return None
    value: float | None = busy[target].get("cpu_ratio_median", {}).get(str(inflight))
    return value


def _busy(results: dict[str, Any], target: str, side: str, inflight: int, key: str) -> float | None:
    """A figure of the idle/busy pairs (``run.bench_busy``) at one point, if measured."""
    busy = results.get("busy") or {}
    if busy.get("status") != "ok":
        return None
    for found in busy[target][side].get("points", []):
        if found["inflight"] == inflight:
            value: float | None = found.get(key)
            return value
    return None


#: Limit of "server CPU per call, one core burnt ÷ idle" (issue 16).
BUSY_CPU_RATIO: Final = 1.5


def busy_table(results: dict[str, Any]) -> str:
    """Idle against one core burnt, per target and point (Markdown)."""
    busy = results.get("busy") or {}
    if busy.get("status") != "ok":
        return f"idle against busy: {busy.get('status', 'not measured')}"
    rows = [
        f"idle against busy: {busy['burners']} other process(es) spinning, "
        f"{busy['burner_cores_used']} cores used by them; {busy['pairs']} back-to-back "
        "pair(s), the best of each side: idle → busy; CPU busy ÷ idle: the median of the "
        "ratios within the pairs",
        "",
        "| target | in flight | calls/s | p50 µs | server CPU µs/call | CPU busy ÷ idle |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for target in ("echo", "hostcall-memory", "hostcall-sqlite"):
        for inflight in busy["inflight"]:

            def pair(key: str, target: str = target, inflight: int = inflight) -> str:
                idle = _busy(results, target, "idle", inflight, key)
                loaded = _busy(results, target, "busy", inflight, key)
                return f"{_fmt(idle)} → {_fmt(loaded)}"

            ratio = _busy_cpu(results, target, inflight)
            rows.append(
                f"| {TARGETS[target]} | {inflight} | {pair('calls_per_s')} | {pair('p50_us')} "
                f"| {pair('server_cpu_us_per_call')} | {_fmt(ratio, 2)} |"
            )
    return "\n".join(rows)


def _pair(results: dict[str, Any], store: str, inflight: int, key: str) -> float | None:
    """A figure of the sandbox on/off pairs (``run.bench_pairs``), if measured."""
    found = (results.get("sandbox_pairs") or {}).get(store, {}).get(str(inflight))
    return None if found is None else found.get(key)


def pairs_table(results: dict[str, Any]) -> str:
    """The sandbox on and off, pair by pair: calls/s and server CPU/call (Markdown)."""
    pairs = results.get("sandbox_pairs") or {}
    if "pairs" not in pairs:
        return f"sandbox on/off pairs: {pairs.get('status', 'not measured')}"
    rows = [
        "the sandbox on and off, back to back (calls/s on / off = ratio; server CPU µs/call "
        "on / off):",
        "",
        "| store | in flight | "
        + " | ".join(f"pair {i + 1}" for i in range(pairs["pairs"]))
        + " | median ratio |",
        "|---|--:|" + "--:|" * pairs["pairs"] + "--:|",
    ]
    for store in ("memory", "sqlite"):
        for inflight in pairs["inflight"]:
            found = pairs[store][str(inflight)]
            cells = [
                f"{_fmt(on)} / {_fmt(off)} = {ratio:.2f}; {_fmt(con)} / {_fmt(coff)}"
                for on, off, ratio, con, coff in zip(
                    found["on_calls_per_s"],
                    found["off_calls_per_s"],
                    found["ratios"],
                    found["on_server_cpu_us_per_call"],
                    found["off_server_cpu_us_per_call"],
                    strict=True,
                )
            ]
            rows.append(
                f"| {store} | {inflight} | " + " | ".join(cells) + f" | {found['ratio_median']} |"
            )
    return "\n".join(rows)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 1)


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def table(results: dict[str, Any]) -> str:
    """Targets × {1, 32} in flight: calls/s, p50, p99, CPU per call (Markdown)."""
    header = (
        "| target | in flight | calls/s | p50 µs | p99 µs | server CPU µs/call "
        "| client CPU µs/call |\n|---|--:|--:|--:|--:|--:|--:|"
    )
    rows = [header]
    for name, label in TARGETS.items():
        entry = results["targets"].get(name)
        if entry is None:
            continue
        if entry.get("status") != "ok":
            rows.append(f"| {label} | – | {entry.get('status')}: {entry.get('reason', '')} |||||")
            continue
        for inflight in TABLE_POINTS:
            found = point(results, name, inflight)
            if found is None:
                continue
            rows.append(
                f"| {label} | {inflight} | {_fmt(found['calls_per_s'])} "
                f"| {_fmt(found['p50_us'])} | {_fmt(found['p99_us'])} "
                f"| {_fmt(found['server_cpu_us_per_call'])} "
                f"| {_fmt(found['client_cpu_us_per_call'])} |"
            )
    return "\n".join(rows)


def sweep_table(results: dict[str, Any]) -> str:
    """calls/s (p99 ms) of every target at every point measured (Markdown)."""
    inflights = sorted(
        {
            p["inflight"]
            for entry in results["targets"].values()
            if entry.get("status") == "ok"
            for p in entry["points"]
        }
    )
    rows = [
        "| target | " + " | ".join(f"{n} in flight" for n in inflights) + " |",
        "|---|" + "--:|" * len(inflights),
    ]
    for name, label in TARGETS.items():
        if point(results, name, inflights[0] if inflights else 1) is None:
            continue
        cells = []
        for inflight in inflights:
            found = point(results, name, inflight)
            cells.append(
                "–"
                if found is None
                else f"{_fmt(found['calls_per_s'])} ({_fmt(found['p99_us'] / 1000, 1)})"
            )
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def checks_table(found: list[Check]) -> str:
    """The checks with their verdicts (Markdown)."""
    rows = ["| check | value | target | verdict | note |", "|---|--:|--:|---|---|"]
    for check in found:
        limit = "(info)" if check.limit is None else f"{check.op} {check.limit:g}"
        verdict = "" if check.limit is None else check.verdict
        value = "–" if check.value is None else f"{check.value:g}"
        rows.append(f"| {check.what} | {value} | {limit} | {verdict} | {check.note} |")
    return "\n".join(rows)


def checks_json(found: list[Check]) -> list[dict[str, Any]]:
    """The checks as JSON objects (``passed`` null when not measured or informational)."""
    return [{**asdict(check), "verdict": check.verdict} for check in found]


def plot(results: dict[str, Any], path: Path) -> None:
    """calls/s and p99 against calls in flight, one line per target (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rates, tails) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, label in TARGETS.items():
        entry = results["targets"].get(name)
        if not entry or entry.get("status") != "ok":
            continue
        points = sorted(entry["points"], key=lambda p: p["inflight"])
        xs = [p["inflight"] for p in points]
        unsandboxed = name.endswith("-nosandbox")  # measured at 1 and 32 only: no line
        style = {
            "linestyle": "--" if name.endswith("-sync") else "none" if unsandboxed else "-",
            "color": _COLOURS.get(name.removesuffix("-sync").removesuffix("-nosandbox")),
            "marker": "x" if unsandboxed else "o",
            "markersize": 9 if unsandboxed else 6,
            "label": label,
        }
        rates.plot(xs, [p["calls_per_s"] for p in points], **style)
        tails.plot(xs, [p["p99_us"] / 1000 for p in points], **style)
    for axis in (rates, tails):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("calls in flight")
        axis.grid(True, which="both", alpha=0.3)
        axis.set_xticks([1, 2, 4, 8, 16, 32])
        axis.set_xticklabels(["1", "2", "4", "8", "16", "32"])
    rates.set_ylabel("calls/s")
    rates.set_ylim(bottom=0)
    tails.set_ylabel("p99 latency (ms)")
    tails.set_yscale("log")
    rates.legend(fontsize=8)
    machine = results.get("machine", {})
    figure.suptitle(
        f"hostcall benchmark, {results.get('started_at', '')[:10]}: "
        f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"Python {machine.get('python', '?')}",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
