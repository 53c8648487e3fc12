"""An invocation's budget and its arithmetic (docs/protocol.md, "The call
pipeline", step 7): plain data and functions, no I/O. The stores apply it
atomically; the broker and ``GET /v1/plan`` show what is left."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from channel.frozen import fast_init

__all__ = [
    "BudgetLimits",
    "BudgetUse",
    "Charge",
    "budget_allows",
    "budget_left",
    "charge_refusal",
]


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """An invocation's budget; ``None`` means no limit."""

    max_calls: int | None = None
    max_cost: float | None = None
    deadline_s: float | None = None
    tool_max_calls: Mapping[str, int] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class BudgetUse:
    """What an invocation has used so far, over all its executions."""

    calls: int = 0
    cost: float = 0.0
    tool_calls: Mapping[str, int] | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class Charge:
    """Budget that ``begin`` takes in the same atomic step as its insert.

    The broker passes one when nothing (no approval) stands between the budget
    and BeginDispatch: one transaction, one fsync, instead of two.
    """

    tool: str
    cost: float
    limits: BudgetLimits
    deadline_at: float | None


_COST_EPSILON: Final = 1e-9


def charge_refusal(
    charge: Charge | None, used: BudgetUse | None, now: float
) -> Literal["limits", "deadline"] | None:
    """Why ``charge`` cannot be taken now (``None``: it fits, or there is none)."""
    if charge is None:
        return None
    if charge.deadline_at is not None and now >= charge.deadline_at:
        return "deadline"
    if used is None or not budget_allows(charge.limits, used, charge.tool, charge.cost):
        return "limits"
    return None


def budget_allows(limits: BudgetLimits, used: BudgetUse, tool: str, cost: float) -> bool:
    """Whether one more call of ``tool`` costing ``cost`` fits the budget."""
    if limits.max_calls is not None and used.calls + 1 > limits.max_calls:
        return False
    # Costs are floats: 0.1 + 0.2 must fit a max_cost of 0.3.
    if limits.max_cost is not None and used.cost + cost > limits.max_cost + _COST_EPSILON:
        return False
    tool_limit = (limits.tool_max_calls or {}).get(tool)
    tool_used = (used.tool_calls or {}).get(tool, 0)
    return tool_limit is None or tool_used + 1 <= tool_limit


def budget_left(
    limits: BudgetLimits, used: BudgetUse | None, deadline_at: float | None
) -> dict[str, Any]:
    """The budget as ``GET /v1/plan`` shows it (docs/protocol.md, "Endpoints"): each limit, what
    is left of it, the deadline; ``None`` for a limit that is not set."""
    calls = used.calls if used is not None else 0
    cost = used.cost if used is not None else 0.0
    return {
        "max_calls": limits.max_calls,
        "calls_left": None if limits.max_calls is None else max(0, limits.max_calls - calls),
        "max_cost": limits.max_cost,
        "cost_left": None if limits.max_cost is None else max(0.0, limits.max_cost - cost),
        "deadline_at": deadline_at,
    }
