"""``hostcall demo``, run as a user runs it: a real CLI process, a real guest, a real bank.

The bank is checked directly afterwards, so the test does not take the demo's
own printout as proof that each effect happened once. The approval step
decides itself (the default, SPEC §9: "end to end, with no setup"), or, with
``--manual-approval``, by ``hostcall approvals`` run as a second process once
the demo has printed its instructions (read from its stdout as they come,
every wait bounded).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import supervisor
import supervisor.demo
from supervisor.admin_client import AdminClient
from supervisor.demo import EXIT_NO_EXAMPLE, example_dir, run_demo
from supervisor.plan import Plan
from tests.harness import without_hostcall_env

#: Upper bound for the whole demo (it takes about a second).
DEMO_TIMEOUT_S = 120
#: Upper bound for one ``hostcall approvals`` command.
CLI_TIMEOUT_S = 30
#: Bound on stopping a demo a failed test left running (SIGTERM, then SIGKILL).
STOP_GRACE_S = 10
#: The agent's charge calls and the memo each one writes into the bank.
CHARGE_MEMOS = {"charge-1001": "order 1001", "charge-1002": "order 1002"}
#: The refund the agent asks approval for, as the bank records it.
REFUND = ("acct_bob", 8_00, "refund of order 1002")
#: The printed command lines for a second terminal.
APPROVE_LINE = re.compile(r"^\s+(\S*hostcall approvals approve (apr_\w+) .*)$")
REJECT_LINE = re.compile(r"^\s+(\S*hostcall approvals reject (apr_\w+) .*)$")


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One run of ``python -m supervisor.cli demo --auto-approve`` in a fresh state dir."""
    workdir = tmp_path_factory.mktemp("demo")
    state_dir = workdir / "st"
    completed = subprocess.run(
        [*_CLI, "demo", "--state-dir", str(state_dir), "--auto-approve"],
        cwd=workdir,
        env=without_hostcall_env(),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    return completed, state_dir


_CLI = (sys.executable, "-m", "supervisor.cli")


def _rows(output: str, call_id: str) -> list[list[str]]:
    """The table rows of the printout that start with ``call_id``."""
    return [line.split() for line in output.splitlines() if line.split()[:1] == [call_id]]


def test_the_demo_exits_zero_and_says_where_its_state_is(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    completed, state_dir = demo_run
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert f"state dir: {state_dir}" in completed.stdout
    assert len(completed.stdout.splitlines()) <= 70


def test_the_demo_shows_a_call_executed_then_a_lost_response_replayed(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    output = demo_run[0].stdout
    assert [row[:3] for row in _rows(output, "charge-1001")] == [
        ["charge-1001", "charge", "executed"],
        ["charge-1001", "charge", "committed"],
    ]
    # The hand-sent POST ran; the client's retry of the same call_id was replayed.
    assert [row[:3] for row in _rows(output, "charge-1002")] == [
        ["charge-1002", "charge", "executed"],
        ["charge-1002", "charge", "replayed"],
        ["charge-1002", "charge", "committed"],
    ]
    assert "charged once, not twice" in output


def test_the_demo_shows_refusals_for_a_tool_outside_the_plan_and_for_bad_arguments(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    output = demo_run[0].stdout
    assert "Refused tool_not_allowed" in output
    assert "Refused invalid_arguments" in output
    assert re.search(r"^\s+cents: Input should be greater than 0$", output, re.MULTILINE)
    # A refusal leaves a receipt but no effect record.
    assert [row[2:4] for row in _rows(output, "delete-alice")] == [["refused", "tool_not_allowed:"]]
    assert [row[2:4] for row in _rows(output, "charge-bad")] == [["refused", "invalid_arguments:"]]


def test_the_demo_shows_an_ambiguous_outcome_that_stays_unknown_when_retried(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    output = demo_run[0].stdout
    assert output.count("-> EffectUnknown (unknown), idempotency_key") == 2
    assert [row[:3] for row in _rows(output, "receipt-1001")] == [
        ["receipt-1001", "send_receipt", "unknown"],
        ["receipt-1001", "send_receipt", "unknown"],
        ["receipt-1001", "send_receipt", "unknown"],
    ]


def test_an_auto_approved_call_runs_once_and_its_receipt_names_the_approval(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    output = demo_run[0].stdout
    opened = re.search(r"host: refund-1002 needs approval, proposal (apr_\w+)$", output, re.M)
    assert opened is not None, output
    approval_id = opened[1]
    assert "host: approved automatically" in output
    assert "-> approved and executed: rf_1, acct_bob balance is now 2000 cents" in output
    assert "hostcall approvals approve" not in output  # nobody is asked
    assert [row[:3] for row in _rows(output, "refund-1002")] == [
        ["refund-1002", "refund", "executed"],
        ["refund-1002", "refund", "committed"],
    ]
    assert _rows(output, "refund-1002")[0][-1] == approval_id
    assert _rows(output, approval_id) == [[approval_id, "refund-1002", "dispatched", "approver"]]


def _assert_each_effect_once(bank: Path) -> None:
    """One charge per charge call and one mail in the demo's bank."""
    with contextlib.closing(sqlite3.connect(bank)) as db:
        charges = dict(db.execute("SELECT memo, count(*) FROM charges GROUP BY memo").fetchall())
        outbox = db.execute("SELECT count(*) FROM outbox").fetchone()[0]
    assert charges == {memo: 1 for memo in CHARGE_MEMOS.values()}
    assert outbox == 1


def test_the_bank_holds_one_charge_per_charge_call_and_one_mail_though_calls_were_retried(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    bank = demo_run[1] / "bank.db"
    assert bank.stat().st_mode & 0o777 == 0o600  # SPEC §13: the state dir's files are 0600
    _assert_each_effect_once(bank)
    # The approved refund gave acct_bob's charge back, once.
    assert _refunds(bank) == [REFUND]
    assert _balances(bank) == {"acct_alice": 50_00 - 12_50, "acct_bob": 20_00 - 8_00 + 8_00}


class _RunningDemo:
    """A ``demo`` process whose stdout a thread reads line by line, as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: re.Pattern[str], timeout: float = DEMO_TIMEOUT_S) -> re.Match[str]:
        """The first line from here on that matches; fails at EOF or past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line matched {pattern.pattern} in {timeout} s:\n" + self.output)
            if line is None:
                pytest.fail(f"the demo ended before {pattern.pattern}:\n" + self.output)
            self.lines.append(line)
            if found := pattern.match(line):
                return found

    def finish(self, timeout: float = DEMO_TIMEOUT_S) -> int:
        """Wait for the demo to exit and read the rest of its output; its exit status."""
        status = self.process.wait(timeout)
        self._reader.join(timeout)
        while (line := self._queue.get_nowait()) is not None:
            self.lines.append(line)
        return status

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def start_demo(tmp_path: Path) -> Iterator[tuple[_RunningDemo, Path]]:
    """``python -m supervisor.cli demo --manual-approval --state-dir st`` (relative),
    waiting for a human."""
    with (tmp_path / "demo.stderr").open("w") as stderr:
        process = subprocess.Popen(
            [*_CLI, "demo", "--manual-approval", "--state-dir", "st"],
            cwd=tmp_path,
            env=without_hostcall_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            yield _RunningDemo(process), tmp_path / "st"
        finally:
            if process.poll() is None:  # a failed test: stop it, TERM first
                process.terminate()
                try:
                    process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(STOP_GRACE_S)
            assert process.stdout is not None
            process.stdout.close()


def _second_terminal(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a ``hostcall …`` line the demo printed, exactly as printed, as a new
    terminal would: elsewhere, with no virtual environment on its PATH."""
    argv = shlex.split(command)
    assert Path(argv[0]).name == "hostcall"
    fresh = {**without_hostcall_env(), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    fresh.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        argv,
        cwd=cwd,
        env=fresh,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


def _balances(bank: Path) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(bank)) as db:
        return dict(db.execute("SELECT account, balance_cents FROM accounts").fetchall())


def _refunds(bank: Path) -> list[tuple[str, int, str]]:
    with contextlib.closing(sqlite3.connect(bank)) as db:
        return db.execute("SELECT account, cents, memo FROM refunds").fetchall()


def test_the_demo_waits_for_an_operator_who_approves_from_a_second_process(
    start_demo: tuple[_RunningDemo, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    demo, state_dir = start_demo
    approve = demo.wait_for(APPROVE_LINE)
    approval_id = approve[2]
    # The printed command names the state dir absolutely: it works from anywhere.
    assert f"--state-dir {shlex.quote(str(state_dir))}" in approve[1]
    elsewhere = tmp_path_factory.mktemp("elsewhere")

    approved = _second_terminal(approve[1], elsewhere)

    assert approved.returncode == 0, approved.stderr
    assert approved.stdout.startswith(f"{approval_id}: approved")
    assert demo.finish() == 0, demo.output
    output = demo.output
    assert "-> approved and executed: rf_1, acct_bob balance is now 2000 cents" in output
    assert [row[:3] for row in _rows(output, "refund-1002")] == [
        ["refund-1002", "refund", "executed"],
        ["refund-1002", "refund", "committed"],
    ]
    assert _rows(output, approval_id) == [[approval_id, "refund-1002", "dispatched", "operator"]]
    assert _refunds(state_dir / "bank.db") == [REFUND]


def test_a_call_an_operator_rejects_never_runs_and_cannot_be_approved_afterwards(
    start_demo: tuple[_RunningDemo, Path],
) -> None:
    demo, state_dir = start_demo
    approve = demo.wait_for(APPROVE_LINE)
    reject = demo.wait_for(REJECT_LINE)
    assert reject[2] == approve[2]
    approval_id = reject[2]
    # Hold the guest (it is blocked on its refund call), so that the demo is
    # still serving when the second decision arrives; the guest resumes below.
    (invocation,) = AdminClient(state_dir).request("GET", "/v1/invocations")
    guest_pid = invocation["executions"][0]["guest_pid"]
    os.kill(guest_pid, signal.SIGSTOP)
    try:
        rejected = _second_terminal(reject[1], state_dir.parent)
        too_late = _second_terminal(approve[1], state_dir.parent)
    finally:
        os.kill(guest_pid, signal.SIGCONT)

    assert rejected.returncode == 0, rejected.stderr
    assert rejected.stdout.startswith(f"{approval_id}: rejected")
    assert too_late.returncode != 0
    assert "not waiting" in too_late.stderr
    assert demo.finish() == 0, demo.output
    output = demo.output
    assert "-> Refused approval_rejected: nothing ran, acct_bob balance stays 1200 cents" in output
    assert [row[2:4] for row in _rows(output, "refund-1002")] == [["refused", "approval_rejected:"]]
    assert _rows(output, approval_id) == [
        [
            approval_id,
            "refund-1002",
            "rejected",
            "operator:",
            *supervisor.demo.REJECT_REASON.split(),
        ]
    ]
    bank = state_dir / "bank.db"
    assert _refunds(bank) == []
    assert _balances(bank)["acct_bob"] == 20_00 - 8_00


async def test_a_proposal_nobody_decides_expires_and_the_demo_still_exits_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    load = Plan.load

    def short_lease(path: Path) -> Plan:
        plan = load(path)
        return Plan(
            plan.tools.values(),
            name=plan.name,
            max_calls=plan.budget.max_calls,
            max_cost=plan.budget.max_cost,
            deadline_s=plan.budget.deadline_s,
            approval_timeout_s=0.5,
        )

    monkeypatch.setattr(supervisor.demo, "Plan", SimpleNamespace(load=short_lease))

    assert await run_demo(str(tmp_path / "st"), auto_approve=False) == 0

    output = capfd.readouterr().out
    assert "hostcall approvals approve apr_" in output
    assert "-> Refused approval_expired: nothing ran" in output
    assert re.search(r"^\s+apr_\w+\s+refund-1002\s+expired\s+lease$", output, re.M)
    assert _refunds(tmp_path / "st" / "bank.db") == []


def test_plain_hostcall_demo_runs_unattended_in_the_default_state_dir(tmp_path: Path) -> None:
    """No flag, no environment, no terminal: it finishes, in ./.hostcall (SPEC §9)."""
    for run in (1, 2):  # a second run in the same state dir: a fresh bank, new receipts
        completed = subprocess.run(
            [*_CLI, "demo"],
            cwd=tmp_path,
            env=without_hostcall_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=DEMO_TIMEOUT_S,
            check=False,
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr
        assert "state dir: .hostcall" in completed.stdout
        assert "host: approved automatically" in completed.stdout
        assert len(list((tmp_path / ".hostcall" / "receipts").glob("inv_*.jsonl"))) == run
        assert _refunds(tmp_path / ".hostcall" / "bank.db") == [REFUND]


def test_the_demo_says_clearly_when_its_example_is_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert example_dir().is_dir()
    installed = tmp_path / "site-packages" / "supervisor" / "__init__.py"
    monkeypatch.setattr(supervisor, "__file__", str(installed))
    with pytest.raises(FileNotFoundError, match="needs a source checkout"):
        example_dir()


async def test_run_demo_explains_a_missing_example_on_stderr_and_exits_non_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    installed = tmp_path / "site-packages" / "supervisor" / "__init__.py"
    monkeypatch.setattr(supervisor, "__file__", str(installed))
    assert await run_demo(str(tmp_path / "st")) == EXIT_NO_EXAMPLE
    assert "needs a source checkout" in capsys.readouterr().err
    assert not (tmp_path / "st").exists()


def test_the_demo_with_a_webassembly_agent_has_the_same_effects_in_the_bank(
    tmp_path: Path,
) -> None:
    """``hostcall demo --wasm``: the agent is examples/billing/agent.c, built
    to WASI with the ziglang wheel; the five steps go through its imports."""
    state_dir = tmp_path / "st"
    completed = subprocess.run(
        [*_CLI, "demo", "--wasm", "--state-dir", str(state_dir)],
        cwd=tmp_path,
        env=without_hostcall_env(),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S * 5,  # the first build of zig's WASI libc takes ~30 s
        check=False,
    )
    output = completed.stdout
    assert completed.returncode == 0, output + completed.stderr
    assert "as a WebAssembly guest" in output
    assert "agent: a WebAssembly guest of invocation" in output
    assert [row[:3] for row in _rows(output, "charge-1002")] == [
        ["charge-1002", "charge", "executed"],
        ["charge-1002", "charge", "replayed"],
        ["charge-1002", "charge", "committed"],
    ]
    assert output.count("-> ambiguous (unknown), idempotency_key") == 2
    assert "-> approved and executed: rf_1, acct_bob balance is now 2000 cents" in output
    bank = state_dir / "bank.db"
    _assert_each_effect_once(bank)
    assert _refunds(bank) == [REFUND]
