"""What only the asyncio client has: many calls in flight on one client, task
cancellation, one event loop.

Its wire behaviour shared with the sync client is checked in
test_client_http.py, which runs against both clients.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from client_fakehost import FAST_RETRY, HANG, Hang, Recorded, Reply, ScriptedHost, ok

from guest_client import GuestEnvironment, Refused
from guest_client.aio import AsyncHostClient, connect
from tests.harness import STEP_TIMEOUT_S

IN_FLIGHT = 32


async def test_many_calls_are_in_flight_at_once_each_on_its_own_connection(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    # The barrier opens only when every call is inside the host at the same time.
    barrier = threading.Barrier(IN_FLIGHT, timeout=STEP_TIMEOUT_S)

    def answer(request: Recorded) -> Reply:
        barrier.wait()
        call_id = request.json()["call_id"]
        return ok(call_id, {"echo": call_id})

    host.default = answer
    ids = [f"c{i}" for i in range(IN_FLIGHT)]

    async with asyncio.timeout(STEP_TIMEOUT_S), connect(retry=FAST_RETRY) as client:
        results = await asyncio.gather(*(client.call("charge", call_id=c) for c in ids))

    assert results == [{"echo": c} for c in ids]
    assert len({request.connection for request in host.requests}) == IN_FLIGHT


async def test_kept_alive_connections_serve_later_calls_after_a_burst(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    host.default = lambda request: ok(request.json()["call_id"], 1)

    async with asyncio.timeout(STEP_TIMEOUT_S), connect(retry=FAST_RETRY) as client:
        await asyncio.gather(*(client.call("charge", call_id=f"a{i}") for i in range(4)))
        for i in range(4):
            await client.call("charge", call_id=f"b{i}")

    later = {request.connection for request in host.requests[4:]}
    assert later <= {request.connection for request in host.requests[:4]}


async def test_a_cancelled_call_drops_its_connection_and_the_client_goes_on(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    arrived = threading.Event()

    def hang(request: Recorded) -> Hang:
        arrived.set()
        return HANG

    host.answer(hang, ok("b", "fine"))

    async with asyncio.timeout(STEP_TIMEOUT_S), connect(retry=FAST_RETRY) as client:
        hanging = asyncio.create_task(client.call("charge", call_id="a"))
        assert await asyncio.to_thread(arrived.wait, STEP_TIMEOUT_S)
        hanging.cancel()
        with pytest.raises(asyncio.CancelledError):
            await hanging
        assert await client.call("charge", call_id="b") == "fine"

    assert host.requests[1].connection != host.requests[0].connection


async def test_a_refusal_is_raised_to_the_awaiting_task(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    host.answer(
        Reply(
            429,
            {
                "status": "refused",
                "call_id": "c",
                "effect": "none",
                "error": {"code": "budget_exhausted", "message": "no calls left"},
                "idempotency_key": "a" * 64,
            },
        )
    )

    async with connect(retry=FAST_RETRY) as client:
        with pytest.raises(Refused) as caught:
            await client.call("charge", call_id="c")

    assert (caught.value.code, caught.value.call_id) == ("budget_exhausted", "c")
    assert caught.value.idempotency_key == "a" * 64


def test_a_client_is_bound_to_the_event_loop_it_was_first_used_on(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    host.default = ok("c", 1)
    client = AsyncHostClient(GuestEnvironment.from_environ(), retry=FAST_RETRY)
    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        assert first.run_until_complete(client.call("charge", call_id="c")) == 1
        with pytest.raises(RuntimeError, match="event loop"):
            second.run_until_complete(client.call("charge", call_id="c"))
        first.run_until_complete(client.aclose())
    finally:
        first.close()
        second.close()


async def test_a_closed_async_client_refuses_to_send(
    host: ScriptedHost, guest_env: dict[str, str]
) -> None:
    client = connect(retry=FAST_RETRY)
    await client.aclose()

    with pytest.raises(RuntimeError):
        await client.call("charge", call_id="c")
    assert host.requests == []
