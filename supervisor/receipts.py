"""Receipts: one hash-chained JSON line per call that reached a broker (SPEC §8).

``hash = sha256(JCS(receipt without hash))`` and ``prev_hash`` is the previous
line's ``hash`` (64 zeros for the first), so changing, removing or reordering a
line breaks the chain.

Two writers: :class:`ReceiptLog` chains lines in the order :meth:`~ReceiptLog.record`
is called and fsyncs the file itself (writes queued while one is being flushed
share its fsync); :class:`JournaledReceipts` lets the SQLite store chain and
journal them in the transactions that record the calls, so a call costs one
fsync, not two (:mod:`supervisor.stores.journal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import weakref
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from supervisor.canonical import jcs, sha256_hex
from supervisor.errors import StoreUnavailable
from supervisor.ids import new_id

if TYPE_CHECKING:
    from supervisor.stores.base import EffectStore
    from supervisor.stores.sqlite import SQLiteEffectStore

__all__ = [
    "GENESIS_HASH",
    "ChainError",
    "JournaledReceipts",
    "ReceiptLog",
    "Receipts",
    "append_to",
    "fsync_path",
    "last_hash",
    "make_receipt",
    "read_receipts",
    "seal",
    "utc_timestamp",
    "verify_chain",
]

logger = logging.getLogger(__name__)

GENESIS_HASH: Final = "0" * 64
_FIELDS: Final = (
    "receipt_id",
    "invocation_id",
    "execution_id",
    "plan_hash",
    "call_id",
    "tool",
    "idempotency_key",
    "outcome",
    "error_code",
    "result_sha256",
    "approval_id",
    "started_at",
    "finished_at",
    "prev_hash",
    "hash",
)
_FIELD_SET: Final = frozenset(_FIELDS)


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 UTC with microseconds, as receipts and the CLI print times."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def last_hash(path: Path) -> str:
    """The ``hash`` of the file's last line, reading only its tail."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            chunk = 4096
            while True:
                start = max(0, size - chunk)
                f.seek(start)
                tail = f.read(size - start)
                lines = tail.rstrip(b"\n").split(b"\n")
                if len(lines) > 1 or start == 0:
                    last = lines[-1]
                    break
                chunk *= 2
    except FileNotFoundError:
        return GENESIS_HASH
    if not last.strip():
        return GENESIS_HASH
    value = json.loads(last)["hash"]
    return str(value)


def make_receipt(
    *,
    invocation_id: str,
    execution_id: str,
    plan_hash: str,
    call_id: str | None,
    tool: str | None,
    idempotency_key: str | None,
    outcome: str,
    error_code: str | None,
    result_sha256: str | None = None,
    approval_id: str | None,
    started_at: float,
    finished_at: float,
) -> dict[str, Any]:
    """A receipt without its place in the chain (``prev_hash`` and ``hash``).

    ``result_sha256``: sha256 hex of the result's JCS, ``None`` when there is none.
    """
    return {
        "receipt_id": new_id("rcpt"),
        "invocation_id": invocation_id,
        "execution_id": execution_id,
        "plan_hash": plan_hash,
        "call_id": call_id,
        "tool": tool,
        "idempotency_key": idempotency_key,
        "outcome": outcome,
        "error_code": error_code,
        "result_sha256": result_sha256,
        "approval_id": approval_id,
        "started_at": utc_timestamp(started_at),
        "finished_at": utc_timestamp(finished_at),
    }


def seal(receipt: Mapping[str, Any], prev_hash: str) -> tuple[bytes, str]:
    """Chain ``receipt`` after ``prev_hash``: its JSON line and its ``hash``."""
    sealed = {**receipt, "prev_hash": prev_hash}
    sealed["hash"] = digest = sha256_hex(jcs(sealed))
    line = json.dumps(sealed, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
    return line, digest


class Receipts(Protocol):
    """Where one invocation's receipts go: :class:`ReceiptLog` (the file,
    fsync'd) or :class:`JournaledReceipts` (the SQLite store's transactions)."""

    path: Path

    async def record(self, receipt: dict[str, Any]) -> None:
        """Chain ``receipt`` (from :func:`make_receipt`) and make it durable."""
        ...

    async def commit(
        self,
        store: EffectStore,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        """Commit a dispatched call's record, then record its receipt.

        Raises:
            StoreUnavailable: the record was not committed (and the receipt
                not recorded): the caller records an ``unknown`` one instead.
        """
        ...


class ReceiptLog:
    """The receipt file of one invocation, shared by all its executions.

    With ``fsync`` (stores that survive the process), :meth:`record` returns
    once its line is on disk; without it (the memory store, whose records do
    not survive the process either) once the line is written to the file.
    """

    def __init__(self, path: Path, executor: Executor | None = None, *, fsync: bool = True) -> None:
        self.path = path
        self._executor = executor  # None: the loop's default pool
        self._fsync = fsync
        self._prev_hash: str | None = None
        self._queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._fd: int | None = None  # opened on the first write, closed with the log
        self._folder_synced = False

    async def append(self, **fields: Any) -> str:
        """Chain and durably write one receipt (fields of :func:`make_receipt`);
        returns its ``receipt_id``."""
        receipt = make_receipt(**fields)
        await self.record(receipt)
        return str(receipt["receipt_id"])

    async def record(self, receipt: dict[str, Any]) -> None:
        if self._prev_hash is None:
            # Read synchronously: an await here would let a second append read
            # the same tail and fork the chain. It reads one small tail, once.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prev_hash = last_hash(self.path)
        line, self._prev_hash = seal(receipt, self._prev_hash)
        if not self._fsync:
            self._write(line)  # a page-cache write, in chain order: no thread hop
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((line, done))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(done)

    async def commit(
        self,
        store: EffectStore,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        await store.commit(invocation_id, call_id, response, now)
        await self.record(receipt)

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                await asyncio.get_running_loop().run_in_executor(
                    self._executor, self._write, b"".join(line for line, _ in batch)
                )
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._flusher = None

    def _write(self, data: bytes) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                weakref.finalize(self, os.close, self._fd)
            _write_all(self._fd, data)
            if self._fsync:
                os.fsync(self._fd)
                if not self._folder_synced:  # the new file's entry in its folder, once
                    fsync_path(self.path.parent)
                    self._folder_synced = True
        except OSError as exc:
            _cannot_write(self.path, exc)


def append_to(path: Path, data: bytes, *, fsync: bool) -> None:
    """Append ``data`` to ``path`` (created ``0600``), all of it, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str | Path) -> None:
    """fsync a file or folder by name (a folder: the entries of new files)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _cannot_write(path: Path, exc: OSError) -> None:
    # The calls themselves are recorded in the effect store; an audit line we
    # could not write must at least be loud.
    logger.error("cannot write receipts to %s: %s", path, exc)


class JournaledReceipts:
    """Receipts written through the SQLite store (SPEC §8, one fsync per call).

    The store chains each receipt and journals its line in the transaction
    that records the call (a committed call's receipt shares its commit), then
    appends it to the file; the file is fsync'd and the journal trimmed in the
    background, and a store that opens after a crash first completes the file
    from the journal. See :mod:`supervisor.stores.journal`.
    """

    def __init__(self, path: Path, store: SQLiteEffectStore) -> None:
        self.path = path
        self._store = store

    async def record(self, receipt: dict[str, Any]) -> None:
        try:
            await self._store.record_receipt(self.path, receipt)
        except StoreUnavailable as exc:
            logger.error("cannot record a receipt for %s: %s", self.path, exc)

    async def commit(
        self,
        store: EffectStore,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        entry = (self.path, receipt)
        await self._store.commit(invocation_id, call_id, response, now, receipt=entry)


@dataclass(frozen=True, slots=True)
class ChainError:
    """Where and why a receipt chain is broken (line numbers from 1)."""

    line: int
    problem: str


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        yield from enumerate(f, start=1)


def read_receipts(path: Path) -> Generator[tuple[int, dict[str, Any] | ChainError], None, None]:
    """Every receipt of a file with its line number (from 1), checking the
    chain as it reads.

    At the first break a :class:`ChainError` is yielded for that line, then
    the line itself if it is a receipt (a changed line still is one). Lines
    after the break are yielded if they are receipts, but no longer
    chain-checked: nothing ties them to the verified part.
    """
    prev: str | None = GENESIS_HASH  # None once the chain is broken
    for number, raw in _lines(path):
        receipt: dict[str, Any] | None = None
        problem: str | None = None
        try:
            value = json.loads(raw)
        except ValueError:
            problem = "not valid JSON"
        else:
            if isinstance(value, dict) and set(value) == _FIELD_SET:
                receipt = value
                if prev is not None:
                    problem = _chain_problem(receipt, prev)
            else:
                problem = "not a receipt (fields differ)"
        if prev is not None:
            if problem is not None:
                yield number, ChainError(number, problem)
                prev = None
            else:
                assert receipt is not None
                prev = receipt["hash"]
        if receipt is not None:
            yield number, receipt


def _chain_problem(receipt: Mapping[str, Any], prev: str) -> str | None:
    if receipt["prev_hash"] != prev:
        return "prev_hash does not match the previous line (removed or reordered)"
    try:
        digest = sha256_hex(jcs({k: v for k, v in receipt.items() if k != "hash"}))
    except ValueError:  # not I-JSON: no hostcall sealed it
        digest = None
    if digest != receipt["hash"]:
        return "hash does not match the content (changed)"
    return None


def verify_chain(path: Path) -> tuple[int, ChainError | None]:
    """Check a receipt file; returns the number of good lines and the first break."""
    count = 0
    with contextlib.closing(read_receipts(path)) as items:
        for _, item in items:
            if isinstance(item, ChainError):
                return count, item
            count += 1
    return count, None
