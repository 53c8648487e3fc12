"""Receipt files: reading a chain's head, appending lines durably, and the
writer that chains a file's lines itself (:class:`ReceiptLog`).

The chain (what a line holds, how it is sealed and verified) is
:mod:`supervisor.receipts`; the SQLite store journals its receipts instead
(:mod:`supervisor.stores.journal`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from supervisor.receipts import GENESIS_HASH, make_receipt, seal

__all__ = ["Commit", "ReceiptLog", "append_to", "fsync_path", "last_hash", "write_all"]

logger = logging.getLogger(__name__)

#: ``EffectStore.commit``: a call's record committed with its response.
Commit = Callable[[str, str, Mapping[str, Any], float], Awaitable[None]]


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


class ReceiptLog:
    """The receipt file of one invocation, shared by all its executions.

    With ``fsync`` (stores that survive the process), :meth:`record` returns
    once its line is on disk; without it (the memory store, whose records do
    not survive the process either) once the line is written to the file.
    ``commit`` is the store's own (``EffectStore.commit``): :meth:`commit`
    commits a call's record through it, then records the receipt — the
    writer a store that does not journal receipts hands out
    (``EffectStore.receipts``).
    """

    def __init__(
        self,
        path: Path,
        executor: Executor | None = None,
        *,
        fsync: bool = True,
        commit: Commit | None = None,
    ) -> None:
        self.path = path
        self._commit = commit
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
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        if self._commit is None:
            raise RuntimeError("this receipt log was made without its store's commit")
        await self._commit(invocation_id, call_id, response, now)
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
            write_all(self._fd, data)
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
        write_all(fd, data)
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


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _cannot_write(path: Path, exc: OSError) -> None:
    # The calls themselves are recorded in the effect store; an audit line we
    # could not write must at least be loud.
    logger.error("cannot write receipts to %s: %s", path, exc)
