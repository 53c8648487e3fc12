"""Admission's decisions, without I/O (supervisor.admission)."""

from __future__ import annotations

import pytest

from supervisor.admission import (
    CLAIM_REFUSALS,
    DECISION_REFUSALS,
    budget_refusal,
    claim_refusal,
    decision_refusal,
    target_refusal,
)


@pytest.mark.parametrize(
    ("reversibility", "targets", "args", "refused"),
    [
        ("irreversible", ["account"], {"account": "a"}, False),
        ("irreversible", ["account"], {"account": ""}, True),
        ("irreversible", ["account"], {"account": None, "other": 1}, True),
        ("irreversible", ["a", "b"], {"a": [], "b": {"x": 1}}, False),
        ("irreversible", ["a", "b"], {"a": [], "b": {}}, True),
        ("irreversible", [], {}, False),
        ("reversible", ["account"], {}, False),
        ("costly", ["account"], {}, False),
    ],
)
def test_an_irreversible_tool_with_targets_needs_one_of_them_set(
    reversibility: str, targets: list[str], args: dict[str, object], refused: bool
) -> None:
    refusal = target_refusal("charge", reversibility, targets, args)
    assert (refusal is not None) is refused
    if refusal is not None:
        assert refusal.code == "target_required" and "charge" in refusal.message


def test_every_decision_but_approved_refuses_and_names_the_proposal() -> None:
    assert decision_refusal("approved", "apr_1") is None
    codes = {}
    for state in [*DECISION_REFUSALS, "waiting", "dispatched"]:
        refusal = decision_refusal(state, "apr_1")
        assert refusal is not None and refusal.approval_id == "apr_1"
        codes[state] = refusal.code
    assert codes == {
        "rejected": "approval_rejected",
        "expired": "approval_expired",
        "cancelled": "cancelled",
        "waiting": "cancelled",  # never decided: not run
        "dispatched": "cancelled",
    }


def test_a_claim_that_did_not_find_the_proposal_approved_refuses() -> None:
    assert claim_refusal("dispatched", "apr_1") is None
    assert {s: claim_refusal(s, "apr_1").code for s in CLAIM_REFUSALS} == {  # type: ignore[union-attr]
        "expired": "approval_expired",
        "cancelled": "cancelled",
    }


def test_the_budget_refusal_says_whether_the_limits_or_the_deadline() -> None:
    assert budget_refusal("limits").code == budget_refusal("deadline").code == "budget_exhausted"
    assert "deadline" in budget_refusal("deadline").message
    assert "budget" in budget_refusal("limits").message
