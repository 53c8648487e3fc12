"""guest_client.aio against a real supervisor, channel and guest process."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from supervisor import Plan, Supervisor, tool
from tests.harness import STEP_TIMEOUT_S, Ledger, wait_until

CALLS = 32

GUEST = r"""
import asyncio, json, sys
from guest_client.aio import connect

async def main():
    async with connect() as client:
        ids = [f"hold_{i}" for i in range(CALLS)]
        first = asyncio.gather(*(client.call("hold", {"n": i}, call_id=ids[i])
                                 for i in range(CALLS)))
        # The test says when every handler has started.
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        # The same calls again while they run: each is answered in_flight and
        # long-polled, on the same client.
        again = asyncio.gather(*(client.call("hold", {"n": i}, call_id=ids[i])
                                 for i in range(CALLS)))
        first, again = await first, await again
        states = await asyncio.gather(*(client.status(call_id) for call_id in ids))
        print(json.dumps({"first": first, "again": again,
                          "effects": sorted({s["effect"] for s in states})}), flush=True)

asyncio.run(main())
""".replace("CALLS", str(CALLS))


def held_plan(ledger: Ledger, gate: asyncio.Event) -> Plan:
    """One async tool that holds every call until the test opens `gate`."""

    @tool(reversibility="irreversible")
    async def hold(n: int) -> int:
        ledger.record("hold", n=n)
        await gate.wait()
        return n * 2

    return Plan([hold], name="aio-test")


async def run_guest(sup: Supervisor, plan: Plan, code: str) -> tuple[Any, asyncio.Task[Any]]:
    """Start `code` as a guest; return its execution and the task of its run."""
    started: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            plan,
            [sys.executable, "-c", code],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    async with asyncio.timeout(STEP_TIMEOUT_S):
        done, _ = await asyncio.wait([started, run], return_when=asyncio.FIRST_COMPLETED)
    if run in done:
        run.result()
    return started.result(), run


async def test_thirty_two_calls_and_their_retries_are_in_flight_at_once_on_one_async_client(
    sup: Supervisor, ledger: Ledger
) -> None:
    gate = asyncio.Event()
    execution, run = await run_guest(sup, held_plan(ledger, gate), GUEST)
    process = execution.process
    assert process is not None and process.stdin is not None and process.stdout is not None
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S * 2):
            # Every handler has started and none has returned: 32 calls are in
            # flight together, on one client.
            await wait_until(lambda: ledger.runs["hold"] == CALLS, "32 calls in flight")
            process.stdin.write(b"go\n")
            await process.stdin.drain()
            # ... and 32 retries of them, each answered in_flight, now polling.
            await wait_until(lambda: execution.broker.outcomes["unknown"] == CALLS, "32 retries")
            gate.set()
            line = await process.stdout.readline()
            outcome = await run
    finally:
        if not run.done():
            run.cancel()
    out = json.loads(line)
    assert outcome.exit_code == 0
    assert out["first"] == [2 * i for i in range(CALLS)]
    assert out["again"] == out["first"]
    assert out["effects"] == ["replayed"]
    assert ledger.runs["hold"] == CALLS
    assert sorted(kwargs["n"] for _, kwargs in ledger.args) == list(range(CALLS))
