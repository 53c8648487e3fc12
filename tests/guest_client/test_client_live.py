"""guest_client against a real supervisor, channel and guest process."""

from __future__ import annotations

import asyncio
import json
import sys

from supervisor import Supervisor
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, wait_until

GUEST = r"""
import json, sys, threading
from guest_client import EffectUnknown, Refused, ToolError, connect

client = connect()
results = {}

def call(name):
    results[name] = client.call("slow_charge", {"account": "a"}, call_id="s1")

first = threading.Thread(target=call, args=("first",))
first.start()
sys.stdin.readline()                       # the test saw the handler start
second = threading.Thread(target=call, args=("second",))
second.start()
first.join(60); second.join(60)
out = {"results": results}
try:
    client.call("flaky_send", {"to": "x@example.com"}, call_id="m1")
except EffectUnknown as exc:
    out["unknown"] = [exc.call_id, exc.idempotency_key]
try:
    client.call("nope", {})
except Refused as exc:
    out["refused"] = exc.code
try:
    client.call("broken", {"x": 1})
except ToolError as exc:
    out["tool_error"] = [exc.type, exc.message]
out["tools"] = sorted(t["name"] for t in client.tools())
print(json.dumps(out), flush=True)
"""


async def test_a_retry_of_an_in_flight_call_long_polls_and_gets_the_single_result(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    started = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            plan,
            [sys.executable, "-c", GUEST],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    async with asyncio.timeout(STEP_TIMEOUT_S * 2):
        execution = await started
        process = execution.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        process.stdin.write(b"go\n")
        await process.stdin.drain()
        # The second request was answered "in flight" (and is now long-polling).
        await wait_until(lambda: execution.broker.outcomes["unknown"] >= 1, "in-flight reply")
        ledger.release.set()
        out = json.loads(await process.stdout.readline())
        outcome = await run
    assert outcome.exit_code == 0
    assert out["results"]["first"] == out["results"]["second"] == "slow_a"
    assert ledger.runs["slow_charge"] == 1
    assert out["unknown"][0] == "m1" and len(out["unknown"][1]) == 64
    assert out["refused"] == "tool_not_allowed"
    assert out["tool_error"] == ["ValueError", "no such thing"]
    assert "charge" in out["tools"]


ADAPTER_GUEST = r"""
import json
from guest_client import connect

client = connect()
step = {"id": "call_Ab12", "type": "function",
        "function": {"name": "charge", "arguments": '{"account": "acct_9", "cents": 700}'}}
out = {
    "first": client.call_openai(step),
    "retried_step": client.call_openai(step),
    "anthropic": client.call_anthropic(
        {"type": "tool_use", "id": "toolu_01X", "name": "lookup", "input": {"account": "acct_9"}}),
    "malformed": client.call_openai({**step, "id": "call_bad",
                                     "function": {"name": "charge", "arguments": "{oops"}}),
    "schema": client.call_anthropic(
        {"type": "tool_use", "id": "toolu_02Y", "name": "charge", "input": {"cents": "lots"}}),
    "status": client.status("call_Ab12")["effect"],
    "tools": {flavor: [t.get("name") or t["function"]["name"] for t in client.tools_for(flavor)]
              for flavor in ("openai", "openai-responses", "anthropic", "mcp")},
}
print(json.dumps(out), flush=True)
"""


async def test_model_tool_calls_run_once_under_the_models_own_ids_against_a_real_host(
    sup: Supervisor, ledger: Ledger
) -> None:
    started = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            billing_plan(ledger),
            [sys.executable, "-c", ADAPTER_GUEST],
            stdout=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    async with asyncio.timeout(STEP_TIMEOUT_S * 2):
        execution = await started
        assert execution.process is not None and execution.process.stdout is not None
        out = json.loads(await execution.process.stdout.readline())
        outcome = await run
        records = await sup.store.calls(execution.invocation_id)
    assert outcome.exit_code == 0
    assert out["first"] == out["retried_step"]
    assert out["first"]["tool_call_id"] == "call_Ab12"
    assert json.loads(out["first"]["content"])["charge_id"] == "ch_1"
    assert out["anthropic"] == {
        "type": "tool_result",
        "tool_use_id": "toolu_01X",
        "content": '{"account":"acct_9"}',
    }
    assert json.loads(out["malformed"]["content"])["error"]["code"] == "invalid_arguments"
    assert out["schema"]["is_error"] is True
    schema_error = json.loads(out["schema"]["content"])["error"]
    assert {tuple(d["loc"]) for d in schema_error["details"]} == {("account",), ("cents",)}
    assert out["status"] == "replayed"
    for names in out["tools"].values():
        assert "charge" in names and "lookup" in names
    assert ledger.runs == {"charge": 1, "lookup": 1}
    assert sorted(record.call_id for record in records) == ["call_Ab12", "toolu_01X"]


WAITS_FOR_APPROVAL = r"""
import json, os
from guest_client import HostcallError, RetryPolicy, connect

# A deadline far shorter than the plan's approval lease.
client = connect(retry=RetryPolicy(deadline=1.0))
out = {"leases": os.environ.get("HOSTCALL_APPROVAL_LEASES")}
try:
    out["result"] = client.call("charge", {"account": "acct_1", "cents": 5}, call_id="c1")
except HostcallError as exc:
    out["error"] = [type(exc).__name__, exc.code]
print(json.dumps(out), flush=True)
"""


async def test_a_call_waiting_for_approval_outlasts_the_policy_deadline_up_to_its_lease(
    sup: Supervisor, ledger: Ledger
) -> None:
    """The client learns the lease (HOSTCALL_APPROVAL_LEASES) and does not give
    up at its 1 s deadline while the proposal still waits (issue 14)."""
    plan = billing_plan(ledger, require_approval_for_irreversible=True, approval_timeout_s=20)
    run = asyncio.create_task(sup.run(plan, [sys.executable, "-c", WAITS_FOR_APPROVAL]))
    async with asyncio.timeout(STEP_TIMEOUT_S * 2):
        await wait_until(lambda: sup.approvals.waiting() == 1, "the proposal")
        [proposal] = sup.approvals.list("waiting")
        loop = asyncio.get_running_loop()
        # Past the client's own deadline (a clock, not an order of events):
        # without the lease it would have given up by now.
        waited_until = loop.time() + 2.0
        while loop.time() < waited_until:
            await asyncio.sleep(0.1)
        sup.approvals.approve(proposal.id)
        outcome = await run
    log = sup.state.logs_dir / outcome.invocation_id / f"{outcome.execution_id}.stdout.log"
    printed = json.loads(log.read_text())
    assert outcome.exit_status == 0
    assert printed["result"] == {"charge_id": "ch_1", "account": "acct_1", "cents": 5}
    assert json.loads(printed["leases"])["charge"] == 20
    assert ledger.runs["charge"] == 1
