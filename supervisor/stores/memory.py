"""An effect store in memory: for tests and throwaway runs. Nothing survives."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import replace
from pathlib import Path
from typing import Any

from supervisor.budget import BudgetLimits
from supervisor.ids import new_id
from supervisor.receipt_files import ReceiptLog
from supervisor.receipts import Receipts
from supervisor.stores.base import (
    Begun,
    BudgetUse,
    Charge,
    EffectRecord,
    EffectStatus,
    InvocationRecord,
    NotPending,
    StartCall,
    budget_allows,
    charge_refusal,
)

__all__ = ["MemoryEffectStore"]


class MemoryEffectStore:
    """:class:`~supervisor.stores.base.EffectStore` in dicts, atomic by one lock."""

    #: Nothing survives the process, so receipt lines are not fsync'd either.
    durable = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], EffectRecord] = {}
        self._invocations: dict[str, InvocationRecord] = {}
        self._revoked: dict[str, set[str]] = {}
        self._rejected: dict[tuple[str, str], tuple[str, str]] = {}
        #: Reservations not yet taken nor given back: id -> (invocation, tool, cost).
        self._reservations: dict[str, tuple[str, str, float]] = {}

    def receipts(self, path: Path, executor: Executor | None) -> Receipts:
        return ReceiptLog(path, executor, fsync=False, commit=self.commit)

    def set_load_hint(self, active_requests: Callable[[], int]) -> None:
        return None  # one lock: nothing to batch

    async def open(self) -> int:
        with self._lock:
            pending = [k for k, r in self._records.items() if r.status is EffectStatus.PENDING]
            for key in pending:
                self._records[key] = replace(self._records[key], status=EffectStatus.UNKNOWN)
            for invocation_id, tool, cost in self._reservations.values():
                self._use(invocation_id, tool, -1, -cost)
            self._reservations.clear()
            return len(pending)

    async def close(self) -> None:
        return None

    async def open_invocation(
        self, invocation_id: str, plan_hash: str, deadline_at: float | None, now: float
    ) -> tuple[InvocationRecord, bool]:
        with self._lock:
            existing = self._invocations.get(invocation_id)
            if existing is not None:
                return existing, False
            record = InvocationRecord(invocation_id, plan_hash, now, deadline_at, BudgetUse())
            self._invocations[invocation_id] = record
            return record, True

    async def get_invocation(self, invocation_id: str) -> InvocationRecord | None:
        with self._lock:
            return self._invocations.get(invocation_id)

    async def list_invocations(self) -> list[InvocationRecord]:
        with self._lock:
            return sorted(self._invocations.values(), key=lambda r: r.created_at)

    def _use(self, invocation_id: str, tool: str, calls: int, cost: float) -> None:
        record = self._invocations.get(invocation_id)
        if record is None:
            return
        tool_calls = dict(record.used.tool_calls or {})
        tool_calls[tool] = tool_calls.get(tool, 0) + calls
        used = BudgetUse(record.used.calls + calls, record.used.cost + cost, tool_calls)
        # Built, not dataclasses.replace'd: this runs for every call.
        self._invocations[invocation_id] = InvocationRecord(
            record.invocation_id, record.plan_hash, record.created_at, record.deadline_at, used
        )

    async def reserve(
        self, invocation_id: str, tool: str, cost: float, limits: BudgetLimits
    ) -> str | None:
        with self._lock:
            record = self._invocations.get(invocation_id)
            if record is None or not budget_allows(limits, record.used, tool, cost):
                return None
            self._use(invocation_id, tool, 1, cost)
            reservation = new_id("rsv")
            self._reservations[reservation] = (invocation_id, tool, cost)
            return reservation

    async def refund(self, reservation_id: str) -> None:
        with self._lock:
            taken = self._reservations.pop(reservation_id, None)
            if taken is not None:
                invocation_id, tool, cost = taken
                self._use(invocation_id, tool, -1, -cost)

    async def get(self, invocation_id: str, call_id: str) -> EffectRecord | None:
        with self._lock:
            return self._records.get((invocation_id, call_id))

    async def begin(
        self,
        start: StartCall,
        now: float,
        charge: Charge | None = None,
        reservation: str | None = None,
    ) -> Begun:
        key = (start.invocation_id, start.call_id)
        with self._lock:
            existing = self._records.get(key)
            if existing is not None and not start.reruns(existing):
                return Begun(False, existing)
            if reservation is not None and self._reservations.pop(reservation, None) is not None:
                charge = None  # paid for by its reservation
            invocation = self._invocations.get(start.invocation_id)
            refused = charge_refusal(charge, invocation.used if invocation else None, now)
            if refused is not None:
                return Begun(False, existing, refused)
            if charge is not None:
                self._use(start.invocation_id, charge.tool, 1, charge.cost)
            record = self._records[key] = start.pending_record(existing, now)
            return Begun(True, record)

    def _update_pending(
        self,
        key: tuple[str, str],
        status: EffectStatus,
        now: float,
        response: Mapping[str, Any] | None = None,
    ) -> bool:
        """Whether the record was ``pending`` (and now has ``status``)."""
        record = self._records.get(key)
        if record is None or record.status is not EffectStatus.PENDING:
            return False
        self._records[key] = EffectRecord(
            record.invocation_id,
            record.call_id,
            record.tool,
            record.idempotency_key,
            status,
            record.execution_id,
            response,
            record.created_at,
            now,
        )
        return True

    async def commit(
        self, invocation_id: str, call_id: str, response: Mapping[str, Any], now: float
    ) -> None:
        with self._lock:
            key = (invocation_id, call_id)
            if not self._update_pending(key, EffectStatus.COMMITTED, now, dict(response)):
                raise NotPending(f"the record of {call_id} is no longer pending")

    async def mark_unknown(self, invocation_id: str, call_id: str, now: float) -> None:
        with self._lock:
            self._update_pending((invocation_id, call_id), EffectStatus.UNKNOWN, now)

    async def release(self, invocation_id: str, call_id: str) -> None:
        with self._lock:
            record = self._records.get((invocation_id, call_id))
            if record is not None and record.status is EffectStatus.PENDING:
                del self._records[(invocation_id, call_id)]

    async def revoke(self, invocation_id: str, tool: str, now: float) -> None:
        with self._lock:
            self._revoked.setdefault(invocation_id, set()).add(tool)

    async def revoked(self, invocation_id: str) -> frozenset[str]:
        with self._lock:
            return frozenset(self._revoked.get(invocation_id, ()))

    async def reject(
        self, invocation_id: str, call_id: str, idempotency_key: str, approval_id: str, now: float
    ) -> None:
        with self._lock:
            self._rejected.setdefault((invocation_id, call_id), (idempotency_key, approval_id))

    async def rejection(self, invocation_id: str, call_id: str) -> tuple[str, str] | None:
        with self._lock:
            return self._rejected.get((invocation_id, call_id))

    async def forget_calls(self, invocation_id: str) -> int:
        with self._lock:
            gone = [
                key
                for key, r in self._records.items()
                if r.invocation_id == invocation_id and r.status is not EffectStatus.PENDING
            ]
            for key in gone:
                del self._records[key]
        return len(gone)

    async def calls(self, invocation_id: str) -> list[EffectRecord]:
        with self._lock:
            found = [r for r in self._records.values() if r.invocation_id == invocation_id]
        return sorted(found, key=lambda r: r.created_at)
