"""What an operator watches: change notices, and each invocation's recent calls.

The console (and anything else on the admin API's ``GET /v1/events``) learns
*that* something changed — a proposal opened or was decided, an execution
started or ended, a call finished, a guest wrote output — and then reads the
state it shows from the admin API. Notices are coalesced per subscriber:
however many calls finish before a subscriber reads, it gets one ``calls``
notice per invocation, so a busy supervisor never floods a page, and a
supervisor nobody watches pays one truth test per notice.

The call journal keeps what the effect records and receipts do not: the
arguments each call came with (bounded; see :class:`CallJournal`).
"""

from __future__ import annotations

import asyncio
import collections
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from supervisor.timestamps import utc_timestamp

__all__ = ["Activity", "CallEntry", "CallJournal", "EventHub", "Subscription", "Topic"]

#: Distinct notices a subscriber may have unread before they collapse into one
#: ``resync`` (read everything again).
MAX_PENDING: Final = 256
#: Calls kept per invocation, newest last.
CALLS_PER_INVOCATION: Final = 500
#: Invocations whose calls are kept; the least recently active is dropped first.
INVOCATIONS_KEPT: Final = 256
#: Calls kept across all invocations: an entry costs about 0.8 KB with small
#: arguments (measured with tracemalloc), so ~16 MiB; past it the least
#: recently active invocations are dropped whole. Without it 256 invocations
#: of 500 calls held ~97 MiB.
CALLS_KEPT: Final = 20_000
#: Arguments of one call larger than this (as JCS) are not kept.
MAX_ARGS_BYTES: Final = 64 * 1024
#: Arguments kept across all invocations; the oldest are dropped first.
ARGS_BUDGET_BYTES: Final = 16 * 2**20


class Topic(enum.StrEnum):
    """What changed."""

    APPROVALS = "approvals"
    INVOCATIONS = "invocations"
    CALLS = "calls"
    LOGS = "logs"
    #: A new sample of the call counters (the console's own).
    METRICS = "metrics"
    #: Too much changed to say what: read everything again.
    RESYNC = "resync"


Notice = tuple[Topic, str | None]


class Subscription:
    """One subscriber's unread notices, each ``(topic, invocation)`` once;
    only of ``topics`` when given (``RESYNC`` always comes through)."""

    def __init__(self, hub: EventHub, topics: frozenset[Topic] | None = None) -> None:
        self._hub = hub
        self._topics = topics
        self._pending: dict[Notice, None] = {}
        self._ready = asyncio.Event()

    def post(self, notice: Notice) -> None:
        """Add a notice (the hub calls this)."""
        if notice in self._pending:
            return
        if self._topics is not None and notice[0] not in self._topics:
            return  # not woken for what it does not read (a call, at every call)
        if len(self._pending) >= MAX_PENDING:
            self._pending = {(Topic.RESYNC, None): None}
        else:
            self._pending[notice] = None
        self._ready.set()

    async def next(self, timeout_s: float) -> list[Notice]:
        """The notices posted since the last call; ``[]`` if none came within
        ``timeout_s``."""
        if not self._pending:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._ready.wait()
            except TimeoutError:
                return []
        notices = list(self._pending)
        self._pending.clear()
        self._ready.clear()
        return notices

    def close(self) -> None:
        """Stop receiving notices."""
        self._hub.unsubscribe(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class EventHub:
    """Fans change notices out to subscribers. Loop thread only."""

    def __init__(self) -> None:
        self._subscribers: set[Subscription] = set()

    def publish(self, topic: Topic, invocation_id: str | None = None) -> None:
        """Tell every subscriber that ``topic`` (of ``invocation_id``) changed."""
        if not self._subscribers:
            return
        notice = (topic, invocation_id)
        for subscriber in self._subscribers:
            subscriber.post(notice)

    def subscribe(self, topics: frozenset[Topic] | None = None) -> Subscription:
        """A new subscription (to ``topics`` only, when given); close it when done."""
        subscription = Subscription(self, topics)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        """Forget ``subscription`` (idempotent)."""
        self._subscribers.discard(subscription)


@dataclass(eq=False, slots=True)
class CallEntry:
    """One call as it reached its broker and was answered."""

    execution_id: str
    call_id: str
    tool: str
    #: The arguments as the guest sent them; ``None`` once dropped or when too large.
    args: Any
    #: Their size as canonical JSON (0 when they were never canonicalized).
    args_bytes: int
    status: str
    #: The receipt's outcome: executed, replayed, refused, failed, unknown, result_invalid.
    outcome: str
    effect: str
    #: The error code, or the reason of an ``ambiguous`` answer.
    code: str | None
    idempotency_key: str | None
    receipt_id: str | None
    approval_id: str | None
    started_at: float
    finished_at: float

    def to_json(self) -> dict[str, Any]:
        """The admin API's form."""
        return {
            "execution_id": self.execution_id,
            "call_id": self.call_id,
            "tool": self.tool,
            "args": self.args,
            "args_kept": self.args is not None,
            "args_bytes": self.args_bytes,
            "status": self.status,
            "outcome": self.outcome,
            "effect": self.effect,
            "code": self.code,
            "idempotency_key": self.idempotency_key,
            "receipt_id": self.receipt_id,
            "approval_id": self.approval_id,
            "started_at": utc_timestamp(self.started_at),
            "finished_at": utc_timestamp(self.finished_at),
            "duration_ms": round((self.finished_at - self.started_at) * 1000, 3),
        }


class CallJournal:
    """Each invocation's last :data:`CALLS_PER_INVOCATION` calls, in memory.

    Bounded four ways, so guests that make calls without end cannot grow
    the supervisor: calls per invocation, invocations kept, calls overall
    (the least recently active invocations go first), and bytes of
    arguments overall (the oldest arguments are dropped first; the call
    stays, marked ``args_kept: false``). Nothing here is durable: the
    receipts are the record.
    """

    def __init__(
        self,
        *,
        per_invocation: int = CALLS_PER_INVOCATION,
        invocations: int = INVOCATIONS_KEPT,
        calls: int = CALLS_KEPT,
        max_args_bytes: int = MAX_ARGS_BYTES,
        args_budget_bytes: int = ARGS_BUDGET_BYTES,
    ) -> None:
        self._per_invocation = per_invocation
        self._invocations = invocations
        self._max_calls = calls
        self._kept = 0  # calls in all the deques
        self._max_args = max_args_bytes
        self._budget = args_budget_bytes
        self._calls: collections.OrderedDict[str, collections.deque[CallEntry]] = (
            collections.OrderedDict()
        )
        #: Entries that held their arguments when added, oldest first; some
        #: may have dropped them since (skipped, and compacted away).
        self._holding: collections.deque[CallEntry] = collections.deque()
        self._held = 0
        self._held_bytes = 0

    def add(self, invocation_id: str, entry: CallEntry) -> None:
        """Keep ``entry`` as the newest call of ``invocation_id``."""
        calls = self._calls.get(invocation_id)
        if calls is None:
            calls = self._calls[invocation_id] = collections.deque(maxlen=self._per_invocation)
        else:
            self._calls.move_to_end(invocation_id)
        if len(calls) == calls.maxlen:
            self._drop_args(calls[0])
        else:
            self._kept += 1
        calls.append(entry)
        while len(self._calls) > 1 and (
            len(self._calls) > self._invocations or self._kept > self._max_calls
        ):
            self._drop_oldest_invocation()
        if entry.args is None:
            return
        if entry.args_bytes > self._max_args:
            entry.args = None
            return
        self._holding.append(entry)
        self._held += 1
        self._held_bytes += entry.args_bytes
        while self._held_bytes > self._budget:
            self._drop_args(self._holding.popleft())
        if len(self._holding) > 2 * self._held + 64:
            self._holding = collections.deque(e for e in self._holding if e.args is not None)

    def calls(self, invocation_id: str) -> list[CallEntry] | None:
        """The kept calls of ``invocation_id``, oldest first; ``None`` if none are kept."""
        calls = self._calls.get(invocation_id)
        return None if calls is None else list(calls)

    def _drop_oldest_invocation(self) -> None:
        _, dropped = self._calls.popitem(last=False)
        self._kept -= len(dropped)
        for old in dropped:
            self._drop_args(old)

    def _drop_args(self, entry: CallEntry) -> None:
        if entry.args is None:
            return
        entry.args = None
        self._held -= 1
        self._held_bytes -= entry.args_bytes


class Activity:
    """The hub and the journal of one supervisor."""

    def __init__(self) -> None:
        self.events = EventHub()
        self.journal = CallJournal()

    def call_finished(self, invocation_id: str, entry: CallEntry) -> None:
        """A broker answered a call."""
        self.journal.add(invocation_id, entry)
        self.events.publish(Topic.CALLS, invocation_id)

    def changed(self, topic: Topic, invocation_id: str | None = None) -> None:
        """Something else changed."""
        self.events.publish(topic, invocation_id)


def notice_json(notice: Notice) -> Mapping[str, Any]:
    """A notice as the event stream sends it."""
    topic, invocation_id = notice
    return {"topic": str(topic), "invocation_id": invocation_id}
