"""hostcall's host side: plans, brokers, stores, receipts and guest processes.

Names are loaded on first use (PEP 562), so a command that needs only a few
of them (``hostcall --help``, ``hostcall approvals list``) starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from supervisor._foreign import FOREIGN_MESSAGE, ForeignSupervisor, foreign_files

#: This ``supervisor`` is hostcall's (supervisord's has the same import name).
_HOSTCALL = True
#: supervisord's files found beside ours: then nothing here can be trusted.
_FOREIGN = foreign_files(__path__[0])

if TYPE_CHECKING:
    from supervisor.approvals import (
        ApprovalController,
        Approver,
        Proposal,
        ProposalNotFound,
        ProposalNotWaiting,
    )
    from supervisor.budget import BudgetLimits
    from supervisor.errors import (
        EffectOutcomeUnknown,
        HostcallError,
        InvocationMismatch,
        PlanError,
        Refusal,
        StateDirBusy,
        StoreUnavailable,
    )
    from supervisor.limits import Limits
    from supervisor.plan import Plan
    from supervisor.sandbox import SandboxPolicy
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
    "Limits",
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
    "SandboxPolicy",
    "StateDirBusy",
    "StoreUnavailable",
    "Supervisor",
    "Tool",
    "tool",
]

_WHERE = {
    "ApprovalController": "supervisor.approvals",
    "Approver": "supervisor.approvals",
    "Proposal": "supervisor.approvals",
    "ProposalNotFound": "supervisor.approvals",
    "ProposalNotWaiting": "supervisor.approvals",
    "EffectOutcomeUnknown": "supervisor.errors",
    "HostcallError": "supervisor.errors",
    "InvocationMismatch": "supervisor.errors",
    "PlanError": "supervisor.errors",
    "Refusal": "supervisor.errors",
    "StateDirBusy": "supervisor.errors",
    "StoreUnavailable": "supervisor.errors",
    "Limits": "supervisor.limits",
    "BudgetLimits": "supervisor.budget",
    "Plan": "supervisor.plan",
    "SandboxPolicy": "supervisor.sandbox",
    "EffectStore": "supervisor.stores",
    "MemoryEffectStore": "supervisor.stores",
    "PostgresEffectStore": "supervisor.stores",
    "SQLiteEffectStore": "supervisor.stores",
    "ExecutionOutcome": "supervisor.supervisor",
    "RunOutcome": "supervisor.supervisor",
    "Supervisor": "supervisor.supervisor",
    "Tool": "supervisor.tools",
    "tool": "supervisor.tools",
}


def __getattr__(name: str) -> Any:
    if _FOREIGN:
        raise ForeignSupervisor(FOREIGN_MESSAGE)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'supervisor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
