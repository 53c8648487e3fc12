"""Receipts journaled in the SQLite store's own transactions.

Without a journal a committed call costs two fsyncs before its reply: the
store's commit and the receipt file's. With it, the writer thread chains the
receipt and inserts its line into ``receipt_journal`` inside the transaction
that records the call, so the commit's fsync makes both durable. Once that
transaction is on disk, the lines are appended to their files (page cache, in
chain order). Now and then (:data:`CHECKPOINT_ROWS` lines, or an idle
moment) the files are fsync'd and the journal rows they hold are deleted.

A crash can leave the newest lines only in the journal (or a torn last line
in a file): :func:`recover`, run when the store opens, completes every file
from the journal before anything else is written.

Threads: lines are chained (:meth:`ReceiptJournal.add`) and their batch
closed (:meth:`~ReceiptJournal.committed`) by whoever holds the store's
connection. Writing them (:meth:`~ReceiptJournal.write`) and checkpoints are
the sync step's: the store runs one at a time, never beside an inline commit.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol

from supervisor.errors import StoreUnavailable
from supervisor.faults import crash_point
from supervisor.receipt_files import append_to, fsync_path, last_hash, write_all
from supervisor.receipts import GENESIS_HASH, seal

__all__ = [
    "CHECKPOINT_ROWS",
    "JOURNAL_SCHEMA",
    "JournaledReceipts",
    "Line",
    "ReceiptJournal",
    "journal_lines",
]

logger = logging.getLogger(__name__)

#: Journaled lines after which the files are fsync'd and the journal trimmed.
CHECKPOINT_ROWS: Final = 1024
#: Chain heads kept in memory (one per receipt file, so per invocation); past
#: this, a checkpoint forgets the least recently written files' heads, which
#: their files' last lines hold (read again if the file is written again).
HEADS_KEPT: Final = 4096
#: Receipt files kept open for appending (one per invocation recently
#: written): no open and close, nor a path to parse, per line.
FILES_KEPT: Final = 64
#: More than any receipt line (ids and names are bounded): how far back a
#: damaged tail is read past what the journal holds.
_LONGEST_LINE: Final = 65536

JOURNAL_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS receipt_journal (
    seq INTEGER PRIMARY KEY,
    path TEXT NOT NULL,
    hash TEXT NOT NULL,
    line BLOB NOT NULL
);
"""


def journal_lines(conn: sqlite3.Connection) -> list[bytes]:
    """Every line the journal holds, in chain order (none if it has no table yet)."""
    if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'receipt_journal'").fetchone():
        return []
    return [
        bytes(line) for (line,) in conn.execute("SELECT line FROM receipt_journal ORDER BY seq")
    ]


class Line(NamedTuple):
    """One journaled receipt line: its file, its bytes, its journal row."""

    path: str
    data: bytes
    seq: int


class ReceiptJournal:
    """Chain heads and unsynced lines of every receipt file the store writes.

    The connection's holder calls :meth:`add` inside an operation, then
    :meth:`end_op` when the operation's savepoint is released or rolled back,
    and :meth:`committed` or :meth:`aborted` when the transaction committed
    or failed: a chain head moves only with a committed line. Once the
    commit is on disk, :meth:`write` appends its lines to their files.
    """

    def __init__(self, *, heads_kept: int | None = None) -> None:
        #: path -> (hash, journal row) of its last committed line, least
        #: recently committed first.
        self._heads: dict[str, tuple[str, int]] = {}
        self._heads_kept = HEADS_KEPT if heads_kept is None else heads_kept
        self._batch_heads: dict[str, tuple[str, int]] = {}
        self._batch: list[Line] = []
        self._op: list[tuple[Line, str]] = []
        self._dirty: set[str] = set()  # written since the last checkpoint
        self._broken: set[str] = set()  # could not be written: lines stay journaled
        #: Descriptors of recently written files, least recently written first.
        self._fds: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._next_seq: int | None = None  # read from the table when first needed
        self._written_seq = 0  # every journal row up to this one is in its file
        #: Lines written to their files since the last checkpoint.
        self.unsynced = 0

    def add(self, conn: sqlite3.Connection, path: Path, receipt: Mapping[str, Any]) -> None:
        """Chain ``receipt`` after its file's head and journal its line."""
        key = str(path)
        line, digest = seal(receipt, self._head(key))
        if self._next_seq is None:
            (last,) = conn.execute("SELECT coalesce(max(seq), 0) FROM receipt_journal").fetchone()
            self._next_seq = int(last) + 1
        # Numbered here, not by SQLite: a trimmed table would hand out its
        # numbers again, and a checkpoint deletes "every row up to" a number.
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        conn.execute(
            "INSERT INTO receipt_journal (seq, path, hash, line) VALUES (?, ?, ?, ?)",
            (seq, key, digest, line),
        )
        self._op.append((Line(key, line, seq), digest))

    def _head(self, path: str) -> str:
        for queued, digest in reversed(self._op):
            if queued.path == path:
                return digest
        known = self._batch_heads.get(path) or self._heads.get(path)
        if known is not None:
            return known[0]
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            head = last_hash(Path(path))
        except (OSError, ValueError, KeyError) as exc:
            # The chain cannot continue this file; the lines stay in the
            # journal (the next start reports them) and the call is recorded.
            self._break(path, OSError(f"its last line is unreadable: {exc}"))
            head = GENESIS_HASH
        self._heads[path] = (head, 0)  # what the file holds: nothing unwritten
        return head

    @property
    def heads(self) -> int:
        """How many files' chain heads are held in memory."""
        return len(self._heads)

    def end_op(self, *, kept: bool) -> None:
        if kept:
            for line, digest in self._op:
                self._batch.append(line)
                self._batch_heads[line.path] = (digest, line.seq)
        self._op.clear()

    def committed(self) -> list[Line]:
        """The transaction committed: move the heads; returns its lines, for
        :meth:`write` once the commit is on disk."""
        batch, self._batch = self._batch, []
        for path, head in self._batch_heads.items():
            self._heads.pop(path, None)  # to the end: the most recently committed
            self._heads[path] = head
        self._batch_heads = {}
        return batch

    def aborted(self) -> None:
        """The transaction rolled back: its lines were never chained."""
        self._op.clear()
        self._batch.clear()
        self._batch_heads.clear()

    def write(self, lines: list[Line]) -> None:
        """Append committed, durable lines to their files (page cache, in
        chain order); a checkpoint fsyncs them later."""
        if not lines:
            return
        crash_point("receipt_journaled")
        by_path: dict[str, list[bytes]] = {}
        for line in lines:
            by_path.setdefault(line.path, []).append(line.data)
        for path, data in by_path.items():
            if path in self._broken:
                continue
            try:
                write_all(self._fd(path), b"".join(data))
            except OSError as exc:
                self._break(path, exc)
            else:
                self._dirty.add(path)
        self.unsynced += len(lines)
        self._written_seq = max(self._written_seq, lines[-1].seq)

    def checkpoint(self, conn: sqlite3.Connection) -> None:
        """fsync the files written since the last checkpoint, then delete the
        journal rows they now hold. Runs outside any other transaction."""
        for path in sorted(self._dirty):
            try:
                fd = self._fds.get(path)
                if fd is not None:
                    os.fsync(fd)
                else:  # closed since: written through its name
                    fsync_path(path)
            except OSError as exc:
                self._break(path, exc)
        for folder in sorted({os.path.dirname(path) for path in self._dirty}):
            with contextlib.suppress(OSError):  # a new file's entry in its folder
                fsync_path(folder)
        self._dirty.clear()
        done = self._written_seq
        broken = sorted(self._broken)
        marks = ", ".join("?" * len(broken))
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                f"DELETE FROM receipt_journal WHERE seq <= ? AND path NOT IN ({marks})",
                (done, *broken),
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.rollback()
            raise
        self.unsynced = 0
        self._forget_heads()

    def _fd(self, path: str) -> int:
        """A descriptor that appends to ``path`` (created ``0600``), kept open."""
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        if len(self._fds) >= FILES_KEPT:
            os.close(self._fds.popitem(last=False)[1])
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        """Close the files kept open (the store is closing: nothing is written after)."""
        fds, self._fds = self._fds, collections.OrderedDict()
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _forget_heads(self) -> None:
        """Keep at most ``heads_kept`` chain heads: forget the least recently
        committed ones whose last line is in its file (written: a broken
        file's lines are not, so its head stays). Under the store's
        connection lock, so no line is being chained or written meanwhile."""
        excess = len(self._heads) - self._heads_kept
        if excess <= 0:
            return
        done = self._written_seq
        forget = [
            path
            for path, (_, seq) in self._heads.items()
            if seq <= done and path not in self._broken
        ][:excess]
        for path in forget:
            del self._heads[path]

    def _break(self, path: str, exc: OSError) -> None:
        # The lines stay in the journal; the next start writes them.
        fd = self._fds.pop(path, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        if path not in self._broken:
            logger.error("cannot write receipts to %s (kept in the store's journal): %s", path, exc)
        self._broken.add(path)

    def recover(self, conn: sqlite3.Connection) -> int:
        """Complete every receipt file from the journal, fsync it and empty
        the journal; returns how many lines were missing. Runs at open,
        before any other write.

        A file whose end does not continue the journal's chain (edited,
        replaced, or damaged beyond its unsynced tail) is left as it is; its
        journaled lines are saved beside it (``<file>.unchained``) and an
        error names both. A file that cannot be written keeps its lines in
        the journal (for the next start), and new receipts continue them.
        """
        written = 0
        paths = [p for (p,) in conn.execute("SELECT DISTINCT path FROM receipt_journal")]
        for path in paths:
            rows = conn.execute(
                "SELECT hash, line FROM receipt_journal WHERE path = ? ORDER BY seq", (path,)
            ).fetchall()
            try:
                missing = _missing(Path(path), rows)
                if missing is None:
                    aside = Path(f"{path}.unchained")
                    append_to(aside, b"".join(line for _, line in rows), fsync=True)
                    logger.error(
                        "receipts %s do not end where the store's journal continues; "
                        "its %d journaled line(s) were saved to %s",
                        path,
                        len(rows),
                        aside,
                    )
                elif missing:
                    append_to(Path(path), b"".join(missing), fsync=True)
                    with contextlib.suppress(OSError):
                        fsync_path(os.path.dirname(path))
                    written += len(missing)
            except OSError as exc:
                logger.error("cannot complete receipts %s from the journal: %s", path, exc)
                # New lines continue the journaled ones (never forgotten: broken).
                self._heads[path] = (rows[-1][0], 0)
                self._broken.add(path)  # and all of them stay in the journal
                continue
            conn.execute("DELETE FROM receipt_journal WHERE path = ?", (path,))
        if written:
            logger.warning("completed %d receipt line(s) from the store's journal", written)
        return written


def _missing(path: Path, rows: list[tuple[str, bytes]]) -> list[bytes] | None:
    """The journaled lines the file lacks, in order; ``None`` if the file does
    not continue the journal's chain."""
    cut = _cut_damaged_tail(path, limit=sum(len(line) for _, line in rows))
    if cut:
        logger.warning("cut %d damaged byte(s) from the end of %s", cut, path)
    try:
        head = last_hash(path)
    except (ValueError, KeyError, TypeError):
        return None  # damaged further back than the journal reaches
    hashes = [digest for digest, _ in rows]
    if head in hashes:
        return [line for _, line in rows[hashes.index(head) + 1 :]]
    if json.loads(rows[0][1])["prev_hash"] == head:
        return [line for _, line in rows]
    return None


def _cut_damaged_tail(path: Path, *, limit: int) -> int:
    """Drop what a crash left at the end of the file: a line cut short, or
    lines that are not receipts (pages of an unsynced write that never landed).
    Only the last ``limit`` bytes may go — as much as the journal holds, the
    most a crash could have left unsynced. Returns how many bytes went."""
    try:
        with path.open("r+b") as f:
            size = f.seek(0, os.SEEK_END)
            base = max(0, size - limit - _LONGEST_LINE)
            f.seek(base)
            data = f.read()
            end = len(data)
            if not data.endswith(b"\n"):
                end = data.rfind(b"\n") + 1  # a torn last line
            while end > 0:
                start = data.rfind(b"\n", 0, end - 1) + 1
                if _is_receipt(data[start:end]) or (start == 0 and base > 0):
                    break  # a good line, or the start of what was read
                end = start
            cut = len(data) - end
            if cut == 0 or cut > limit:
                return 0  # nothing to cut, or more than a crash explains: leave it
            f.truncate(base + end)
            os.fsync(f.fileno())
            return cut
    except FileNotFoundError:
        return 0


def _is_receipt(line: bytes) -> bool:
    try:
        value = json.loads(line)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("hash"), str)


class JournalingStore(Protocol):
    """What :class:`JournaledReceipts` needs of its store (the SQLite one)."""

    async def record_receipt(self, path: Path, receipt: Mapping[str, Any]) -> None: ...

    async def commit(
        self,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        *,
        receipt: tuple[Path, Mapping[str, Any]] | None = None,
    ) -> None: ...


class JournaledReceipts:
    """Receipts written through the SQLite store (docs/approvals.md, one fsync per call).

    The store chains each receipt and journals its line in the transaction
    that records the call (a committed call's receipt shares its commit), then
    appends it to the file; the file is fsync'd and the journal trimmed in the
    background, and a store that opens after a crash first completes the file
    from the journal. See :mod:`supervisor.stores.journal`.
    """

    def __init__(self, path: Path, store: JournalingStore) -> None:
        self.path = path
        self._store = store

    async def record(self, receipt: dict[str, Any]) -> None:
        try:
            await self._store.record_receipt(self.path, receipt)
        except StoreUnavailable as exc:
            logger.error("cannot record a receipt for %s: %s", self.path, exc)

    async def commit(
        self,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        entry = (self.path, receipt)
        await self._store.commit(invocation_id, call_id, response, now, receipt=entry)
