"""Guest output: passed through, kept per execution under the state dir,
size-capped with rotation, and never containing the credential."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

__all__ = ["LOG_BACKUPS", "LOG_MAX_BYTES", "Redactor", "RotatingLog", "pump"]

logger = logging.getLogger(__name__)

#: Largest a guest's log file grows before it is rotated …
LOG_MAX_BYTES: Final = 10 * 1024 * 1024
#: … and how many rotated files (``.1`` newest) are kept beside it.
LOG_BACKUPS: Final = 2
REDACTED: Final = b"[hostcall: credential redacted]"
_CHUNK: Final = 64 * 1024


class Redactor:
    """Replaces a secret in a byte stream, also when it straddles two chunks.

    Only a tail that could still begin the secret is held back, so a prompt
    without a newline reaches the terminal at once.
    """

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._pending = b""

    def feed(self, data: bytes) -> bytes:
        """Redact ``data``; returns what is safe to write now."""
        buffer = (self._pending + data).replace(self._secret, REDACTED)
        hold = 0
        for size in range(min(len(self._secret) - 1, len(buffer)), 0, -1):
            if self._secret.startswith(buffer[-size:]):
                hold = size
                break
        self._pending = buffer[len(buffer) - hold :] if hold else b""
        return buffer[: len(buffer) - hold]

    def flush(self) -> bytes:
        """What is left at the end of the stream (cannot be the whole secret)."""
        rest, self._pending = self._pending, b""
        return rest


class RotatingLog:
    """An append-only file that rotates at ``max_bytes`` (``f``, ``f.1``, … ``f.N``)."""

    def __init__(
        self, path: Path, *, max_bytes: int = LOG_MAX_BYTES, backups: int = LOG_BACKUPS
    ) -> None:
        self.path = path
        self._max_bytes = max_bytes
        self._backups = backups
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._size = os.fstat(self._fd).st_size

    def write(self, data: bytes) -> None:
        """Append ``data``, rotating first if it would not fit."""
        while data:
            room = self._max_bytes - self._size
            if room <= 0:
                self._rotate()
                continue
            part, data = data[:room], data[room:]
            os.write(self._fd, part)
            self._size += len(part)

    def _rotate(self) -> None:
        os.close(self._fd)
        for index in range(self._backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            newer = self.path.with_name(f"{self.path.name}.{index - 1}") if index > 1 else self.path
            if newer.exists():
                os.replace(newer, older)
        if self._backups == 0:
            self.path.unlink(missing_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


async def pump(
    reader: asyncio.StreamReader,
    *,
    log: RotatingLog,
    passthrough: Callable[[bytes], object] | None,
    redactor: Redactor,
) -> None:
    """Copy a guest's stream to its log and (optionally) our own stream until EOF."""

    def emit(data: bytes) -> None:
        if not data:
            return
        try:
            log.write(data)
        except OSError as exc:  # a full disk must not stop the guest's output
            logger.error("cannot write guest log %s: %s", log.path, exc)
        if passthrough is not None:
            with contextlib.suppress(OSError, ValueError):
                passthrough(data)

    try:
        while chunk := await reader.read(_CHUNK):
            emit(redactor.feed(chunk))
        emit(redactor.flush())
    finally:
        log.close()
