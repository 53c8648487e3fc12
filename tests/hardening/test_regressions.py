"""Bugs the model test (test_model.py) found, each as a plain, minimal test.

Receipt chain race. The model's sequence was: a fresh broker (a new supervisor,
or one restarted on the same state dir), then two requests racing as the very
first calls it serves — here two copies of one new call, as a transport retry
or a parallel tool call sends them. Both appends of the fresh ``ReceiptLog``
see no previous hash yet and both read it from the file: the second line then
names the same ``prev_hash`` as the first (``hostcall receipts verify`` reports
the chain broken at line 2), or it reads the first line half-written and the
request fails with ``JSONDecodeError`` instead of its reply. Any two requests
whose receipts are the log's first and overlap do it (the third test).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from supervisor import Plan, tool
from supervisor.approvals import ApprovalController
from supervisor.broker import Broker
from supervisor.receipt_files import ReceiptLog
from supervisor.receipts import verify_chain
from supervisor.stores import MemoryEffectStore
from tests.harness import STEP_TIMEOUT_S


def receipt(call_id: str) -> dict[str, Any]:
    return {
        "invocation_id": "inv_1",
        "execution_id": "exe_1",
        "plan_hash": "sha256:" + "0" * 64,
        "call_id": call_id,
        "tool": "echo",
        "idempotency_key": "k" * 64,
        "outcome": "executed",
        "error_code": None,
        "approval_id": None,
        "started_at": 0.0,
        "finished_at": 0.0,
    }


async def test_two_concurrent_first_receipts_of_a_new_log_keep_the_chain(tmp_path: Path) -> None:
    path = tmp_path / "receipts.jsonl"
    log = ReceiptLog(path)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await asyncio.gather(log.append(**receipt("c1")), log.append(**receipt("c2")))
    assert verify_chain(path) == (2, None)


async def test_concurrent_first_receipts_after_a_restart_extend_the_chain(
    tmp_path: Path,
) -> None:
    path = tmp_path / "receipts.jsonl"
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await ReceiptLog(path).append(**receipt("c0"))  # the supervisor before the restart
        restarted = ReceiptLog(path)
        await asyncio.gather(*(restarted.append(**receipt(f"c{i}")) for i in (1, 2, 3)))
    assert verify_chain(path) == (4, None)


async def test_the_first_two_requests_a_broker_serves_at_once_leave_an_intact_receipt_chain(
    tmp_path: Path,
) -> None:
    @tool(reversibility="irreversible")
    async def pay(ref: str) -> dict[str, str]:
        return {"ref": ref}

    plan = Plan([pay], name="race")
    store = MemoryEffectStore()
    await store.open()
    await store.open_invocation("inv_1", plan.plan_hash, None, 0.0)
    broker = Broker(
        plan=plan,
        invocation_id="inv_1",
        execution_id="exe_1",
        store=store,
        approvals=ApprovalController(),
        receipts=store.receipts(tmp_path / "receipts.jsonl", None),
        dispatch_blocker=lambda: None,
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        # Refused at once (no such tool): nothing but the receipts orders them.
        replies = await asyncio.gather(broker.call("c1", "nope", {}), broker.call("c2", "nope", {}))
    assert [r.status for r in replies] == ["refused", "refused"]
    assert verify_chain(tmp_path / "receipts.jsonl") == (2, None)
