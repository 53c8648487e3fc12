"""What only the asyncio client has: many calls in flight on one client, task
cancellation, one event loop, and its own small HTTP/1.1 reader.

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
from guest_client.aio_transport import BadResponse, encode_request, parse_head, read_response
from tests.harness import STEP_TIMEOUT_S

IN_FLIGHT = 32


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


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


def test_a_request_is_encoded_as_http_1_1_with_its_length() -> None:
    raw = encode_request("POST", "/v1/calls", {"Authorization": "Bearer x"}, b"{}")

    assert raw == (
        b"POST /v1/calls HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer x\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    assert b"Content-Length" not in encode_request("GET", "/v1/plan", {}, None)


def test_a_header_value_with_a_line_break_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="line break"):
        encode_request("GET", "/v1/plan", {"X": "a\r\nInjected: 1"}, None)


def test_a_response_head_is_parsed_with_lower_case_names_and_joined_repeats() -> None:
    status, http10, headers = parse_head(
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/json\r\nVia: a\r\nVia: b\r\n\r\n"
    )

    assert (status, http10) == (409, False)
    assert headers == {"content-type": "application/json", "via": "a, b"}


@pytest.mark.parametrize(
    "head",
    [b"SPDY/3 200 OK\r\n\r\n", b"HTTP/1.1 2xx OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n"],
)
def test_a_head_that_is_not_http_1_1_is_a_bad_response(head: bytes) -> None:
    with pytest.raises(BadResponse):
        parse_head(head)


async def test_a_chunked_body_with_trailers_is_read_whole() -> None:
    reader = reader_of(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n"
    )

    assert await read_response(reader) == (200, b"hello world", False)


async def test_informational_answers_are_skipped_and_close_is_honoured() -> None:
    reader = reader_of(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )

    assert await read_response(reader) == (200, b"{}", True)


async def test_a_body_without_a_length_runs_to_the_end_of_the_connection() -> None:
    reader = reader_of(b"HTTP/1.0 200 OK\r\n\r\n{}")

    assert await read_response(reader) == (200, b"{}", True)


async def test_a_chunk_size_that_is_not_hex_is_a_bad_response() -> None:
    reader = reader_of(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")

    with pytest.raises(BadResponse):
        await read_response(reader)
