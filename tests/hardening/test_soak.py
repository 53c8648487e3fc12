"""The soak (``scripts/soak``): a bounded run in CI, and the leak heuristics it applies.

The long runs are for a person (docs/guarantees.md has this machine's
figures); here a 10 s run shows the script works end to end against a real
``hostcall serve`` and that its checks hold, and the heuristics are shown to
fail on the leaks they are meant to catch.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import tracemalloc
from itertools import pairwise
from pathlib import Path
from typing import Any

from supervisor import Supervisor
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, load_script

SCRIPT = Path(__file__).parents[2] / "scripts" / "soak"
#: The bounded run's length, and a bound on the whole subprocess around it.
SOAK_S = 10.0
RUN_BOUND_S = 120.0
#: What an ended execution may keep for good: its ids, state and credential
#: digest (enough to answer ``execution_fenced``), not its process, pipes and broker.
#: Plus noise: psutil's per-pid cache, a dict resize now and then.
RETAINED_PER_EXECUTION = 3 * 1024
#: Enough runs that small one-off allocations average out, in each of two
#: windows: what an execution leaves behind is the smaller window's growth.
RUNS = 100
WINDOWS = 2
#: How much of each allocation's stack a failure shows.
FRAMES = 8


soak = load_script(SCRIPT, "hostcall_soak")


def samples(rss: list[float], fds: list[int], errors: int = 0) -> list[Any]:
    """One sample a second, with the given RSS and descriptor series."""
    return [
        soak.Sample(
            t_s=float(i + 1),
            rss_mib=r,
            fds=f,
            threads=10,
            cpu_pct=50.0,
            guests=4,
            calls=100,
            calls_per_s=100.0,
            p50_ms=5.0,
            p99_ms=20.0,
            errors=errors if i == len(rss) - 1 else 0,
        )
        for i, (r, f) in enumerate(zip(rss, fds, strict=True))
    ]


def test_a_bounded_soak_of_a_real_hostcall_serve_holds_every_leak_heuristic(
    tmp_path: Path,
) -> None:
    report_path = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--duration", str(SOAK_S), "--guests", "3", "--guest-lifetime", "4"),
            *("--json", str(report_path)),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
        check=False,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    summary = report["summary"]
    assert summary["ok"]
    assert summary["duration_s"] >= SOAK_S
    assert summary["guests_launched"] >= 6  # each slot was refilled at least once
    assert summary["calls"] >= 100
    assert summary["verdict_errors"] == 0
    assert len(report["samples"]) >= SOAK_S
    assert all(s["rss_mib"] > 0 and s["fds"] > 0 for s in report["samples"])
    assert "rss MiB" in done.stdout  # the table over time


def test_steady_rss_and_descriptors_that_come_and_go_pass() -> None:
    series = samples([60.0 + (i % 3) * 0.5 for i in range(40)], [40 + (i % 5) for i in range(40)])
    verdict = soak.judge(series, duration_s=40, max_rss_growth_pct=25)
    assert verdict.problems == []


def test_rss_that_keeps_growing_fails_the_soak() -> None:
    series = samples([60.0 + i for i in range(40)], [40] * 40)
    verdict = soak.judge(series, duration_s=40, max_rss_growth_pct=25)
    assert verdict.rss_growth_pct > 25
    assert any("RSS grew" in p for p in verdict.problems)


def test_descriptors_whose_floor_rises_above_the_early_peak_fail_the_soak() -> None:
    series = samples([60.0] * 40, [40 + i // 2 for i in range(40)])
    verdict = soak.judge(series, duration_s=40, max_rss_growth_pct=25)
    assert any("descriptors" in p for p in verdict.problems)


def test_a_failed_call_fails_the_soak() -> None:
    verdict = soak.judge(samples([60.0] * 40, [40] * 40, errors=1), 40, 25)
    assert verdict.problems == ["1 call(s) failed"]


def test_the_warm_up_is_left_out_of_the_comparison() -> None:
    # Start-up growth in the first seconds (imports, caches) is not a leak.
    rss = [30.0 + 6 * i for i in range(5)] + [60.0] * 35
    verdict = soak.judge(samples(rss, [40] * 40), duration_s=40, max_rss_growth_pct=25)
    assert verdict.problems == []


async def test_ended_executions_do_not_pile_up_in_a_long_running_supervisor(
    tmp_path: Path, ledger: Ledger
) -> None:
    """A ``hostcall serve`` launches guest after guest for days: what each ended
    one leaves behind must stay small (the 5-minute soak in docs/guarantees.md
    saw RSS climb with the number of guests launched, not with calls)."""
    plan = billing_plan(ledger)
    # The default store (SQLite): the memory store keeps every record in this
    # process by design, which is not what a long-running supervisor uses.
    async with Supervisor(tmp_path / "state") as sup:
        # 10-20 s on this kind of machine under tracing; a busy CI host is slower.
        async with asyncio.timeout(STEP_TIMEOUT_S * 4):
            for _ in range(5):  # warm-up: first-use caches, the sampler task
                await sup.run(plan, ["/bin/true"])
            gc.collect()
            tracemalloc.start(FRAMES)
            try:
                snapshots = [tracemalloc.take_snapshot()]
                for _ in range(WINDOWS):
                    for _ in range(RUNS):
                        await sup.run(plan, ["/bin/true"])
                    gc.collect()
                    snapshots.append(tracemalloc.take_snapshot())
            finally:
                tracemalloc.stop()
    # A leak grows in every window; a one-off does not: the interpreter's table
    # of interned strings, allocated before tracing began, resized once inside a
    # window in a long test session (+3.8 MB, all of it "new" to tracemalloc).
    windows = [after.compare_to(before, "traceback") for before, after in pairwise(snapshots)]
    grown = min(windows, key=lambda stats: sum(stat.size_diff for stat in stats))
    per_execution = sum(stat.size_diff for stat in grown) / RUNS
    assert per_execution < RETAINED_PER_EXECUTION, (
        f"{per_execution:.0f} bytes per execution; where it grew most:\n"
        + "\n".join(_where(stat) for stat in grown[:5])
    )


def _where(stat: tracemalloc.StatisticDiff) -> str:
    frames = "\n".join(f"    {frame}" for frame in stat.traceback.format(most_recent_first=True))
    return f"  +{stat.size_diff} B in {stat.count_diff} blocks:\n{frames}"


def test_the_table_of_ended_executions_is_capped() -> None:
    """Past the cap, the oldest ended executions are forgotten (their stale
    credentials then get ``unauthenticated`` instead of ``execution_fenced``)."""
    from supervisor.executions import Execution, ExecutionTable
    from supervisor.outcomes import ExecutionOutcome

    table = ExecutionTable(max_ended=3)
    for n in range(5):
        execution = Execution(f"exe_{n}", "inv", "sha256:x", b"", None)  # type: ignore[arg-type]
        table.add(execution)
        execution.end()
        ended = ExecutionOutcome(execution.execution_id, 0, None, "exited", 0.0, 0.0, None, 0, {})
        table.retire(execution, ended)
    assert [e.execution_id for e in table] == ["exe_2", "exe_3", "exe_4"]
