"""kill -9 of the supervisor mid-handler, then ``hostcall run --invocation``.

The handlers write every real execution to a ledger file (fsync'd), which
survives the crash; the test counts executions there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import STEP_TIMEOUT_S, read_line

GUEST = Path(__file__).parents[1] / "guests" / "scripted.py"
TOOLS = """
import os, socket, threading
from supervisor import tool

def _ledger(line):
    fd = os.open(os.environ["LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)

@tool(reversibility="irreversible", target_args=["account"], cost=1)
def charge(account: str, cents: int) -> dict:
    _ledger(f"charge {account} {cents}")
    return {"charge_id": "ch_" + account, "cents": cents}

@tool(reversibility="irreversible", target_args=["account"], cost=1)
def hang(account: str) -> str:
    _ledger(f"hang {account}")
    with socket.socket(socket.AF_UNIX) as s:   # tell the test we are mid-handler
        s.connect(os.environ["SIGNAL_SOCKET"])
        s.sendall(b"started")
    threading.Event().wait(120)                 # the supervisor dies before this ends
    return "finished"
"""
PLAN = """
[plan]
name = "crash"
max_calls = 10
max_cost = 10

[tools.charge]
handler = "crash_tools:charge"

[tools.hang]
handler = "crash_tools:hang"
"""


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "crash_tools.py").write_text(TOOLS)
    (folder / "plan.toml").write_text(PLAN)
    return folder / "plan.toml"


def _run_cmd(state: Path, plan: Path, calls: list[list[object]]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "supervisor.cli",
        "run",
        "--state-dir",
        str(state),
        "--plan",
        str(plan),
        "--invocation",
        "inv_crash",
        "--",
        sys.executable,
        str(GUEST),
        "calls",
        json.dumps(calls),
    ]


def _start_run(
    state: Path, plan: Path, calls: list[list[object]], env: dict[str, str]
) -> subprocess.Popen[str]:
    """``hostcall run`` of the scripted guest, in a session of its own."""
    return subprocess.Popen(
        _run_cmd(state, plan, calls),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _kill_mid_run(run: subprocess.Popen[str]) -> None:
    """What a crash leaves: the supervisor killed with SIGKILL. Its sandboxed
    guest dies with it (S5); the pid it reported is its sandbox's (2), no
    host process to signal."""
    os.kill(run.pid, signal.SIGKILL)
    run.wait(timeout=STEP_TIMEOUT_S)


def test_after_kill_9_mid_handler_a_resumed_invocation_replays_commits_and_reports_unknown(
    tmp_path: Path, plan_file: Path
) -> None:
    state, ledger = tmp_path / "st", tmp_path / "ledger.txt"
    signal_path = tmp_path / "signal.sock"
    env = {**os.environ, "LEDGER": str(ledger), "SIGNAL_SOCKET": str(signal_path)}
    calls = [
        ["c1", "charge", {"account": "alice", "cents": 500}],
        ["h1", "hang", {"account": "bob"}],
    ]
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(signal_path))
        listener.listen(1)
        listener.settimeout(STEP_TIMEOUT_S)
        with _start_run(state, plan_file, calls, env) as first:
            assert first.stdout is not None
            assert "pid" in json.loads(read_line(first.stdout))  # the guest runs
            committed = json.loads(read_line(first.stdout))
            connection, _ = listener.accept()  # the hang handler is running now
            connection.close()
            _kill_mid_run(first)
    assert committed == {"call_id": "c1", "result": {"charge_id": "ch_alice", "cents": 500}}

    again = [*calls, ["plan", "__plan__", {}]]
    second = subprocess.run(
        _run_cmd(state, plan_file, again),
        env=env,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S * 2,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    lines = [json.loads(line) for line in second.stdout.splitlines()[1:]]
    assert lines[0] == committed  # replayed from the store, not run again
    assert lines[1]["call_id"] == "h1"
    assert lines[1]["code"] == "ambiguous"
    assert len(lines[1]["unknown"]) == 64  # carries the idempotency key
    budget = lines[2]["plan"]["budget"]
    assert budget["calls_left"] == 8  # two calls used before the crash
    assert budget["cost_left"] == 8
    assert ledger.read_text().splitlines() == ["charge alice 500", "hang bob"]
    assert "replayed 1" in second.stderr and "unknown 1" in second.stderr


APPROVAL_PLAN = """
[plan]
name = "crash-approval"
max_calls = 1
max_cost = 1

[tools.charge]
handler = "crash_tools:charge"
approval = "always"
"""


def _hostcall(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )


def _waiting_proposal(state: Path) -> str:
    """The id of the proposal waiting on the supervisor of ``state``, asked
    again until there is one (bounded)."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        listed = _hostcall("approvals", "list", "--json", "--state-dir", str(state))
        if listed.returncode == 0:
            waiting = [p["id"] for p in json.loads(listed.stdout) if p["state"] == "waiting"]
            if waiting:
                return str(waiting[0])
        time.sleep(0.05)  # a poll: the proposal appears when the guest's call arrives
    raise AssertionError(f"no proposal waiting within {STEP_TIMEOUT_S} s")


def test_after_kill_9_during_an_approval_wait_the_reserved_budget_is_given_back(
    tmp_path: Path,
) -> None:
    """SPEC §5 step 7: a reservation is returned if the call does not reach
    dispatch — also when the supervisor dies while the call waits for its
    approval. With max_calls = 1, the resumed invocation's retry must get a
    new proposal and run, not 429 budget_exhausted for a call that never ran."""
    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "crash_tools.py").write_text(TOOLS)
    plan = folder / "plan.toml"
    plan.write_text(APPROVAL_PLAN)
    state, ledger = tmp_path / "st", tmp_path / "ledger.txt"
    env = {**os.environ, "LEDGER": str(ledger)}
    calls = [["p1", "charge", {"account": "alice", "cents": 500}]]
    with _start_run(state, plan, calls, env) as first:
        assert first.stdout is not None
        assert "pid" in json.loads(read_line(first.stdout))  # the guest runs
        _waiting_proposal(state)  # the budget is reserved; the call waits
        _kill_mid_run(first)

    with _start_run(state, plan, [*calls, ["plan", "__plan__", {}]], env) as second:
        try:
            approved = _hostcall(
                "approvals", "approve", _waiting_proposal(state), "--state-dir", str(state)
            )
            out, err = second.communicate(timeout=STEP_TIMEOUT_S * 2)
        finally:
            if second.poll() is None:
                second.kill()
                second.wait(timeout=STEP_TIMEOUT_S)
    assert approved.returncode == 0, approved.stderr
    assert second.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()[1:]]
    assert lines[0] == {"call_id": "p1", "result": {"charge_id": "ch_alice", "cents": 500}}
    assert lines[1]["plan"]["budget"]["calls_left"] == 0  # this run's call, once
    assert ledger.read_text().splitlines() == ["charge alice 500"]
