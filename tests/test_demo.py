"""``hostcall demo``, run as a user runs it: a real CLI process, a real guest, a real bank.

The bank is checked directly afterwards, so the test does not take the demo's
own printout as proof that each effect happened once.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import supervisor
from supervisor.demo import EXIT_NO_EXAMPLE, example_dir, run_demo

#: Upper bound for the whole demo (it takes well under a second).
DEMO_TIMEOUT_S = 120
#: The agent's charge calls and the memo each one writes into the bank.
CHARGE_MEMOS = {"charge-1001": "order 1001", "charge-1002": "order 1002"}


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One run of ``python -m supervisor.cli demo`` in a fresh state dir."""
    workdir = tmp_path_factory.mktemp("demo")
    state_dir = workdir / "st"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCALL_")}
    completed = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "demo", "--state-dir", str(state_dir)],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    return completed, state_dir


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
    assert [row[2:4] for row in _rows(output, "refund-1001")] == [["refused", "tool_not_allowed:"]]
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


def test_the_bank_holds_one_charge_per_charge_call_and_one_mail_though_calls_were_retried(
    demo_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    bank = demo_run[1] / "bank.db"
    with contextlib.closing(sqlite3.connect(bank)) as db:
        charges = dict(db.execute("SELECT memo, count(*) FROM charges GROUP BY memo").fetchall())
        outbox = db.execute("SELECT count(*) FROM outbox").fetchone()[0]
        balances = dict(db.execute("SELECT account, balance_cents FROM accounts").fetchall())
    assert charges == {memo: 1 for memo in CHARGE_MEMOS.values()}
    assert outbox == 1
    assert balances == {"acct_alice": 50_00 - 12_50, "acct_bob": 20_00 - 8_00}


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
