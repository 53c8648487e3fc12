"""The SQLite store's pipelined commit (supervisor/stores/sqlite.py).

The loop runs a batch's ``COMMIT`` with ``synchronous=NORMAL`` and the writer
fsyncs the WAL itself, so the loop commits the next batches during the fsync.
What must hold:
no operation is answered before the fsync that covers its transaction, and
a failed fsync answers an error and stops the store — it never reports a
commit the disk may not have.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import supervisor.stores.sqlite as sqlite_store
from supervisor.errors import StoreUnavailable
from supervisor.stores import EffectStatus, SQLiteEffectStore, StartCall
from tests.harness import STEP_TIMEOUT_S, wait_until


def _start(call_id: str) -> StartCall:
    return StartCall("inv_p", call_id, "charge", "k" * 64, "exe_p", reversible=False)


class HeldFsync:
    """Holds every fsync of one descriptor until released; counts them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fd: int | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.synced = 0
        real = os.fsync

        def fsync(fd: int) -> None:
            if fd == self.fd:
                self.entered.set()
                assert self.release.wait(STEP_TIMEOUT_S), "the test never released the fsync"
                real(fd)
                self.synced += 1
            else:
                real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldFsync]:
    held = HeldFsync(monkeypatch)
    yield held
    held.release.set()  # never leave the writer thread waiting


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteEffectStore]:
    store = SQLiteEffectStore(tmp_path / "effects.db")
    await store.open()
    try:
        yield store
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await store.close()


async def test_no_operation_is_answered_before_the_fsync_that_covers_it(
    store: SQLiteEffectStore, held: HeldFsync
) -> None:
    held.fd = store._wal_fd
    begin = asyncio.ensure_future(store.begin(_start("c1"), time.time()))
    async with asyncio.timeout(STEP_TIMEOUT_S):
        assert await asyncio.to_thread(held.entered.wait, STEP_TIMEOUT_S)
    # The row is committed (the connection reads it back) but the WAL is
    # not yet on disk: neither the begin nor a read that saw it answers.
    read = asyncio.ensure_future(store.get("inv_p", "c1"))
    # The read's own batch runs and commits meanwhile (pipelined), and waits.
    await wait_until(lambda: store._syncing == 2, "the read's batch to reach the writer")
    assert not begin.done()
    assert not read.done()
    assert held.synced == 0
    held.release.set()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        begun = await begin
        record = await read
    assert begun.won
    assert held.synced >= 1
    assert record is not None and record.status is EffectStatus.PENDING


@pytest.mark.parametrize("inline", [False, True], ids=["writer", "inline"])
async def test_a_failed_fsync_fails_the_operation_and_stops_the_store(
    store: SQLiteEffectStore, monkeypatch: pytest.MonkeyPatch, inline: bool
) -> None:
    if inline:
        store.set_load_hint(lambda: 1)  # one request alone: it fsyncs on the loop
    real = os.fsync

    def fsync(fd: int) -> None:
        if fd == store._wal_fd:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        with pytest.raises(StoreUnavailable):
            await store.begin(_start("c1"), time.time())
        # What the disk may have lost is never reported; nothing more commits.
        with pytest.raises(StoreUnavailable):
            await store.get("inv_p", "c1")


async def test_a_failed_fsync_while_the_loop_runs_the_next_batch_fails_both_cleanly(
    store: SQLiteEffectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer stops on a failed fsync while the loop is inside the next
    batch's statements: it must not close the connection under them."""
    syncing, running = threading.Event(), threading.Event()
    real = os.fsync

    def fsync(fd: int) -> None:
        if fd == store._wal_fd:
            syncing.set()
            assert running.wait(STEP_TIMEOUT_S)
            raise OSError(5, "Input/output error")
        real(fd)

    def long_statement(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS filler (n INTEGER)")
        running.set()  # the writer's fsync fails now, while this runs
        conn.execute(
            "INSERT INTO filler WITH RECURSIVE c(n) AS"
            " (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < 300000) SELECT n FROM c"
        )

    monkeypatch.setattr(os, "fsync", fsync)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        begin = asyncio.ensure_future(store.begin(_start("c1"), time.time()))
        # Its batch is committed and the writer is in its fsync: the next
        # batch is the loop's alone.
        assert await asyncio.to_thread(syncing.wait, STEP_TIMEOUT_S)
        outcomes = await asyncio.gather(begin, store._run(long_statement), return_exceptions=True)
    assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes


async def test_a_writer_that_fails_after_answering_fails_what_comes_next_and_closes(
    store: SQLiteEffectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_store, "WAL_BATCHES", 1)  # checkpoint after every fsync

    synced = threading.Event()
    sync = store._sync

    def sync_and_tell(lines: list[Any]) -> None:
        sync(lines)
        synced.set()

    def broken(*_: object, wait: bool = False) -> None:
        # Only the checkpoint after c1's fsync. Not the idle one, which may
        # come first on a busy machine (0.2 s after open), nor the one after
        # open()'s own batch: open() is answered before the writer looks at
        # whether a checkpoint is due, so that look may come after this patch.
        # Either would kill the writer before there is anything to answer.
        if wait and synced.is_set():
            raise RuntimeError("a bug in the checkpoint")

    monkeypatch.setattr(store, "_sync", sync_and_tell)
    monkeypatch.setattr(store, "_checkpoint", broken)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        assert (await store.begin(_start("c1"), time.time())).won  # answered, then it died
        with pytest.raises(StoreUnavailable):
            await store.begin(_start("c2"), time.time())


async def test_the_wal_it_fsyncs_is_the_one_sqlite_writes_also_through_a_symlink(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real" / "effects.db"
    real.parent.mkdir()
    link = tmp_path / "effects.db"
    link.symlink_to(real)
    store = SQLiteEffectStore(link)
    await store.open()
    try:
        assert store._wal_fd is not None
        assert os.readlink(f"/proc/self/fd/{store._wal_fd}") == f"{real}-wal"
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert (await store.begin(_start("c1"), time.time())).won
    finally:
        await store.close()
    assert not (tmp_path / "effects.db-wal").exists()


async def test_commits_made_on_the_loop_still_get_the_wal_checkpointed(tmp_path: Path) -> None:
    """One request alone commits on the loop, never through the writer; the
    writer must still checkpoint the WAL, or it grows with every call (and
    each commit becomes an append, whose fsync costs about twice an
    overwrite's). Measured by the WAL file's size: SQLite reuses it from the
    start after a checkpoint, and it only grows when none has run."""
    db = tmp_path / "effects.db"
    wal = Path(f"{db}-wal")
    store = SQLiteEffectStore(db)
    store.set_load_hint(lambda: 1)  # every operation commits on this thread
    await store.open()
    calls = iter(range(10**6))

    async def call() -> None:  # two transactions: begin, then commit
        call_id = f"c{next(calls)}"
        assert (await store.begin(_start(call_id), time.time())).won
        await store.commit("inv_p", call_id, {"status": "ok"}, time.time())

    try:
        async with asyncio.timeout(STEP_TIMEOUT_S * 6):
            for _ in range(32):
                await call()
            before = wal.stat().st_size
            for _ in range(64):
                await call()
            per_commit = (wal.stat().st_size - before) / 128
            assert per_commit > 0
            for _ in range(6 * sqlite_store.WAL_BATCHES):  # 12 x WAL_BATCHES commits
                await call()
            # Checkpointed every WAL_BATCHES commits. The writer thread may lag
            # (a busy 2-core machine: one CI run saw about 4 batches' growth),
            # but unchecked the WAL would hold all 12 batches and more.
            assert wal.stat().st_size <= per_commit * 6 * sqlite_store.WAL_BATCHES
    finally:
        await store.close()
