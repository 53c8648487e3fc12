"""hostcall's host side: plans, brokers, stores, receipts and guest processes."""

from __future__ import annotations

from supervisor.approvals import (
    ApprovalController,
    Approver,
    Proposal,
    ProposalNotFound,
    ProposalNotWaiting,
)
from supervisor.errors import (
    EffectOutcomeUnknown,
    HostcallError,
    InvocationMismatch,
    PlanError,
    Refusal,
    StateDirBusy,
    StoreUnavailable,
)
from supervisor.plan import BudgetLimits, Plan
from supervisor.stores import (
    EffectStore,
    MemoryEffectStore,
    PostgresEffectStore,
    SQLiteEffectStore,
)
from supervisor.supervisor import ExecutionOutcome, RunOutcome, Supervisor
from supervisor.tools import Tool, tool

__all__ = [
    "ApprovalController",
    "Approver",
    "BudgetLimits",
    "EffectOutcomeUnknown",
    "EffectStore",
    "ExecutionOutcome",
    "HostcallError",
    "InvocationMismatch",
    "MemoryEffectStore",
    "Plan",
    "PlanError",
    "PostgresEffectStore",
    "Proposal",
    "ProposalNotFound",
    "ProposalNotWaiting",
    "Refusal",
    "RunOutcome",
    "SQLiteEffectStore",
    "StateDirBusy",
    "StoreUnavailable",
    "Supervisor",
    "Tool",
    "tool",
]
