"""Receipts journaled in the SQLite store (supervisor/stores/journal.py).

A committed call and its receipt share one transaction (one fsync); the line
reaches the file right after, and the journal is trimmed once the file is
fsync'd. A crash between the commit and the file write (the
``receipt_journaled`` crash point, a real SIGKILL) leaves the line only in
the journal: the next start completes the file, also past a torn last line.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from supervisor.errors import StoreUnavailable
from supervisor.receipts import GENESIS_HASH, make_receipt, seal, verify_chain
from supervisor.stores import SQLiteEffectStore, StartCall
from supervisor.stores.journal import JOURNAL_SCHEMA, JournaledReceipts, Line, ReceiptJournal
from tests.harness import STEP_TIMEOUT_S, read_line, wait_until

GUEST = Path(__file__).parents[1] / "guests" / "scripted.py"


def _receipt(call_id: str, outcome: str = "refused") -> dict[str, Any]:
    now = time.time()
    return make_receipt(
        invocation_id="inv_j",
        execution_id="exe_j",
        plan_hash="p" * 64,
        call_id=call_id,
        tool="noop",
        idempotency_key="k" * 64,
        outcome=outcome,
        error_code=None,
        approval_id=None,
        started_at=now,
        finished_at=now,
    )


def _journal_rows(db: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT path, hash FROM receipt_journal ORDER BY seq").fetchall()


def _call_ids(path: Path) -> list[str]:
    return [json.loads(line)["call_id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("inline", [False, True], ids=["writer", "inline-mixed"])
async def test_a_commit_and_its_receipt_share_a_transaction_and_reach_the_file(
    tmp_path: Path, inline: bool
) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "receipts" / "inv_j.jsonl"
    store = SQLiteEffectStore(db)
    if inline:  # every other operation on this thread, as with one request alone
        turns = itertools.cycle((True, False))
        store.set_load_hint(lambda: 1 if next(turns) else 2)
    await store.open()
    try:
        receipts = JournaledReceipts(path, store)
        await store.open_invocation("inv_j", "p" * 64, None, time.time())
        begun = await store.begin(StartCall("inv_j", "c1", "noop", "k" * 64, "exe_j", False), 1.0)
        assert begun.won
        executed = _receipt("c1", "executed")
        await receipts.commit("inv_j", "c1", {"status": "ok"}, 2.0, executed)
        # Answered: the line is in the file already, and durable in the journal.
        assert _call_ids(path) == ["c1"]
        assert json.loads(path.read_text())["receipt_id"] == executed["receipt_id"]
        record = await store.get("inv_j", "c1")
        assert record is not None and record.response == {"status": "ok"}
        for n in range(5):
            await receipts.record(_receipt(f"r{n}"))
        assert _call_ids(path) == ["c1", "r0", "r1", "r2", "r3", "r4"]
    finally:
        await store.close()
    assert verify_chain(path) == (6, None)
    assert _journal_rows(db) == []  # the file was fsync'd, the journal trimmed


async def test_a_failed_commit_records_no_receipt_and_keeps_the_chain(tmp_path: Path) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "inv_j.jsonl"
    store = SQLiteEffectStore(db)
    await store.open()
    try:
        receipts = JournaledReceipts(path, store)
        await receipts.record(_receipt("r0"))
        with pytest.raises(TypeError):  # a response that is not JSON: the op fails
            await receipts.commit("inv_j", "c1", {"x": object()}, 2.0, _receipt("c1"))
        await receipts.record(_receipt("r1"))
    finally:
        await store.close()
    assert _call_ids(path) == ["r0", "r1"]
    assert verify_chain(path) == (2, None)


_CRASHING_WRITER = textwrap.dedent(
    """
    import asyncio, sys, time
    from pathlib import Path
    from supervisor.receipts import make_receipt
    from supervisor.stores.journal import JournaledReceipts
    from supervisor.stores import SQLiteEffectStore

    async def main(db, path):
        store = SQLiteEffectStore(Path(db))
        await store.open()
        receipts = JournaledReceipts(Path(path), store)
        for n in range(5):  # HOSTCALL_FAULT kills us after the 3rd commit
            now = time.time()
            await receipts.record(make_receipt(
                invocation_id="inv_j", execution_id="exe_j", plan_hash="p" * 64,
                call_id=f"r{n}", tool="noop", idempotency_key=None, outcome="refused",
                error_code="tool_not_allowed", approval_id=None, started_at=now, finished_at=now))
        await store.close()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _crash_after_third_journal_commit(db: Path, path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(db), str(path)],
        env={**os.environ, "HOSTCALL_FAULT": "receipt_journaled:3"},
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert _call_ids(path) == ["r0", "r1"]  # the 3rd line is only in the journal
    assert len(_journal_rows(db)) == 3


async def test_a_crash_between_commit_and_file_write_is_completed_at_the_next_start(
    tmp_path: Path,
) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "inv_j.jsonl"
    _crash_after_third_journal_commit(db, path)
    store = SQLiteEffectStore(db)
    await store.open()
    try:
        await JournaledReceipts(path, store).record(_receipt("after"))
    finally:
        await store.close()
    assert _call_ids(path) == ["r0", "r1", "r2", "after"]
    assert verify_chain(path) == (4, None)
    assert _journal_rows(db) == []


@pytest.mark.parametrize(
    "tail",
    [
        b'{"receipt_id":"rcpt_torn","invocation_',  # a write cut by the crash
        # a later page of an unsynced write landed, an earlier one not
        b"\0" * 300 + b'"tool":"noop"}\n',
    ],
    ids=["torn-last-line", "damaged-pages"],
)
async def test_a_damaged_end_is_cut_and_rewritten_from_the_journal(
    tmp_path: Path, tail: bytes
) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "inv_j.jsonl"
    _crash_after_third_journal_commit(db, path)
    with path.open("ab") as f:
        f.write(tail)
    store = SQLiteEffectStore(db)
    await store.open()
    await store.close()
    assert _call_ids(path) == ["r0", "r1", "r2"]
    assert verify_chain(path) == (3, None)


async def test_a_file_that_does_not_continue_the_journal_is_left_alone_and_nothing_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "inv_j.jsonl"
    _crash_after_third_journal_commit(db, path)
    foreign, _ = seal(_receipt("x"), GENESIS_HASH)
    path.write_bytes(foreign)  # someone replaced the file with another chain
    store = SQLiteEffectStore(db)
    await store.open()
    try:
        await JournaledReceipts(path, store).record(_receipt("later"))
    finally:
        await store.close()
    assert _call_ids(path) == ["x", "later"]  # the file goes on from its own end
    assert verify_chain(path) == (2, None)
    aside = Path(f"{path}.unchained")  # the journaled lines, kept for an operator
    assert _call_ids(aside) == ["r0", "r1", "r2"]
    assert verify_chain(aside) == (3, None)
    assert _journal_rows(db) == []
    assert str(aside) in caplog.text


async def test_with_every_commit_inline_the_journal_is_still_trimmed_when_idle(
    tmp_path: Path,
) -> None:
    db, path = tmp_path / "effects.db", tmp_path / "inv_j.jsonl"
    store = SQLiteEffectStore(db)
    store.set_load_hint(lambda: 1)  # one request at a time: nothing goes to the writer
    await store.open()
    try:
        receipts = JournaledReceipts(path, store)
        for n in range(5):
            await receipts.record(_receipt(f"r{n}"))
        assert len(_journal_rows(db)) == 5
        await wait_until(lambda: _journal_rows(db) == [], "the idle writer to trim the journal")
    finally:
        await store.close()
    assert verify_chain(path) == (5, None)


@pytest.mark.parametrize("step", ["_sync", "_finish_batch"])  # the writer's, the loop's
async def test_a_batch_that_breaks_fails_the_waiting_ops_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    store = SQLiteEffectStore(tmp_path / "effects.db")
    await store.open()

    def broken(*_: object) -> object:
        raise RuntimeError("a bug in the store")

    monkeypatch.setattr(store, step, broken)
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            first = asyncio.ensure_future(store.get("inv_j", "c1"))
            second = asyncio.ensure_future(store.get("inv_j", "c2"))
            outcomes = await asyncio.gather(first, second, return_exceptions=True)
            assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
            with pytest.raises(StoreUnavailable):
                await store.get("inv_j", "c3")
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await store.close()


PLAN = """
[plan]
name = "journal"

[tools.charge]
handler = "journal_tools:charge"
"""
TOOLS = """
from supervisor import tool

@tool(reversibility="irreversible")
def charge(account: str) -> dict:
    return {"charged": account}
"""


def test_hostcall_run_killed_after_a_commit_has_its_executed_receipt_after_resume(
    tmp_path: Path,
) -> None:
    (tmp_path / "journal_tools.py").write_text(TOOLS)
    (tmp_path / "plan.toml").write_text(PLAN)
    state = tmp_path / "st"
    calls = json.dumps([["c1", "charge", {"account": "a"}]])
    command = [
        *(sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(state)),
        *("--plan", str(tmp_path / "plan.toml"), "--invocation", "inv_jr", "--"),
        *(sys.executable, str(GUEST), "calls", calls),
    ]
    with subprocess.Popen(
        command,
        env={**os.environ, "HOSTCALL_FAULT": "receipt_journaled:1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as first:
        assert first.stdout is not None
        assert "pid" in json.loads(read_line(first.stdout))  # the guest runs
        # The run kills itself; its sandboxed guest dies with it (S5).
        assert first.wait(timeout=STEP_TIMEOUT_S) == -signal.SIGKILL
    path = state / "receipts" / "inv_jr.jsonl"
    assert not path.exists() or path.read_text() == ""  # the line never reached the file

    second = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S * 2,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    answer = json.loads(second.stdout.splitlines()[1])
    assert answer == {"call_id": "c1", "result": {"charged": "a"}}  # replayed, not rerun
    receipts = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["call_id"], r["outcome"]) for r in receipts] == [
        ("c1", "executed"),  # completed from the journal at the second start
        ("c1", "replayed"),
    ]
    assert receipts[0]["result_sha256"] == receipts[1]["result_sha256"]
    assert verify_chain(path) == (2, None)


def test_the_journal_holds_a_bounded_number_of_chain_heads_and_every_chain_continues(
    tmp_path: Path,
) -> None:
    # One head per receipt file, so per invocation: a supervisor that runs
    # for months must not keep them all. Forgotten heads are read back from
    # their files; a head whose last line is not in its file yet is kept.
    conn = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    conn.executescript(JOURNAL_SCHEMA)
    journal = ReceiptJournal(heads_kept=4)
    files = [tmp_path / "receipts" / f"inv_{n}.jsonl" for n in range(12)]

    def commit(path: Path, call_id: str) -> list[Line]:
        conn.execute("BEGIN IMMEDIATE")
        journal.add(conn, path, _receipt(call_id))
        journal.end_op(kept=True)
        conn.execute("COMMIT")
        return journal.committed()

    for turn in range(3):
        for path in files:
            journal.write(commit(path, f"c{turn}"))
            journal.checkpoint(conn)
            assert journal.heads <= 4
    # Committed but not yet written (the writer has not fsync'd them): a
    # checkpoint meanwhile keeps their heads, or the next line would fork.
    waiting = [commit(path, "c3") for path in files[:6]]
    journal.checkpoint(conn)
    assert journal.heads >= 6
    for lines in waiting:
        journal.write(lines)
    for path in files:
        journal.write(commit(path, "c4"))
    journal.checkpoint(conn)
    journal.close()
    conn.close()

    assert journal.heads <= 4
    for n, path in enumerate(files):
        expected = ["c0", "c1", "c2", "c3", "c4"] if n < 6 else ["c0", "c1", "c2", "c4"]
        assert _call_ids(path) == expected
        assert verify_chain(path) == (len(expected), None)


def test_receipt_files_stay_open_for_appending_and_no_more_of_them_than_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each line is appended through a kept descriptor (no open and close per
    # call); past FILES_KEPT the least recently written file is closed, and a
    # checkpoint still fsyncs it, through its name.
    monkeypatch.setattr("supervisor.stores.journal.FILES_KEPT", 2)
    before = len(os.listdir("/proc/self/fd"))
    conn = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    conn.executescript(JOURNAL_SCHEMA)
    journal = ReceiptJournal()
    files = [tmp_path / "receipts" / f"inv_{n}.jsonl" for n in range(5)]
    connected = len(os.listdir("/proc/self/fd"))
    try:
        for turn in range(2):
            for path in files:
                conn.execute("BEGIN IMMEDIATE")
                journal.add(conn, path, _receipt(f"c{turn}"))
                journal.end_op(kept=True)
                conn.execute("COMMIT")
                journal.write(journal.committed())
                assert len(os.listdir("/proc/self/fd")) - connected <= 2
        journal.checkpoint(conn)
    finally:
        journal.close()
        conn.close()
    assert len(os.listdir("/proc/self/fd")) == before
    for path in files:
        assert _call_ids(path) == ["c0", "c1"]
        assert verify_chain(path) == (2, None)
    assert _journal_rows(tmp_path / "journal.db") == []
