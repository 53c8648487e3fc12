"""SPEC §13 S9: a guest cannot deny others the channel, nor the supervisor its descriptors.

At most N open connections per execution (per sandbox, or per session for an
unsandboxed guest) and a share of the process's descriptors for the channel
as a whole; idle and half-sent requests are closed, a long poll is not; a
process out of descriptors keeps serving. Real sockets and real processes,
against a fake execution directory: the broker is not what is tested here.

The fakes, the peer script and the server run in a subprocess
(``python -m tests.channel.test_connections serve ...``) are shared with
test_origin_pidns.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from channel.errors import Refusal
from channel.server import ChannelServer
from channel.wire import CallReply

ROOT = Path(__file__).resolve().parents[2]
#: Bound on every wait of these tests.
STEP_TIMEOUT_S = 15.0
#: The idle timeout of the tests that wait for it.
IDLE_S = 0.3
CREDENTIAL = "test-credential-" + "x" * 27
PLAN_HASH = "sha256:" + "ab" * 32


# -- fakes ------------------------------------------------------------------


class FakeBroker:
    """Answers at once, but for a long poll, which waits until released."""

    def __init__(self) -> None:
        self.polling = asyncio.Event()
        self.release = asyncio.Event()
        self.polls = 0

    async def call(self, call_id: str, tool: str, args: dict[str, Any]) -> CallReply:
        return CallReply("ok", call_id, "executed", tool, {"ran": True}, "0" * 64, "rcpt_1")

    async def status(self, call_id: str, wait_s: float) -> CallReply:
        if wait_s > 0:
            self.polls += 1
            self.polling.set()
            await self.release.wait()
        return CallReply.refused(call_id, Refusal("not_found", "no record of this call"))

    async def plan_view(self) -> dict[str, Any]:
        return {"plan_hash": PLAN_HASH}


@dataclass(eq=False)
class FakeExecution:
    """An execution as the channel sees it (``channel.routing.ExecutionPort``)."""

    execution_id: str = "exe_1"
    invocation_id: str = "inv_1"
    plan_hash: str = PLAN_HASH
    credential_sha256: bytes = hashlib.sha256(CREDENTIAL.encode()).digest()
    live: bool = True
    guest_pid: int | None = None
    guest_pidns: int | None = None
    guest_uid: int | None = None
    broker: FakeBroker = field(default_factory=FakeBroker)

    async def wait_launched(self, timeout_s: float) -> None:
        return None


class FakeDirectory:
    def __init__(self, *executions: FakeExecution) -> None:
        self._by_id = {execution.execution_id: execution for execution in executions}

    def lookup(self, execution_id: str) -> FakeExecution | None:
        return self._by_id.get(execution_id)


def identity(execution: FakeExecution) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {CREDENTIAL}",
        "Hostcall-Execution": execution.execution_id,
        "Hostcall-Invocation": execution.invocation_id,
        "Hostcall-Plan": execution.plan_hash,
    }


def encode_request(
    execution: FakeExecution,
    method: str = "GET",
    path: str = "/v1/plan",
    *,
    close: bool = False,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost"]
    lines += [f"{name}: {value}" for name, value in identity(execution).items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@contextlib.asynccontextmanager
async def channel(
    socket_dir: Path, execution: FakeExecution, **options: Any
) -> AsyncIterator[ChannelServer]:
    """A channel serving ``execution`` on a socket in ``socket_dir``."""
    socket_dir.mkdir(mode=0o700, exist_ok=True)
    server = ChannelServer(FakeDirectory(execution), socket_dir / "channel.sock", **options)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


async def wait_until(predicate: Callable[[], bool]) -> None:
    """Poll (bounded) for a condition the server makes true."""
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while not predicate():
            await asyncio.sleep(0.005)


# -- clients ----------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: Any


class Connection:
    """One raw HTTP/1.1 connection from this process."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def response(self) -> Response:
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in filter(None, lines):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers["content-length"]))
        return Response(int(status_line.split()[1]), headers, json.loads(body))

    async def request(self, execution: FakeExecution, path: str = "/v1/plan") -> Response:
        self.send(encode_request(execution, path=path))
        return await self.response()

    async def rest(self) -> bytes:
        """Everything until the server closes the connection."""
        return await self.reader.read()


class Clients:
    """Connections opened by a test, all closed at its end."""

    def __init__(self) -> None:
        self._open: list[Connection] = []

    async def open(self, path: Path) -> Connection:
        reader, writer = await asyncio.open_unix_connection(str(path))
        connection = Connection(reader, writer)
        self._open.append(connection)
        return connection

    async def close(self, connection: Connection) -> None:
        connection.writer.close()
        with contextlib.suppress(OSError):
            await connection.writer.wait_closed()

    async def close_all(self) -> None:
        for connection in self._open:
            await self.close(connection)


@pytest.fixture
async def clients() -> AsyncIterator[Clients]:
    opened = Clients()
    try:
        yield opened
    finally:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await opened.close_all()


#: A peer process (standard library only): for each line of stdin, a JSON
#: object ``{"raw": request}``, one connection, one request, and one line out:
#: ``{"status": ..., "body": ...}``, or ``{"error": ...}`` if it failed. With
#: ``non-dumpable`` after the socket's path it first makes itself non-dumpable
#: (``prctl(PR_SET_DUMPABLE, 0)``) and says whether it is in each answer.
PEER = r"""
import json, socket, sys
path = sys.argv[1]
dumpable = None
if sys.argv[2:] == ["non-dumpable"]:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    dumpable = libc.prctl(3, 0, 0, 0, 0)  # PR_GET_DUMPABLE
for line in sys.stdin:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(json.loads(line)["raw"].encode("latin-1"))
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        answer = {"status": int(head.split()[1]), "body": json.loads(body)}
    except (OSError, ValueError, IndexError) as exc:
        answer = {"error": repr(exc)}
    if dumpable is not None:
        answer["dumpable"] = dumpable
    print(json.dumps(answer), flush=True)
"""


async def peer_in_new_session(socket_path: Path, request: bytes) -> dict[str, Any]:
    """One request from another process, in a session of its own (another group)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PEER,
        str(socket_path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    line = json.dumps({"raw": request.decode("latin-1")}).encode() + b"\n"
    async with asyncio.timeout(STEP_TIMEOUT_S):
        out, _ = await process.communicate(line)
    answer: dict[str, Any] = json.loads(out)
    return answer


# -- limits -----------------------------------------------------------------


async def test_the_65th_connection_of_an_execution_is_answered_503_and_the_first_64_still_work(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())  # this process is the guest
    async with asyncio.timeout(STEP_TIMEOUT_S), channel(tmp_path / "s", execution) as server:
        first = [await clients.open(server.socket_path) for _ in range(64)]
        before = [(await connection.request(execution)).status for connection in first]
        extra = await clients.open(server.socket_path)
        refused = await extra.request(execution)
        rest = await extra.rest()
        after = [(await connection.request(execution)).status for connection in first]
        still_open = server.open_connections

    assert before == after == [200] * 64
    assert refused.status == 503
    assert refused.headers["connection"] == "close"
    assert refused.headers["content-type"] == "application/json"
    assert refused.body == {
        "status": "refused",
        "call_id": None,
        "effect": "none",
        "error": {
            "code": "too_many_connections",
            "message": "this execution already has 64 open connections to the channel",
        },
    }
    assert rest == b""  # and closed
    assert still_open == 64


async def test_another_execution_gets_in_while_one_is_at_its_limit_and_a_freed_slot_is_reused(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, max_connections_per_group=2) as server,
    ):
        held = [await clients.open(server.socket_path) for _ in range(2)]
        for connection in held:
            assert (await connection.request(execution)).status == 200
        over = await (await clients.open(server.socket_path)).request(execution)
        # A child of this process (so part of the guest) in a session of its
        # own: another group, which gets in.
        other = await peer_in_new_session(server.socket_path, encode_request(execution, close=True))
        await clients.close(held[0])
        await wait_until(lambda: server.open_connections == 1)
        again = await (await clients.open(server.socket_path)).request(execution)

    assert over.status == 503
    assert other["status"] == 200
    assert again.status == 200


async def test_a_request_whose_guest_hung_up_holds_its_place_until_it_is_answered(
    tmp_path: Path, clients: Clients
) -> None:
    # A request goes on when its guest hangs up (a dispatched handler is never
    # cancelled). If the hang-up freed the place, a guest could send a call,
    # hang up and open another connection, as often as it liked: calls in
    # progress per execution would have no bound. Long polls stand in for
    # calls here.
    execution = FakeExecution(guest_pid=os.getpid())
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, max_connections_per_group=2) as server,
    ):
        for n in range(2):
            connection = await clients.open(server.socket_path)
            connection.send(encode_request(execution, path=f"/v1/calls/c{n}?wait=60"))
        await wait_until(lambda: execution.broker.polls == 2)
        await clients.close_all()
        await wait_until(lambda: server.orphaned_requests == 2)
        descriptors_left = server.open_connections
        while_running = await (await clients.open(server.socket_path)).request(execution)
        execution.broker.release.set()
        await wait_until(lambda: server.orphaned_requests == 0)
        after = await (await clients.open(server.socket_path)).request(execution)

    assert descriptors_left == 0  # the connections themselves are gone
    assert while_running.status == 503
    assert while_running.body["error"]["code"] == "too_many_connections"
    assert after.status == 200


async def test_the_channel_as_a_whole_refuses_connections_beyond_its_total(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, max_connections=2) as server,
    ):
        for _ in range(2):
            connection = await clients.open(server.socket_path)
            assert (await connection.request(execution)).status == 200
        other = await peer_in_new_session(server.socket_path, encode_request(execution, close=True))

    assert other["status"] == 503
    assert other["body"]["error"] == {
        "code": "too_many_connections",
        "message": "the channel has too many open connections",
    }


# -- idle connections -------------------------------------------------------


async def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(
    tmp_path: Path, clients: Clients
) -> None:
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", FakeExecution(), idle_timeout_s=IDLE_S) as server,
    ):
        opened_at = loop.time()
        silent = await clients.open(server.socket_path)
        rest = await silent.rest()
        waited = loop.time() - opened_at
        await wait_until(lambda: server.open_connections == 0)

    assert rest == b""
    assert waited >= IDLE_S * 0.9


async def test_a_kept_alive_connection_is_closed_once_idle_after_its_last_answer(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    loop = asyncio.get_running_loop()
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, idle_timeout_s=IDLE_S) as server,
    ):
        connection = await clients.open(server.socket_path)
        answer = await connection.request(execution)
        answered_at = loop.time()
        rest = await connection.rest()
        waited = loop.time() - answered_at

    assert answer.status == 200
    assert rest == b""
    assert waited >= IDLE_S * 0.9


async def test_a_long_poll_in_progress_is_not_idle(tmp_path: Path, clients: Clients) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, idle_timeout_s=IDLE_S) as server,
    ):
        polling = await clients.open(server.socket_path)
        polling.send(encode_request(execution, path="/v1/calls/c1?wait=60"))
        await execution.broker.polling.wait()
        # Opened after the poll began: once the server closed it as idle, the
        # poll has been in progress for longer than the idle timeout.
        idle = await clients.open(server.socket_path)
        assert await idle.rest() == b""
        execution.broker.release.set()
        answer = await polling.response()

    assert (answer.status, answer.body["error"]["code"]) == (404, "not_found")


async def test_a_request_trickled_byte_by_byte_is_closed_when_the_idle_timeout_passes(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    head = encode_request(execution)[:-4] + b"\r\nX-Padding: " + b"y" * 4096
    loop = asyncio.get_running_loop()

    async def trickle(connection: Connection) -> None:
        # Past the transport: a write into the connection the server closed
        # fails here, and not as the reader's error instead of its EOF.
        fd = connection.writer.get_extra_info("socket").fileno()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in head:
                os.write(fd, bytes([byte]))
                await asyncio.sleep(IDLE_S / 10)  # paces the trickle; nothing waits on it

    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, idle_timeout_s=IDLE_S) as server,
    ):
        connection = await clients.open(server.socket_path)
        opened_at = loop.time()
        sender = asyncio.create_task(trickle(connection))
        rest = await connection.rest()
        waited = loop.time() - opened_at
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, OSError):
            await sender

    assert rest == b""
    # Closed at the idle timeout, not pushed back by each byte (the head
    # alone would take 400 times as long to trickle in).
    assert IDLE_S * 0.9 <= waited < IDLE_S * 5


async def test_a_request_whose_body_never_arrives_whole_is_answered_400_and_closed(
    tmp_path: Path, clients: Clients
) -> None:
    execution = FakeExecution(guest_pid=os.getpid())
    head = encode_request(execution, "POST", "/v1/calls")[:-2]
    head += b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    async with (
        asyncio.timeout(STEP_TIMEOUT_S),
        channel(tmp_path / "s", execution, idle_timeout_s=IDLE_S) as server,
    ):
        connection = await clients.open(server.socket_path)
        connection.send(head + b'{"call_id": ')
        answer = await connection.response()
        rest = await connection.rest()

    assert (answer.status, answer.body["error"]["code"]) == (400, "bad_request")
    assert "did not arrive within" in answer.body["error"]["message"]
    assert rest == b""


# -- out of descriptors -----------------------------------------------------


class ServerProcess:
    """A channel (and an admin stand-in) served by ``serve()`` in a child process."""

    def __init__(self, process: asyncio.subprocess.Process, ready: dict[str, Any]) -> None:
        self.process = process
        self.channel = Path(ready["channel"])
        self.admin = Path(ready["admin"])

    @classmethod
    @contextlib.asynccontextmanager
    async def run(cls, *argv: str, prefix: tuple[str, ...] = ()) -> AsyncIterator[ServerProcess]:
        process = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            "-m",
            "tests.channel.test_connections",
            "serve",
            *argv,
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            async with asyncio.timeout(STEP_TIMEOUT_S):
                line = await process.stdout.readline()
            if not line:
                assert process.stderr is not None
                raise AssertionError((await process.stderr.read()).decode())
            yield cls(process, json.loads(line))
        finally:
            assert process.stdin is not None
            process.stdin.close()  # it stops when its stdin ends
            async with asyncio.timeout(STEP_TIMEOUT_S):
                await process.communicate()

    async def command(self, op: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(op.encode() + b"\n")
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await self.process.stdin.drain()
            answer: dict[str, Any] = json.loads(await self.process.stdout.readline())
        return answer

    async def stop(self) -> str:
        """Ask it to stop; what it logged."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            _, err = await self.process.communicate()
        return err.decode()

    async def ping_admin(self) -> bytes:
        reader, writer = await asyncio.open_unix_connection(str(self.admin))
        try:
            writer.write(b"ping\n")
            return await reader.readline()
        finally:
            writer.close()
            await writer.wait_closed()


LOOPS = ["asyncio", "uvloop"]


async def outcome(connection: Connection) -> int | str:
    try:
        return (await connection.response()).status
    except (OSError, asyncio.IncompleteReadError):
        return "broken"


@pytest.mark.parametrize("loop_name", LOOPS)
async def test_a_connection_queued_while_the_process_is_out_of_descriptors_is_served_after(
    tmp_path: Path, clients: Clients, loop_name: str
) -> None:
    execution = FakeExecution()  # what serve() serves, origin check off
    socket_dir = tmp_path / "s"
    async with (
        asyncio.timeout(STEP_TIMEOUT_S * 2),
        ServerProcess.run(str(socket_dir), "--loop", loop_name, "--nofile", "64") as server,
    ):
        established = await clients.open(server.channel)
        assert (await established.request(execution)).status == 200
        hogged = await server.command("hog")
        during = await established.request(execution)
        queued = await clients.open(server.channel)  # waits in the backlog
        queued.send(encode_request(execution))
        # The server must have tried (and failed) to accept it before the
        # descriptors come back, or there is no starvation to see.
        starved = await server.command("starved")
        await server.command("free")
        served = await queued.response()
        pong = await server.ping_admin()
        log = await server.stop()

    assert hogged["hogged"] > 0
    assert during.status == 200
    assert starved == {"starved": True}
    assert served.status == 200
    assert pong == b"pong\n"
    # One warning for the whole time it could not accept, not one per attempt.
    assert log.count("cannot accept connections") == 1, log


@pytest.mark.parametrize("loop_name", LOOPS)
async def test_a_flood_of_channel_connections_leaves_descriptors_for_the_rest_of_the_supervisor(
    tmp_path: Path, clients: Clients, loop_name: str
) -> None:
    execution = FakeExecution()
    nofile = 128
    async with (
        asyncio.timeout(STEP_TIMEOUT_S * 2),
        ServerProcess.run(
            str(tmp_path / "s"),
            "--loop",
            loop_name,
            "--nofile",
            str(nofile),
            "--per-group",
            "1000",
        ) as server,
    ):
        flood = []
        for _ in range(nofile):
            flood.append(connection := await clients.open(server.channel))
            connection.send(encode_request(execution))
        outcomes = [await outcome(connection) for connection in flood]
        pong = await server.ping_admin()
        spare = await server.command("hog")

    assert outcomes.count(200) == nofile // 2  # its share: half the soft limit
    # A refused connection is answered 503, or, when too many refusals are
    # pending, closed at once: a request written after that fails.
    assert set(outcomes) <= {200, 503, "broken"}
    assert pong == b"pong\n"
    assert spare["hogged"] >= nofile // 4


# -- the server in a child process ------------------------------------------


async def _pong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while await reader.readline():
        writer.write(b"pong\n")
        await writer.drain()
    writer.close()


class _OnMessage(logging.Handler):
    """Calls ``then`` when a record's message contains ``text``."""

    def __init__(self, text: str, then: Callable[[], None]) -> None:
        super().__init__()
        self._text = text
        self._then = then

    def emit(self, record: logging.LogRecord) -> None:
        if self._text in record.getMessage():
            self._then()


async def serve(socket_dir: Path, nofile: int | None, per_group: int) -> None:
    """Serve a channel and an admin stand-in until stdin ends; obey commands.

    ``hog``: open descriptors until there is none left; ``free``: close them;
    ``starved``: wait until the channel has logged that it cannot accept.
    """
    starved = asyncio.Event()
    logging.basicConfig(level=logging.WARNING)  # to stderr, which the test reads
    logging.getLogger("channel").addHandler(_OnMessage("cannot accept connections", starved.set))
    if nofile is not None:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
    socket_dir.mkdir(mode=0o700, exist_ok=True)
    channel_server = ChannelServer(
        FakeDirectory(FakeExecution()),
        socket_dir / "channel.sock",
        origin_check=False,
        max_connections_per_group=per_group,
    )
    await channel_server.start()
    admin = await asyncio.start_unix_server(_pong, str(socket_dir / "admin.sock"))
    print(json.dumps({"channel": str(channel_server.socket_path), "admin": str(admin_path(admin))}))
    sys.stdout.flush()
    hogged: list[int] = []
    while command := (await asyncio.to_thread(sys.stdin.readline)).strip():
        if command == "hog":
            with contextlib.suppress(OSError):
                while True:
                    hogged.append(os.open("/dev/null", os.O_RDONLY))
            answer = {"hogged": len(hogged)}
        elif command == "starved":
            async with asyncio.timeout(STEP_TIMEOUT_S):
                await starved.wait()
            answer = {"starved": True}
        else:
            answer = {"freed": len(hogged)}
            for fd in hogged:
                os.close(fd)
            hogged.clear()
        print(json.dumps(answer), flush=True)
    admin.close()
    await channel_server.close()


def admin_path(server: asyncio.AbstractServer) -> str:
    [sock] = server.sockets  # type: ignore[attr-defined]
    return str(sock.getsockname())


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket_dir", type=Path)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--nofile", type=int)
    parser.add_argument("--per-group", type=int, default=64)
    args = parser.parse_args(argv)
    run = serve(args.socket_dir, args.nofile, args.per_group)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(run)
    else:
        asyncio.run(run)


if __name__ == "__main__":
    assert sys.argv[1] == "serve"
    main(sys.argv[2:])
