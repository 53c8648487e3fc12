"""Auditing receipts against their chain, each other and the effect records
(supervisor/audit.py, SPEC §8 and §13).

One honest run makes the state every test starts from: real brokers (two
executions of one invocation) on a real SQLite store, with the receipts
journaled through the store as a supervisor writes them — the code that
records every call, without a guest process (the sandbox is not what these
tests are about). Each test works on its own copy and tampers with it as an
attacker with the state dir would: rewriting receipts and recomputing the
whole chain, or changing the store's rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import shutil
import sqlite3
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from supervisor.approvals import ApprovalController
from supervisor.audit import (
    AuditCache,
    EffectsSnapshot,
    ReceiptAudit,
    SQLiteEffectsView,
    audit_receipts,
    effects_for,
)
from supervisor.broker import Broker
from supervisor.canonical import jcs, sha256_hex
from supervisor.errors import StoreUnavailable
from supervisor.ids import new_id
from supervisor.plan import Plan
from supervisor.receipts import GENESIS_HASH, seal, verify_chain
from supervisor.stores import SQLiteEffectStore
from supervisor.stores.journal import JournaledReceipts
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan

INVOCATION = "inv_audit"

#: The honest run: per execution, each request and the receipt it leaves.
HONEST: list[list[tuple[str, str, dict[str, Any], str]]] = [
    [
        ("c1", "charge", {"account": "a", "cents": 5}, "executed"),
        ("c1", "charge", {"account": "a", "cents": 5}, "replayed"),
        ("n1", "nope", {}, "refused"),
        ("b1", "broken", {"x": 1}, "failed"),
        # released: a plain error leaves no effect, so it runs again
        ("b1", "broken", {"x": 1}, "failed"),
        ("m1", "flaky_send", {"to": "x@example.com"}, "unknown"),  # irreversible, ambiguous
        ("m1", "flaky_send", {"to": "x@example.com"}, "unknown"),  # ... never run again
        ("r1", "flaky_read", {"key": "k"}, "unknown"),  # reversible, timed out
        ("r1", "flaky_read", {"key": "k"}, "executed"),  # ... so it runs again (SPEC §5)
        ("x1", "bad_result", {}, "result_invalid"),
        ("x1", "bad_result", {}, "replayed"),
    ],
    [  # a second execution of the same invocation
        ("c1", "charge", {"account": "a", "cents": 5}, "replayed"),
        ("l1", "lookup", {"account": "a"}, "executed"),
    ],
]
RECEIPTS = [(call_id, outcome) for execution in HONEST for call_id, _, _, outcome in execution]


def _broker(plan: Plan, store: SQLiteEffectStore, receipts: JournaledReceipts) -> Broker:
    """A broker as the supervisor makes one for a new execution."""
    return Broker(
        plan=plan,
        invocation_id=INVOCATION,
        execution_id=new_id("exe"),
        store=store,
        approvals=ApprovalController(),
        receipts=receipts,
        dispatch_blocker=lambda: None,
    )


async def _honest_run(state: Path, *, audit_while_open: bool = False) -> ReceiptAudit | None:
    ledger = Ledger()
    plan = billing_plan(ledger)
    store = SQLiteEffectStore(state / "effects.db")
    await store.open()
    live: ReceiptAudit | None = None
    try:
        await store.open_invocation(INVOCATION, plan.plan_hash, None, time.time())
        receipts = JournaledReceipts(_receipts_file(state), store)
        for execution in HONEST:
            broker = _broker(plan, store, receipts)
            for call_id, tool, args, _ in execution:
                await broker.call(call_id, tool, args)
        if audit_while_open:  # the store's writer thread is running, its WAL open
            path = _receipts_file(state)
            live = audit_receipts(path, effects=SQLiteEffectsView(state / "effects.db"))
    finally:
        await store.close()
    assert (ledger.runs["charge"], ledger.runs["broken"], ledger.runs["flaky_read"]) == (1, 2, 2)
    return live


def _receipts_file(state: Path) -> Path:
    return state / "receipts" / f"{INVOCATION}.jsonl"


@pytest.fixture(scope="module")
def honest_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("honest") / "state"

    async def bounded() -> None:
        async with asyncio.timeout(STEP_TIMEOUT_S * 4):
            await _honest_run(state)

    asyncio.run(bounded())
    return state


@pytest.fixture
def state(honest_state: Path, tmp_path: Path) -> Path:
    """This test's own copy of the honest run's state dir (no supervisor holds it)."""
    copy = tmp_path / "state"
    shutil.copytree(honest_state, copy)
    return copy


# -- tampering as an attacker with the state dir would ------------------------


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _rechain(path: Path, receipts: list[dict[str, Any]]) -> None:
    """Write ``receipts`` with every hash recomputed: the chain stays intact."""
    prev, lines = GENESIS_HASH, []
    for receipt in receipts:
        body = {k: v for k, v in receipt.items() if k not in ("prev_hash", "hash")}
        line, prev = seal(body, prev)
        lines.append(line)
    path.write_bytes(b"".join(lines))
    assert verify_chain(path) == (len(receipts), None)


def _line_of(receipts: list[dict[str, Any]], call_id: str, outcome: str) -> int:
    return next(
        n
        for n, r in enumerate(receipts, start=1)
        if (r["call_id"], r["outcome"]) == (call_id, outcome)
    )


@contextlib.contextmanager
def _store(state: Path) -> Iterator[sqlite3.Connection]:
    """A writable connection to the store, as an attacker with the state dir has."""
    conn = sqlite3.connect(state / "effects.db", isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def _audit(state: Path) -> ReceiptAudit:
    return audit_receipts(_receipts_file(state), effects=SQLiteEffectsView(state / "effects.db"))


def _found(audit: ReceiptAudit) -> list[tuple[str, int | None]]:
    return [(f.rule, f.line) for f in audit.findings]


# -- honest runs ----------------------------------------------------------------


def test_an_honest_run_with_every_outcome_and_a_reversible_rerun_has_no_finding(
    state: Path,
) -> None:
    path = _receipts_file(state)
    assert [(r["call_id"], r["outcome"]) for r in _read(path)] == RECEIPTS

    audit = _audit(state)

    assert audit.ok
    assert audit.findings == ()
    assert audit.lines() == []
    assert audit.summary() == (
        f"{path}: {len(RECEIPTS)} receipt(s), hash chain intact; "
        f"they agree with the effect records in {state / 'effects.db'}"
    )


async def test_an_audit_while_a_supervisor_still_holds_the_store_finds_nothing(
    tmp_path: Path,
) -> None:
    async with asyncio.timeout(STEP_TIMEOUT_S * 4):
        live = await _honest_run(tmp_path / "state", audit_while_open=True)
    assert live is not None
    assert live.findings == ()
    assert live.receipts == len(RECEIPTS)


async def test_a_store_audited_while_closed_opens_as_usual_afterwards(state: Path) -> None:
    assert _audit(state).findings == ()
    store = SQLiteEffectStore(state / "effects.db")
    async with asyncio.timeout(STEP_TIMEOUT_S):
        assert await store.open() == 0  # nothing pending to recover, nothing broken
        try:
            [record] = [r for r in await store.calls(INVOCATION) if r.call_id == "l1"]
            assert record.response is not None
            assert record.response["result"] == {"account": "a"}
        finally:
            await store.close()
    assert _audit(state).findings == ()


# -- receipts rewritten with a recomputed chain --------------------------------


def test_a_rewritten_result_with_a_recomputed_chain_disagrees_with_the_stored_result(
    state: Path,
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    forged = sha256_hex(jcs({"charge_id": "ch_999", "account": "a", "cents": 5}))
    for receipt in receipts:
        if receipt["call_id"] == "c1":
            receipt["result_sha256"] = forged
    _rechain(path, receipts)

    audit = _audit(state)

    c1_lines = [n for n, r in enumerate(receipts, start=1) if r["call_id"] == "c1"]
    assert _found(audit) == [("record_mismatch", n) for n in c1_lines]
    assert not audit.ok
    first = audit.lines()[0]
    assert first.startswith(f"{path}: line {c1_lines[0]}: executed receipt of call c1 (charge)")
    assert f"result_sha256 {forged} is not the stored result's" in first
    assert "treat this state dir as tampered with" in first


def test_a_forged_second_executed_receipt_with_a_correct_chain_is_a_double_execution(
    state: Path,
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    receipts.append({**receipts[0], "receipt_id": "rcpt_forged"})  # c1 executed, again
    _rechain(path, receipts)

    for effects in (None, SQLiteEffectsView(state / "effects.db")):
        audit = audit_receipts(path, effects=effects)
        assert _found(audit) == [("double_execution", len(receipts))]
        assert not audit.ok
    [line] = audit.lines()
    assert line.startswith(f"{path}: line {len(receipts)}: call c1 (charge) of {INVOCATION}")
    assert "line 1 already recorded it executed" in line


def test_an_unknown_receipt_between_two_executed_ones_does_not_excuse_the_second(
    state: Path,
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    executed = receipts[0]
    unknown = {**executed, "outcome": "unknown", "error_code": "unknown", "result_sha256": None}
    receipts += [unknown, {**executed, "receipt_id": "rcpt_forged"}]
    _rechain(path, receipts)

    audit = audit_receipts(path, effects=None)

    assert _found(audit) == [("double_execution", len(receipts))]


def test_a_result_invalid_receipt_forged_after_an_executed_one_is_a_double_execution(
    state: Path,
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    executed = receipts[0]
    receipts.append({**executed, "outcome": "result_invalid", "result_sha256": None})
    _rechain(path, receipts)

    audit = _audit(state)

    # Twice wrong: run twice, and the store holds c1's result, not an error.
    assert _found(audit) == [
        ("double_execution", len(receipts)),
        ("record_mismatch", len(receipts)),
    ]


@pytest.mark.parametrize(("call_id", "outcome"), [("c1", "executed"), ("x1", "result_invalid")])
def test_a_deleted_receipt_of_a_commit_with_a_recomputed_chain_is_found_through_the_store(
    state: Path, call_id: str, outcome: str
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    del receipts[_line_of(receipts, call_id, outcome) - 1]
    _rechain(path, receipts)

    audit = _audit(state)

    assert _found(audit) == [("unreceipted_commit", None)]
    assert not audit.ok
    [line] = audit.lines()
    assert line.startswith(f"{path}: call {call_id} ")
    assert "no executed or result_invalid receipt records it" in line
    # Without the store, nothing in the file itself gives it away.
    assert audit_receipts(path, effects=None).findings == ()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"outcome": "Executed"}, "outcome 'Executed'"),
        ({"outcome": ["executed"]}, "outcome ['executed']"),
        ({"call_id": 1}, "call_id is not a string"),
        ({"invocation_id": None}, "invocation_id is not a string"),
    ],
)
def test_a_line_hostcall_never_writes_is_reported_even_with_a_correct_chain(
    state: Path, change: dict[str, Any], problem: str
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    receipts.append({**receipts[0], **change})
    _rechain(path, receipts)

    audit = audit_receipts(path, effects=SQLiteEffectsView(state / "effects.db"))

    assert _found(audit) == [("malformed", len(receipts))]
    assert problem in audit.lines()[0]
    assert "this line was forged or damaged" in audit.lines()[0]


# -- the store changed instead of the receipts ---------------------------------


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (
            "UPDATE effects SET response = json_set(response, '$.result.cents', 500000)",
            "is not the stored result's",
        ),
        ("UPDATE effects SET status = 'unknown', response = NULL", "the effect record is unknown"),
        ("DELETE FROM effects", "there is no effect record"),
        ("UPDATE effects SET idempotency_key = 'k'", "with idempotency_key k"),
        ("UPDATE effects SET response = 'not json'", "the stored response is unreadable"),
    ],
)
def test_a_changed_store_row_disagrees_with_every_receipt_of_its_call(
    state: Path, change: str, problem: str
) -> None:
    receipts = _read(_receipts_file(state))
    with _store(state) as conn:
        conn.execute(f"{change} WHERE invocation_id = ? AND call_id = 'c1'", (INVOCATION,))

    audit = _audit(state)

    c1_lines = [n for n, r in enumerate(receipts, start=1) if r["call_id"] == "c1"]
    assert _found(audit) == [("record_mismatch", n) for n in c1_lines]
    assert all(problem in line for line in audit.lines())
    assert verify_chain(_receipts_file(state)) == (len(receipts), None)


def test_a_stored_error_in_place_of_a_result_disagrees_with_the_executed_receipt(
    state: Path,
) -> None:
    with _store(state) as conn:
        (response,) = conn.execute(
            "SELECT response FROM effects WHERE call_id = 'x1' AND invocation_id = ?",
            (INVOCATION,),
        ).fetchone()
        conn.execute(
            "UPDATE effects SET response = ? WHERE call_id = 'l1' AND invocation_id = ?",
            (response, INVOCATION),
        )

    audit = _audit(state)

    [finding] = audit.findings
    assert (finding.rule, finding.line) == ("record_mismatch", len(RECEIPTS))
    assert "the stored response is result_invalid" in finding.message


# -- what a live or a crashed store legitimately looks like --------------------


def test_a_receipt_still_in_the_stores_journal_counts_as_written(state: Path) -> None:
    # A crash between the commit and the file write (or a live supervisor a
    # moment before it writes): the line is only in the store's journal.
    path = _receipts_file(state)
    data = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(data[:-1]))
    last = json.loads(data[-1])
    assert (last["call_id"], last["outcome"]) == ("l1", "executed")
    with _store(state) as conn:
        conn.execute(
            "INSERT INTO receipt_journal (seq, path, hash, line) VALUES (1, ?, ?, ?)",
            (str(path), last["hash"], data[-1]),
        )

    audit = _audit(state)

    assert audit.findings == ()
    assert audit.receipts == len(RECEIPTS) - 1


@dataclasses.dataclass
class _Moving:
    """A view over a real store during whose read the supervisor writes a
    committed call's line to the file (after the file was read)."""

    inner: SQLiteEffectsView
    path: Path
    late_line: bytes
    source: str = "the moving store"
    receipts_share_commit: bool = True

    def snapshot(self, invocation_ids: Collection[str]) -> EffectsSnapshot:
        taken = self.inner.snapshot(invocation_ids)
        with self.path.open("ab") as f:
            f.write(self.late_line)
        return taken


def test_a_commit_whose_receipt_reaches_the_file_during_the_audit_is_not_reported(
    state: Path,
) -> None:
    path = _receipts_file(state)
    data = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(data[:-1]))
    moving = _Moving(SQLiteEffectsView(state / "effects.db"), path, data[-1])

    audit = audit_receipts(path, effects=moving)

    assert audit.findings == ()
    assert verify_chain(path) == (len(RECEIPTS), None)


@dataclasses.dataclass
class _ReceiptAfterCommit:
    """The seam a store without a receipt journal (PostgreSQL) plugs into:
    its receipt is written after the commit, so a crash can separate them."""

    inner: SQLiteEffectsView
    source: str = "the replicas' store"
    receipts_share_commit: bool = False

    def snapshot(self, invocation_ids: Collection[str]) -> EffectsSnapshot:
        return self.inner.snapshot(invocation_ids)


def test_a_commit_without_receipt_is_only_a_warning_where_a_crash_can_separate_them(
    state: Path,
) -> None:
    path = _receipts_file(state)
    receipts = _read(path)
    del receipts[_line_of(receipts, "c1", "executed") - 1]
    _rechain(path, receipts)

    audit = audit_receipts(
        path, effects=_ReceiptAfterCommit(SQLiteEffectsView(state / "effects.db"))
    )

    assert audit.ok
    assert [(f.rule, f.severity) for f in audit.findings] == [("unreceipted_commit", "warning")]
    assert audit.lines()[0].startswith(f"{path}: warning: call c1 (charge) is committed")
    assert "a crash between the commit and its receipt" in audit.lines()[0]
    assert audit.summary().endswith("; they agree with the replicas' store; 1 warning(s)")


async def test_receipts_of_an_invocation_another_store_ran_are_not_cross_checked(
    state: Path, tmp_path: Path
) -> None:
    other = SQLiteEffectStore(tmp_path / "other.db")
    await other.open()
    await other.close()

    audit = audit_receipts(_receipts_file(state), effects=SQLiteEffectsView(tmp_path / "other.db"))

    assert audit.ok
    assert _found(audit) == [("not_in_store", None)]
    assert f"invocation {INVOCATION} is not in the effect records in" in audit.lines()[0]


# -- the chain, as verify_chain sees it ----------------------------------------


def test_a_changed_line_without_a_recomputed_chain_breaks_it_and_is_still_checked(
    state: Path,
) -> None:
    path = _receipts_file(state)
    lines = path.read_text().splitlines(keepends=True)
    forged = sha256_hex(jcs({"charge_id": "ch_999"}))
    lines[0] = lines[0].replace(json.loads(lines[0])["result_sha256"], forged)
    path.write_text("".join(lines))

    audit = _audit(state)

    count, broken = verify_chain(path)
    assert broken is not None
    assert (count, broken.line) == (0, 1)
    assert _found(audit) == [("chain", 1), ("record_mismatch", 1)]
    assert audit.lines()[0] == (
        f"{path}: line 1: {broken.problem} (0 receipt(s) before it verified)"
    )
    assert not audit.chain_intact
    assert audit.summary().startswith(f"{path}: {len(RECEIPTS)} receipt(s), hash chain broken")


def test_an_unreadable_file_raises_and_an_unreadable_store_says_so(
    state: Path, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        audit_receipts(tmp_path / "missing.jsonl", effects=None)
    (tmp_path / "junk.db").write_bytes(b"not a database, just junk" * 100)
    with pytest.raises(StoreUnavailable, match="cannot read effect store"):
        audit_receipts(_receipts_file(state), effects=SQLiteEffectsView(tmp_path / "junk.db"))


# -- which store a file is checked against -------------------------------------


def test_the_store_beside_a_receipts_folder_is_found_and_a_named_state_dir_must_hold_one(
    state: Path, tmp_path: Path
) -> None:
    path = _receipts_file(state)
    beside = effects_for(path, None)
    assert beside is not None
    assert beside.path == state / "effects.db"

    elsewhere = tmp_path / "copy.jsonl"
    shutil.copy(path, elsewhere)
    assert effects_for(elsewhere, None) is None
    named = effects_for(elsewhere, state)
    assert named is not None
    assert named.path == state / "effects.db"
    with pytest.raises(StoreUnavailable, match="no effect store to check against"):
        effects_for(elsewhere, tmp_path)


# -- going on from an earlier audit -------------------------------------------


def test_an_audit_going_on_from_the_last_finds_what_a_fresh_one_does(state: Path) -> None:
    """The admin API's worker audits the same files every few seconds, from
    where it stopped: a file that changed anywhere but at its end must be
    read afresh, and a line still being written must be read again."""
    path = _receipts_file(state)
    honest = path.read_bytes()
    lines = honest.splitlines(keepends=True)
    receipts = _read(path)
    forged_line = _line_of(receipts, "c1", "executed")
    changed = honest.replace(b'"tool":"charge"', b'"tool":"chargf"', 1)  # same length
    assert len(changed) == len(honest) and changed != honest
    growing = [
        b"".join(lines[:3]),  # the first calls
        b"".join(lines[:3]) + lines[3][:40],  # the next line, half written
        b"".join(lines[:5]),  # finished, and one more
        honest,  # all of them
        changed,  # a line read before, changed in place
        honest,  # put back
        b"".join(lines[:2] + lines[3:]),  # a line read before, removed
        honest[: len(lines[0]) + 10],  # cut short inside the second line
        honest + lines[forged_line - 1],  # a second executed receipt appended
    ]
    effects = SQLiteEffectsView(state / "effects.db")
    cache = AuditCache()
    resumed: list[bool] = []
    resume = cache.resume

    def told(path: Path, f: BinaryIO) -> Any:
        reading = resume(path, f)
        resumed.append(reading is not None)
        return reading

    cache.resume = told  # type: ignore[method-assign]
    going_on, fresh = [], []
    for content in growing:
        path.write_bytes(content)
        going_on.append(audit_receipts(path, effects=effects, cache=cache))
        fresh.append(audit_receipts(path, effects=effects))
    assert going_on == fresh
    # It did go on where the file had only grown (else this proves nothing).
    assert resumed == [False, True, True, True, False, False, False, False, True]
    intact = [True, False, True, True, False, True, False, False, False]
    assert [a.chain_intact for a in fresh] == intact
    assert "double_execution" in {f.rule for f in fresh[-1].findings}
