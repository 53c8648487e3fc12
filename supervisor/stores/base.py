"""The effect store interface (docs/operations.md, "Stores") and the records it keeps.

At-most-once rests on one primitive, :meth:`EffectStore.begin`: insert a
``pending`` record if there is none, atomically with respect to every other
caller, in every process that shares the store.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from channel.frozen import fast_init
from supervisor.budget import (
    BudgetLimits,
    BudgetUse,
    Charge,
    budget_allows,
    budget_left,
    charge_refusal,
)
from supervisor.receipts import Receipts

__all__ = [
    "Begun",
    "BudgetUse",
    "Charge",
    "EffectRecord",
    "EffectStatus",
    "EffectStore",
    "InvocationRecord",
    "NotPending",
    "StartCall",
    "budget_allows",
    "budget_left",
    "charge_refusal",
]


class NotPending(Exception):
    """:meth:`EffectStore.commit` found the call's record no longer ``pending``:
    another supervisor took this one for dead (a replica whose lease ran out)
    and turned it ``unknown``, or began it again. Nothing was written, and the
    record says the outcome is in doubt, so the guest must be told that too:
    ``ambiguous`` ``unknown``, never ``executed``."""


class EffectStatus(enum.StrEnum):
    """States of an effect record. ``failed`` calls leave no record (released)."""

    PENDING = "pending"
    COMMITTED = "committed"
    UNKNOWN = "unknown"


@fast_init
@dataclass(frozen=True, slots=True)
class EffectRecord:
    """The durable row for one ``(invocation_id, call_id)``."""

    invocation_id: str
    call_id: str
    tool: str
    idempotency_key: str
    status: EffectStatus
    execution_id: str
    response: Mapping[str, Any] | None
    created_at: float
    updated_at: float


@fast_init
@dataclass(frozen=True, slots=True)
class StartCall:
    """What :meth:`EffectStore.begin` is asked to record."""

    invocation_id: str
    call_id: str
    tool: str
    idempotency_key: str
    execution_id: str
    reversible: bool

    def reruns(self, record: EffectRecord) -> bool:
        """Whether ``begin`` runs ``record``'s call again (docs/protocol.md, step 5): a
        reversible tool whose outcome is in doubt, same tool and arguments."""
        return (
            self.reversible
            and record.status is EffectStatus.UNKNOWN
            and (record.tool, record.idempotency_key) == (self.tool, self.idempotency_key)
        )

    def pending_record(self, rerun: EffectRecord | None, now: float) -> EffectRecord:
        """The ``pending`` record a winning ``begin`` leaves (``rerun``: the
        ``unknown`` record of a reversible call it starts again)."""
        return EffectRecord(
            self.invocation_id,
            self.call_id,
            self.tool,
            self.idempotency_key,
            EffectStatus.PENDING,
            self.execution_id,
            None,
            rerun.created_at if rerun is not None else now,
            now,
        )


@fast_init
@dataclass(frozen=True, slots=True)
class Begun:
    """The result of ``begin``: whether this caller won, and the record as it is now.

    ``record`` is ``None`` only when there was none and ``exhausted`` says why
    nothing was inserted: the charge did not fit (``"limits"``) or the
    invocation's deadline had passed (``"deadline"``).
    """

    won: bool
    record: EffectRecord | None
    exhausted: Literal["limits", "deadline"] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class InvocationRecord:
    """An invocation: its plan, when its deadline passes and its budget use."""

    invocation_id: str
    plan_hash: str
    created_at: float
    deadline_at: float | None
    used: BudgetUse


class EffectStore(Protocol):
    """Durable effect records and invocation budgets.

    Contract, for every implementation:

    - :meth:`begin` is atomic across every caller sharing the store (threads,
      tasks, processes, hosts): of concurrent callers for one key exactly one
      gets ``won=True``. It inserts a ``pending`` record, or for a reversible
      tool turns an ``unknown`` record back into ``pending``; otherwise it
      returns the existing record unchanged. The ``pending`` row is durable
      when ``begin`` returns.
    - :meth:`reserve` checks and takes budget atomically: concurrent calls
      cannot overspend. A reservation is durable and is either taken by
      :meth:`begin` or given back, once, by :meth:`refund` — or by
      :meth:`open` when its owner crashed before either.
    - :meth:`open` turns the ``pending`` rows this store's owner left behind
      into ``unknown`` (a crash leaves doubt, never a duplicate), and gives
      back the reservations it left (a call waiting for approval never ran).
    - Driver errors surface as :class:`~supervisor.errors.StoreUnavailable`.
    """

    @property
    def durable(self) -> bool:
        """Whether records survive the process (receipts are fsync'd if so)."""
        ...

    def receipts(self, path: Path, executor: Executor | None) -> Receipts:
        """The writer of the receipt file at ``path`` for calls recorded here:
        one per file and process (the caller keeps it), its lines chained in
        the order they are given, durable as this store's records are.
        ``executor`` runs its blocking file writes."""
        ...

    def set_load_hint(self, active_requests: Callable[[], int]) -> None:
        """Learn how many requests the supervisor serves at the moment: a store
        may skip batching when one is alone (nothing to share a commit with)."""
        ...

    async def open(self) -> int:
        """Prepare the store, recovering what a crashed owner left; returns how
        many pending rows became unknown."""
        ...

    async def close(self) -> None:
        """Release connections and threads. Idempotent."""
        ...

    async def open_invocation(
        self, invocation_id: str, plan_hash: str, deadline_at: float | None, now: float
    ) -> tuple[InvocationRecord, bool]:
        """Create the invocation or return the existing one; the flag says "created"."""
        ...

    async def get_invocation(self, invocation_id: str) -> InvocationRecord | None:
        """The invocation, or ``None``."""
        ...

    async def list_invocations(self) -> list[InvocationRecord]:
        """Every invocation, oldest first."""
        ...

    async def reserve(
        self, invocation_id: str, tool: str, cost: float, limits: BudgetLimits
    ) -> str | None:
        """Take one call of ``tool`` and ``cost`` from the budget if it fits,
        durably: the reservation's id, or ``None`` when it does not fit."""
        ...

    async def refund(self, reservation_id: str) -> None:
        """Give back a reservation whose call did not reach dispatch. Once: a
        reservation given back already, or taken by :meth:`begin`, is left."""
        ...

    async def get(self, invocation_id: str, call_id: str) -> EffectRecord | None:
        """The effect record, or ``None``."""
        ...

    async def begin(
        self,
        start: StartCall,
        now: float,
        charge: Charge | None = None,
        reservation: str | None = None,
    ) -> Begun:
        """The insert-if-absent primitive (see the class docstring).

        With ``charge``, a call that would (re)start also takes that budget
        in the same atomic step — or, if it does not fit or the deadline has
        passed, nothing is inserted and ``exhausted`` says so. With
        ``reservation`` (from :meth:`reserve`) that reservation is what it
        takes, in the same step; ``charge`` only if it is gone (given back by
        recovery meanwhile). An existing record that is returned unchanged
        takes nothing, and leaves the reservation to be refunded.
        """
        ...

    async def commit(
        self, invocation_id: str, call_id: str, response: Mapping[str, Any], now: float
    ) -> None:
        """Turn a ``pending`` record ``committed`` with the response to replay.

        Raises:
            NotPending: the record is not (or no longer this store's) ``pending``;
                nothing was written.
        """
        ...

    async def mark_unknown(self, invocation_id: str, call_id: str, now: float) -> None:
        """Record that a ``pending`` call's outcome is in doubt."""
        ...

    async def release(self, invocation_id: str, call_id: str) -> None:
        """Delete a ``pending`` record after a failure that left no effect."""
        ...

    async def revoke(self, invocation_id: str, tool: str, now: float) -> None:
        """Refuse every later call and replay of ``tool`` in this invocation."""
        ...

    async def revoked(self, invocation_id: str) -> frozenset[str]:
        """The tools revoked for this invocation."""
        ...

    async def reject(
        self, invocation_id: str, call_id: str, idempotency_key: str, approval_id: str, now: float
    ) -> None:
        """Remember that an operator rejected this call (its retries, here or
        on another supervisor, are refused without asking again)."""
        ...

    async def rejection(self, invocation_id: str, call_id: str) -> tuple[str, str] | None:
        """The rejected call's ``(idempotency_key, approval_id)``, if it was."""
        ...

    async def calls(self, invocation_id: str) -> list[EffectRecord]:
        """Every effect record of an invocation, oldest first."""
        ...

    async def forget_calls(self, invocation_id: str) -> int:
        """Delete an invocation's effect records that are no longer in flight
        (``committed`` or ``unknown``); how many. Its invocation row (budget,
        deadline), revocations and rejections stay. Only ``hostcall gc`` calls this, and
        only for an invocation whose deadline has passed: then no call of it
        can be admitted again, so forgetting what ran cannot run it twice."""
        ...
