"""The clients' HTTP/1.1 (guest_client.http11): requests encoded in one
piece, responses framed by length, chunks or the connection's end — read the
same by the sync transport's socket reader and the async one's streams."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from guest_client.aio_transport import read_response
from guest_client.http11 import BadResponse, RequestEncoder, encode_request, parse_head
from guest_client.transport import _Connection, _Ended
from tests.harness import STEP_TIMEOUT_S


async def read_async(data: bytes) -> tuple[int, bytes, bool]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    async with asyncio.timeout(STEP_TIMEOUT_S):
        return await read_response(reader)


async def read_sync(data: bytes) -> tuple[int, bytes, bool]:
    """The sync transport's reader on a real socket, the host's end written and closed."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        connection = _Connection(ours)
        connection.deadline = time.monotonic() + STEP_TIMEOUT_S
        return connection.read_response()


READERS = [pytest.param(read_async, id="async"), pytest.param(read_sync, id="sync")]
Read = Callable[[bytes], Awaitable[tuple[int, bytes, bool]]]


def test_a_request_is_encoded_as_http_1_1_with_its_length() -> None:
    raw = encode_request("POST", "/v1/calls", {"Authorization": "Bearer x"}, b"{}")

    assert raw == (
        b"POST /v1/calls HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer x\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    assert encode_request("GET", "/v1/plan", {}, None) == (
        b"GET /v1/plan HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )


def test_an_encoder_sends_its_headers_on_every_request() -> None:
    encoder = RequestEncoder({"Authorization": "Bearer x", "Accept": "application/json"})

    first = encoder.encode("GET", "/v1/calls/a", None)
    second = encoder.encode("POST", "/v1/calls", b'{"a":1}')

    assert first.startswith(b"GET /v1/calls/a HTTP/1.1\r\nHost: localhost\r\n")
    assert second.startswith(b"POST /v1/calls HTTP/1.1\r\nHost: localhost\r\n")
    for raw in (first, second):
        assert b"\r\nAuthorization: Bearer x\r\nAccept: application/json\r\n" in raw
    assert second.endswith(b'\r\nContent-Length: 7\r\n\r\n{"a":1}')


def test_a_header_value_with_a_line_break_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="line break"):
        encode_request("GET", "/v1/plan", {"X": "a\r\nInjected: 1"}, None)
    with pytest.raises(ValueError, match="line break"):
        RequestEncoder({"X\n": "a"})


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


@pytest.mark.parametrize("read", READERS)
async def test_a_body_is_read_by_its_content_length(read: Read) -> None:
    answer = await read(b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}')

    assert answer == (200, b'{"ok":true}', False)


@pytest.mark.parametrize("read", READERS)
async def test_a_chunked_body_with_trailers_is_read_whole(read: Read) -> None:
    answer = await read(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nTrailer: x\r\n\r\n"
    )

    assert answer == (200, b"hello world", False)


@pytest.mark.parametrize("read", READERS)
async def test_informational_answers_are_skipped_and_close_is_honoured(read: Read) -> None:
    answer = await read(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"
    )

    assert answer == (200, b"{}", True)


@pytest.mark.parametrize("read", READERS)
async def test_a_body_without_a_length_runs_to_the_end_of_the_connection(read: Read) -> None:
    assert await read(b"HTTP/1.0 200 OK\r\n\r\n{}") == (200, b"{}", True)


@pytest.mark.parametrize("read", READERS)
async def test_an_http_1_0_answer_keeps_the_connection_only_when_it_says_keep_alive(
    read: Read,
) -> None:
    kept = await read(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n")
    closed = await read(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n")

    assert kept == (200, b"", False)
    assert closed == (200, b"", True)


@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("size", [b"zz", b"-5", b"0x5", b"1_0", b"+5", b""])
async def test_a_chunk_size_that_is_not_hex_digits_is_a_bad_response(
    read: Read, size: bytes
) -> None:
    with pytest.raises(BadResponse):
        await read(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + size
            + b"\r\nhello\r\n0\r\n\r\n"
        )


@pytest.mark.parametrize("read", READERS)
async def test_an_unknown_transfer_encoding_is_a_bad_response(read: Read) -> None:
    with pytest.raises(BadResponse, match="transfer-encoding"):
        await read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx")


async def test_a_sync_read_that_ends_midway_says_whether_anything_arrived() -> None:
    with pytest.raises(_Ended) as nothing:
        await read_sync(b"")
    with pytest.raises(_Ended) as something:
        await read_sync(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}")

    assert nothing.value.nothing_read
    assert not something.value.nothing_read


async def test_a_sync_head_past_its_limit_is_a_bad_response() -> None:
    with pytest.raises(BadResponse, match="no b'\\\\r\\\\n\\\\r\\\\n'"):
        await read_sync(b"HTTP/1.1 200 OK\r\nX: " + b"y" * (70 * 1024) + b"\r\n\r\n")


async def test_a_sync_connection_with_bytes_past_the_response_is_not_used_again() -> None:
    one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    answer = await read_sync(one + one)

    assert answer == (200, b"{}", True)


def test_a_sync_read_ends_by_its_deadline_however_slowly_the_bytes_come() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"HTTP/1.1 200 OK\r\n")  # and then nothing more
        connection = _Connection(ours)
        connection.deadline = time.monotonic() + 0.2

        with pytest.raises(TimeoutError):
            connection.read_response()
