"""Executions as the channel sees them, and the table it looks them up in."""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from supervisor.broker import Broker
from supervisor.errors import Refusal
from supervisor.limits import EndReason
from supervisor.outcomes import ExecutionOutcome

__all__ = ["Execution", "ExecutionState", "ExecutionTable"]


class ExecutionState(enum.StrEnum):
    """Lifecycle of one attempt. Only ``starting`` and ``running`` are live."""

    STARTING = "starting"
    RUNNING = "running"
    ENDED = "ended"
    CANCELLED = "cancelled"
    FENCED = "fenced"


@dataclass(eq=False)
class Execution:
    """One launch of a guest: its identity facts, its broker and its state."""

    execution_id: str
    invocation_id: str
    plan_hash: str
    credential_sha256: bytes
    broker: Broker
    guest_pid: int | None = None
    process: asyncio.subprocess.Process | None = None
    state: ExecutionState = ExecutionState.STARTING
    #: Called once when the execution stops being live (e.g. to cancel proposals).
    on_end: Callable[[Execution], object] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: Why the supervisor stopped it (a limit), if it did; else a cancel.
    stop_reason: EndReason | None = None
    #: How it ended, once it has.
    outcome: ExecutionOutcome | None = None

    @property
    def live(self) -> bool:
        """Whether its credential still opens the door."""
        return self.state in (ExecutionState.STARTING, ExecutionState.RUNNING)

    def end(self, state: ExecutionState = ExecutionState.ENDED) -> None:
        """Stop accepting calls; the first reason to end it is kept."""
        if not self.live:
            return
        self.state = state
        self.ended.set()
        if self.on_end is not None:
            self.on_end(self)

    def dispatch_blocker(self) -> Refusal | None:
        """Why a call of this execution may not cross BeginDispatch now, if so."""
        if self.live:
            return None
        if self.state is ExecutionState.FENCED:
            return Refusal("execution_fenced", "a newer execution of this invocation took over")
        return Refusal("cancelled", "the execution ended before the call was dispatched")

    def describe(self) -> dict[str, object]:
        """This execution for the admin API (with its outcome once it ended)."""
        return {
            "execution_id": self.execution_id,
            "invocation_id": self.invocation_id,
            "state": str(self.state),
            "guest_pid": self.guest_pid,
            "outcome": self.outcome.to_json() if self.outcome is not None else None,
        }


class ExecutionTable:
    """Every execution of one supervisor, by id (ended ones stay, fenced)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Execution] = {}

    def add(self, execution: Execution) -> None:
        """Register a new execution."""
        self._by_id[execution.execution_id] = execution

    def lookup(self, execution_id: str) -> Execution | None:
        """The execution with this id, live or not."""
        return self._by_id.get(execution_id)

    def __iter__(self) -> Iterator[Execution]:
        return iter(list(self._by_id.values()))

    def of_invocation(self, invocation_id: str) -> list[Execution]:
        """Executions of one invocation, oldest first."""
        return [e for e in self._by_id.values() if e.invocation_id == invocation_id]
