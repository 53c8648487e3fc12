"""What ``hostcall run`` and ``hostcall serve`` tell the operator on stderr while
they run (docs/operations.md, "Seeing what happens").

Always, TTY or not: one line when a call starts waiting for approval — its
proposal, tool, arguments in short, and the exact command that decides it —
and one when it is decided; ``serve`` also logs each launch and exit, ``run``
each new attempt. On a terminal, ``run`` also keeps one status line at the
bottom: elapsed time, the execution and attempt, calls by outcome, approvals
waiting. It is redrawn in place and cleared before any other output (guest
output included, see :class:`supervisor.logs.Passthrough`), so lines never
mix. The watch reads the supervisor's own change notices
(:mod:`supervisor.activity`), the ones the console gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Final

from supervisor.activity import Topic
from supervisor.cli.app import one_line, short_json
from supervisor.cli.hints import hostcall_command, state_dir_flag
from supervisor.logs import Passthrough
from supervisor.supervisor import Supervisor

__all__ = ["StatusLine", "Watch", "decide_hint"]

#: How often the status line is redrawn.
STATUS_INTERVAL_S: Final = 0.25
#: The notices after which the watcher reads approvals and executions again.
_LOOKED_AT: Final = frozenset({Topic.APPROVALS, Topic.INVOCATIONS, Topic.RESYNC})
#: Arguments are cut to this many characters in the waiting line.
SHORT_ARGS: Final = 80
_SPINNER: Final = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


def decide_hint(proposal_id: str, state_dir: Path) -> str:
    """The exact commands that approve or reject ``proposal_id``."""
    command = f"{shlex.quote(hostcall_command())} approvals"
    flag = state_dir_flag(state_dir)
    return f"{command} approve {proposal_id}{flag}  (or: reject {proposal_id}{flag} --reason …)"


def _calls_text(calls: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(calls.items()) if v) or "no calls yet"


class StatusLine:
    """One line redrawn in place at the bottom of a terminal, by a thread of its own.

    The event loop only hands it the text (:meth:`show`): a terminal that stops
    reading (a paused scroll) never blocks the loop. Guest output is written
    by :class:`Passthrough`'s threads; all take :attr:`lock`, the line is
    erased before anything else is written, and it is not drawn while the
    last thing written ends mid-line (``\r`` would return over it).
    """

    def __init__(self, stream: IO[str]) -> None:
        self.lock = threading.Lock()
        self._stream = stream
        self._shown = False
        self._mid_line = False
        self._text: str | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hostcall-status", daemon=True)
        self._thread.start()

    def clear_locked(self) -> None:
        """Erase the line (hold :attr:`lock`)."""
        if self._shown:
            with contextlib.suppress(OSError, ValueError):
                self._stream.write("\r\x1b[K")
                self._stream.flush()
            self._shown = False

    def wrote_locked(self, data: bytes) -> None:
        """Something else was written (hold :attr:`lock`)."""
        if data:
            self._mid_line = not data.endswith(b"\n")

    def show(self, text: str) -> None:
        """Draw ``text`` in place of the line, soon; never blocks."""
        self._text = text
        self._wake.set()

    def close(self, timeout_s: float = 1.0) -> None:
        """Erase the line and stop drawing (bounded)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self.lock:
                if self._closed:
                    self.clear_locked()
                    return
                if self._mid_line or self._text is None:
                    continue
                try:
                    width = os.get_terminal_size(self._stream.fileno()).columns or 100
                except (OSError, ValueError):  # 0 columns: a terminal with no size set
                    width = 100
                with contextlib.suppress(OSError, ValueError):
                    self._stream.write("\r\x1b[K" + self._text[: max(10, width - 1)])
                    self._stream.flush()
                    self._shown = True


class _Lines:
    """Whole lines on a stream, through its pass-through thread when it has one
    (never blocking the loop, in order with guest output), else printed."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._through = Passthrough.to(stream)

    def say(self, line: str) -> None:
        if self._through is not None:
            self._through.say(line)
            return
        with contextlib.suppress(OSError, ValueError):
            print(line, file=self._stream, flush=True)

    async def drained(self, timeout_s: float) -> None:
        if self._through is not None:
            await self._through.drained(timeout_s)


class Watch:
    """Follows one supervisor and tells the operator (see the module docstring).

    Args:
        sup: The supervisor.
        state_dir: Its state dir, for the commands the lines print.
        prefix: What every line starts with (``hostcall``, ``hostcall serve``).
        invocation_id: ``run``'s invocation: the status line and attempt lines
            are about it; ``None`` (``serve``): every launch and exit is logged.
        attempts: ``run --attempts``.
        status: Draw the status line (a terminal).
    """

    def __init__(
        self,
        sup: Supervisor,
        state_dir: Path,
        *,
        prefix: str,
        invocation_id: str | None = None,
        attempts: int = 1,
        status: bool = False,
        stream: IO[str] | None = None,
    ) -> None:
        self._sup = sup
        self._state_dir = state_dir
        self._prefix = prefix
        self._invocation_id = invocation_id
        self._attempts = attempts
        out = stream or sys.stderr
        self._line: StatusLine | None = StatusLine(out) if status else None
        self._out = _Lines(out)
        self._proposals: dict[str, str] = {}
        self._executions: dict[str, str] = {}
        self._started = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin following (a task on the running loop)."""
        if self._line is not None:
            Passthrough.interposer = self._line
        self._task = asyncio.create_task(self._follow())

    async def close(self) -> None:
        """Stop following; the status line is erased."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._look()  # what happened at the very end (a decision, the exit)
        await self._out.drained(STATUS_INTERVAL_S * 4)  # before hostcall's summary
        if self._line is not None:
            await asyncio.to_thread(self._line.close)
            if Passthrough.interposer is self._line:
                Passthrough.interposer = None

    def say(self, line: str) -> None:
        """Print ``line`` (above the status line, if there is one), inert: it
        may quote what an operator typed (a reason) or a guest sent."""
        self._out.say(one_line(line))

    async def _follow(self) -> None:
        # Without a status line, calls change nothing it shows: not woken by them.
        topics = None if self._line is not None else _LOOKED_AT
        with self._sup.activity.events.subscribe(topics) as notices:
            self._look()
            while True:
                got = await notices.next(STATUS_INTERVAL_S)
                if {topic for topic, _ in got} & _LOOKED_AT:
                    self._look()
                if self._line is not None:
                    self._line.show(self._status())

    def _look(self) -> None:
        self._look_at_proposals()
        self._look_at_executions()

    def _mine(self, invocation_id: str) -> bool:
        return self._invocation_id is None or invocation_id == self._invocation_id

    def _look_at_proposals(self) -> None:
        for proposal in self._sup.approvals.list():
            if not self._mine(proposal.invocation_id):
                continue
            before = self._proposals.get(proposal.id)
            if before == proposal.state:
                continue
            self._proposals[proposal.id] = proposal.state
            if proposal.state == "waiting":
                lease = max(0.0, proposal.expires_at - time.time())
                self.say(
                    f"{self._prefix}: approval {proposal.id} waiting: {proposal.call_id} "
                    f"{proposal.tool} {short_json(proposal.args, SHORT_ARGS)} "
                    f"({proposal.reversibility}, lease {lease:.0f} s) — "
                    f"{decide_hint(proposal.id, self._state_dir)}"
                )
            elif proposal.state == "dispatched" and before == "approved":
                continue  # "approved" was said; dispatch is the call's business
            elif before in (None, "waiting") or proposal.state != "dispatched":
                state = "approved" if proposal.state == "dispatched" else proposal.state
                by = f" by {proposal.decided_by}" if proposal.decided_by else ""
                reason = f": {proposal.reason}" if proposal.reason else ""
                self.say(f"{self._prefix}: approval {proposal.id} {state}{by}{reason}")

    def _look_at_executions(self) -> None:
        mine = [e for e in self._sup.executions() if self._mine(e.invocation_id)]
        for number, execution in enumerate(mine, start=1):
            described = execution.describe()
            state = str(described["state"])
            before = self._executions.get(execution.execution_id)
            if before == state:
                continue
            self._executions[execution.execution_id] = state
            if before is None and self._invocation_id is not None:
                if number > 1:
                    self.say(
                        f"{self._prefix}: attempt {number}/{self._attempts}: execution "
                        f"{execution.execution_id}"
                    )
                continue
            if before is None:
                self.say(
                    f"{self._prefix}: launched {execution.execution_id} of "
                    f"{execution.invocation_id}: {shlex.join(execution.argv)}"
                )
            elif execution.outcome is not None and self._invocation_id is None:
                self.say(
                    f"{self._prefix}: {execution.invocation_id} {execution.outcome.describe()}"
                )

    def _status(self) -> str:
        elapsed = time.monotonic() - self._started
        spin = _SPINNER[int(elapsed / STATUS_INTERVAL_S) % len(_SPINNER)]
        mine = [e for e in self._sup.executions() if self._mine(e.invocation_id)]
        waiting = sum(
            p.state == "waiting" for p in self._sup.approvals.list() if self._mine(p.invocation_id)
        )
        parts = [f"{spin} {elapsed:.1f} s"]
        if mine:
            last = mine[-1]
            parts.append(
                f"{last.execution_id} (attempt {len(mine)}/{self._attempts}, {last.state})"
            )
            parts.append(_calls_text(last.calls()))
        if waiting:
            parts.append(f"{waiting} approval{'s' if waiting != 1 else ''} waiting")
        return " · ".join(parts)
