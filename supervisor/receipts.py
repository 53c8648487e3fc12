"""Receipts: one hash-chained JSON line per call that reached a broker (SPEC §8).

``hash = sha256(JCS(receipt without hash))`` and ``prev_hash`` is the previous
line's ``hash`` (64 zeros for the first), so changing, removing or reordering a
line breaks the chain. Lines are chained in the order :meth:`ReceiptLog.append`
is called; writes queued while one is being flushed share its fsync.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
from collections.abc import Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from supervisor.canonical import jcs, sha256_hex
from supervisor.ids import new_id

__all__ = ["GENESIS_HASH", "ChainError", "ReceiptLog", "utc_timestamp", "verify_chain"]

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


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 UTC with microseconds, as receipts and the CLI print times."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _last_hash(path: Path) -> str:
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
    """The receipt file of one invocation, shared by all its executions."""

    def __init__(self, path: Path, executor: Executor | None = None) -> None:
        self.path = path
        self._executor = executor  # None: the loop's default pool
        self._prev_hash: str | None = None
        self._queue: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def append(
        self,
        *,
        invocation_id: str,
        execution_id: str,
        plan_hash: str,
        call_id: str | None,
        tool: str | None,
        idempotency_key: str | None,
        outcome: str,
        error_code: str | None,
        result: Any = None,
        has_result: bool = False,
        approval_id: str | None,
        started_at: float,
        finished_at: float,
    ) -> str:
        """Chain and durably write one receipt; returns its ``receipt_id``."""
        if self._prev_hash is None:
            # Read synchronously: an await here would let a second append read
            # the same tail and fork the chain. It reads one small tail, once.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._prev_hash = _last_hash(self.path)
        receipt: dict[str, Any] = {
            "receipt_id": new_id("rcpt"),
            "invocation_id": invocation_id,
            "execution_id": execution_id,
            "plan_hash": plan_hash,
            "call_id": call_id,
            "tool": tool,
            "idempotency_key": idempotency_key,
            "outcome": outcome,
            "error_code": error_code,
            "result_sha256": sha256_hex(jcs(result)) if has_result else None,
            "approval_id": approval_id,
            "started_at": utc_timestamp(started_at),
            "finished_at": utc_timestamp(finished_at),
            "prev_hash": self._prev_hash,
        }
        receipt["hash"] = sha256_hex(jcs(receipt))
        self._prev_hash = receipt["hash"]
        line = json.dumps(receipt, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((line, done))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(done)
        return str(receipt["receipt_id"])

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        self._executor, self._write, b"".join(line for line, _ in batch)
                    )
                except OSError as exc:
                    # The calls themselves are recorded in the effect store; an
                    # audit line we could not write must at least be loud.
                    logger.error("cannot write receipts to %s: %s", self.path, exc)
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)
        finally:
            self._flusher = None

    def _write(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class ChainError:
    """Where and why a receipt chain is broken (line numbers from 1)."""

    line: int
    problem: str


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        yield from enumerate(f, start=1)


def verify_chain(path: Path) -> tuple[int, ChainError | None]:
    """Check a receipt file; returns the number of good lines and the first break."""
    prev = GENESIS_HASH
    count = 0
    for number, raw in _lines(path):
        try:
            receipt = json.loads(raw)
        except ValueError:
            return count, ChainError(number, "not valid JSON")
        if not isinstance(receipt, dict) or set(receipt) != set(_FIELDS):
            return count, ChainError(number, "not a receipt (fields differ)")
        claimed = receipt.pop("hash")
        if receipt["prev_hash"] != prev:
            return count, ChainError(
                number, "prev_hash does not match the previous line (removed or reordered)"
            )
        if sha256_hex(jcs(receipt)) != claimed:
            return count, ChainError(number, "hash does not match the content (changed)")
        prev = claimed
        count += 1
    return count, None
