"""The fault-injection harness (``scripts/faults``): a bounded run, and its checker.

The bounded runs kill -9 real ``hostcall run`` supervisors at every crash point
of the pipeline, resume each invocation and replay every call; the harness
counts executions from its own fsync'd ledger. The checker tests show that
the harness does see a duplicate or a lost commit when there is one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.harness import load_script

SCRIPT = Path(__file__).parents[2] / "scripts" / "faults"
#: Bound on a whole bounded run (it takes a fraction of this on an idle machine).
RUN_BOUND_S = 600.0
KEY = "k" * 64


faults = load_script(SCRIPT, "hostcall_faults")


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Short on purpose: with a socket path too long for sun_path, each trial's
    # supervisor makes a /tmp/hostcall-* folder, and one killed never removes it.
    path = Path(tempfile.mkdtemp(prefix="hcf-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_harness(workdir: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    report = workdir / "report.json"
    command = [sys.executable, str(SCRIPT), "--workdir", str(workdir / "run")]
    done = subprocess.run(
        [*command, "--json", str(report), "--quiet", *options],
        capture_output=True,
        text=True,
        timeout=RUN_BOUND_S,
        check=False,
    )
    return done, json.loads(report.read_text()) if report.exists() else None


def test_a_bounded_fault_run_at_every_point_finds_no_duplicate_and_no_lost_commit(
    workdir: Path,
) -> None:
    done, report = run_harness(
        workdir, "--trials", "50", "--jobs", "2", "--spawn", "fork", "--seed", "11"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["trials"] == 50
    assert report["duplicates"] == 0
    assert report["lost_commits"] == 0
    assert report["failed_trials"] == 0
    assert report["harness_errors"] == 0
    assert report["leftover_processes"] == 0
    assert report["executions"] > 0
    for point, figures in report["by_point"].items():
        assert figures["trials"] == 10, point
    # Crashes between BeginDispatch and commit were answered ambiguous unknown.
    assert report["in_doubt_answered_unknown"] > 0
    assert "duplicates 0, lost commits 0" in done.stdout


def test_trials_with_real_python_m_supervisor_cli_processes_hold_too(workdir: Path) -> None:
    done, report = run_harness(
        workdir, "--trials", "10", "--jobs", "2", "--spawn", "exec", "--seed", "12"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (report["trials"], report["duplicates"], report["lost_commits"]) == (10, 0, 0)
    assert report["failed_trials"] == report["harness_errors"] == 0
    assert all(figures["trials"] == 2 for figures in report["by_point"].values())


def test_webassembly_guests_killed_with_their_supervisor_at_every_point_hold_too(
    workdir: Path,
) -> None:
    """The guest is a module inside the supervisor (--guest wasm): kill -9 ends
    both; the resumed invocation's new instance replays every call."""
    done, report = run_harness(
        workdir, "--trials", "25", "--jobs", "2", "--spawn", "fork", "--guest", "wasm",
        "--seed", "17",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert report["guest"] == "wasm"
    assert (report["trials"], report["duplicates"], report["lost_commits"]) == (25, 0, 0)
    assert report["failed_trials"] == report["harness_errors"] == 0
    assert report["leftover_processes"] == 0
    assert all(figures["trials"] == 5 for figures in report["by_point"].values())
    assert report["in_doubt_answered_unknown"] > 0


def test_the_harness_refuses_the_memory_store_which_keeps_nothing_across_a_restart(
    workdir: Path,
) -> None:
    done, report = run_harness(workdir, "--trials", "1", "--store", "memory")
    assert done.returncode == 2
    assert "same state dir" in done.stderr
    assert report is None


# -- the checker, on evidence made by hand --------------------------------------


def charge(call_id: str) -> Any:
    return faults.Call(call_id, "charge", {"ref": call_id, "cents": 100})


def lookup(call_id: str) -> Any:
    return faults.Call(call_id, "lookup", {"ref": call_id})


def flaky(call_id: str) -> Any:
    return faults.Call(call_id, "flaky", {"ref": call_id})


def trial(point: str, crash: int, *calls: Any) -> Any:
    return faults.Trial(0, point, crash + 1, crash, tuple(calls))


def faithful_evidence(t: Any) -> Any:
    """What a system that follows the replay table leaves behind."""
    ledger: list[Any] = []
    first: dict[str, dict[str, Any]] = {}
    second: dict[str, dict[str, Any]] = {}
    rows: dict[str, tuple[str, Any]] = {}
    used = t.crash + (t.point != "before_begin")  # charged when it won BeginDispatch
    unknown = {"unknown": KEY, "reason": "unknown"}
    for i, call in enumerate(t.calls):
        want = faults.expect(t, i)
        runs1 = [faults.Execution(call.call_id, call.tool, 1, f"a{i}")] * want.first_runs
        runs2 = [faults.Execution(call.call_id, call.tool, 2, f"b{i}")] * want.second_runs
        ledger += runs1 + runs2
        used += want.second_runs
        if i < t.crash:
            first[call.call_id] = (
                {"result": faults._result_of(call, runs1[0])} if call.returns else unknown
            )
        if want.second_answer == "replay":
            second[call.call_id] = {"result": faults._result_of(call, runs1[0])}
        elif want.second_answer == "fresh" and call.returns:
            second[call.call_id] = {"result": faults._result_of(call, runs2[0])}
        else:
            second[call.call_id] = unknown
        response = {"result": second[call.call_id].get("result")}
        rows[call.call_id] = (want.final, response if want.final == "committed" else None)
    return faults.Evidence(
        first_exit=-9,
        second_exit=0,
        ledger=tuple(ledger),
        first_answers=first,
        second_answers=second,
        rows=rows,
        calls_used=used,
        receipt_chain_error=None,
        leftover_processes=0,
    )


@pytest.mark.parametrize("point", faults.POINTS)
def test_the_checker_accepts_what_the_replay_table_predicts_at_every_point(point: str) -> None:
    t = trial(point, 2, charge("c0"), flaky("c1"), lookup("c2"), charge("c3"), lookup("c4"))
    verdict = faults.check(t, faithful_evidence(t))
    assert verdict.problems == []
    assert (verdict.duplicates, verdict.lost_commits) == (0, 0)


def test_the_checker_counts_a_second_execution_of_an_irreversible_call_as_a_duplicate() -> None:
    t = trial("in_handler", 1, charge("c0"), charge("c1"), charge("c2"))
    evidence = faithful_evidence(t)
    again = faults.Execution("c1", "charge", 2, "again")
    verdict = faults.check(t, replace(evidence, ledger=(*evidence.ledger, again)))
    assert verdict.duplicates == 1
    assert any("c1 (charge) ran 1+1 times" in p for p in verdict.problems)


def test_the_checker_allows_a_reversible_call_in_doubt_to_run_again_but_only_once() -> None:
    t = trial("after_handler", 0, lookup("c0"), charge("c1"))
    evidence = faithful_evidence(t)
    assert faults.check(t, evidence).problems == []  # ran in both runs: allowed
    third = faults.Execution("c0", "lookup", 2, "third")
    verdict = faults.check(t, replace(evidence, ledger=(*evidence.ledger, third)))
    assert verdict.duplicates == 1


def test_the_checker_counts_a_commit_answered_differently_after_the_restart_as_lost() -> None:
    t = trial("before_reply", 1, charge("c0"), charge("c1"), charge("c2"))
    evidence = faithful_evidence(t)
    second = dict(evidence.second_answers)
    second["c1"] = {"unknown": KEY, "reason": "unknown"}  # the commit was forgotten
    verdict = faults.check(t, replace(evidence, second_answers=second))
    assert verdict.lost_commits == 1
    second["c1"] = {"result": {"ref": "c1", "run": 2, "nonce": "other", "cents": 100}}
    assert faults.check(t, replace(evidence, second_answers=second)).lost_commits == 1


def test_the_checker_requires_an_irreversible_call_in_doubt_to_answer_unknown() -> None:
    t = trial("after_begin", 0, charge("c0"))
    evidence = faithful_evidence(t)
    verdict = faults.check(t, evidence)
    assert verdict.in_doubt == 1
    second = {"c0": {"error": "tool_error"}}
    verdict = faults.check(t, replace(evidence, second_answers=second))
    assert verdict.in_doubt == 0
    assert any("in doubt" in p for p in verdict.problems)


def test_the_checker_reports_a_fault_that_never_fired_and_processes_left_behind() -> None:
    t = trial("before_begin", 0, charge("c0"))
    evidence = replace(faithful_evidence(t), first_exit=0, leftover_processes=1)
    problems = faults.check(t, evidence).problems
    assert any("fault missed" in p for p in problems)
    assert any("left behind" in p for p in problems)


def test_trials_are_the_same_for_a_seed_and_deal_the_points_round_robin() -> None:
    trials = [faults.make_trial(5, i, (3, 10)) for i in range(10)]
    assert trials == [faults.make_trial(5, i, (3, 10)) for i in range(10)]
    assert sorted(t.point for t in trials) == sorted(faults.POINTS * 2)
    for t in trials:
        reaching = [i for i, c in enumerate(t.calls) if faults.reaches(c, t.point)]
        assert reaching[t.nth - 1] == t.crash
