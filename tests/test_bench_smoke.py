"""scripts/bench runs end to end: a quick run produces well-formed JSON with every
target and every check. No timing is asserted: on a shared machine the numbers of
a run this short mean nothing, only their presence and shape are tested."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import without_hostcall_env

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "scripts" / "benchmarks" / "run.py"
#: The whole quick run, every child process included, stays well inside this.
QUICK_RUN_TIMEOUT_S = 180

HTTP_TARGETS = [
    "echo",
    "hostcall-memory",
    "hostcall-sqlite",
    "hostcall-memory-sync",
    "hostcall-sqlite-sync",
]
#: ``hostcall run`` by default (sandboxed) and with ``--no-sandbox``.
SANDBOXED_TARGETS = {
    "hostcall-memory": True,
    "hostcall-sqlite": True,
    "hostcall-memory-sync": True,
    "hostcall-sqlite-sync": True,
    "hostcall-memory-nosandbox": False,
    "hostcall-sqlite-nosandbox": False,
}
POINT_FIELDS = {
    "tool",
    "inflight",
    "calls",
    "errors",
    "seconds",
    "calls_per_s",
    "p50_us",
    "p90_us",
    "p99_us",
    "mean_us",
    "client_cpu_us_per_call",
    "server_cpu_us_per_call",
}
CHECKS = {
    "sqlite32_vs_echo32",
    "memory1_vs_echo1",
    "sqlite1_added_p50_us",
    "sqlite1_vs_mcp1",
    "memory1_server_cpu_us",
    "memory1_cpu_vs_echo1",
    "sqlite32_vs_memory32",
    "many_vs_single",
    "many_rss_mb",
    "launch_overhead_ms",
}
#: The cost of the sandbox (issue 12, item 7).
SANDBOX_CHECKS = {
    "launch_overhead_sandbox_ms",
    "memory1_sandbox_vs_off",
    "memory32_sandbox_vs_off",
    "sqlite1_sandbox_vs_off",
    "sqlite32_sandbox_vs_off",
    "many_not_ok",
}
#: What a busy machine does to the server CPU per call (issue 16).
BUSY_CHECKS = {"busy_cpu_memory1", "busy_cpu_memory32", "busy_cpu_sqlite1", "busy_cpu_sqlite32"}
#: A fast start of the CLI (issue 14).
CLI_CHECKS = {"cli_help_ms", "cli_approvals_list_ms"}
LAUNCH_MODES = {"sandbox": True, "sandbox_fresh_workdir": True, "no_sandbox": False}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    folder = tmp_path_factory.mktemp("bench")
    out = folder / "bench.json"
    plot = folder / "bench.png"
    env = without_hostcall_env()
    completed = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--quick",
            "--json",
            str(out),
            "--work-dir",
            str(folder),
            "--results-dir",
            str(folder),
            *(["--plot", str(plot)] if _has("matplotlib") else []),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    if _has("matplotlib"):
        assert plot.read_bytes().startswith(b"\x89PNG")
    return json.loads(out.read_text()), completed.stdout


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _assert_point_is_well_formed(found: dict[str, Any]) -> None:
    assert set(found) >= POINT_FIELDS
    assert found["calls"] > 0
    assert found["errors"] == 0, found["first_error"]
    assert 0 < found["p50_us"] <= found["p99_us"]
    assert found["server_cpu_us_per_call"] is not None


def test_a_quick_run_measures_every_http_target_at_1_and_32_calls_in_flight(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, _ = quick_run
    for target in HTTP_TARGETS:
        entry = results["targets"][target]
        assert entry["status"] == "ok", entry
        assert [p["inflight"] for p in entry["points"]] == [1, 32]
        for found in entry["points"]:
            _assert_point_is_well_formed(found)


def test_hostcall_is_measured_with_its_guest_in_the_sandbox_and_without_it_at_1_and_32(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, _ = quick_run
    for target, sandboxed in SANDBOXED_TARGETS.items():
        entry = results["targets"][target]
        assert entry["status"] == "ok", entry
        assert entry["sandboxed"] is sandboxed, target
        assert [p["inflight"] for p in entry["points"]] == [1, 32]
        for found in entry["points"]:
            _assert_point_is_well_formed(found)
            # Read off the supervisor's CPU, sampled from outside the guest.
            assert found["server_cpu_from"] == "trace"


def test_the_sandbox_on_and_off_are_compared_within_back_to_back_pairs(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, _ = quick_run
    pairs = results["sandbox_pairs"]
    assert pairs["pairs"] == 1
    for store in ("memory", "sqlite"):
        for inflight in ("1", "32"):
            found = pairs[store][inflight]
            assert found["errors"] == 0
            assert len(found["ratios"]) == 1
            assert found["ratio_median"] == found["ratios"][0] > 0
            assert found["server_cpu_diff_median_us"] is not None


def test_mcp_is_measured_when_installed_and_skipped_with_a_reason_otherwise(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, _ = quick_run
    entry = results["targets"]["mcp-stdio"]
    if _has("mcp"):
        assert entry["status"] == "ok", entry
        for found in entry["points"]:
            _assert_point_is_well_formed(found)
    else:
        assert entry["status"] == "skipped"
        assert "mcp" in entry["reason"]


def test_a_quick_run_reports_guests_launch_fsync_import_time_and_the_thread_hop(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, _ = quick_run
    many = results["many_guests"]
    assert many["guests"] == 3
    assert many["many"]["calls"] > 0
    assert many["many"]["errors"] == 0
    assert many["many"]["guests_failed"] == 0
    assert many["many"]["supervisor_peak_rss_mb"] > 0
    assert many["many"]["guests_not_ok"] == 0
    assert many["single"]["server_cpu_us_per_call"] is not None
    assert "pid" in many["sandbox"]["namespaces"]
    unsandboxed = results["many_guests_nosandbox"]
    assert unsandboxed["sandbox"] == "off"
    assert unsandboxed["many"]["guests_failed"] == 0
    assert results["launch"]["runs"] == 2
    assert results["launch"]["bare_p50_ms"] > 0
    for mode, sandboxed in LAUNCH_MODES.items():
        launched = results["launch"][mode]
        assert launched["hostcall_p50_ms"] > 0
        assert launched["overhead_p50_ms"] is not None
        assert (launched["sandbox"] != "off") is sandboxed, mode
    assert results["launch"]["sandbox"]["sandbox"]["workdir"] == "overlay"
    assert results["launch"]["sandbox_fresh_workdir"]["sandbox"]["workdir"] == "fresh"
    assert results["fsync"]["p50_us"] > 0
    assert results["import_time"]["importtime_ms"] is not None
    assert results["cli_start"]["help_ms"] > 0
    assert results["cli_start"]["approvals_list_ms"] > 0
    assert results["thread_hop"]["hop_p50_us"] > 0
    assert results["machine"]["cores"] >= 1


def test_the_guest_client_is_measured_against_a_raw_client_through_a_real_guest(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, stdout = quick_run
    client = results["client"]
    assert client["status"] == "ok"
    for name in ("raw", "sync", "async"):
        measured = client[name]
        assert measured["calls_per_s"] > 0
        assert 0 < measured["p50_us"] <= measured["p99_us"]
        assert measured["client_cpu_us_per_call"] > 0
        assert measured["server_cpu_us_per_call"] is not None
    for name in ("sync", "async"):
        assert client[name]["p50_us_vs_raw"] > 0
        assert client[name]["client_cpu_us_per_call_vs_raw"] > 0
    assert "guest_client HostClient" in stdout
    assert "guest_client AsyncHostClient" in stdout


def test_every_check_of_issues_8_and_12_has_a_value_and_a_verdict(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, stdout = quick_run
    checks = {check["name"]: check for check in results["checks"]}
    measured = CHECKS | SANDBOX_CHECKS | CLI_CHECKS | BUSY_CHECKS
    assert set(checks) >= measured
    mcp_checks = {"sqlite1_vs_mcp1"}
    for name in measured - (set() if _has("mcp") else mcp_checks):
        assert checks[name]["value"] is not None, name
        assert checks[name]["verdict"] in ("PASS", "MISS"), name
    for name in CHECKS | SANDBOX_CHECKS | BUSY_CHECKS:
        assert checks[name]["what"] in stdout


def test_the_busy_part_runs_each_target_idle_and_with_a_core_burnt(
    quick_run: tuple[dict[str, Any], str],
) -> None:
    results, stdout = quick_run
    busy = results["busy"]
    assert busy["status"] == "ok"
    assert busy["burner_cores_used"] > 0.2  # the burner did take CPU
    for target in ("echo", "hostcall-memory", "hostcall-sqlite"):
        for side in ("idle", "busy"):
            points = busy[target][side]["points"]
            assert [found["inflight"] for found in points] == busy["inflight"], (target, side)
            for found in points:
                _assert_point_is_well_formed(found)
    assert "idle against busy" in stdout


def _run_script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``scripts/benchmarks/NAME ARGS`` to completion; it must succeed."""
    completed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmarks" / name), *args],
        env=without_hostcall_env(),
        capture_output=True,
        text=True,
        timeout=QUICK_RUN_TIMEOUT_S,
    )
    assert completed.returncode == 0, completed.stderr
    return completed


def test_compare_runs_two_trees_side_by_side_and_reports_each_metric_per_pair(
    tmp_path: Path,
) -> None:
    # The tool that A/Bs two versions (docs/benchmarks.md): this tree against
    # itself, two pairs, a short window; only the shape is checked.
    out = tmp_path / "compare.json"
    completed = _run_script(
        "compare.py",
        *("--base", str(ROOT), "--head", str(ROOT), "--pairs", "2"),
        *("--warmup", "0.1", "--duration", "0.3", "--json", str(out)),
    )
    result = json.loads(out.read_text())
    assert (result["store"], result["inflight"], result["pairs"]) == ("memory", 1, 2)
    for metric in ("calls_per_s", "p50_us", "p99_us", "server_cpu_us_per_call"):
        row = result["summary"][metric]
        assert row["base_median"] > 0 and row["head_median"] > 0
        assert len(row["ratios"]) == 2 and row["ratio_median"] > 0
    assert "server_cpu_us_per_call" in completed.stdout


@pytest.mark.parametrize("inflight", [1, 4])
def test_the_store_alone_runs_both_transactions_of_each_call_and_times_them(
    tmp_path: Path, inflight: int
) -> None:
    # scripts/benchmarks/store_alone.py (docs/benchmarks.md, the SQLite
    # target's figures): a real SQLite store in tmp_path, a few calls.
    completed = _run_script(
        "store_alone.py",
        *("--inflight", str(inflight), "--calls", "40", "--work-dir", str(tmp_path)),
    )
    first, *statements = completed.stdout.splitlines()
    assert first.startswith(f"store alone, {inflight} in flight, 40 calls: ")
    per_call = {line.split("µs each")[1].strip(): line.split()[0] for line in statements}
    # Every call inserts its pending row and commits it, with its receipt journaled.
    assert per_call["INSERT INTO effects"] == "1.00"
    assert per_call["INSERT INTO receipt_journal"] == "1.00"
    assert "COMMIT" in per_call
    assert list(tmp_path.iterdir()) == []  # its scratch folder is gone
