"""The clients' HTTP/1.1 (guest_client.http11): requests encoded in one
piece, responses framed by length, chunks or the connection's end. Every
framing case runs four ways: the reader fed all at once and a byte at a
time, the sync transport's connection on a real socket, and the async
transport's protocol on one."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from guest_client.aio_transport import _Connection as AsyncConnection
from guest_client.http11 import (
    MAX_HEAD_BYTES,
    BadResponse,
    ConnectionEnded,
    RequestEncoder,
    ResponseReader,
    encode_request,
    parse_head,
)
from guest_client.transport import _Connection as SyncConnection
from tests.harness import STEP_TIMEOUT_S

Answer = tuple[int, bytes, bool]


def feed_in_pieces(data: bytes, size: int) -> Answer:
    reader = ResponseReader()
    reader.expect()
    for start in range(0, len(data), size):
        reader.feed(data[start : start + size])
        answer = reader.next_response()
        if answer is not None:
            return answer
    reader.feed(b"")
    answer = reader.next_response()
    assert answer is not None
    return answer


async def read_whole(data: bytes) -> Answer:
    return feed_in_pieces(data, len(data) or 1)


async def read_bytewise(data: bytes) -> Answer:
    return feed_in_pieces(data, 1)


async def read_sync(data: bytes) -> Answer:
    """The sync transport's connection on a real socket, the host's end written and closed."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        connection = SyncConnection(ours)
        connection.deadline = time.monotonic() + STEP_TIMEOUT_S
        return connection.exchange(b"GET / HTTP/1.1\r\n\r\n")


async def read_async(data: bytes) -> Answer:
    """The async transport's protocol on a real socket, the host's end written and closed."""
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(data)
        theirs.shutdown(socket.SHUT_WR)
        loop = asyncio.get_running_loop()
        transport, connection = await loop.create_unix_connection(AsyncConnection, sock=ours)
        try:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                return await connection.exchange(b"GET / HTTP/1.1\r\n\r\n")
        finally:
            transport.abort()


READERS = [
    pytest.param(read_whole, id="fed-whole"),
    pytest.param(read_bytewise, id="fed-bytewise"),
    pytest.param(read_sync, id="sync"),
    pytest.param(read_async, id="async"),
]
Read = Callable[[bytes], Awaitable[Answer]]


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
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nxx",
        # chunked must be the last coding (RFC 9112 section 6.1)
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\n{}",
        "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n{}".encode("latin-1"),
        b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 4301 + b"\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 19 + b"\r\n",
    ],
    ids=["gzip", "chunked-not-last", "status-2000", "superscript-length", "huge-length",
         "negative-length", "huge-chunk"],
)  # fmt: skip
async def test_an_answer_this_client_cannot_frame_is_a_bad_response(
    read: Read, answer: bytes
) -> None:
    with pytest.raises(BadResponse):
        await read(answer)


@pytest.mark.parametrize("read", READERS)
@pytest.mark.parametrize("status", [204, 304])
async def test_a_204_or_304_has_no_body_whatever_its_length_says(read: Read, status: int) -> None:
    answer = f"HTTP/1.1 {status} X\r\nContent-Length: 5\r\n\r\n".encode()

    assert await read(answer) == (status, b"", False)


@pytest.mark.parametrize("read", READERS)
async def test_an_answer_that_ends_midway_says_whether_anything_of_it_arrived(read: Read) -> None:
    with pytest.raises(ConnectionEnded) as nothing:
        await read(b"")
    with pytest.raises(ConnectionEnded) as head_only:
        await read(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    with pytest.raises(ConnectionEnded) as chunks_only:
        await read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")

    assert nothing.value.nothing_read
    assert not head_only.value.nothing_read
    assert not chunks_only.value.nothing_read


@pytest.mark.parametrize("read", READERS)
async def test_a_head_longer_than_the_limit_is_a_bad_response_however_it_arrives(
    read: Read,
) -> None:
    # The head's closing CRLF CRLF starts at the limit, and then a byte past it.
    filler = b"X: " + b"y" * (MAX_HEAD_BYTES - len(b"HTTP/1.1 200 OK\r\nX: "))
    at_limit = b"HTTP/1.1 200 OK\r\n" + filler + b"\r\n\r\n"
    past_limit = b"HTTP/1.1 200 OK\r\n" + filler + b"y\r\n\r\n"

    assert await read(at_limit) == (200, b"", True)
    with pytest.raises(BadResponse, match="first 65536 bytes"):
        await read(past_limit)


# Fed a byte at a time, the response is whole before the stray bytes come:
# they then make the idle reader unusable (the test after this one).
@pytest.mark.parametrize("read", [r for r in READERS if r.id != "fed-bytewise"])
async def test_bytes_past_the_response_keep_the_connection_from_being_used_again(
    read: Read,
) -> None:
    one = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

    assert await read(one + one) == (200, b"{}", True)


def test_a_reader_that_got_bytes_while_idle_is_not_usable() -> None:
    reader = ResponseReader()
    reader.expect()
    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    assert reader.next_response() == (200, b"", False)
    assert reader.usable

    reader.feed(b"HTTP/1.1 200 OK\r\n")

    assert not reader.usable


async def test_a_sync_connection_the_host_wrote_to_while_idle_is_not_reused() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        connection = SyncConnection(ours)
        assert connection.usable()
        theirs.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n"stray"')
        assert not connection.usable()
    closed_ours, closed_theirs = socket.socketpair()
    with closed_ours:
        closed_theirs.close()
        assert not SyncConnection(closed_ours).usable()


def test_a_sync_read_ends_by_its_deadline_however_slowly_the_bytes_come() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"HTTP/1.1 200 OK\r\n")  # and then nothing more
        connection = SyncConnection(ours)
        connection.deadline = time.monotonic() + 0.2

        with pytest.raises(TimeoutError):
            connection.exchange(b"GET / HTTP/1.1\r\n\r\n")


def test_an_answer_that_came_before_a_failed_send_is_the_outcome() -> None:
    """A host may refuse a large request after its head and close unread:
    the send then fails, but the answer is already there to read."""
    ours, theirs = socket.socketpair()
    with ours:
        theirs.sendall(b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        theirs.close()
        connection = SyncConnection(ours)
        connection.deadline = time.monotonic() + STEP_TIMEOUT_S

        answer = connection.exchange(b"POST / HTTP/1.1\r\n\r\n" + b"x" * (4 << 20))

    assert answer == (503, b"{}", True)


def test_a_send_that_fails_with_no_answer_waiting_still_fails() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        theirs.close()
        connection = SyncConnection(ours)
        connection.deadline = time.monotonic() + STEP_TIMEOUT_S

        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            connection.exchange(b"POST / HTTP/1.1\r\n\r\n" + b"x" * (4 << 20))
        assert not connection.reader.got_any


async def test_an_async_connection_the_host_writes_to_while_idle_is_dropped() -> None:
    ours, theirs = socket.socketpair()
    with theirs:
        theirs.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        loop = asyncio.get_running_loop()
        transport, connection = await loop.create_unix_connection(AsyncConnection, sock=ours)
        try:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                assert await connection.exchange(b"GET / HTTP/1.1\r\n\r\n") == (200, b"{}", False)
                assert connection.usable
                theirs.sendall(b"y" * 65536)  # nobody asked: never buffered
                await connection.closed
            assert not connection.usable
        finally:
            transport.abort()


def test_a_reader_is_done_after_a_bad_response() -> None:
    reader = ResponseReader()
    reader.expect()
    reader.feed(b"SPDY/3 200 OK\r\n\r\n")
    with pytest.raises(BadResponse):
        reader.next_response()

    reader.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    assert not reader.usable
    with pytest.raises(RuntimeError, match="no response is expected"):
        reader.next_response()


@pytest.mark.parametrize("read", READERS)
async def test_chunks_with_a_length_beside_them_close_the_connection_after(read: Read) -> None:
    answer = await read(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    )

    assert answer == (200, b"{}", True)
