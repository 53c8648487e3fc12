"""SPEC §5.7: budgets belong to the invocation; replays are free; no overspending."""

from __future__ import annotations

import asyncio
from pathlib import Path

from supervisor import Supervisor
from tests.harness import Ledger, billing_plan, driven_guest


async def test_calls_past_max_calls_are_refused_but_replays_still_answer(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=2)
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        first = await guest.call("a", "lookup", {"account": "1"})
        second = await guest.call("b", "lookup", {"account": "2"})
        third = await guest.call("c", "lookup", {"account": "3"})
        replay = await guest.call("a", "lookup", {"account": "1"})
    assert [r["status"] for r in (first, second, third, replay)] == [200, 200, 429, 200]
    assert third["body"]["error"]["code"] == "budget_exhausted"
    assert replay["body"]["effect"] == "replayed"
    assert ledger.runs["lookup"] == 2


async def test_max_cost_counts_each_tools_cost(tmp_path: Path, ledger: Ledger) -> None:
    plan = billing_plan(ledger, max_cost=25)  # charge costs 10
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        replies = [
            await guest.call(f"c{i}", "charge", {"account": "a", "cents": i}) for i in range(3)
        ]
        free = await guest.call("l1", "lookup", {"account": "a"})
    assert [r["status"] for r in replies] == [200, 200, 429]
    assert free["status"] == 200
    assert ledger.runs["charge"] == 2


async def test_a_refusal_before_dispatch_gives_the_reservation_back(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=1)
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        refused = await guest.call("c0", "charge", {"account": "", "cents": 1})
        ok = await guest.call("c1", "charge", {"account": "a", "cents": 1})
    assert refused["body"]["error"]["code"] == "target_required"
    assert ok["status"] == 200


async def test_concurrent_distinct_calls_cannot_overspend(tmp_path: Path, ledger: Ledger) -> None:
    plan = billing_plan(ledger, max_calls=5)
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        # The driver runs each command on its own thread and connection.
        distinct = await asyncio.gather(
            *(guest.call(f"d{i}", "lookup", {"account": str(i)}) for i in range(20))
        )
    statuses = sorted(r["status"] for r in distinct)
    assert statuses == [200] * 5 + [429] * 15
    assert ledger.runs["lookup"] == 5


async def test_a_new_execution_of_the_invocation_does_not_get_a_fresh_budget(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=2)
    async with Supervisor(tmp_path / "s") as sup:
        async with driven_guest(sup, plan, invocation_id="inv_b") as guest:
            await guest.call("a", "lookup", {"account": "1"})
        async with driven_guest(sup, plan, invocation_id="inv_b") as guest:
            view = await guest.request(method="GET", path="/v1/plan")
            second = await guest.call("b", "lookup", {"account": "2"})
            third = await guest.call("c", "lookup", {"account": "3"})
    assert view["body"]["budget"]["calls_left"] == 1
    assert second["status"] == 200
    assert third["status"] == 429


async def test_calls_after_the_deadline_are_refused(tmp_path: Path, ledger: Ledger) -> None:
    plan = billing_plan(ledger, deadline_s=3600)
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        ok = await guest.call("a", "lookup", {"account": "1"})
        # Move the invocation's clock past its deadline instead of waiting for it.
        broker = guest.execution.broker
        assert broker.deadline_at is not None
        broker.clock = lambda: broker.deadline_at + 1  # type: ignore[operator]
        late = await guest.call("b", "lookup", {"account": "2"})
    assert ok["status"] == 200
    assert late["status"] == 429
    assert late["body"]["error"]["code"] == "budget_exhausted"
