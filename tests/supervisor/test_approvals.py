"""Approvals (SPEC §7) and BeginDispatch as their linearization point.

Races are decided by the order of synchronous steps in the test (events, not
sleeps): the broker resumes only after the test's whole block has run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import supervisor.approvals as approvals_module
from channel.wire import CallReply
from supervisor import Plan, tool
from supervisor.approvals import (
    ENDED_KEPT,
    TRANSITIONS,
    ApprovalController,
    ProposalNotWaiting,
    ProposalRequest,
    next_state,
)
from supervisor.broker import Broker
from supervisor.errors import Refusal, StoreUnavailable
from supervisor.stores import EffectStatus, MemoryEffectStore, SQLiteEffectStore
from tests.harness import STEP_TIMEOUT_S, Ledger, wait_until

INV, EXE = "inv_a", "exe_a"
STATES = ["waiting", "approved", "rejected", "expired", "cancelled", "dispatched"]
EVENTS = ["approve", "reject", "expire", "cancel", "dispatch"]


@pytest.mark.parametrize(("state", "event"), list(itertools.product(STATES, EVENTS)))
def test_the_proposal_state_machine_allows_exactly_the_spec_moves(state: str, event: str) -> None:
    allowed = {
        ("waiting", "approve"): "approved",
        ("waiting", "reject"): "rejected",
        ("waiting", "expire"): "expired",
        ("waiting", "cancel"): "cancelled",
        ("approved", "dispatch"): "dispatched",
        ("approved", "expire"): "expired",
        ("approved", "cancel"): "cancelled",
    }
    assert next_state(state, event) == allowed.get((state, event))  # type: ignore[arg-type]
    assert dict(TRANSITIONS) == allowed


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    broker: Broker
    approvals: ApprovalController
    clock: FakeClock
    store: MemoryEffectStore
    ledger: Ledger
    blocked: list[Refusal]

    def call(self, call_id: str, tool_name: str, args: dict[str, Any]) -> asyncio.Task[CallReply]:
        return asyncio.create_task(self.broker.call(call_id, tool_name, args))

    async def proposal(self, count: int = 1) -> str:
        await wait_until(lambda: self.approvals.waiting() >= count, "a waiting proposal")
        return self.approvals.list("waiting")[-1].id


def approval_plan(ledger: Ledger) -> Plan:
    @tool(reversibility="irreversible", approval="always", target_args=["account"])
    def pay(account: str, cents: int) -> str:
        ledger.record("pay", account=account, cents=cents)
        ledger.started.set()
        if not ledger.release.wait(STEP_TIMEOUT_S):
            raise RuntimeError("never released")
        return f"paid_{account}"

    @tool(reversibility="reversible", approval="always")
    def sync_mirror(key: str) -> str:
        if ledger.record("sync_mirror", key=key) == 1:
            raise TimeoutError("mirror timed out")
        return "synced"

    @tool(reversibility="reversible")
    def read(key: str) -> str:
        ledger.record("read", key=key)
        return key

    return Plan([pay, sync_mirror, read], name="approvals", max_calls=10)


@pytest.fixture
async def rig(tmp_path: Path, ledger: Ledger) -> AsyncIterator[Rig]:
    clock = FakeClock()
    store = MemoryEffectStore()
    await store.open()
    plan = approval_plan(ledger)
    await store.open_invocation(INV, plan.plan_hash, None, clock())
    approvals = ApprovalController(clock=clock)
    blocked: list[Refusal] = []
    broker = Broker(
        plan=plan,
        invocation_id=INV,
        execution_id=EXE,
        store=store,
        approvals=approvals,
        receipts=store.receipts(tmp_path / "receipts.jsonl", None),
        dispatch_blocker=lambda: blocked[0] if blocked else None,
        clock=clock,
    )
    yield Rig(broker, approvals, clock, store, ledger, blocked)
    ledger.release.set()


async def reply_of(task: asyncio.Task[CallReply]) -> CallReply:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return await task


async def test_an_approved_call_runs_once(rig: Rig) -> None:
    rig.ledger.release.set()
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    proposal = rig.approvals.approve(proposal_id)
    reply = await reply_of(task)
    assert (reply.status, reply.effect, reply.result) == ("ok", "executed", "paid_a")
    assert proposal.state == "dispatched"
    assert rig.ledger.runs["pay"] == 1


async def test_a_rejected_call_is_refused_runs_nothing_and_returns_its_budget(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.reject(proposal_id, reason="looks wrong")
    reply = await reply_of(task)
    invocation = await rig.store.get_invocation(INV)
    assert reply.error is not None
    assert reply.error["code"] == "approval_rejected"
    assert reply.http_status == 403
    assert rig.ledger.runs == {}
    receipt = json.loads(rig.broker.receipts.path.read_text().splitlines()[-1])
    assert receipt["approval_id"] == proposal_id
    assert receipt["error_code"] == "approval_rejected"
    assert invocation is not None
    assert invocation.used.calls == 0
    assert await rig.store.get(INV, "c1") is None


async def test_a_refund_the_store_cannot_make_does_not_hide_the_rejection(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guest is told why its call did not run (rejected), not that the
    store failed to give the reservation back; the store's next start does."""

    async def unavailable(reservation_id: str) -> None:
        raise StoreUnavailable("the database went away")

    monkeypatch.setattr(rig.store, "refund", unavailable)
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    rig.approvals.reject(await rig.proposal(), reason="looks wrong")
    reply = await reply_of(task)
    assert reply.error is not None
    assert (reply.http_status, reply.error["code"]) == (403, "approval_rejected")
    assert rig.ledger.runs == {}


async def test_a_lease_that_runs_out_refuses_with_approval_expired(tmp_path: Path) -> None:
    ledger = Ledger()
    plan = approval_plan(ledger)
    store = MemoryEffectStore()
    await store.open()
    await store.open_invocation(INV, plan.plan_hash, None, 0.0)
    broker = Broker(
        plan=Plan(list(plan.tools.values()), approval_timeout_s=0.05),
        invocation_id=INV,
        execution_id=EXE,
        store=store,
        approvals=ApprovalController(),
        receipts=store.receipts(tmp_path / "r.jsonl", None),
        dispatch_blocker=lambda: None,
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        reply = await broker.call("c1", "pay", {"account": "a", "cents": 5})
    assert reply.error is not None
    assert reply.error["code"] == "approval_expired"
    assert ledger.runs == {}


async def test_approve_then_expire_before_dispatch_leaves_the_handler_uncalled(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    proposal = rig.approvals.approve(proposal_id)
    rig.clock.now = proposal.expires_at + 1  # the lease ends before the broker resumes
    reply = await reply_of(task)
    assert reply.error is not None
    assert reply.error["code"] == "approval_expired"
    assert proposal.state == "expired"
    assert rig.ledger.runs == {}


async def test_expire_then_approve_fails_the_decision_and_the_call(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.clock.now += 10_000
    with pytest.raises(ProposalNotWaiting, match="expired"):
        rig.approvals.approve(proposal_id)
    reply = await reply_of(task)
    assert reply.error is not None
    assert reply.error["code"] == "approval_expired"
    assert rig.ledger.runs == {}


async def test_a_call_approved_after_the_invocations_deadline_does_not_run(rig: Rig) -> None:
    """Its reservation was made in time, before the approval wait; the
    deadline still holds at BeginDispatch, and the reservation goes back."""
    rig.broker.deadline_at = rig.clock() + 60
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.clock.now += 61  # the approval lease (300 s) still runs
    rig.approvals.approve(proposal_id)
    reply = await reply_of(task)
    invocation = await rig.store.get_invocation(INV)
    assert reply.error is not None
    assert (reply.error["code"], reply.http_status) == ("budget_exhausted", 429)
    assert rig.ledger.runs == {}
    assert invocation is not None
    assert invocation.used.calls == 0


async def test_approve_then_cancel_before_dispatch_is_cancelled_with_no_call(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    proposal = rig.approvals.approve(proposal_id)
    rig.approvals.cancel_execution(EXE)
    reply = await reply_of(task)
    assert reply.error is not None
    assert (reply.error["code"], reply.http_status) == ("cancelled", 409)
    assert proposal.state == "cancelled"
    assert rig.ledger.runs == {}


async def test_a_cancelled_execution_refuses_an_approved_call_at_begin_dispatch(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.approve(proposal_id)
    rig.blocked.append(Refusal("cancelled", "the execution was cancelled"))
    reply = await reply_of(task)
    assert reply.error is not None
    assert reply.error["code"] == "cancelled"
    assert rig.ledger.runs == {}


async def test_cancel_then_approve_fails_the_decision(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.cancel_execution(EXE)
    with pytest.raises(ProposalNotWaiting, match="cancelled"):
        rig.approvals.approve(proposal_id)
    reply = await reply_of(task)
    assert reply.error is not None
    assert reply.error["code"] == "cancelled"
    assert rig.ledger.runs == {}


async def test_a_cancel_after_begin_dispatch_cannot_undo_the_effect(rig: Rig) -> None:
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.approve(proposal_id)
    assert await asyncio.to_thread(rig.ledger.started.wait, STEP_TIMEOUT_S)
    rig.approvals.cancel_execution(EXE)
    rig.blocked.append(Refusal("cancelled", "the execution was cancelled"))
    rig.ledger.release.set()
    reply = await reply_of(task)
    record = await rig.store.get(INV, "c1")
    assert (reply.status, reply.effect) == ("ok", "executed")
    assert record is not None
    assert record.status is EffectStatus.COMMITTED
    assert rig.approvals.get(proposal_id).state == "dispatched"
    assert rig.ledger.runs["pay"] == 1


async def test_two_retries_of_one_call_wait_on_one_proposal_and_run_once(rig: Rig) -> None:
    first = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    second = rig.call("c1", "pay", {"account": "a", "cents": 5})
    third = rig.call("c1", "pay", {"account": "a", "cents": 5})
    status = await rig.broker.status("c1", 0)
    assert status.status == "awaiting_approval"
    assert status.http_status == 202
    assert len(rig.approvals.list()) == 1  # the retries joined, no new proposal
    rig.approvals.approve(proposal_id)
    rig.ledger.release.set()
    replies = [await reply_of(t) for t in (first, second, third)]
    assert replies[0].effect == "executed"
    for retry in replies[1:]:  # they joined the proposal: they share the outcome
        assert (retry.status, retry.effect, retry.result) == ("ok", "replayed", "paid_a")
    assert len(rig.approvals.list()) == 1
    assert rig.ledger.runs["pay"] == 1


async def test_a_retry_that_joins_before_the_proposal_opens_gets_the_outcome_too(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both requests start together: the second joins while the first is still
    in its replay check (a store read that yields, as SQLite's does), before
    any proposal exists."""
    read = rig.store.get

    async def yielding_get(invocation_id: str, call_id: str) -> Any:
        await asyncio.sleep(0)  # let the retry in: the read of a real store yields
        return await read(invocation_id, call_id)

    monkeypatch.setattr(rig.store, "get", yielding_get)
    first = rig.call("c1", "pay", {"account": "a", "cents": 5})
    second = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.approve(proposal_id)
    await wait_until(rig.ledger.started.is_set, "the approved call running")
    for _ in range(50):  # every step the retry could take now (no timer: only turns)
        await asyncio.sleep(0)
    rig.ledger.release.set()
    replies = [await reply_of(t) for t in (first, second)]
    assert [(r.status, r.effect) for r in replies] == [("ok", "executed"), ("ok", "replayed")]
    assert rig.ledger.runs["pay"] == 1


async def test_a_joined_retry_gets_the_rejection_too(rig: Rig) -> None:
    first = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    second = rig.call("c1", "pay", {"account": "a", "cents": 5})
    rig.approvals.reject(proposal_id)
    for task in (first, second):
        reply = await reply_of(task)
        assert reply.error is not None
        assert reply.error["code"] == "approval_rejected"
    assert rig.ledger.runs == {}


async def test_a_retry_of_a_rejected_call_is_rejected_without_asking_again(rig: Rig) -> None:
    """Otherwise a guest could retry until someone clicked approve."""
    first = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.reject(proposal_id, reason="no")
    rejected = await reply_of(first)
    retry = await reply_of(rig.call("c1", "pay", {"account": "a", "cents": 5}))
    other = rig.call("c2", "pay", {"account": "a", "cents": 5})  # a new call: asked anew
    other_id = await rig.proposal()
    rig.approvals.reject(other_id)
    await reply_of(other)
    receipt = json.loads(rig.broker.receipts.path.read_text().splitlines()[1])
    invocation = await rig.store.get_invocation(INV)

    assert rejected.error is not None and rejected.error["code"] == "approval_rejected"
    assert retry.error is not None and retry.error["code"] == "approval_rejected"
    assert receipt["call_id"] == "c1" and receipt["approval_id"] == proposal_id
    assert [p.id for p in rig.approvals.list()] == [proposal_id, other_id]
    assert rig.ledger.runs == {}
    assert invocation is not None and invocation.used.calls == 0  # nothing reserved stays


async def test_a_rejection_holds_for_retries_after_a_restart_without_asking_again(
    tmp_path: Path, ledger: Ledger
) -> None:
    """A rejection outlives the supervisor that took it: the retry of a
    rejected call, by the same invocation's next attempt after a restart (or
    on another replica), is refused at once, with no new proposal."""
    plan = approval_plan(ledger)
    args = {"account": "a", "cents": 5}
    replies: list[CallReply] = []
    listed: list[list[str]] = []
    for attempt in range(2):
        store = SQLiteEffectStore(tmp_path / "effects.db")
        await store.open()
        try:
            await store.open_invocation(INV, plan.plan_hash, None, 1.0)
            approvals = ApprovalController()
            broker = Broker(
                plan=plan,
                invocation_id=INV,
                execution_id=f"exe_{attempt}",
                store=store,
                approvals=approvals,
                receipts=store.receipts(tmp_path / "receipts.jsonl", None),
                dispatch_blocker=lambda: None,
            )
            call = asyncio.create_task(broker.call("c1", "pay", args))
            if attempt == 0:
                await wait_until(lambda: approvals.waiting() == 1, "the proposal")  # noqa: B023
                approvals.reject(approvals.list("waiting")[0].id, reason="no")
            replies.append(await reply_of(call))
            other = asyncio.create_task(broker.call(f"n{attempt}", "pay", args))  # a new call
            await wait_until(lambda: approvals.waiting() == 1, "a new call's proposal")  # noqa: B023
            approvals.reject(approvals.list("waiting")[0].id)
            await reply_of(other)
            listed.append([p.call_id for p in approvals.list()])
        finally:
            await store.close()

    first, retried = replies
    assert first.error is not None and retried.error is not None
    assert (first.error["code"], retried.error["code"]) == ("approval_rejected",) * 2
    assert listed == [["c1", "n0"], ["n1"]]  # after the restart: nobody asked about c1
    receipts = [json.loads(line) for line in (tmp_path / "receipts.jsonl").read_text().splitlines()]
    c1 = [r for r in receipts if r["call_id"] == "c1"]
    assert [r["error_code"] for r in c1] == ["approval_rejected"] * 2
    assert c1[0]["approval_id"] == c1[1]["approval_id"]  # the rejection it was
    assert ledger.runs == {}


async def test_a_call_that_runs_again_after_unknown_needs_a_fresh_approval(rig: Rig) -> None:
    first = rig.call("m1", "sync_mirror", {"key": "k"})
    first_id = await rig.proposal()
    rig.approvals.approve(first_id)
    assert (await reply_of(first)).reason == "unknown"
    again = rig.call("m1", "sync_mirror", {"key": "k"})
    second_id = await rig.proposal()
    assert second_id != first_id
    rig.approvals.approve(second_id)
    reply = await reply_of(again)
    assert (reply.effect, reply.result) == ("executed", "synced")
    assert rig.ledger.runs["sync_mirror"] == 2


async def test_a_tool_without_an_approval_rule_never_opens_a_proposal(rig: Rig) -> None:
    reply = await reply_of(rig.call("r1", "read", {"key": "x"}))
    assert reply.effect == "executed"
    assert rig.approvals.list() == []


async def test_a_decision_on_a_proposal_that_is_not_waiting_fails(rig: Rig) -> None:
    rig.ledger.release.set()
    task = rig.call("c1", "pay", {"account": "a", "cents": 5})
    proposal_id = await rig.proposal()
    rig.approvals.approve(proposal_id)
    await reply_of(task)
    for decide in (rig.approvals.approve, rig.approvals.reject):
        with pytest.raises(ProposalNotWaiting, match="dispatched, not waiting"):
            decide(proposal_id)


Decide = Callable[[Any], Any]


async def _sync_yes(proposal: Any) -> bool:
    return True


def _sync_no(proposal: Any) -> str:
    return "reject"


@pytest.mark.parametrize(
    ("approver", "code"),
    [
        (_sync_yes, None),
        (_sync_no, "approval_rejected"),
        (lambda proposal: True, None),
    ],
)
async def test_an_approver_callback_sync_or_async_decides(
    tmp_path: Path, ledger: Ledger, approver: Decide, code: str | None
) -> None:
    ledger.release.set()
    plan = approval_plan(ledger)
    store = MemoryEffectStore()
    await store.open()
    await store.open_invocation(INV, plan.plan_hash, None, 0.0)
    approvals = ApprovalController(approver)
    broker = Broker(
        plan=plan,
        invocation_id=INV,
        execution_id=EXE,
        store=store,
        approvals=approvals,
        receipts=store.receipts(tmp_path / "r.jsonl", None),
        dispatch_blocker=lambda: None,
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        reply = await broker.call("c1", "pay", {"account": "a", "cents": 1})
    [proposal] = approvals.list()
    if code is None:
        assert reply.effect == "executed"
        assert proposal.decided_by == "approver"
    else:
        assert reply.error is not None
        assert reply.error["code"] == code
    assert ledger.runs["pay"] == (1 if code is None else 0)


async def test_require_approval_for_irreversible_asks_for_untagged_tools_only(
    tmp_path: Path, ledger: Ledger
) -> None:
    @tool(reversibility="reversible")
    def look(key: str) -> str:
        return key

    @tool
    def act(key: str) -> str:
        return key

    plan = Plan([look, act], require_approval_for_irreversible=True)
    assert not plan.needs_approval(plan.tools["look"])
    assert plan.needs_approval(plan.tools["act"])


async def test_ended_proposals_are_forgotten_past_a_bound_and_rejections_still_hold() -> None:
    # A guest can ask as often as it likes, with arguments of up to a megabyte.
    approvals = ApprovalController(approver=lambda proposal: "reject")
    asked = ENDED_KEPT + 20

    def request(n: int) -> ProposalRequest:
        return ProposalRequest(INV, "exe_1", f"c{n}", "pay", {"pad": "x" * 1000}, f"k{n}", 60)

    decided = [await approvals.request(request(n)) for n in range(asked)]
    retried = await approvals.request(request(0))
    listed = approvals.list()
    assert [p.state for p in decided] == ["rejected"] * asked
    assert [p.id for p in listed] == [p.id for p in decided[-ENDED_KEPT:]]
    assert retried.id == decided[0].id and retried.state == "rejected"
    assert retried.args == {}  # forgotten with the listing; the rejection is kept
    assert listed[0].args == {"pad": "x" * 1000}


async def test_ended_proposals_are_kept_only_up_to_a_total_of_argument_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 256 ended proposals of a megabyte each would be 256 MB of a guest's.
    monkeypatch.setattr(approvals_module, "ENDED_KEPT_BYTES", 1_000_000)
    approvals = ApprovalController(approver=lambda proposal: "reject")

    def request(n: int, size: int) -> ProposalRequest:
        return ProposalRequest(INV, "exe_1", f"c{n}", "pay", {"pad": "x" * size}, f"k{n}", 60)

    decided = [await approvals.request(request(n, 300_000)) for n in range(5)]
    assert [p.id for p in approvals.list()] == [p.id for p in decided[-3:]]  # 3 × 300 KB
    huge = await approvals.request(request(5, 2_000_000))
    assert [p.id for p in approvals.list()] == [huge.id]  # the newest, however large


async def test_a_list_previews_large_arguments_and_a_proposal_has_them_whole() -> None:
    approvals = ApprovalController(approver=lambda proposal: "reject")
    large = {"pad": "\u00e9" * 20_000, "n": 1}  # é: two bytes each in UTF-8
    small = {"n": 2}
    await approvals.request(ProposalRequest(INV, "exe_1", "c1", "pay", large, "k1", 60))
    await approvals.request(ProposalRequest(INV, "exe_1", "c2", "pay", small, "k2", 60))
    first, second = (p.to_json(preview=True) for p in approvals.list())
    assert first["args"] is None
    assert first["args_bytes"] == len(
        json.dumps(large, ensure_ascii=False).replace(" ", "").encode()
    )
    assert first["args_preview"] == json.dumps(large, ensure_ascii=False, indent=2)[:2048]
    assert (second["args"], second["args_bytes"], "args_preview" in second) == (small, 7, False)
    assert approvals.list()[0].to_json()["args"] == large  # not previewed unless asked
    # Deeply nested: indented whole it would be 200 × its size; only the start is encoded.
    deep: Any = [0] * 10_000
    for _ in range(200):
        deep = [deep]
    await approvals.request(ProposalRequest(INV, "exe_1", "c3", "pay", {"d": deep}, "k3", 60))
    shown = approvals.list()[-1].to_json(preview=True)["args_preview"]
    assert shown == json.dumps({"d": deep}, indent=2)[:2048]
