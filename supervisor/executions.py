"""Executions as the channel sees them, and the table it looks them up in."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import time
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from channel.routing import BrokerPort
from channel.wire import CallReply
from supervisor.broker import Broker
from supervisor.errors import Refusal
from supervisor.limits import EndReason, Limits
from supervisor.outcomes import ExecutionOutcome
from supervisor.spawn import GuestProcess
from supervisor.timestamps import utc_timestamp

__all__ = ["Execution", "ExecutionState", "ExecutionTable"]


class ExecutionState(enum.StrEnum):
    """Lifecycle of one attempt. Only ``starting`` and ``running`` are live."""

    STARTING = "starting"
    RUNNING = "running"
    ENDED = "ended"
    CANCELLED = "cancelled"
    FENCED = "fenced"


@dataclass(eq=False, slots=True)
class Execution:
    """One launch of a guest: its identity facts, its broker and its state."""

    execution_id: str
    invocation_id: str
    plan_hash: str
    credential_sha256: bytes
    #: Its broker while it may still answer calls; a stand-in that refuses
    #: once it is retired (its memory freed).
    broker: BrokerPort
    guest_pid: int | None = None
    #: The guest's command, and the limits it runs under (set at launch).
    argv: tuple[str, ...] = ()
    limits: Limits | None = None
    #: When it was created (epoch seconds).
    created_at: float = field(default_factory=time.time)
    #: The guest's pid namespace and outside uid when it runs in a sandbox
    #: (the channel's origin check); ``None`` without one.
    guest_pidns: int | None = None
    guest_uid: int | None = None
    #: The execution's ``"sandbox"`` (docs/sandbox.md): ``"off"`` or what was used.
    sandbox: Mapping[str, Any] | str = "off"
    process: GuestProcess | None = None
    state: ExecutionState = ExecutionState.STARTING
    #: Called once when the execution stops being live (e.g. to cancel proposals).
    on_end: Callable[[Execution], object] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: Why the supervisor stopped it (a limit), if it did; else a cancel.
    stop_reason: EndReason | None = None
    #: How it ended, once it has.
    outcome: ExecutionOutcome | None = None

    launched: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set once its guest is gone, every process of it ended, and its outcome known.
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    #: Its calls by receipt outcome while it runs (its broker's own count).
    _calls: Mapping[str, int] = field(init=False, repr=False)

    async def wait_launched(self, timeout_s: float) -> None:
        """Wait (bounded) until the guest's pid is recorded."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.launched.wait()

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

    def stop_for(self, reason: EndReason) -> None:
        """A limit says it must stop: ended as cancelled, ``reason`` kept."""
        if self.live:
            self.stop_reason = reason
        self.end(ExecutionState.CANCELLED)

    def dispatch_blocker(self) -> Refusal | None:
        """Why a call of this execution may not cross BeginDispatch now, if so."""
        if self.live:
            return None
        if self.state is ExecutionState.FENCED:
            return Refusal("execution_fenced", "a newer execution of this invocation took over")
        return Refusal("cancelled", "the execution ended before the call was dispatched")

    def __post_init__(self) -> None:
        self._calls = self.broker.outcomes if isinstance(self.broker, Broker) else {}

    def calls(self) -> Mapping[str, int]:
        """Its calls by receipt outcome, so far."""
        return self.outcome.calls if self.outcome is not None else self._calls

    def started(self, process: GuestProcess, *, pidns: int | None, uid: int | None,
                sandbox: Mapping[str, Any] | str) -> None:  # fmt: skip
        """Its guest runs: the process, and what the origin check knows it by
        (its pid; in a sandbox its pid namespace and outside uid)."""
        self.process = process
        self.guest_pid = process.pid
        self.guest_pidns = pidns
        self.guest_uid = uid
        self.sandbox = sandbox
        self._running()

    def started_wasm(self, sandbox: Mapping[str, Any]) -> None:
        """Its WebAssembly guest runs, in this process: no pid, no socket —
        its instance is its identity (docs/wasm.md)."""
        self.sandbox = sandbox
        self._running()

    def _running(self) -> None:
        # Fenced or cancelled while it started: it stays so (its caller stops
        # the guest), never live again.
        if self.state is ExecutionState.STARTING:
            self.state = ExecutionState.RUNNING
        self.launched.set()

    def retire(self, outcome: ExecutionOutcome) -> None:
        """It ended and nothing of it runs: keep its identity facts and outcome,
        free the rest (its broker is replaced by one that refuses)."""
        self.outcome = outcome  # its calls are counted there now
        self._calls = _NO_CALLS
        self.process = None
        self.stopped.set()
        self.stopped = _ENDED
        self.broker = ENDED_BROKER
        self.on_end = None
        self.ended = _ENDED  # one shared, already-set event for all retired ones
        self.launched = _ENDED

    def describe(self) -> dict[str, object]:
        """This execution for the admin API (with its outcome once it ended).

        An execution that no longer accepts calls but whose guest is still
        being stopped is ``stopping``: ``ended``, ``cancelled`` or ``fenced``
        mean that no process of it is alive any more (docs/security.md, S5).
        """
        stopping = not self.live and self.launched.is_set() and self.outcome is None
        return {
            "execution_id": self.execution_id,
            "invocation_id": self.invocation_id,
            "state": "stopping" if stopping else str(self.state),
            "created_at": utc_timestamp(self.created_at),
            "argv": list(self.argv),
            "limits": self.limits.to_json() if self.limits is not None else None,
            "calls": dict(self.calls()),
            "guest_pid": self.guest_pid,
            "sandbox": dict(self.sandbox) if isinstance(self.sandbox, Mapping) else self.sandbox,
            "outcome": self.outcome.to_json() if self.outcome is not None else None,
        }


class _EndedBroker:
    """Stands in for the broker of an ended execution, so its memory is freed.

    The channel never reaches it (an ended execution is refused
    ``execution_fenced`` first); should anything else, it refuses too.
    """

    def _refusal(self, call_id: str | None) -> CallReply:
        return CallReply.refused(call_id, Refusal("execution_fenced", "this execution has ended"))

    async def call(self, call_id: str, tool: str, args: dict[str, Any]) -> CallReply:
        return self._refusal(call_id)

    async def status(self, call_id: str, wait_s: float) -> CallReply:
        return self._refusal(call_id)

    async def plan_view(self) -> dict[str, Any]:
        return {}


ENDED_BROKER: Final = _EndedBroker()
_NO_CALLS: Final[Mapping[str, int]] = types.MappingProxyType({})
_ENDED: Final = asyncio.Event()
_ENDED.set()
#: Ended executions remembered (so their credentials get ``execution_fenced``,
#: not ``unauthenticated``); older ones are forgotten first.
MAX_ENDED_EXECUTIONS: Final = 10_000


class ExecutionTable:
    """Every execution of one supervisor, by id (ended ones stay, fenced)."""

    def __init__(self, max_ended: int = MAX_ENDED_EXECUTIONS) -> None:
        self._by_id: dict[str, Execution] = {}
        self._ended: collections.deque[str] = collections.deque()
        self._max_ended = max_ended

    def add(self, execution: Execution) -> None:
        """Register a new execution."""
        self._by_id[execution.execution_id] = execution

    def discard(self, execution: Execution) -> None:
        """Forget an execution whose guest never started: nothing of it ran."""
        self._by_id.pop(execution.execution_id, None)

    def retire(self, execution: Execution, outcome: ExecutionOutcome) -> None:
        """An execution ended with ``outcome``: it keeps only what its id
        still answers for; the oldest ended ones are forgotten."""
        execution.retire(outcome)
        self._ended.append(execution.execution_id)
        while len(self._ended) > self._max_ended:
            self._by_id.pop(self._ended.popleft(), None)

    def lookup(self, execution_id: str) -> Execution | None:
        """The execution with this id, live or not."""
        return self._by_id.get(execution_id)

    def __iter__(self) -> Iterator[Execution]:
        return iter(list(self._by_id.values()))

    def of_invocation(self, invocation_id: str) -> list[Execution]:
        """Executions of one invocation, oldest first."""
        return [e for e in self._by_id.values() if e.invocation_id == invocation_id]
