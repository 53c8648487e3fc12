"""The SQLite store's schema and statements, on a connection (no threads, no
transactions of their own): the store runs them in its group commit
(:mod:`supervisor.stores.sqlite`), and the offline readers — ``hostcall
calls``, ``hostcall invocations``, ``hostcall receipts verify`` — run the very
same ones on a read-only connection. As :mod:`supervisor.stores.postgres_sql`
is to the PostgreSQL store.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from supervisor.budget import BudgetLimits, BudgetUse, Charge, budget_allows, charge_refusal
from supervisor.errors import StoreUnavailable
from supervisor.stores.base import (
    Begun,
    EffectRecord,
    EffectStatus,
    InvocationRecord,
    NotPending,
    StartCall,
)
from supervisor.stores.journal import JOURNAL_SCHEMA, journal_lines

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "begin",
    "calls",
    "calls_of",
    "commit",
    "forget_calls",
    "get_effect",
    "get_invocation",
    "known_invocations",
    "list_invocations",
    "mark_unknown",
    "migrate",
    "open_invocation",
    "read_calls",
    "read_invocations",
    "read_only",
    "read_snapshot",
    "refund",
    "reject",
    "rejection",
    "release",
    "reserve",
    "return_reservations",
    "revoke",
    "revoked",
    "unknown_pending",
    "use",
]

T = TypeVar("T")

#: 2: the receipt journal. 3: reservations (an older hostcall would leave
#: them to be given back twice, so it must not open this database).
SCHEMA_VERSION: Final = 3

SCHEMA: Final = (
    """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS invocations (
    invocation_id TEXT PRIMARY KEY,
    plan_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    deadline_at REAL,
    calls_used INTEGER NOT NULL DEFAULT 0,
    cost_used REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tool_usage (
    invocation_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    calls_used INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (invocation_id, tool)
);
CREATE TABLE IF NOT EXISTS effects (
    invocation_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'committed', 'unknown')),
    execution_id TEXT NOT NULL,
    response TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (invocation_id, call_id)
);
CREATE INDEX IF NOT EXISTS effects_by_status ON effects (status);
CREATE TABLE IF NOT EXISTS reservations (
    reservation_id TEXT PRIMARY KEY,
    invocation_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    cost REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS revocations (
    invocation_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    revoked_at REAL NOT NULL,
    PRIMARY KEY (invocation_id, tool)
);
CREATE TABLE IF NOT EXISTS rejections (
    invocation_id TEXT NOT NULL,
    call_id TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    approval_id TEXT NOT NULL,
    rejected_at REAL NOT NULL,
    PRIMARY KEY (invocation_id, call_id)
);
"""
    + JOURNAL_SCHEMA
)

EFFECT_COLUMNS: Final = (
    "invocation_id, call_id, tool, idempotency_key, status, execution_id, response,"
    " created_at, updated_at"
)


def effect(
    row: tuple[Any, ...] | None, parse: Callable[[str], Any] = json.loads
) -> EffectRecord | None:
    """A row of ``effects`` as a record (``parse`` reads its response)."""
    if row is None:
        return None
    inv, call_id, tool, key, status, execution_id, response, created, updated = row
    return EffectRecord(
        inv,
        call_id,
        tool,
        key,
        EffectStatus(status),
        execution_id,
        parse(response) if response is not None else None,
        created,
        updated,
    )


def get_effect(conn: sqlite3.Connection, invocation_id: str, call_id: str) -> EffectRecord | None:
    row = conn.execute(
        f"SELECT {EFFECT_COLUMNS} FROM effects WHERE invocation_id = ? AND call_id = ?",
        (invocation_id, call_id),
    ).fetchone()
    return effect(row)


def get_invocation(conn: sqlite3.Connection, invocation_id: str) -> InvocationRecord | None:
    row = conn.execute(
        "SELECT invocation_id, plan_hash, created_at, deadline_at, calls_used, cost_used"
        " FROM invocations WHERE invocation_id = ?",
        (invocation_id,),
    ).fetchone()
    if row is None:
        return None
    tool_calls = dict(
        conn.execute(
            "SELECT tool, calls_used FROM tool_usage WHERE invocation_id = ?", (invocation_id,)
        ).fetchall()
    )
    return InvocationRecord(row[0], row[1], row[2], row[3], BudgetUse(row[4], row[5], tool_calls))


def list_invocations(conn: sqlite3.Connection) -> list[InvocationRecord]:
    """Every invocation, oldest first."""
    ids = conn.execute("SELECT invocation_id FROM invocations ORDER BY created_at")
    return [r for (i,) in ids.fetchall() if (r := get_invocation(conn, i)) is not None]


def open_invocation(
    conn: sqlite3.Connection,
    invocation_id: str,
    plan_hash: str,
    deadline_at: float | None,
    now: float,
) -> tuple[InvocationRecord, bool]:
    created = conn.execute(
        "INSERT INTO invocations (invocation_id, plan_hash, created_at, deadline_at)"
        " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (invocation_id, plan_hash, now, deadline_at),
    ).rowcount
    record = get_invocation(conn, invocation_id)
    assert record is not None
    return record, created == 1


def reserve(
    conn: sqlite3.Connection,
    reservation_id: str,
    invocation_id: str,
    tool: str,
    cost: float,
    limits: BudgetLimits,
) -> bool:
    # Read and write in one transaction on the only writer: atomic.
    record = get_invocation(conn, invocation_id)
    if record is None or not budget_allows(limits, record.used, tool, cost):
        return False
    use(conn, invocation_id, tool, 1, cost)
    conn.execute(
        "INSERT INTO reservations (reservation_id, invocation_id, tool, cost) VALUES (?, ?, ?, ?)",
        (reservation_id, invocation_id, tool, cost),
    )
    return True


def _take_reservation(
    conn: sqlite3.Connection, reservation_id: str
) -> tuple[str, str, float] | None:
    """Delete a reservation; what it held (invocation, tool, cost), or None if gone."""
    return conn.execute(  # type: ignore[no-any-return]
        "DELETE FROM reservations WHERE reservation_id = ? RETURNING invocation_id, tool, cost",
        (reservation_id,),
    ).fetchone()


def refund(conn: sqlite3.Connection, reservation_id: str) -> None:
    taken = _take_reservation(conn, reservation_id)
    if taken is not None:
        invocation_id, tool, cost = taken
        use(conn, invocation_id, tool, -1, -cost)


def return_reservations(conn: sqlite3.Connection) -> int:
    """Give back every reservation (one supervisor per database: at open, each
    is a crash's leftover, its call never dispatched); how many."""
    taken = conn.execute("DELETE FROM reservations RETURNING invocation_id, tool, cost").fetchall()
    for invocation_id, tool, cost in taken:
        use(conn, invocation_id, tool, -1, -cost)
    return len(taken)


def use(conn: sqlite3.Connection, invocation_id: str, tool: str, calls: int, cost: float) -> bool:
    """Count ``calls`` and ``cost`` against the invocation; whether it exists."""
    updated = conn.execute(
        "UPDATE invocations SET calls_used = calls_used + ?, cost_used = cost_used + ?"
        " WHERE invocation_id = ?",
        (calls, cost, invocation_id),
    ).rowcount
    if updated != 1:
        return False  # no such invocation: no per-tool row for one that may be opened later
    conn.execute(
        "INSERT INTO tool_usage (invocation_id, tool, calls_used) VALUES (?, ?, ?)"
        " ON CONFLICT (invocation_id, tool)"
        " DO UPDATE SET calls_used = calls_used + excluded.calls_used",
        (invocation_id, tool, calls),
    )
    return True


def begin(
    conn: sqlite3.Connection,
    start: StartCall,
    now: float,
    charge: Charge | None,
    reservation: str | None = None,
) -> Begun:
    # One transaction on the only writer: the check, the charge and the
    # insert are atomic, and cost one fsync together. The insert comes first
    # (a new call is the usual case): a row that is already there is read
    # only then, and an insert whose charge does not fit is taken back.
    inserted = (
        conn.execute(
            "INSERT INTO effects (invocation_id, call_id, tool, idempotency_key, status,"
            " execution_id, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, 'pending', ?, ?, ?) ON CONFLICT DO NOTHING",
            (
                start.invocation_id,
                start.call_id,
                start.tool,
                start.idempotency_key,
                start.execution_id,
                now,
                now,
            ),
        ).rowcount
        == 1
    )
    existing = None
    if not inserted:
        existing = get_effect(conn, start.invocation_id, start.call_id)
        if existing is None:
            # Cannot happen under BEGIN IMMEDIATE; if it did, the savepoint
            # rolls the charge back and the call is refused, not run.
            raise sqlite3.IntegrityError("begin lost a race it cannot lose")
        if not start.reruns(existing):
            return Begun(False, existing)
    if reservation is not None and _take_reservation(conn, reservation) is not None:
        charge = None  # paid for by its reservation
    if charge is not None:
        refused = _charge(conn, start.invocation_id, charge, now)
        if refused is not None:
            if inserted:
                conn.execute(
                    "DELETE FROM effects WHERE invocation_id = ? AND call_id = ?",
                    (start.invocation_id, start.call_id),
                )
            return Begun(False, existing, refused)
    if not inserted:
        changed = conn.execute(
            "UPDATE effects SET status = 'pending', execution_id = ?, updated_at = ?"
            " WHERE invocation_id = ? AND call_id = ? AND status = 'unknown'",
            (start.execution_id, now, start.invocation_id, start.call_id),
        ).rowcount
        if changed != 1:
            raise sqlite3.IntegrityError("begin lost a race it cannot lose")
    return Begun(True, start.pending_record(existing, now))


def _charge(
    conn: sqlite3.Connection, invocation_id: str, charge: Charge, now: float
) -> Literal["limits", "deadline"] | None:
    """Take ``charge`` from the invocation's budget, or say why it does not
    fit (:func:`~supervisor.budget.charge_refusal`'s answer). A plan without
    limits only needs the invocation's row to be there: the update that
    counts the call finds it, without reading the budget first."""
    limits = charge.limits
    if limits.max_calls is None and limits.max_cost is None and not limits.tool_max_calls:
        if charge.deadline_at is not None and now >= charge.deadline_at:
            return "deadline"
        return None if use(conn, invocation_id, charge.tool, 1, charge.cost) else "limits"
    refused = charge_refusal(charge, budget_use(conn, invocation_id, charge.tool), now)
    if refused is None:
        use(conn, invocation_id, charge.tool, 1, charge.cost)
    return refused


def budget_use(conn: sqlite3.Connection, invocation_id: str, tool: str) -> BudgetUse | None:
    """What an invocation has used, with ``tool``'s own calls only (all a
    charge of ``tool`` is checked against), in one statement."""
    row = conn.execute(
        "SELECT calls_used, cost_used,"
        " (SELECT calls_used FROM tool_usage WHERE invocation_id = ?1 AND tool = ?2)"
        " FROM invocations WHERE invocation_id = ?1",
        (invocation_id, tool),
    ).fetchone()
    if row is None:
        return None
    return BudgetUse(row[0], row[1], {tool: row[2]} if row[2] is not None else {})


def commit(
    conn: sqlite3.Connection, invocation_id: str, call_id: str, response_json: str, now: float
) -> None:
    updated = conn.execute(
        "UPDATE effects SET status = 'committed', response = ?, updated_at = ?"
        " WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
        (response_json, now, invocation_id, call_id),
    ).rowcount
    if updated != 1:  # raised inside the op: its transaction, receipt line too, rolls back
        raise NotPending(f"the record of {call_id} is no longer pending")


def mark_unknown(conn: sqlite3.Connection, invocation_id: str, call_id: str, now: float) -> None:
    conn.execute(
        "UPDATE effects SET status = 'unknown', updated_at = ?"
        " WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
        (now, invocation_id, call_id),
    )


def release(conn: sqlite3.Connection, invocation_id: str, call_id: str) -> None:
    conn.execute(
        "DELETE FROM effects WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
        (invocation_id, call_id),
    )


def forget_calls(conn: sqlite3.Connection, invocation_id: str) -> int:
    cursor = conn.execute(
        "DELETE FROM effects WHERE invocation_id = ? AND status != 'pending'", (invocation_id,)
    )
    return cursor.rowcount


def revoke(conn: sqlite3.Connection, invocation_id: str, tool: str, now: float) -> None:
    conn.execute(
        "INSERT INTO revocations (invocation_id, tool, revoked_at) VALUES (?, ?, ?)"
        " ON CONFLICT DO NOTHING",
        (invocation_id, tool, now),
    )


def revoked(conn: sqlite3.Connection, invocation_id: str) -> frozenset[str]:
    rows = conn.execute("SELECT tool FROM revocations WHERE invocation_id = ?", (invocation_id,))
    return frozenset(tool for (tool,) in rows.fetchall())


def reject(
    conn: sqlite3.Connection,
    invocation_id: str,
    call_id: str,
    idempotency_key: str,
    approval_id: str,
    now: float,
) -> None:
    conn.execute(
        "INSERT INTO rejections (invocation_id, call_id, idempotency_key, approval_id,"
        " rejected_at) VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
        (invocation_id, call_id, idempotency_key, approval_id, now),
    )


def rejection(conn: sqlite3.Connection, invocation_id: str, call_id: str) -> tuple[str, str] | None:
    row = conn.execute(
        "SELECT idempotency_key, approval_id FROM rejections"
        " WHERE invocation_id = ? AND call_id = ?",
        (invocation_id, call_id),
    ).fetchone()
    return None if row is None else (row[0], row[1])


def calls(conn: sqlite3.Connection, invocation_id: str) -> list[EffectRecord]:
    """An invocation's records, oldest first."""
    return calls_of(conn, [invocation_id])


def calls_of(
    conn: sqlite3.Connection,
    invocation_ids: Collection[str],
    parse: Callable[[str], Any] = json.loads,
) -> list[EffectRecord]:
    """The records of these invocations, oldest first (``parse`` reads responses)."""
    ids = sorted(invocation_ids)
    if not ids:
        return []
    marks = ", ".join("?" * len(ids))
    rows = conn.execute(
        f"SELECT {EFFECT_COLUMNS} FROM effects WHERE invocation_id IN ({marks})"
        " ORDER BY created_at, call_id",
        ids,
    ).fetchall()
    return [r for row in rows if (r := effect(row, parse)) is not None]


def known_invocations(conn: sqlite3.Connection, invocation_ids: Collection[str]) -> frozenset[str]:
    """Those of ``invocation_ids`` the store has."""
    ids = sorted(invocation_ids)
    if not ids:
        return frozenset()
    marks = ", ".join("?" * len(ids))
    rows = conn.execute(
        f"SELECT invocation_id FROM invocations WHERE invocation_id IN ({marks})", ids
    )
    return frozenset(i for (i,) in rows)


def migrate(conn: sqlite3.Connection) -> None:
    """Bring an opened database to :data:`SCHEMA_VERSION` (after :data:`SCHEMA`).

    Raises:
        sqlite3.DatabaseError: it was made by a newer hostcall.
    """
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None:
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
    elif int(row[0]) > SCHEMA_VERSION:
        raise sqlite3.DatabaseError(
            f"schema version {row[0]} is newer than this hostcall ({SCHEMA_VERSION})"
        )
    elif int(row[0]) < SCHEMA_VERSION:  # 1 -> 2: the journal table (SCHEMA made it)
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),)
        )


def unknown_pending(conn: sqlite3.Connection) -> int:
    """Every ``pending`` row becomes ``unknown`` (one supervisor per database:
    at open, each is a crash's leftover); how many."""
    return conn.execute("UPDATE effects SET status = 'unknown' WHERE status = 'pending'").rowcount


# -- offline: a store no supervisor holds ------------------------------------------


def read_only(path: Path, op: Callable[[sqlite3.Connection], T], *, snapshot: bool = False) -> T:
    """``op`` on a read-only connection to a SQLite store no supervisor holds
    (no recovery, no writer thread); with ``snapshot``, every statement of
    ``op`` in one read transaction.

    Raises:
        StoreUnavailable: the file is missing or not a hostcall store.
    """
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"cannot read effect store {path}: {exc}") from exc
    try:
        if snapshot:
            conn.execute("BEGIN")
        return op(conn)
    except (sqlite3.Error, ValueError) as exc:
        raise StoreUnavailable(f"cannot read effect store {path}: {exc}") from exc
    finally:
        conn.close()


def read_invocations(path: Path) -> list[InvocationRecord]:
    """Every invocation of a SQLite store no supervisor holds, oldest first
    (``hostcall invocations`` after a run).

    Raises:
        StoreUnavailable: the file is missing or not a hostcall store.
    """
    return read_only(path, list_invocations, snapshot=True)


def read_snapshot(
    path: Path, invocation_ids: Collection[str], parse: Callable[[str], Any]
) -> tuple[frozenset[str], list[EffectRecord], list[bytes]]:
    """For an audit, in one read transaction of a store no supervisor need
    hold: which of ``invocation_ids`` it has, their records (``parse`` reads
    responses: an audit must read a damaged one too), and every line of the
    receipt journal.

    Raises:
        StoreUnavailable: the file cannot be read.
    """

    def op(conn: sqlite3.Connection) -> tuple[frozenset[str], list[EffectRecord], list[bytes]]:
        known = known_invocations(conn, invocation_ids)
        return known, calls_of(conn, known, parse), journal_lines(conn)

    return read_only(path, op, snapshot=True)


def read_calls(path: Path, invocation_id: str) -> list[EffectRecord] | None:
    """An invocation's records read from a SQLite store no supervisor holds
    (``hostcall calls`` after a run). ``None`` if the invocation is unknown.

    Raises:
        StoreUnavailable: the file is missing or not a hostcall store.
    """

    def op(conn: sqlite3.Connection) -> list[EffectRecord] | None:
        if get_invocation(conn, invocation_id) is None:
            return None
        return calls(conn, invocation_id)

    return read_only(path, op, snapshot=True)
