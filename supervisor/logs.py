"""Guest output: passed through, kept per execution under the state dir, cut
at an output budget, and never containing the credential (docs/security.md, S9).

A guest may write without end. What it writes is kept, and passed through,
only up to two budgets that apply at once: one shared by both streams of an
execution and one shared by every execution of an invocation. When either runs
out, one marker line says so and the rest is read and discarded, so the guest
never blocks on a full pipe and nothing it writes can fill the host's disk.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO, ClassVar, Final, Literal, Protocol

from supervisor.terminal import TerminalText, escape_controls, is_terminal

__all__ = [
    "EXECUTION_OUTPUT_LIMIT",
    "INVOCATION_OUTPUT_LIMIT",
    "REDACTED",
    "CappedStream",
    "GuestLog",
    "OutputBudget",
    "Passthrough",
    "Redactor",
    "allow",
    "pump",
]

logger = logging.getLogger(__name__)

_KiB: Final = 1024
_MiB: Final = 1024 * _KiB
#: Output one execution may keep, its stdout and stderr together (docs/security.md, S9) …
EXECUTION_OUTPUT_LIMIT: Final = 64 * _MiB
#: … and all executions of one invocation together, across supervisor restarts.
INVOCATION_OUTPUT_LIMIT: Final = 256 * _MiB
#: What the log and the pass-through show where the guest printed its credential.
REDACTED: Final = b"[hostcall: credential redacted]"
_CHUNK: Final = 64 * 1024

Scope = Literal["execution", "invocation"]


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
        if not self._secret:
            return data  # nothing to hide (a WebAssembly guest has no credential)
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


# -- budgets: arithmetic only ---------------------------------------------------


@dataclass(slots=True)
class OutputBudget:
    """Bytes of guest output one scope may still keep (log and pass-through
    are the same bytes, counted once).

    One per execution, shared by its two streams; one per invocation, shared
    by its executions for as long as any of them runs here.
    """

    scope: Scope
    limit: int
    used: int = 0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"an output limit cannot be negative: {self.limit}")

    @classmethod
    def for_execution(cls, limit: int = EXECUTION_OUTPUT_LIMIT) -> OutputBudget:
        """A fresh budget for one execution's stdout and stderr together."""
        return cls("execution", limit)

    @classmethod
    def for_invocation(cls, folder: Path, limit: int = INVOCATION_OUTPUT_LIMIT) -> OutputBudget:
        """A budget for an invocation whose logs are kept in ``folder``.

        It starts from the bytes already there, so earlier executions (also
        of an earlier supervisor) count. Markers found there count too; they
        are a line each.
        """
        return cls("invocation", limit, _bytes_in(folder))

    @property
    def left(self) -> int:
        """Bytes this scope may still keep."""
        return max(0, self.limit - self.used)

    def marker(self) -> bytes:
        """The line that ends a stream this budget cut."""
        return (
            f"\n[hostcall: output cut: this {self.scope}'s output limit of "
            f"{_amount(self.limit)} was reached; the rest was discarded]\n"
        ).encode()


def allow(size: int, budgets: Sequence[OutputBudget]) -> tuple[int, OutputBudget | None]:
    """Charge a write of ``size`` bytes to all ``budgets`` at once.

    Returns:
        How many of the bytes may be kept (what every budget allows, and that
        much is charged to each), and the budget that cut the rest — the
        tightest, the first of equals — or ``None`` if all of them fit.
    """
    tightest = min(budgets, key=lambda budget: budget.left, default=None)
    if tightest is None or tightest.left >= size:
        kept, cut_by = size, None
    else:
        kept, cut_by = tightest.left, tightest
    for budget in budgets:
        budget.used += kept
    return kept, cut_by


class CappedStream:
    """One guest stream on its way out: redacted first, then cut at its budgets.

    Redacting before cutting means the cut falls in the redacted text, never
    inside a credential; once cut, the redactor is dropped without a flush,
    so the start of a credential it was holding back never comes out either.
    """

    def __init__(self, redactor: Redactor, budgets: Sequence[OutputBudget]) -> None:
        self._redactor: Redactor | None = redactor
        self._budgets = tuple(budgets)
        #: The budget that cut this stream, once one has.
        self.cut_by: OutputBudget | None = None

    def feed(self, chunk: bytes) -> bytes:
        """What to write of ``chunk``: a part of it, then the marker at the cut."""
        if self._redactor is None:
            return b""
        return self._admit(self._redactor.feed(chunk))

    def finish(self) -> bytes:
        """What to write at the end of the stream."""
        if self._redactor is None:
            return b""
        return self._admit(self._redactor.flush())

    def _admit(self, data: bytes) -> bytes:
        if not data:
            return b""
        kept, cut_by = allow(len(data), self._budgets)
        if cut_by is None:
            return data
        self.cut_by, self._redactor = cut_by, None
        # The marker is outside the budget: it is the one line that says why
        # the output stops, and a stream can be cut only once.
        return data[:kept] + cut_by.marker()


# -- the file ------------------------------------------------------------------


class GuestLog:
    """One stream's log: ``<folder>/<execution_id>.<stream>.log``, append-only.

    The folder is made 0700 and the file 0600; neither is reached through a
    symlink planted at its path. It never raises: a file that cannot be opened
    or written (a full disk) is reported once, and the output still passes
    through.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reported = False
        try:
            self._fd = _open_private(path)
        except OSError as exc:
            self._fd = -1
            self._report(exc)

    def write(self, data: bytes) -> None:
        """Append ``data``, whole or as much as the file takes."""
        if self._fd < 0:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._report(exc)

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _report(self, exc: OSError) -> None:
        if not self._reported:
            self._reported = True
            logger.error(
                "cannot write guest log %s: %s; the output still passes through", self.path, exc
            )


def _open_private(path: Path) -> int:
    path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path.parent, 0o700)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(folder, 0o700)
        # O_NONBLOCK: a FIFO planted here must not block the open; it is
        # refused below like anything else that is not a regular file.
        fd = os.open(
            path.name,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
            0o600,
            dir_fd=folder,
        )
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.fchmod(fd, 0o600)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bytes_in(folder: Path) -> int:
    """The size of the regular files in ``folder`` (0 if there is none)."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        pass
    except OSError as exc:
        # Its logs cannot be opened either then; what is not kept is not counted.
        logger.error("cannot read guest log folder %s: %s", folder, exc)
    return total


def _amount(size: int) -> str:
    for unit, name in ((_MiB, "MiB"), (_KiB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


# -- the pump ------------------------------------------------------------------


async def pump(
    reader: asyncio.StreamReader,
    *,
    log: GuestLog,
    passthrough: Passthrough | Callable[[bytes], object] | None,
    redactor: Redactor,
    budgets: Sequence[OutputBudget],
    on_output: Callable[[], object] | None = None,
) -> None:
    """Copy a guest's stream to its log and (optionally) our own stream until EOF.

    Both get the same bytes, cut where any of ``budgets`` runs out; the pipe
    is read to its end regardless; ``on_output()`` after each write. Closes
    ``log`` at the end.
    """
    stream = CappedStream(redactor, budgets)

    def emit(data: bytes) -> None:
        if not data:
            return
        log.write(data)
        if isinstance(passthrough, Passthrough):
            passthrough.write(data)
        elif passthrough is not None:
            with contextlib.suppress(OSError, ValueError):
                passthrough(data)
        if on_output is not None:
            on_output()

    try:
        while chunk := await reader.read(_CHUNK):
            emit(stream.feed(chunk))
        emit(stream.finish())
        if isinstance(passthrough, Passthrough):
            await passthrough.drained(PASSTHROUGH_DRAIN_S)
    finally:
        log.close()


# -- the pass-through ------------------------------------------------------------

#: Guest output waiting for a slow reader of our own stream before more is dropped.
PASSTHROUGH_BACKLOG: Final = 4 * 1024 * 1024
#: How long hostcall's own line (a log line) waits for its stream, busy with
#: guest output, before it is queued behind that output instead.
OWN_LINE_WAIT_S: Final = 0.02
#: How long a finished pump waits for its output to reach our stream.
PASSTHROUGH_DRAIN_S: Final = 5.0


class Interposer(Protocol):
    """A line drawn on the same terminal as guest output (see :class:`Passthrough`):
    erased before guest output is written, told what was written (a line it
    cuts in two must not be drawn over), both under its lock."""

    @property
    def lock(self) -> threading.Lock: ...

    def clear_locked(self) -> None: ...

    def wrote_locked(self, data: bytes) -> None: ...


class Passthrough:
    """Guest output on one of the supervisor's own streams, written by a thread.

    A reader of our stdout that stops reading (a paused pager, a full pipe)
    must never block the event loop, which serves every guest, the admin API
    and the sampler (docs/security.md, S9). Writes are queued and a daemon thread
    performs them; past :data:`PASSTHROUGH_BACKLOG` waiting bytes, output is
    dropped, and one line says how much once the reader catches up. The log
    files under the state dir still get everything (up to the budgets).
    """

    _by_stream: ClassVar[dict[int, Passthrough]] = {}
    #: Something else that draws on the terminal (the CLI's status line): it is
    #: cleared, under its lock, before guest output is written.
    interposer: ClassVar[Interposer | None] = None
    #: Whether what was last written to a terminal ended mid-line (our
    #: stdout and stderr are mostly one terminal: this is shared).
    _terminal_mid_line: ClassVar[bool] = False
    #: Held around each write to a terminal and the update of where it
    #: ended, by the pass-through threads and by hostcall's own lines
    #: (:meth:`own_line`). A stream that is no terminal has a lock of its
    #: own: a paused reader of our stdout (a pager) blocks no log line.
    _terminal_writing: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, buffer: BinaryIO, backlog: int = PASSTHROUGH_BACKLOG) -> None:
        self._buffer = buffer
        self._backlog = backlog
        self._queue: collections.deque[tuple[bytes, bool]] = collections.deque()
        self._mid_line = False
        self._queued = 0
        self._dropped = 0
        #: Lines of hostcall's own queued and not yet written: while there
        #: are, :meth:`own_line` queues its line too (in order behind them).
        self._own_pending = 0
        self._lock = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        # A terminal gets control characters as text (see supervisor.terminal).
        try:
            escape = is_terminal(buffer.fileno())
        except (OSError, ValueError):  # no descriptor (a test's capture buffer)
            escape = False
        self._text = TerminalText() if escape else None
        self._writing = Passthrough._terminal_writing if escape else threading.Lock()

    @classmethod
    def to(cls, stream: IO[str]) -> Passthrough | None:
        """The pass-through to ``stream`` (one per stream, shared by all guests)."""
        buffer = getattr(stream, "buffer", None)
        if buffer is None:
            return None
        found = cls._by_stream.get(id(buffer))
        if found is None or found._buffer is not buffer:
            found = cls._by_stream[id(buffer)] = cls(buffer)
        return found

    def write(self, data: bytes) -> None:
        """Queue a guest's ``data``; never blocks."""
        self._enqueue(data, own=False)

    def say(self, line: str) -> None:
        """Queue one line of hostcall's own; never blocks. It starts a row of
        its own: after a guest's unfinished line (a bare ``\\r`` too), a
        newline comes first, so guest text never shares hostcall's row."""
        self._enqueue(line.encode(errors="backslashreplace") + b"\n", own=True)

    @classmethod
    def end_guest_line(cls, stream: IO[str]) -> None:
        """Before hostcall prints to ``stream`` itself (once the guests are
        done): end a guest's unfinished line there, as :meth:`say` would."""
        cls.own_line(stream, None)

    @classmethod
    def own_line(cls, stream: IO[str], line: str | None) -> None:
        """Write one line of hostcall's own to ``stream`` (a log line), on a
        row of its own, as :meth:`say` would; ``None``: only end a guest's
        unfinished line there.

        At once, so that it is not lost at exit, when the stream is free
        within :data:`OWN_LINE_WAIT_S`; else (its pass-through is writing a
        backlog of guest output to a slow reader) queued behind that output,
        as :meth:`say` queues, and so are the lines after it until it is
        written: the event loop, which logs, never waits longer, and the lines
        keep their order.
        """
        through = cls.to(stream)
        if through is None:  # no byte stream beneath (a test's capture)
            if line is not None:
                with contextlib.suppress(OSError, ValueError):
                    stream.write(line + "\n")
                    stream.flush()
            return
        if through._own_pending or not through._writing.acquire(timeout=OWN_LINE_WAIT_S):
            if line is not None:
                through.say(line)  # behind the guest's output, and our lines queued before
            return
        try:
            with contextlib.suppress(OSError, ValueError):
                # What was written to it before goes first. Only now: while
                # the pass-through writes, its buffer's lock is taken.
                stream.flush()
            if line is not None:
                data = line.encode(errors="backslashreplace") + b"\n"
                if through._text is not None:
                    data = escape_controls(data)
                through._write(data, own=True, dropped=0)  # under the status line too
            elif through._ended_mid_line:
                through._write(b"", own=True, dropped=0)  # the newline that ends it
        finally:
            through._writing.release()

    def _enqueue(self, data: bytes, *, own: bool) -> None:
        with self._lock:
            # hostcall's own lines have room past the guests' backlog: a
            # flood of guest output drops guest output, not them.
            if self._queued + len(data) > self._backlog * (2 if own else 1):
                self._dropped += len(data)
                return
            self._queue.append((data, own))
            self._queued += len(data)
            self._own_pending += own
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hostcall-passthrough", daemon=True
                )
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._idle.set()
                    self._lock.wait()
                data, own = self._queue.popleft()
                self._queued -= len(data)
                dropped, self._dropped = self._dropped, 0
            if self._text is not None:
                data = escape_controls(data) if own else self._text.feed(data)
            with self._writing:
                self._write(data, own, dropped)
                if own:
                    with self._lock:
                        self._own_pending -= 1

    def _write(self, data: bytes, own: bool, dropped: int) -> None:
        """One write to the stream (under ``_writing``)."""
        if own and self._ended_mid_line:
            data = b"\n" + data
        if dropped:
            data = (
                f"\n[hostcall: {dropped} bytes of guest output not shown here: "
                "this stream was not being read; the log under the state dir has them]\n"
            ).encode() + data
        interposer = Passthrough.interposer
        with contextlib.suppress(OSError, ValueError):
            if interposer is None:
                self._buffer.write(data)
                self._buffer.flush()
            else:
                with interposer.lock:
                    interposer.clear_locked()
                    self._buffer.write(data)
                    self._buffer.flush()
                    interposer.wrote_locked(data)
        if data:
            self._ended_mid_line = not data.endswith(b"\n")

    @property
    def _ended_mid_line(self) -> bool:
        if self._text is None:
            return self._mid_line
        return Passthrough._terminal_mid_line or self._text.mid_character

    @_ended_mid_line.setter
    def _ended_mid_line(self, value: bool) -> None:
        if self._text is None:
            self._mid_line = value
        else:
            Passthrough._terminal_mid_line = value

    async def drained(self, timeout_s: float) -> bool:
        """Wait (bounded) until everything queued so far has been written."""
        if self._idle.is_set():
            return True
        return await asyncio.to_thread(self._idle.wait, timeout_s)
