"""The default effect store: one SQLite database in WAL mode (docs/operations.md, "Stores").

One connection, used by one thread at a time (under a lock). Operations
queued in one turn of the event loop share a transaction (group commit):
their statements run on the loop's thread, each inside its own SAVEPOINT so
one failing operation does not undo its neighbours, and so does ``COMMIT`` —
with ``synchronous=NORMAL`` it writes the WAL without waiting for the disk.
A writer thread then fsyncs the WAL file and only after that answers the
batch's operations: every batch committed while it fsyncs shares the next
fsync, and the loop never waits for the disk nor for the writer thread to be
scheduled. No operation is answered before the fsync that covers its
transaction (a read too: it may have seen a neighbour's write), so when
``begin`` returns its ``pending`` row is on disk, as with
``synchronous=FULL``. A failed fsync fails the operations it covered and
stops the store.

When nothing could share a transaction (the supervisor's load hint,
``set_load_hint``, says the caller's request is the only one) the fsync runs
on the loop too: no
hand-off to the writer and back. The writer also checkpoints the WAL into the
database (SQLite's automatic checkpoint, which would run inside a ``COMMIT``
on the loop, is off). Receipts are journaled in the same transactions
(:mod:`supervisor.stores.journal`): a committed call and its receipt share one
fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Final, TypeVar, cast

from supervisor.budget import BudgetLimits
from supervisor.canonical import compact_json
from supervisor.errors import StoreUnavailable
from supervisor.ids import new_id
from supervisor.lockfile import drop_lock, hold_lock
from supervisor.receipt_files import fsync_path
from supervisor.receipts import Receipts
from supervisor.stores import sqlite_sql as sql
from supervisor.stores.base import (
    Begun,
    Charge,
    EffectRecord,
    InvocationRecord,
    StartCall,
)
from supervisor.stores.journal import CHECKPOINT_ROWS, JournaledReceipts, Line, ReceiptJournal
from supervisor.stores.sqlite_sql import SCHEMA_VERSION, read_calls, read_invocations

__all__ = ["SCHEMA_VERSION", "SQLiteEffectStore", "read_calls", "read_invocations"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How long the writer waits idle before it fsyncs journaled receipt files.
CHECKPOINT_IDLE_S: Final = 0.2
#: Most operations one transaction takes; the rest wait for the next one.
MAX_BATCH: Final = 256
#: Batches between two checkpoints of the WAL into the database (SQLite's own,
#: inside a COMMIT on the loop, is off).
WAL_BATCHES: Final = 256
#: Tries to open a new store while another connection switches it to WAL.
_OPEN_ATTEMPTS: Final = 20
_OPEN_BACKOFF_S: Final = 0.01
#: How long SQLite waits for a lock held by a reader (e.g. ``hostcall calls``).
BUSY_TIMEOUT_MS: Final = 5000

_Op = Callable[[sqlite3.Connection], Any]
_Outcome = tuple[Any, BaseException | None]  # an op's result, or its error
_Settled = tuple["asyncio.Future[Any]", Any, BaseException | None]
#: How soon a batch tries again while the writer holds the connection for a checkpoint.
_BUSY_RETRY_S: Final = 0.001
#: How long the writer waits for the connection to trim or checkpoint (the
#: loop holds it for one transaction at a time, never across an await).
_BUSY_WAIT_S: Final = 1.0
#: Queued by the loop to ask the writer for a checkpoint: commits made on the
#: loop (one request alone) never pass through the writer otherwise.
_CHECKPOINT: Final[tuple[list[_Settled], list[Line]]] = ([], [])
#: Bound on close() waiting for queued ops.
CLOSE_DRAIN_S: Final = 30.0


class SQLiteEffectStore:
    """:class:`~supervisor.stores.base.EffectStore` in a SQLite file.

    One supervisor per database: from :meth:`open` to :meth:`close` the store
    holds an exclusive lock on the file ``<database>-lock``, and a second
    store on the same database (another supervisor, whatever its state dir:
    ``--store sqlite:///PATH`` may name one file from several) is refused.
    So on :meth:`open` every ``pending`` row is a leftover of a crash and
    becomes ``unknown``.
    """

    #: Records survive the process (receipts share its transactions:
    #: :class:`~supervisor.receipts.JournaledReceipts`).
    durable = True

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        #: Committed batches to fsync (their answers and receipt lines); None
        #: stops the writer.
        self._queue: queue.SimpleQueue[tuple[list[_Settled], list[Line]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._journal = ReceiptJournal()
        self._conn: sqlite3.Connection | None = None
        self._pending: list[tuple[_Op, asyncio.Future[Any]]] = []
        self._syncing = 0  # committed batches handed to the writer, not yet answered
        self._commits = 0  # batches since the last WAL checkpoint (both threads: approximate)
        self._checkpoint_asked = False  # _CHECKPOINT is queued, not yet done
        self._wal_fd: int | None = None  # the WAL file, fsync'd after each commit
        self._lock_fd: int | None = None  # <database>-lock, held from open() to close()
        self._closing = False
        self._failed: BaseException | None = None  # why the writer thread died
        self._writer_gone = False  # set by the writer thread as it ends, however
        self._scheduled = False  # _start_batch is due on the loop
        self._idle = asyncio.Event()
        #: Held while a transaction or checkpoint uses the connection.
        self._busy = threading.Lock()
        #: When set and true, an operation that finds the writer idle runs on
        #: the event loop's thread: one request alone has nothing to share a
        #: transaction with. The supervisor sets it to "the channel serves
        #: one request at most"; under load every operation goes to the writer.
        #: Requests the supervisor serves now (``set_load_hint``); one alone
        #: commits inline.
        self._active_requests: Callable[[], int] | None = None

    # -- the writer thread ------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Its folder exists: _lock made it, first.
        _private(self.path)
        # Switching a new file to WAL takes an exclusive lock that SQLite does
        # not wait for: two processes opening one new store at once can see
        # "database is locked". Retry that, boundedly.
        for attempt in range(_OPEN_ATTEMPTS):
            conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            try:
                conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
                conn.execute("PRAGMA journal_mode = WAL")
                # COMMIT does not fsync; _sync does, before anyone is answered.
                conn.execute("PRAGMA synchronous = NORMAL")
                # Not inside a COMMIT on the loop: the writer checkpoints.
                conn.execute("PRAGMA wal_autocheckpoint = 0")
                conn.executescript(sql.SCHEMA)
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

    def _open_wal(self, conn: sqlite3.Connection) -> int:
        """A descriptor of the WAL file SQLite writes, kept open for the
        writer's fsyncs. Its name comes from SQLite (which resolves a
        symlinked database), not from ours. It is fsync'd once now, with its
        folder: what a killed predecessor committed but never fsync'd is on
        disk before recovery writes receipt lines for it."""
        conn.execute("SELECT count(*) FROM meta").fetchone()  # the WAL exists once read
        database = next(row[2] for row in conn.execute("PRAGMA database_list") if row[1] == "main")
        fd = os.open(f"{database}-wal", os.O_RDONLY)
        try:
            os.fsync(fd)
            fsync_path(os.path.dirname(database))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _sync(self, lines: list[Line]) -> None:
        """Make what has been committed durable (one fsync of the WAL), then
        append the committed receipt lines to their files."""
        assert self._wal_fd is not None
        os.fsync(self._wal_fd)
        self._journal.write(lines)

    def _serve(self, conn: sqlite3.Connection, wal_fd: int) -> None:
        """The writer thread: fsyncs what the loop committed, then answers it;
        trims the journal and checkpoints the WAL. Every batch committed while
        it fsyncs shares the next fsync. If anything fails here, the batches
        it holds and every one queued fail, and the store stops."""
        assert self._loop is not None
        held: list[_Settled] = []  # answers taken from the queue, not yet posted
        try:
            while True:
                try:
                    # Woken now and then also with nothing queued: inline
                    # commits journal lines without passing through here.
                    job = self._queue.get(timeout=CHECKPOINT_IDLE_S)
                except queue.Empty:
                    self._checkpoint(conn)  # idle: make the receipt files durable
                    continue
                jobs = [job]
                with contextlib.suppress(queue.Empty):
                    while jobs[-1] is not None:
                        jobs.append(self._queue.get_nowait())
                batches = [j for j in jobs if j is not None and j is not _CHECKPOINT]
                if batches:
                    held = [s for batch, _ in batches for s in batch]
                    self._sync([line for _, lines in batches for line in lines])
                    self._loop.call_soon_threadsafe(self._synced, held, len(batches))
                    held = []
                    self._commits += len(batches)
                asked = any(j is _CHECKPOINT for j in jobs)
                if asked:  # answered now, taken or not: the loop may ask again
                    self._checkpoint_asked = False
                if asked or self._checkpoint_due():
                    self._checkpoint(conn, wait=True)
                if jobs[-1] is None:
                    self._checkpoint(conn, wait=True)
                    return
        except BaseException as exc:  # a failed fsync, or a bug: fail, never hang or lie
            logger.exception("effect store %s: the writer thread failed", self.path)
            failed = sqlite3.DatabaseError(f"the writer thread failed: {exc!r}")
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                lost = [future for future, _, _ in held]
                self._loop.call_soon_threadsafe(self._writer_died, failed, lost)
        finally:
            self._writer_gone = True
            # Not under the loop's feet: it may be running a batch right now.
            if self._busy.acquire(timeout=CLOSE_DRAIN_S):
                conn.close()
                self._journal.close()
                self._busy.release()
            else:
                logger.error("effect store %s: left open, its connection stayed busy", self.path)
            os.close(wal_fd)

    def _checkpoint(self, conn: sqlite3.Connection, *, wait: bool = False) -> None:
        """Trim the journal and checkpoint the WAL into the database, between
        the loop's transactions (when the connection is free: at once, or
        within ``_BUSY_WAIT_S`` with ``wait``; else at the next chance)."""
        if self._busy.acquire(timeout=_BUSY_WAIT_S if wait else 0):
            try:
                self._trim(conn)
                if self._commits:
                    self._commits = 0
                    try:
                        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    except sqlite3.Error as exc:  # the WAL keeps it; the next one retries
                        logger.error("effect store %s: WAL checkpoint failed: %s", self.path, exc)
            finally:
                self._busy.release()

    def _checkpoint_due(self) -> bool:
        """Enough commits, or journal lines, since the last checkpoint: a WAL
        left to grow makes every commit an append the file system must
        allocate, and its fsync twice as dear as an overwrite."""
        return self._journal.unsynced >= CHECKPOINT_ROWS or self._commits >= WAL_BATCHES

    def _trim(self, conn: sqlite3.Connection) -> None:
        if not self._journal.unsynced:
            return
        try:
            self._journal.checkpoint(conn)
        except sqlite3.Error as exc:  # the rows stay; the next checkpoint or start retries
            logger.error("effect store %s: cannot trim the receipt journal: %s", self.path, exc)

    # -- transactions (the caller holds _busy) --------------------------------

    def _begin_batch(self, conn: sqlite3.Connection, ops: list[_Op]) -> tuple[list[_Outcome], bool]:
        """``BEGIN`` and run ``ops``. Returns each op's result or error, and
        whether a transaction is open to commit.

        Ops rarely fail, and a savepoint per op costs two statements: a
        batch runs without them first. If one op fails, the transaction is
        rolled back (and the receipt lines it chained forgotten) and the
        batch runs again with each op in its own savepoint, so the failing
        one does not undo its neighbours. Ops are statements on the
        database and the journal's chain, nothing else: running them again
        gives the same results.
        """
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            self._abort(conn)
            return [(None, exc) for _ in ops], False
        if len(ops) > 1:
            try:
                outcomes: list[_Outcome] = []
                for op in ops:
                    outcomes.append((op(conn), None))
                    self._journal.end_op(kept=True)
                return outcomes, True
            except Exception:  # boundary: whichever op failed, each runs again below
                self._abort(conn)
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                self._abort(conn)
                return [(None, exc) for _ in ops], False
        return self._run_each(conn, ops)

    def _run_each(self, conn: sqlite3.Connection, ops: list[_Op]) -> tuple[list[_Outcome], bool]:
        """Run ``ops`` in the open transaction, each in its own savepoint when
        there are several (see :meth:`_begin_batch`)."""
        outcomes: list[_Outcome] = []
        alone = len(ops) == 1  # no neighbours to protect: no savepoint
        try:
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

    def _finish_batch(
        self, conn: sqlite3.Connection, outcomes: list[_Outcome]
    ) -> tuple[list[_Outcome], list[Line] | None]:
        """``COMMIT``; returns the outcomes and the receipt lines to write
        once :meth:`_sync` has made the commit durable (``None``: the commit
        failed and every op gets its error)."""
        try:
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            self._abort(conn)
            return [(None, exc) for _ in outcomes], None
        return outcomes, self._journal.committed()

    def _abort(self, conn: sqlite3.Connection) -> None:
        """Roll the batch back, and the journal lines it chained."""
        self._journal.aborted()
        with contextlib.suppress(sqlite3.Error):  # e.g. a connection already closed
            if conn.in_transaction:
                conn.rollback()

    # -- the loop side ----------------------------------------------------------

    async def _run(self, op: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``op`` in a transaction; returns once that transaction is on disk.

        Ops queued in one turn of the loop form a batch: its statements and
        its ``COMMIT`` run on the loop's thread (the connection is used by one
        thread at a time, under ``_busy``), the fsync that makes it durable on
        the writer thread, so the loop keeps serving — and committing the next
        batches — while the disk works. A request alone (``set_load_hint``)
        also fsyncs on the loop: there is nothing to overlap, and no hand-off
        to pay for.
        """
        if self._thread is None or self._loop is None:
            raise RuntimeError("SQLiteEffectStore used before open() or after close()")
        if self._failed is not None or self._writer_gone:
            raise StoreUnavailable(f"effect store {self.path}: its writer thread has stopped")
        active = self._active_requests
        if (
            active is not None
            and not self._pending
            and not self._syncing
            and active() <= 1
            and self._busy.acquire(blocking=False)
        ):
            try:
                [(result, error)] = self._commit_inline(op)
            finally:
                self._busy.release()
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

    def _commit_inline(self, op: _Op) -> list[_Outcome]:
        """One op's transaction and its fsync, here and now (under ``_busy``,
        with nothing handed to the writer: its files are ours meanwhile)."""
        assert self._conn is not None
        outcomes, open_ = self._begin_batch(self._conn, [op])
        if open_:
            outcomes, lines = self._finish_batch(self._conn, outcomes)
            self._commits += 1  # approximate (two threads): when to checkpoint the WAL
            if lines is not None:
                try:
                    self._sync(lines)
                except OSError as exc:  # committed, but perhaps not on disk: stop
                    logger.exception("effect store %s: fsync failed", self.path)
                    self._failed = sqlite3.DatabaseError(f"fsync failed: {exc!r}")
                    return [(None, self._failed)]
        if self._checkpoint_due() and not self._checkpoint_asked:
            # The writer sees none of these commits: ask it. It takes the
            # connection once this thread lets go of it, off the loop.
            self._checkpoint_asked = True
            self._queue.put(_CHECKPOINT)
        return outcomes

    def _kick(self) -> None:
        """Start the next batch at the end of this loop iteration."""
        if self._pending and not self._scheduled:
            assert self._loop is not None
            self._scheduled = True
            self._loop.call_soon(self._start_batch)
        elif not (self._pending or self._syncing or self._scheduled):
            self._idle.set()

    def _start_batch(self) -> None:
        """Run and commit the queued ops (on the loop), then hand the batch to
        the writer to fsync; nobody is answered before that fsync."""
        self._scheduled = False
        if self._failed is not None or self._closing:
            self._fail_pending()
            return
        if not self._pending:
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
            lines = None
            if open_:
                outcomes, lines = self._finish_batch(self._conn, outcomes)
        except Exception as exc:  # a bug: the batch's fate is unclear, so stop the store
            logger.exception("effect store %s: a batch failed", self.path)
            self._abort(self._conn)
            self._failed = sqlite3.DatabaseError(f"the effect store failed: {exc!r}")
            _settle([(f, None, self._failed) for _, f in batch])
            self._fail_pending()
            return
        finally:
            self._busy.release()
        settled = [(f, *o) for (_, f), o in zip(batch, outcomes, strict=True)]
        if lines is None:  # nothing committed: the ops failed, nothing to wait for
            _settle(settled)
        else:
            self._syncing += 1
            self._queue.put((settled, lines))
        self._kick()

    def _synced(self, settled: list[_Settled], batches: int) -> None:
        """The writer's fsync covered these batches: answer their ops."""
        self._syncing -= batches
        _settle(settled)
        self._kick()

    def _writer_died(self, failed: BaseException, futures: list[asyncio.Future[Any]]) -> None:
        """Nothing more will be made durable: fail the batches the writer
        held, those handed to it meanwhile, and what waits."""
        self._failed = failed
        _settle([(f, None, failed) for f in futures])
        self._fail_queued(failed)
        self._fail_pending()

    def _fail_queued(self, error: BaseException) -> None:
        """Answer every batch still in the writer's queue with ``error``
        (the writer is gone)."""
        self._syncing = 0
        self._checkpoint_asked = False
        lost: list[asyncio.Future[Any]] = []
        with contextlib.suppress(queue.Empty):
            while True:
                job = self._queue.get_nowait()
                if job is not None:
                    lost.extend(future for future, _, _ in job[0])
        _settle([(f, None, error) for f in lost])

    def _fail_pending(self) -> None:
        """Answer every queued op with an error (the store is closing or broken)."""
        pending, self._pending = self._pending, []
        error = self._failed or sqlite3.OperationalError("the effect store was closed")
        _settle([(future, None, error) for _, future in pending])
        if not self._syncing:
            self._idle.set()

    # -- lifecycle ----------------------------------------------------------

    def receipts(self, path: Path, executor: Executor | None) -> Receipts:
        # Journaled in the call's own transaction: one fsync for both.
        return JournaledReceipts(path, self)

    def set_load_hint(self, active_requests: Callable[[], int]) -> None:
        self._active_requests = active_requests

    async def open(self) -> int:
        if self._thread is not None or self._lock_fd is not None:
            raise RuntimeError("SQLiteEffectStore.open() called twice")
        try:
            # Here, not in a thread: an open() cancelled while a thread took
            # the lock would leave it held, with nobody to let it go.
            self._lock_fd = _lock(self.path)
            conn = await asyncio.to_thread(self._connect)
        except (sqlite3.Error, OSError) as exc:  # OSError: the folder cannot be made
            self._unlock()
            raise StoreUnavailable(f"cannot open effect store {self.path}: {exc}") from exc
        except BaseException:
            self._unlock()
            raise
        try:
            self._wal_fd = await asyncio.to_thread(self._open_wal, conn)
        except BaseException as exc:
            conn.close()
            self._unlock()
            if isinstance(exc, (sqlite3.Error, OSError)):
                raise StoreUnavailable(f"cannot open effect store {self.path}: {exc}") from exc
            raise
        self._loop = asyncio.get_running_loop()
        self._conn = conn
        self._idle = asyncio.Event()
        self._idle.set()
        # A fresh start also after an open() that failed and closed.
        self._journal = ReceiptJournal()
        self._pending, self._scheduled, self._syncing, self._commits = [], False, 0, 0
        self._closing, self._failed, self._checkpoint_asked = False, None, False
        self._writer_gone = False
        self._thread = threading.Thread(
            target=self._serve, args=(conn, self._wal_fd), name="hostcall-sqlite", daemon=True
        )
        self._thread.start()

        def migrate_and_recover(conn: sqlite3.Connection) -> tuple[int, int]:
            sql.migrate(conn)
            self._journal.recover(conn)  # receipt lines a crash kept out of their files
            return sql.unknown_pending(conn), sql.return_reservations(conn)

        try:
            unknown, returned = await self._run(migrate_and_recover)
        except BaseException:
            await self.close()  # a store that failed to open holds no thread
            raise
        if returned:
            logger.warning(
                "effect store %s: %d call(s) were waiting for approval when the last"
                " supervisor stopped; their budget reservations are given back",
                self.path,
                returned,
            )
        return unknown

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
            self._wal_fd = None  # the writer closed it
            # A batch the writer never took (it failed first) fails too.
            self._fail_queued(self._failed or sqlite3.OperationalError("the store was closed"))
        self._unlock()

    def _unlock(self) -> None:
        """Let the next store open the database (its connection is closed,
        or left to a writer that could not close it, which writes no more)."""
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            drop_lock(fd)

    # -- invocations and budget -------------------------------------------

    async def open_invocation(
        self, invocation_id: str, plan_hash: str, deadline_at: float | None, now: float
    ) -> tuple[InvocationRecord, bool]:
        return await self._run(
            lambda conn: sql.open_invocation(conn, invocation_id, plan_hash, deadline_at, now)
        )

    async def get_invocation(self, invocation_id: str) -> InvocationRecord | None:
        return await self._run(lambda conn: sql.get_invocation(conn, invocation_id))

    async def list_invocations(self) -> list[InvocationRecord]:
        return await self._run(sql.list_invocations)

    async def reserve(
        self, invocation_id: str, tool: str, cost: float, limits: BudgetLimits
    ) -> str | None:
        reservation = new_id("rsv")
        fits = await self._run(
            lambda conn: sql.reserve(conn, reservation, invocation_id, tool, cost, limits)
        )
        return reservation if fits else None

    async def refund(self, reservation_id: str) -> None:
        await self._run(lambda conn: sql.refund(conn, reservation_id))

    # -- effect records -----------------------------------------------------

    async def get(self, invocation_id: str, call_id: str) -> EffectRecord | None:
        return await self._run(lambda conn: sql.get_effect(conn, invocation_id, call_id))

    async def begin(
        self,
        start: StartCall,
        now: float,
        charge: Charge | None = None,
        reservation: str | None = None,
    ) -> Begun:
        return await self._run(lambda conn: sql.begin(conn, start, now, charge, reservation))

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
        text = compact_json(response)

        def op(conn: sqlite3.Connection) -> None:
            sql.commit(conn, invocation_id, call_id, text, now)
            if receipt is not None:
                self._journal.add(conn, *receipt)

        await self._run(op)

    async def record_receipt(self, path: Path, receipt: Mapping[str, Any]) -> None:
        """Chain a receipt into the file at ``path`` through the journal."""
        await self._run(lambda conn: self._journal.add(conn, path, receipt))

    async def mark_unknown(self, invocation_id: str, call_id: str, now: float) -> None:
        await self._run(lambda conn: sql.mark_unknown(conn, invocation_id, call_id, now))

    async def release(self, invocation_id: str, call_id: str) -> None:
        await self._run(lambda conn: sql.release(conn, invocation_id, call_id))

    async def forget_calls(self, invocation_id: str) -> int:
        return await self._run(lambda conn: sql.forget_calls(conn, invocation_id))

    async def revoke(self, invocation_id: str, tool: str, now: float) -> None:
        await self._run(lambda conn: sql.revoke(conn, invocation_id, tool, now))

    async def revoked(self, invocation_id: str) -> frozenset[str]:
        return await self._run(lambda conn: sql.revoked(conn, invocation_id))

    async def reject(
        self, invocation_id: str, call_id: str, idempotency_key: str, approval_id: str, now: float
    ) -> None:
        await self._run(
            lambda conn: sql.reject(conn, invocation_id, call_id, idempotency_key, approval_id, now)
        )

    async def rejection(self, invocation_id: str, call_id: str) -> tuple[str, str] | None:
        return await self._run(lambda conn: sql.rejection(conn, invocation_id, call_id))

    async def calls(self, invocation_id: str) -> list[EffectRecord]:
        return await self._run(lambda conn: sql.calls(conn, invocation_id))


def _settle(outcomes: list[_Settled]) -> None:
    for future, result, error in outcomes:
        if future.done():  # the awaiting task was cancelled
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _lock(database: Path) -> int:
    """Take the exclusive lock of ``database`` (the file ``<database>-lock``
    beside the file a symlink names, which names its holder's pid) and return
    its descriptor.

    Raises:
        StoreUnavailable: another store holds it (another supervisor runs on
            this database).
        OSError: the folder or the lock file cannot be made.
    """
    database.parent.mkdir(parents=True, exist_ok=True)
    # Beside the file itself, as SQLite's -wal: one lock whatever symlink names it.
    # O_NOFOLLOW: a symlink planted at the lock must not get its target emptied.
    real = os.path.realpath(database)
    fd = os.open(f"{real}-lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        holder = hold_lock(fd)
    except BaseException:
        os.close(fd)
        raise
    if holder is not None:
        os.close(fd)
        raise StoreUnavailable(
            f"effect store {database} is in use by another supervisor (pid {holder}):"
            " one supervisor per SQLite database; give this one its own --store, or"
            " launch guests on the running one with `hostcall serve`"
        )
    return fd


def _private(database: Path) -> None:
    """The database file, and with it its ``-wal`` and ``-shm`` (SQLite gives
    them the database's mode), readable by its owner only (docs/sandbox.md)."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
        with contextlib.suppress(FileNotFoundError, PermissionError):
            if os.stat(path).st_uid == os.getuid():
                os.chmod(path, 0o600)
