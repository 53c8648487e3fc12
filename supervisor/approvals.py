"""The approval step (SPEC §5.8, §7) as the broker sees it.

Until the approvals issue lands, :class:`ApproveAll` answers every proposal at
once with "approved". The seam is already where SPEC puts it: after the budget
is reserved, before BeginDispatch, and a ticket must be claimed (synchronously,
in the same step as the liveness check) for the call to cross BeginDispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

__all__ = ["ApprovalGate", "ApprovalTicket", "ApproveAll", "ProposalRequest"]

Decision = Literal["approved", "rejected", "expired", "cancelled"]


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    """One concrete call waiting for a decision."""

    invocation_id: str
    execution_id: str
    call_id: str
    tool: str
    args: dict[str, Any]
    idempotency_key: str
    timeout_s: float


class ApprovalTicket(Protocol):
    """The outcome of asking: a decision, and the right to dispatch once."""

    @property
    def decision(self) -> Decision: ...

    @property
    def approval_id(self) -> str | None: ...

    def claim_dispatch(self) -> bool:
        """Atomically ``approved → dispatched``; False if it expired or was cancelled."""
        ...


class ApprovalGate(Protocol):
    """Asks for (and waits for) a decision on one proposal."""

    async def request(self, proposal: ProposalRequest) -> ApprovalTicket: ...


@dataclass(slots=True)
class _Approved:
    approval_id: str | None = None
    decision: Decision = "approved"

    def claim_dispatch(self) -> bool:
        return True


class ApproveAll:
    """Approves every proposal immediately (no operator in the loop)."""

    async def request(self, proposal: ProposalRequest) -> ApprovalTicket:
        return _Approved()
