"""The default effect store: one SQLite database in WAL mode (SPEC §6).

One connection, used by one thread at a time. Operations queued while a
transaction is being committed share the next one (group commit): their
statements run on the event loop's thread, each inside its own SAVEPOINT so one
failing operation does not undo its neighbours, and the ``COMMIT`` with its
fsync runs on a writer thread while the loop keeps serving. The writer touches
no Python-heavy work, so the two threads do not trade the GIL per statement.
When nothing could share a transaction (:attr:`SQLiteEffectStore.inline_when`
says the caller's request is the only one) the commit runs on the loop too: no
hand-off to the writer and back. ``synchronous=FULL``: when ``begin`` returns,
its ``pending`` row is on disk. Receipts are journaled in the same transactions
(:mod:`supervisor.stores.journal`): a committed call and its receipt share one
fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar, cast

from supervisor.errors import StoreUnavailable
from supervisor.plan import BudgetLimits
from supervisor.stores.base import (
    Begun,
    BudgetUse,
    Charge,
    EffectRecord,
    EffectStatus,
    InvocationRecord,
    StartCall,
    budget_allows,
    charge_refusal,
)
from supervisor.stores.journal import CHECKPOINT_ROWS, JOURNAL_SCHEMA, ReceiptJournal

__all__ = ["SCHEMA_VERSION", "SQLiteEffectStore", "read_calls"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: 2: the receipt journal.
SCHEMA_VERSION: Final = 2
#: How long the writer waits idle before it fsyncs journaled receipt files.
CHECKPOINT_IDLE_S: Final = 0.2
#: Most operations one transaction takes; the rest wait for the next one.
MAX_BATCH: Final = 256
#: Tries to open a new store while another connection switches it to WAL.
_OPEN_ATTEMPTS: Final = 20
_OPEN_BACKOFF_S: Final = 0.01
#: How long SQLite waits for a lock held by a reader (e.g. ``hostcall calls``).
BUSY_TIMEOUT_MS: Final = 5000

_SCHEMA: Final = (
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
CREATE TABLE IF NOT EXISTS revocations (
    invocation_id TEXT NOT NULL,
    tool TEXT NOT NULL,
    revoked_at REAL NOT NULL,
    PRIMARY KEY (invocation_id, tool)
);
"""
    + JOURNAL_SCHEMA
)

_EFFECT_COLUMNS: Final = (
    "invocation_id, call_id, tool, idempotency_key, status, execution_id, response,"
    " created_at, updated_at"
)

_Op = Callable[[sqlite3.Connection], Any]
_Outcome = tuple[Any, BaseException | None]  # an op's result, or its error
_Settled = tuple["asyncio.Future[Any]", Any, BaseException | None]
#: How soon a batch tries again while the writer holds the connection for a checkpoint.
_BUSY_RETRY_S: Final = 0.001
#: Bound on close() waiting for queued ops.
CLOSE_DRAIN_S: Final = 30.0


def _effect(row: tuple[Any, ...] | None) -> EffectRecord | None:
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
        json.loads(response) if response is not None else None,
        created,
        updated,
    )


def _get_effect(conn: sqlite3.Connection, invocation_id: str, call_id: str) -> EffectRecord | None:
    row = conn.execute(
        f"SELECT {_EFFECT_COLUMNS} FROM effects WHERE invocation_id = ? AND call_id = ?",
        (invocation_id, call_id),
    ).fetchone()
    return _effect(row)


def _get_invocation(conn: sqlite3.Connection, invocation_id: str) -> InvocationRecord | None:
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


class SQLiteEffectStore:
    """:class:`~supervisor.stores.base.EffectStore` in a SQLite file.

    One supervisor per database (the state dir's lock guarantees it), so on
    :meth:`open` every ``pending`` row is a leftover of a crash and becomes
    ``unknown``.
    """

    #: Records survive the process (receipts share its transactions:
    #: :class:`~supervisor.receipts.JournaledReceipts`).
    durable = True

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: Batches to commit (their futures and outcomes); None stops the writer.
        self._queue: queue.SimpleQueue[tuple[list[asyncio.Future[Any]], list[_Outcome]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._journal = ReceiptJournal()
        self._conn: sqlite3.Connection | None = None
        self._pending: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._committing = False  # a batch's COMMIT is on the writer thread
        self._closing = False
        self._failed: BaseException | None = None  # why the writer thread died
        self._scheduled = False  # _start_batch is due on the loop
        self._idle = asyncio.Event()
        #: Held while a transaction or checkpoint uses the connection.
        self._busy = threading.Lock()
        #: When set and true, an operation that finds the writer idle runs on
        #: the event loop's thread: one request alone has nothing to share a
        #: transaction with. The supervisor sets it to "the channel serves
        #: one request at most"; under load every operation goes to the writer.
        self.inline_when: Callable[[], bool] | None = None

    # -- the writer thread ------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Switching a new file to WAL takes an exclusive lock that SQLite does
        # not wait for: two processes opening one new store at once can see
        # "database is locked". Retry that, boundedly.
        for attempt in range(_OPEN_ATTEMPTS):
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute("PRAGMA synchronous = FULL")
                conn.executescript(_SCHEMA)
            except sqlite3.OperationalError as exc:
                conn.close()
                if "locked" not in str(exc) or attempt == _OPEN_ATTEMPTS - 1:
                    raise
                time.sleep(_OPEN_BACKOFF_S * (attempt + 1))
            except BaseException:
                conn.close()
                raise
            else:
                return conn
        raise AssertionError("unreachable")

    def _serve(self, conn: sqlite3.Connection) -> None:
        """The writer thread: commits (the fsync) and checkpoints, nothing else."""
        try:
            while True:
                try:
                    # Woken now and then also with nothing queued: inline
                    # commits journal lines without passing through here.
                    job = self._queue.get(timeout=CHECKPOINT_IDLE_S)
                except queue.Empty:
                    self._checkpoint(conn)  # idle: make the receipt files durable
                    continue
                if job is None:
                    self._checkpoint(conn)
                    return
                # _busy was taken on the loop by _start_batch; _committed, back
                # on the loop, releases it (no race with the next batch there).
                futures, outcomes = job
                assert self._loop is not None
                try:
                    outcomes = self._finish_batch(conn, outcomes)
                    if self._journal.unsynced >= CHECKPOINT_ROWS:
                        self._trim(conn)  # once per CHECKPOINT_ROWS lines: this batch waits
                except Exception as exc:  # a bug: fail this batch and what waits, not hang
                    logger.exception("effect store %s: the writer thread failed", self.path)
                    failed = sqlite3.DatabaseError(f"the writer thread failed: {exc!r}")
                    self._loop.call_soon_threadsafe(self._committed, [], failed)
                    lost: list[_Settled] = [(f, None, failed) for f in futures]
                    self._loop.call_soon_threadsafe(self._committed, lost)
                    return
                settled = [(f, *o) for f, o in zip(futures, outcomes, strict=True)]
                self._loop.call_soon_threadsafe(self._committed, settled)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """When idle: trim the journal unless a batch holds the connection
        (its commit trims it when due; the next idle moment retries)."""
        if self._busy.acquire(blocking=False):
            try:
                self._trim(conn)
            finally:
                self._busy.release()

    def _trim(self, conn: sqlite3.Connection) -> None:
        if not self._journal.unsynced:
            return
        try:
            self._journal.checkpoint(conn)
        except sqlite3.Error as exc:  # the rows stay; the next checkpoint or start retries
            logger.error("effect store %s: cannot trim the receipt journal: %s", self.path, exc)

    # -- transactions (the caller holds _busy) --------------------------------

    def _begin_batch(self, conn: sqlite3.Connection, ops: list[_Op]) -> tuple[list[_Outcome], bool]:
        """``BEGIN`` and run ``ops``, each in its own savepoint when there are
        several, so one failing op does not undo its neighbours. Returns each
        op's result or error, and whether a transaction is open to commit."""
        outcomes: list[_Outcome] = []
        alone = len(ops) == 1  # no neighbours to protect: no savepoint
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                if not alone:
                    conn.execute("SAVEPOINT op")
                try:
                    result = op(conn)
                except Exception as exc:  # boundary: the store must outlive any one op
                    if alone:
                        self._abort(conn)
                        return [(None, exc)], False
                    self._journal.end_op(kept=False)
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    outcomes.append((None, exc))
                else:
                    if not alone:
                        conn.execute("RELEASE op")
                    self._journal.end_op(kept=True)
                    outcomes.append((result, None))
        except sqlite3.Error as exc:
            self._abort(conn)
            return [(None, exc) for _ in ops], False
        return outcomes, True

    def _finish_batch(self, conn: sqlite3.Connection, outcomes: list[_Outcome]) -> list[_Outcome]:
        """``COMMIT`` (one fsync for the batch), then the journaled lines go
        to their files; if the commit fails every op gets its error."""
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._abort(conn)
            return [(None, exc) for _ in outcomes]
        self._journal.end_batch(committed=True)
        return outcomes

    def _abort(self, conn: sqlite3.Connection) -> None:
        """Roll the batch back, and the journal lines it chained."""
        self._journal.end_op(kept=False)
        self._journal.end_batch(committed=False)
        with contextlib.suppress(sqlite3.Error):  # e.g. a connection already closed
            if conn.in_transaction:
                conn.rollback()

    # -- the loop side ----------------------------------------------------------

    async def _run(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``op`` in a transaction; returns once that transaction is on disk.

        Ops queued while a commit is being written form the next batch: their
        statements run on the loop's thread (the connection is used by one
        thread at a time, under ``_busy``), the ``COMMIT`` and its fsync on the
        writer thread, so the loop keeps serving while the disk works. A
        request alone (:attr:`inline_when`) also commits on the loop: there is
        nothing to overlap, and no hand-off to pay for.
        """
        if self._thread is None or self._loop is None:
            raise RuntimeError("SQLiteEffectStore used before open() or after close()")
        if self._failed is not None or not self._thread.is_alive():
            raise StoreUnavailable(f"effect store {self.path}: its writer thread has stopped")
        inline = self.inline_when
        if (
            inline is not None
            and not self._pending
            and not self._committing
            and inline()
            and self._busy.acquire(blocking=False)
        ):
            try:
                assert self._conn is not None
                outcomes, open_ = self._begin_batch(self._conn, [op])
                if open_:
                    outcomes = self._finish_batch(self._conn, outcomes)
                if self._journal.unsynced >= CHECKPOINT_ROWS:
                    self._trim(self._conn)  # once per CHECKPOINT_ROWS lines
            finally:
                self._busy.release()
            [(result, error)] = outcomes
            if isinstance(error, sqlite3.Error):
                raise StoreUnavailable(f"effect store {self.path}: {error}") from error
            if error is not None:
                raise error
            return cast(T, result)
        future: asyncio.Future[T] = self._loop.create_future()
        self._pending.append((op, future))
        self._idle.clear()
        self._kick()
        try:
            return await future
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"effect store {self.path}: {exc}") from exc

    def _kick(self) -> None:
        """Start the next batch at the end of this loop iteration, unless a
        commit is being written (its completion kicks again)."""
        if self._pending and not self._committing and not self._scheduled:
            assert self._loop is not None
            self._scheduled = True
            self._loop.call_soon(self._start_batch)
        elif not self._pending and not self._committing and not self._scheduled:
            self._idle.set()

    def _start_batch(self) -> None:
        self._scheduled = False
        if self._failed is not None or self._closing:
            self._fail_pending()
            return
        if self._committing or not self._pending:
            self._kick()
            return
        if not self._busy.acquire(blocking=False):  # the writer is checkpointing
            assert self._loop is not None
            self._scheduled = True
            self._loop.call_later(_BUSY_RETRY_S, self._start_batch)
            return
        batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        assert self._conn is not None
        try:
            outcomes, open_ = self._begin_batch(self._conn, [op for op, _ in batch])
        except BaseException:
            self._busy.release()
            raise
        if not open_:  # nothing to commit: the ops failed
            self._busy.release()
            _settle([(f, *o) for (_, f), o in zip(batch, outcomes, strict=True)])
            self._kick()
            return
        self._committing = True  # _busy stays held until the writer has committed
        self._queue.put(([f for _, f in batch], outcomes))

    def _committed(self, settled: list[_Settled], failed: BaseException | None = None) -> None:
        if failed is not None:  # the writer thread is gone: nothing more will commit
            self._failed = failed
            self._fail_pending()
            return
        self._committing = False
        self._busy.release()
        try:
            if self._pending and not self._scheduled:
                # What queued up during the commit goes to the disk now, not a
                # loop turn later: the commit is the one serial step.
                self._scheduled = True
                self._start_batch()
        finally:
            _settle(settled)
            self._kick()

    def _fail_pending(self) -> None:
        """Answer every queued op with an error (the store is closing or broken)."""
        pending, self._pending = self._pending, []
        error = self._failed or sqlite3.OperationalError("the effect store was closed")
        _settle([(future, None, error) for _, future in pending])
        if not self._committing:
            self._idle.set()

    # -- lifecycle ----------------------------------------------------------

    async def open(self) -> int:
        if self._thread is not None:
            raise RuntimeError("SQLiteEffectStore.open() called twice")
        try:
            conn = await asyncio.to_thread(self._connect)
        except (sqlite3.Error, OSError) as exc:  # OSError: the folder cannot be made
            raise StoreUnavailable(f"cannot open effect store {self.path}: {exc}") from exc
        self._loop = asyncio.get_running_loop()
        self._conn = conn
        self._idle = asyncio.Event()
        self._idle.set()
        # A fresh start also after an open() that failed and closed.
        self._journal = ReceiptJournal()
        self._pending, self._committing, self._scheduled = [], False, False
        self._closing, self._failed = False, None
        self._thread = threading.Thread(
            target=self._serve, args=(conn,), name="hostcall-sqlite", daemon=True
        )
        self._thread.start()

        def migrate_and_recover(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None:
                conn.execute(
                    "INSERT INTO meta (key, value) VALUES ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            elif int(row[0]) > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(
                    f"schema version {row[0]} is newer than this hostcall ({SCHEMA_VERSION})"
                )
            elif int(row[0]) < SCHEMA_VERSION:  # 1 -> 2: the journal table (_SCHEMA made it)
                conn.execute(
                    "UPDATE meta SET value = ? WHERE key = 'schema_version'",
                    (str(SCHEMA_VERSION),),
                )
            self._journal.recover(conn)  # receipt lines a crash kept out of their files
            return conn.execute(
                "UPDATE effects SET status = 'unknown' WHERE status = 'pending'"
            ).rowcount

        try:
            return await self._run(migrate_and_recover)
        except BaseException:
            await self.close()  # a store that failed to open holds no thread
            raise

    async def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            # Queued ops still run (each is bounded by SQLite's busy timeout);
            # whatever is still queued after CLOSE_DRAIN_S fails, not hangs.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_DRAIN_S):
                    await self._idle.wait()
            self._closing = True
            self._fail_pending()
            self._queue.put(None)
            await asyncio.to_thread(thread.join)

    # -- invocations and budget -------------------------------------------

    async def open_invocation(
        self, invocation_id: str, plan_hash: str, deadline_at: float | None, now: float
    ) -> tuple[InvocationRecord, bool]:
        def op(conn: sqlite3.Connection) -> tuple[InvocationRecord, bool]:
            created = conn.execute(
                "INSERT INTO invocations (invocation_id, plan_hash, created_at, deadline_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (invocation_id, plan_hash, now, deadline_at),
            ).rowcount
            record = _get_invocation(conn, invocation_id)
            assert record is not None
            return record, created == 1

        return await self._run(op)

    async def get_invocation(self, invocation_id: str) -> InvocationRecord | None:
        return await self._run(lambda conn: _get_invocation(conn, invocation_id))

    async def list_invocations(self) -> list[InvocationRecord]:
        def op(conn: sqlite3.Connection) -> list[InvocationRecord]:
            ids = conn.execute("SELECT invocation_id FROM invocations ORDER BY created_at")
            return [r for (i,) in ids.fetchall() if (r := _get_invocation(conn, i)) is not None]

        return await self._run(op)

    async def reserve(
        self, invocation_id: str, tool: str, cost: float, limits: BudgetLimits
    ) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            # Read and write in one transaction on the only writer: atomic.
            record = _get_invocation(conn, invocation_id)
            if record is None or not budget_allows(limits, record.used, tool, cost):
                return False
            _use(conn, invocation_id, tool, 1, cost)
            return True

        return await self._run(op)

    async def refund(self, invocation_id: str, tool: str, cost: float) -> None:
        await self._run(lambda conn: _use(conn, invocation_id, tool, -1, -cost))

    # -- effect records -----------------------------------------------------

    async def get(self, invocation_id: str, call_id: str) -> EffectRecord | None:
        return await self._run(lambda conn: _get_effect(conn, invocation_id, call_id))

    async def begin(self, start: StartCall, now: float, charge: Charge | None = None) -> Begun:
        def op(conn: sqlite3.Connection) -> Begun:
            # One transaction on the only writer: the check, the charge and the
            # insert are atomic, and cost one fsync together.
            existing = _get_effect(conn, start.invocation_id, start.call_id)
            if existing is not None and not start.reruns(existing):
                return Begun(False, existing)
            if charge is not None:
                invocation = _get_invocation(conn, start.invocation_id)
                refused = charge_refusal(charge, invocation.used if invocation else None, now)
                if refused is not None:
                    return Begun(False, existing, refused)
                _use(conn, start.invocation_id, charge.tool, 1, charge.cost)
            if existing is None:
                changed = conn.execute(
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
            else:
                changed = conn.execute(
                    "UPDATE effects SET status = 'pending', execution_id = ?, updated_at = ?"
                    " WHERE invocation_id = ? AND call_id = ? AND status = 'unknown'",
                    (start.execution_id, now, start.invocation_id, start.call_id),
                ).rowcount
            if changed != 1:
                # Cannot happen under BEGIN IMMEDIATE; if it did, the savepoint
                # rolls the charge back and the call is refused, not run.
                raise sqlite3.IntegrityError("begin lost a race it cannot lose")
            return Begun(True, start.pending_record(existing, now))

        return await self._run(op)

    async def commit(
        self,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        *,
        receipt: tuple[Path, Mapping[str, Any]] | None = None,
    ) -> None:
        """See :meth:`EffectStore.commit`; with ``receipt`` (its file and its
        fields) the call's receipt is journaled in the same transaction."""
        text = json.dumps(response, separators=(",", ":"))

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE effects SET status = 'committed', response = ?, updated_at = ?"
                " WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
                (text, now, invocation_id, call_id),
            )
            if receipt is not None:
                self._journal.add(conn, *receipt)

        await self._run(op)

    async def record_receipt(self, path: Path, receipt: Mapping[str, Any]) -> None:
        """Chain a receipt into the file at ``path`` through the journal."""
        await self._run(lambda conn: self._journal.add(conn, path, receipt))

    async def mark_unknown(self, invocation_id: str, call_id: str, now: float) -> None:
        await self._run(
            lambda conn: conn.execute(
                "UPDATE effects SET status = 'unknown', updated_at = ?"
                " WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
                (now, invocation_id, call_id),
            )
        )

    async def release(self, invocation_id: str, call_id: str) -> None:
        await self._run(
            lambda conn: conn.execute(
                "DELETE FROM effects"
                " WHERE invocation_id = ? AND call_id = ? AND status = 'pending'",
                (invocation_id, call_id),
            )
        )

    async def revoke(self, invocation_id: str, tool: str, now: float) -> None:
        await self._run(
            lambda conn: conn.execute(
                "INSERT INTO revocations (invocation_id, tool, revoked_at) VALUES (?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                (invocation_id, tool, now),
            )
        )

    async def revoked(self, invocation_id: str) -> frozenset[str]:
        def op(conn: sqlite3.Connection) -> frozenset[str]:
            rows = conn.execute(
                "SELECT tool FROM revocations WHERE invocation_id = ?", (invocation_id,)
            )
            return frozenset(tool for (tool,) in rows.fetchall())

        return await self._run(op)

    async def calls(self, invocation_id: str) -> list[EffectRecord]:
        def op(conn: sqlite3.Connection) -> list[EffectRecord]:
            rows = conn.execute(
                f"SELECT {_EFFECT_COLUMNS} FROM effects WHERE invocation_id = ?"
                " ORDER BY created_at, call_id",
                (invocation_id,),
            ).fetchall()
            return [r for row in rows if (r := _effect(row)) is not None]

        return await self._run(op)


def _use(conn: sqlite3.Connection, invocation_id: str, tool: str, calls: int, cost: float) -> None:
    updated = conn.execute(
        "UPDATE invocations SET calls_used = calls_used + ?, cost_used = cost_used + ?"
        " WHERE invocation_id = ?",
        (calls, cost, invocation_id),
    ).rowcount
    if updated != 1:
        return  # no such invocation: no per-tool row for one that may be opened later
    conn.execute(
        "INSERT INTO tool_usage (invocation_id, tool, calls_used) VALUES (?, ?, ?)"
        " ON CONFLICT (invocation_id, tool)"
        " DO UPDATE SET calls_used = calls_used + excluded.calls_used",
        (invocation_id, tool, calls),
    )


def _settle(outcomes: list[_Settled]) -> None:
    for future, result, error in outcomes:
        if future.done():  # the awaiting task was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def read_calls(path: Path, invocation_id: str) -> list[EffectRecord] | None:
    """An invocation's records read from a SQLite store no supervisor holds.

    Read-only (no recovery, no writer thread): for ``hostcall calls`` after a
    run. ``None`` if the invocation is unknown.

    Raises:
        StoreUnavailable: the file is missing or not a hostcall store.
    """
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"cannot read effect store {path}: {exc}") from exc
    try:
        if _get_invocation(conn, invocation_id) is None:
            return None
        rows = conn.execute(
            f"SELECT {_EFFECT_COLUMNS} FROM effects WHERE invocation_id = ?"
            " ORDER BY created_at, call_id",
            (invocation_id,),
        ).fetchall()
        return [r for row in rows if (r := _effect(row)) is not None]
    except sqlite3.Error as exc:
        raise StoreUnavailable(f"cannot read effect store {path}: {exc}") from exc
    finally:
        conn.close()
