"""Admission's decisions, as data and pure functions (docs/protocol.md, "The
call pipeline", steps 5-9). No I/O: the broker loads, asks these, and acts.

Everything that refuses a call between the plan lookup and BeginDispatch is
decided here — the replay table is :mod:`supervisor.replay`, the budget
arithmetic :mod:`supervisor.budget` — so a second transport (a WebAssembly
guest's ``host_call``) admits calls by the very same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

from supervisor.errors import Refusal

__all__ = [
    "CLAIM_REFUSALS",
    "DECISION_REFUSALS",
    "budget_refusal",
    "claim_refusal",
    "decision_refusal",
    "reused_refusal",
    "target_refusal",
]

REUSED_MESSAGE: Final = "this call_id was used before with another tool or other arguments"
BUDGET_MESSAGE: Final = "the invocation's budget would be exceeded"
DEADLINE_MESSAGE: Final = "the invocation's deadline has passed"

#: Step 8: what a decided proposal means for its call (``approved``: it goes on).
DECISION_REFUSALS: Final[Mapping[str, tuple[str, str]]] = {
    "rejected": ("approval_rejected", "an operator rejected this call"),
    "expired": ("approval_expired", "no decision was made before the approval lapsed"),
    "cancelled": ("cancelled", "the call was cancelled before dispatch"),
}
#: Step 9: what claiming an approved proposal at BeginDispatch can find instead
#: of ``dispatched``.
CLAIM_REFUSALS: Final[Mapping[str, tuple[str, str]]] = {
    "expired": ("approval_expired", "the approval lapsed before dispatch"),
    "cancelled": ("cancelled", "the call was cancelled before dispatch"),
}


def _refusal(entry: tuple[str, str], approval_id: str | None) -> Refusal:
    refusal = Refusal(*entry)
    refusal.approval_id = approval_id  # the receipt names the proposal
    return refusal


def target_refusal(
    tool: str, reversibility: str, target_args: Sequence[str], args: Mapping[str, Any]
) -> Refusal | None:
    """Step 6: an irreversible tool with ``target_args`` needs one of them set."""
    if reversibility != "irreversible" or not target_args:
        return None
    if any(args.get(name) not in (None, "", [], {}) for name in target_args):
        return None
    return Refusal("target_required", f"{tool} needs one of {list(target_args)}")


def budget_refusal(why: Literal["limits", "deadline"]) -> Refusal:
    """Step 7: the budget would be exceeded, or its deadline has passed."""
    return Refusal("budget_exhausted", DEADLINE_MESSAGE if why == "deadline" else BUDGET_MESSAGE)


def decision_refusal(state: str, approval_id: str) -> Refusal | None:
    """Step 8: the refusal a decided proposal in ``state`` means; ``None`` for
    ``approved``. Any state not in the table is a cancel."""
    if state == "approved":
        return None
    return _refusal(DECISION_REFUSALS.get(state, DECISION_REFUSALS["cancelled"]), approval_id)


def claim_refusal(state: str, approval_id: str) -> Refusal | None:
    """Step 9: the refusal of a claim that did not find the proposal still
    approved (``dispatched``: it did)."""
    if state == "dispatched":
        return None
    return _refusal(CLAIM_REFUSALS.get(state, CLAIM_REFUSALS["cancelled"]), approval_id)


def reused_refusal() -> Refusal:
    """Step 5: the ``call_id`` names another tool or other arguments."""
    return Refusal("call_id_reused", REUSED_MESSAGE)
