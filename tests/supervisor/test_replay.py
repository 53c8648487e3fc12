"""SPEC §5.5's replay table and §5.7's budget arithmetic, as pure functions.

No store, no event loop: a record (or none) goes in, a decision comes out.
Each table below is the spec's table written out row by row.
"""

from __future__ import annotations

import pytest

from supervisor.budget import BudgetLimits
from supervisor.replay import Replay, decide_replay
from supervisor.stores.base import BudgetUse, EffectRecord, EffectStatus, budget_allows

TOOL = "charge"
KEY = "a" * 64


def record(status: EffectStatus, *, tool: str = TOOL, key: str = KEY) -> EffectRecord:
    response = {"status": "ok"} if status is EffectStatus.COMMITTED else None
    return EffectRecord("inv_1", "call_1", tool, key, status, "exe_1", response, 1.0, 2.0)


PENDING, COMMITTED, UNKNOWN = EffectStatus.PENDING, EffectStatus.COMMITTED, EffectStatus.UNKNOWN

# (record status or None, record's tool, record's key, reversible) -> action
REPLAY_TABLE = [
    # none | any -> continue
    pytest.param(None, TOOL, KEY, False, Replay.CONTINUE, id="none-irreversible-continues"),
    pytest.param(None, TOOL, KEY, True, Replay.CONTINUE, id="none-reversible-continues"),
    # any record, other tool or other key | any -> 422 call_id_reused
    *(
        pytest.param(
            status, tool, key, reversible, Replay.REUSED,
            id=f"{status}-{what}-{'reversible' if reversible else 'irreversible'}-is-reused",
        )
        for status in (PENDING, COMMITTED, UNKNOWN)
        for what, tool, key in (("other-tool", "refund", KEY), ("other-key", TOOL, "b" * 64))
        for reversible in (False, True)
    ),
    # committed | any -> 200 replayed
    pytest.param(COMMITTED, TOOL, KEY, False, Replay.REPLAY, id="committed-irreversible-replays"),
    pytest.param(COMMITTED, TOOL, KEY, True, Replay.REPLAY, id="committed-reversible-replays"),
    # pending or unknown | not reversible -> 409 in_flight / unknown
    pytest.param(PENDING, TOOL, KEY, False, Replay.IN_FLIGHT, id="pending-irreversible-in-flight"),
    pytest.param(UNKNOWN, TOOL, KEY, False, Replay.UNKNOWN, id="unknown-irreversible-unknown"),
    # pending | reversible -> 409 in_flight
    pytest.param(PENDING, TOOL, KEY, True, Replay.IN_FLIGHT, id="pending-reversible-in-flight"),
    # unknown | reversible -> continue: it runs again
    pytest.param(UNKNOWN, TOOL, KEY, True, Replay.CONTINUE, id="unknown-reversible-runs-again"),
]  # fmt: skip


@pytest.mark.parametrize(("status", "tool", "key", "reversible", "expected"), REPLAY_TABLE)
def test_the_replay_decision_follows_the_spec_table_row_by_row(
    status: EffectStatus | None, tool: str, key: str, reversible: bool, expected: Replay
) -> None:
    found = None if status is None else record(status, tool=tool, key=key)

    decision = decide_replay(found, TOOL, KEY, reversible)

    assert decision.action is expected
    assert decision.record is found


def test_the_wire_names_of_replay_actions_are_the_spec_codes() -> None:
    # The broker turns these into error codes and ambiguous reasons on the wire.
    assert Replay.REUSED.value == "call_id_reused"
    assert Replay.REPLAY.value == "replayed"
    assert Replay.IN_FLIGHT.value == "in_flight"
    assert Replay.UNKNOWN.value == "unknown"


NO_LIMITS = BudgetLimits()

# (limits, used so far, tool, cost) -> whether one more call fits
BUDGET_TABLE = [
    pytest.param(NO_LIMITS, BudgetUse(10**6, 10.0**9), TOOL, 10**6, True, id="no-limits"),
    pytest.param(BudgetLimits(max_calls=3), BudgetUse(2), TOOL, 0, True, id="last-call-fits"),
    pytest.param(BudgetLimits(max_calls=3), BudgetUse(3), TOOL, 0, False, id="max-calls-used-up"),
    pytest.param(BudgetLimits(max_calls=0), BudgetUse(), TOOL, 0, False, id="max-calls-zero"),
    pytest.param(BudgetLimits(max_cost=25), BudgetUse(1, 20.0), TOOL, 5, True, id="cost-fits"),
    pytest.param(BudgetLimits(max_cost=25), BudgetUse(2, 20.0), TOOL, 5.5, False, id="cost-over"),
    pytest.param(BudgetLimits(max_cost=0), BudgetUse(), TOOL, 0, True, id="free-call-zero-budget"),
    pytest.param(BudgetLimits(max_cost=0), BudgetUse(), TOOL, 1, False, id="paid-call-zero-budget"),
    pytest.param(
        BudgetLimits(tool_max_calls={TOOL: 2}), BudgetUse(5, 0.0, {TOOL: 1}), TOOL, 0, True,
        id="tool-limit-not-reached",
    ),
    pytest.param(
        BudgetLimits(tool_max_calls={TOOL: 2}), BudgetUse(5, 0.0, {TOOL: 2}), TOOL, 0, False,
        id="tool-limit-reached",
    ),
    pytest.param(
        BudgetLimits(tool_max_calls={TOOL: 2}), BudgetUse(5, 0.0, {TOOL: 2}), "lookup", 0, True,
        id="tool-limit-binds-only-its-tool",
    ),
    pytest.param(
        BudgetLimits(tool_max_calls={TOOL: 1}), BudgetUse(), TOOL, 0, True,
        id="tool-limit-with-no-use-recorded",
    ),
    pytest.param(
        BudgetLimits(max_calls=10, max_cost=100, tool_max_calls={TOOL: 5}),
        BudgetUse(9, 99.0, {TOOL: 4}), TOOL, 1, True,
        id="every-limit-just-fits",
    ),
    pytest.param(
        BudgetLimits(max_calls=10, max_cost=100, tool_max_calls={TOOL: 5}),
        BudgetUse(10, 0.0, {TOOL: 0}), TOOL, 0, False,
        id="one-limit-exhausted-is-enough",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("limits", "used", "tool", "cost", "expected"), BUDGET_TABLE)
def test_budget_allows_one_more_call_only_when_every_limit_still_holds(
    limits: BudgetLimits, used: BudgetUse, tool: str, cost: float, expected: bool
) -> None:
    assert budget_allows(limits, used, tool, cost) is expected
