"""Fuzzing the channel: schemathesis against the OpenAPI document, and raw frames.

Everything is sent from inside a real guest (the relay below) to a real
supervisor's socket, so the origin check stays on. The relay is a dumb pipe:
it gets bytes from the test, writes them to the socket (in chunks, with pauses
when asked) and hands back whatever the server answered. Hypothesis and
schemathesis run in the test process and drive it.

What every batch must show: no 5xx other than ``tool_error``/``result_invalid``
(and those only from a handler that really ran), no ``internal_error`` logged
by the channel, no handler called by a refused request, and a server that
still serves a normal guest afterwards with no descriptor left behind.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import requests.adapters
import schemathesis
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.failures import Failure, FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from channel.openapi import document
from supervisor import Plan, Supervisor, tool
from supervisor.executions import Execution
from tests.harness import STEP_TIMEOUT_S, Driver, Ledger, billing_plan, driven_guest, wait_until

#: Multiplies every batch's number of generated cases (1 in the suite). The
#: endurance run of docs/guarantees.md sets it, with pytest's
#: ``--hypothesis-seed`` so that the run can be repeated.
SCALE = int(os.environ.get("HOSTCALL_FUZZ_SCALE", "1"))

#: A guest that relays raw bytes to a Unix socket for the test driving it.
#: Commands are JSON lines on stdin, each run in its own thread, each answered
#: with one JSON line carrying its ``id``:
#:   {"op": "identity"} -> credential, invocation, execution, plan
#:   {"op": "frame", "chunks": [b64…], "pause_s": s, "read_s": s, "close": bool, "head": bool}
#:       -> {"response": b64, "sent": bool, "eof": bool, "error": str | null}
#: A frame's reading stops at the end of the first complete response (by its
#: Content-Length; none after a HEAD), at EOF, or after ``read_s``; ``close``
#: hangs up unread.
#: ``sent`` is false when the server hung up before it had the whole frame.
RELAY_GUEST = r"""
import base64, json, os, socket, sys, threading, time

SOCKET = os.environ["HOSTCALL_SOCKET"]
with os.fdopen(int(os.environ["HOSTCALL_CREDENTIAL_FD"]), "rb") as f:
    CREDENTIAL = f.read().decode().strip()
OUT = threading.Lock()


def complete(data, head_request):
    top, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    if top.startswith(b"HTTP/1.1 100 "):
        return complete(body, head_request)
    if head_request:
        return True
    for line in top.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return len(body) >= int(value.strip())
            except ValueError:
                return False
    return False


def frame(command):
    chunks = [base64.b64decode(c) for c in command["chunks"]]
    read_s = command.get("read_s", 5.0)
    data, eof, error, sent = b"", False, None, False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(read_s)
        sock.connect(command.get("socket", SOCKET))
        try:
            for i, chunk in enumerate(chunks):
                if i and command.get("pause_s"):
                    time.sleep(command["pause_s"])  # the dribble is the attack itself
                sock.sendall(chunk)
            sent = True
        except OSError as exc:  # the server refused early and hung up: read what it said
            error = repr(exc)
        deadline = time.monotonic() + read_s
        while not command.get("close") and not complete(data, command.get("head", False)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            got = sock.recv(65536)
            if not got:
                eof = True
                break
            data += got
    except OSError as exc:
        error = repr(exc)
    finally:
        sock.close()
    return {"response": base64.b64encode(data).decode(), "eof": eof, "error": error,
            "sent": sent}


def handle(command):
    if command["op"] == "identity":
        answer = {"credential": CREDENTIAL, "invocation": os.environ["HOSTCALL_INVOCATION"],
                  "execution": os.environ["HOSTCALL_EXECUTION"],
                  "plan": os.environ["HOSTCALL_PLAN"]}
    else:
        answer = frame(command)
    answer["id"] = command.get("id")
    with OUT:
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


for line in sys.stdin:
    command = json.loads(line)
    if command["op"] == "exit":
        handle({"op": "identity", "id": command.get("id")})
        os._exit(0)
    threading.Thread(target=handle, args=(command,), daemon=True).start()
"""

#: Codes of a 500 that are a handler's own doing (SPEC §4.3); any other 5xx is a bug.
HANDLER_ERRORS = frozenset({"tool_error", "result_invalid"})
#: How long a frame that is complete by construction may take to be answered.
ANSWER_S = 10.0
#: How long to wait for an answer to a frame that may leave the server waiting.
LINGER_S = 0.3


# -- the relay guest ------------------------------------------------------------


@dataclass(frozen=True)
class HttpAnswer:
    """One HTTP response as the relay read it off the socket."""

    status: int
    reason: str
    version: int
    headers: list[tuple[str, str]]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str:
        return next((v for k, v in self.headers if k.lower() == name.lower()), "")


def parse_answer(raw: bytes, *, head: bool = False) -> HttpAnswer | None:
    """The first HTTP response in ``raw``, or None when there is none (or half of one).

    Its own small parser: the server answers in the version it was asked in
    (``HTTP/2.0 400 …`` to a request line claiming 2.0), which http.client refuses.
    The answer to a ``head`` request has no body, whatever its Content-Length says.
    """
    top, sep, rest = raw.partition(b"\r\n\r\n")
    if not sep:
        return None
    status_line, *lines = top.decode("latin-1").split("\r\n")
    version, _, status_reason = status_line.partition(" ")
    status, _, reason = status_reason.partition(" ")
    if not version.startswith("HTTP/") or not status.isdigit():
        return None
    if status.startswith("1"):  # 100 Continue: the answer follows
        return parse_answer(rest, head=head)
    headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines)]
    length = "0" if head else next((v for k, v in headers if k.lower() == "content-length"), None)
    if length is None or not length.isdigit() or len(rest) < int(length):
        return None
    number = 11 if version == "HTTP/1.1" else 10
    return HttpAnswer(int(status), reason, number, headers, rest[: int(length)])


class RelayDriver(Driver):
    """:class:`Driver` for the relay, whose answer lines can be far longer than
    asyncio's 64 KiB line limit (a relayed OpenAPI document, base64-encoded)."""

    async def _read(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        buffer = b""
        try:
            while chunk := await stdout.read(1 << 16):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    answer = json.loads(line)
                    waiter = self._waiting.pop(answer.pop("id", None), None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(answer)
        finally:
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(EOFError("the guest closed its stdout"))


@dataclass
class Relay:
    """The test's handle on a relay guest."""

    driver: Driver
    loop: asyncio.AbstractEventLoop
    identity: dict[str, str] = field(default_factory=dict)

    @property
    def execution(self) -> Execution:
        return self.driver.execution

    def identity_lines(self, **override: str) -> bytes:
        """The four identity headers of this guest, as raw header lines."""
        values = {
            "Authorization": f"Bearer {self.identity['credential']}",
            "Hostcall-Invocation": self.identity["invocation"],
            "Hostcall-Execution": self.identity["execution"],
            "Hostcall-Plan": self.identity["plan"],
            **override,
        }
        return b"".join(f"{k}: {v}\r\n".encode() for k, v in values.items())

    async def frame(
        self,
        chunks: list[bytes],
        *,
        pause_s: float = 0.0,
        read_s: float = ANSWER_S,
        close: bool = False,
        socket_path: str | None = None,
    ) -> tuple[bytes, bool]:
        """Send ``chunks`` on a fresh connection from inside the guest.

        Returns what came back, and whether the server took the whole frame.
        """
        command: dict[str, Any] = {
            "op": "frame",
            "chunks": [base64.b64encode(c).decode() for c in chunks],
            "pause_s": pause_s,
            "read_s": read_s,
            "close": close,
            "head": chunks[0].startswith(b"HEAD "),
        }
        if socket_path is not None:
            command["socket"] = socket_path
        answer = await self.driver.send(command)
        return base64.b64decode(answer["response"]), bool(answer["sent"])

    def frame_from_thread(self, chunks: list[bytes], **options: Any) -> tuple[bytes, bool]:
        """:meth:`frame` for code running in a worker thread (hypothesis, schemathesis)."""
        future = asyncio.run_coroutine_threadsafe(self.frame(chunks, **options), self.loop)
        return future.result(timeout=STEP_TIMEOUT_S * 4)


@contextlib.asynccontextmanager
async def relay_guest(sup: Supervisor, plan: Plan) -> AsyncIterator[Relay]:
    """Run the relay as a guest of ``sup`` and yield the test's handle on it."""
    started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            plan,
            [sys.executable, "-c", RELAY_GUEST],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            done, _ = await asyncio.wait([started, run], return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            run.result()
        relay = Relay(RelayDriver(started.result()), asyncio.get_running_loop())
        relay.identity = await relay.driver.send({"op": "identity"})
        yield relay
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
            await relay.driver.send({"op": "exit"})
        await relay.driver.close()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await run
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run


# -- what every batch checks ------------------------------------------------------


def open_fds(sup: Supervisor) -> int:
    """Descriptors of this process, which is the supervisor, but the receipt
    files its store keeps open for appending (at most ``FILES_KEPT``: a file is
    opened when its invocation's first receipt is written, whenever that is)."""
    receipts = str(sup.state.receipts_dir)
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, now closed
            continue
        count += not target.startswith(receipts)
    return count


def server_faults(records: list[logging.LogRecord]) -> list[str]:
    """Errors hostcall itself logged: an ``internal_error`` answer, a crashed task.

    aiohttp's own "Error handling request" lines for frames its parser
    refuses are not counted here (they are answered 400 without reaching us).
    """
    return [
        f"{r.name}: {r.getMessage()} {r.exc_text or ''}"
        for r in records
        if r.levelno >= logging.ERROR and r.name.split(".")[0] in ("channel", "supervisor")
    ]


def fault_of(answer: HttpAnswer, *, head: bool = False) -> str | None:
    """Why ``answer`` breaks SPEC §4.3 for a request that must run no handler, if it does."""
    if answer.status >= 500:
        return f"{answer.status} {answer.body[:300]!r}"
    if head or not answer.header("Content-Type").startswith("application/json"):
        return None
    try:
        body = answer.json
    except ValueError:
        return f"a JSON content type with a body that is not JSON: {answer.body[:300]!r}"
    if not isinstance(body, dict):
        return f"a JSON answer that is not an object: {answer.body[:300]!r}"
    if answer.status == 200 and "effect" not in body:
        return None  # GET /v1/plan or /v1/openapi.json
    if "status" not in body or "effect" not in body:
        return f"a JSON answer without status and effect: {answer.body[:300]!r}"
    if body["effect"] in ("executed", "failed", "unknown"):
        return f"a request that must run nothing got {answer.body[:300]!r}"
    return None


def _code_of(answer: HttpAnswer, *, head: bool) -> str:
    if head or not answer.header("Content-Type").startswith("application/json"):
        return "http-parser" if answer.status == 400 else f"no body ({answer.status})"
    try:
        body = answer.json
        return str((body.get("error") or {}).get("code") or body.get("status") or "document")
    except (ValueError, AttributeError):
        return "not JSON"


@dataclass
class Batch:
    """What one batch of fuzz cases saw."""

    sent: int = 0
    answered: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    #: Error codes of the answers; ``http-parser`` for aiohttp's own 400s.
    codes: Counter[str] = field(default_factory=Counter)
    faults: list[str] = field(default_factory=list)

    def see(self, frame: bytes, raw: bytes, *, must_answer: bool) -> None:
        self.sent += 1
        head = frame.startswith(b"HEAD ")
        answer = parse_answer(raw, head=head)
        if answer is None:
            if must_answer:
                self.faults.append(f"no answer to a complete frame: {frame[:300]!r}")
            return
        self.answered += 1
        self.statuses[answer.status] += 1
        self.codes[_code_of(answer, head=head)] += 1
        fault = fault_of(answer, head=head)
        if fault is not None:
            self.faults.append(f"{fault} for {frame[:300]!r}")


async def assert_still_serving(guest: Driver, ledger: Ledger, call_id: str) -> None:
    """A normal call from another guest is still answered, and runs its handler once."""
    reply = await guest.call(call_id, "lookup", {"account": call_id})
    assert reply["status"] == 200, reply
    assert reply["body"]["effect"] == "executed"
    assert ledger.args.count(("lookup", {"account": call_id})) == 1


# -- raw frames -------------------------------------------------------------------

_METHODS = st.sampled_from([b"POST", b"GET", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH"])
_BAD_METHODS = st.sampled_from(
    [b"TRACE", b"CONNECT", b"PRI", b"get", b"G\x00T", b"POST\x7f", b"", b"\xff\xfe"]
) | st.binary(max_size=12)
_PATHS = st.sampled_from(
    [
        b"/v1/calls",
        b"/v1/calls/c1",
        b"/v1/calls/c1?wait=0",
        b"/v1/calls/c1?wait=1e309",
        b"/v1/calls/c1?wait=0x1&wait=2",
        b"/v1/calls/%00",
        b"/v1/calls/%ff%fe",
        b"/v1/calls/..%2f..%2fetc%2fpasswd",
        b"/v1/plan",
        b"/v1/openapi.json",
        b"/../../../etc/passwd",
        b"http://evil.example/v1/plan",
        b"/v1/calls/" + b"x" * 9000,
        b"/v1/plan?" + b"a=1&" * 2000,
    ]
)
_BAD_PATHS = st.sampled_from([b"*", b"", b"/v1/\xff\xfe", b"/v1/ca lls"]) | st.binary(max_size=64)
_VERSIONS = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"])
_BAD_VERSIONS = st.sampled_from([b"HTTP/2.0", b"HTTP/0.9", b"http/1.1", b"HTTP/1.1\x00", b""])
_HEADER_NAMES = st.sampled_from(
    [
        *(b"X-A", b"Host", b"Content-Type", b"Expect", b"Upgrade", b"Connection"),
        *(b"Authorization", b"Hostcall-Execution", b"Hostcall-Plan", b"Transfer-Encoding"),
        *(b"X-\x01", b"X A", b""),
    ]
)
_PRINTABLE = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
_HEADER_VALUES = st.one_of(
    _PRINTABLE.map(str.encode),
    st.binary(max_size=40),
    st.sampled_from([b"100-continue", b"websocket", b"keep-alive", b"Bearer \x00", b"a\r\n b"]),
    st.sampled_from([8190, 8191, 100_000]).map(lambda n: b"v" * n),
)
#: Identity header sets: the guest's own (so the body gets read), none, or broken.
_IDENTITIES = st.sampled_from(
    ["own", "own", "own", "none", "wrong_credential", "other_execution", "no_plan"]
)
#: At most one part of the frame is broken, so that most frames get far enough
#: to meet the identity checks and the body parser.
_BREAK = st.sampled_from(["nothing", "nothing", "nothing", "method", "path", "version"])


def _identity(relay: Relay, which: str) -> bytes:
    if which == "own":
        return relay.identity_lines()
    if which == "wrong_credential":
        return relay.identity_lines(Authorization="Bearer " + "A" * 43)
    if which == "other_execution":
        return relay.identity_lines(**{"Hostcall-Execution": "exe_nobody"})
    if which == "no_plan":
        return relay.identity_lines(**{"Hostcall-Plan": ""})
    return b""


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


#: Bodies no handler may ever run for: bad JSON, bad UTF-8, deep nesting,
#: calls of a tool outside the plan, arguments the schema refuses.
_BODIES = st.one_of(
    st.binary(max_size=200),
    st.sampled_from(
        [
            b"",
            b"{",
            b'{"call_id": "c1", "tool": "\xff\xfe", "args": {}}',
            b'{"call_id": "c\xc3\x28", "tool": "lookup", "args": {"account": "a"}}',
            b'{"call_id": "c1", "tool": "lookup", "args": {"account": "\xed\xa0\x80"}}',
            b'{"call_id": "c1", "tool": "lookup", "args": {"account": 1e999999}}',
            b'{"call_id": "c1", "tool": "lookup", "args": {"account": "a", "account": "b"}}',
            b'{"call_id": "c1", "tool": "charge", "args": {"cents": -1e308}}',
            b'{"call_id": "c1", "tool": "delete_everything", "args": {}}',
            b'{"call_id": "c1", "tool": "lookup", "args": {"account": ' + _nested(500) + b"}}",
            b'{"call_id": "c1", "tool": "lookup", "args": ' + _nested(100_000) + b"}",
            _nested(100_000),
            b"{" * 50_000,
            b'{"a":' * 20_000,
            b'"' + b"\\u" * 10_000,
            b"1" * 100_000,
        ]
    ),
    st.builds(
        lambda account, cents: json.dumps(
            {"call_id": "c1", "tool": "charge", "args": {"account": account, "cents": cents}}
        ).encode(),
        st.one_of(st.integers(), st.floats(allow_nan=False), st.none(), st.lists(st.text())),
        st.one_of(st.text(), st.none(), st.booleans()),
    ),
)
_CONTENT_LENGTH = st.sampled_from(
    ["honest", "honest", "honest", "honest", "honest", "absent", "lie", "junk", "twice"]
)


@st.composite
def raw_frames(draw: st.DrawFn, relay: Relay) -> tuple[bytes, bool]:
    """One request as bytes, and whether it is complete (the server must answer it)."""
    broken = draw(_BREAK)
    method = draw(_BAD_METHODS if broken == "method" else _METHODS)
    path = draw(_BAD_PATHS if broken == "path" else _PATHS)
    version = draw(_BAD_VERSIONS if broken == "version" else _VERSIONS)
    line = b" ".join(part for part in (method, path, version) if part) + b"\r\n"
    headers = b"Host: hostcall\r\nConnection: close\r\n" + _identity(relay, draw(_IDENTITIES))
    if draw(st.integers(0, 3)):
        headers += b"Content-Type: application/json\r\n"
    for name, value in draw(st.lists(st.tuples(_HEADER_NAMES, _HEADER_VALUES), max_size=2)):
        headers += name + b": " + value + b"\r\n"
    body = draw(_BODIES)
    length = draw(_CONTENT_LENGTH)
    complete = length == "honest"
    if length == "honest":
        headers += b"Content-Length: %d\r\n" % len(body)
    elif length == "lie":
        headers += b"Content-Length: %d\r\n" % draw(st.sampled_from([len(body) + 1, 10**12]))
    elif length == "junk":
        headers += b"Content-Length: " + draw(st.sampled_from([b"-1", b"abc", b"1e3", b" "]))
        headers += b"\r\n"
    elif length == "twice":
        headers += b"Content-Length: %d\r\nContent-Length: %d\r\n" % (len(body), len(body) + 1)
    else:
        body = b""
    return line + headers + b"\r\n" + body, complete


_CONTENT_TYPES = st.sampled_from(
    [
        b"application/json",
        b"application/json; charset=utf-8",
        b"application/json; charset=latin-1",
        b"Application/JSON",
        b"application/json, text/plain",
        b"text/plain",
        b"application/x-www-form-urlencoded",
        b"multipart/form-data; boundary=x",
        b"",
    ]
)


@st.composite
def hostile_requests(draw: st.DrawFn, relay: Relay) -> tuple[bytes, bool]:
    """Well-formed HTTP whose identity, content type and body are hostile."""
    method, path = draw(
        st.sampled_from(
            [(b"POST", b"/v1/calls")] * 6
            + [(b"GET", b"/v1/calls/c1"), (b"GET", b"/v1/plan"), (b"PUT", b"/v1/calls")]
        )
    )
    headers = b"Host: hostcall\r\nConnection: close\r\n" + _identity(relay, draw(_IDENTITIES))
    if draw(st.integers(0, 4)):
        content_type = draw(st.sampled_from([b"application/json"] * 4) | _CONTENT_TYPES)
        headers += b"Content-Type: " + content_type + b"\r\n"
    for name in draw(st.lists(st.sampled_from([b"X-A", b"Accept", b"User-Agent"]), max_size=2)):
        headers += name + b": " + draw(_PRINTABLE).encode() + b"\r\n"
    body = draw(_BODIES)
    if draw(st.integers(0, 4)):
        return (
            method
            + b" "
            + path
            + b" HTTP/1.1\r\n"
            + headers
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body,
            True,
        )
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    return (
        method
        + b" "
        + path
        + b" HTTP/1.1\r\n"
        + headers
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunked,
        True,
    )


@st.composite
def framing_attacks(draw: st.DrawFn, relay: Relay) -> tuple[bytes, bool]:
    """Request smuggling and chunked-encoding tricks on an authenticated POST."""
    good = b'{"call_id": "c1", "tool": "delete_everything", "args": {}}'
    head = (
        b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\nConnection: close\r\n"
        + relay.identity_lines()
        + b"Content-Type: application/json\r\n"
    )
    kind = draw(st.sampled_from(["chunked", "bad_chunk", "te_and_cl", "te_junk", "huge_chunk"]))
    if kind == "chunked":
        cut = draw(st.integers(min_value=1, max_value=len(good) - 1))
        body = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (cut, good[:cut], len(good) - cut, good[cut:])
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + body, True
    if kind == "bad_chunk":
        size = draw(st.sampled_from([b"zz", b"-1", b"0x10", b"", b"1;" + b"e" * 9000]))
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n0\r\n\r\n", True
    if kind == "te_and_cl":
        return (
            head + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + good,
            True,
        )
    if kind == "te_junk":
        coding = draw(st.sampled_from([b"gzip", b"chunked, chunked", b"identity", b"\x00"]))
        return head + b"Transfer-Encoding: " + coding + b"\r\n\r\n" + good, False
    # A chunk that declares far more than the body limit.
    return head + b"Transfer-Encoding: chunked\r\n\r\nffffffffff\r\n" + good, False


def seed_frames(relay: Relay) -> list[tuple[bytes, bool]]:
    """Frames every run sends, whatever the generators draw: the attacks the
    issue names, each reaching the part of the channel it is meant for."""

    def post(body: bytes, *, length: int | None = None, extra: bytes = b"") -> bytes:
        return (
            b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\nConnection: close\r\n"
            + relay.identity_lines()
            + b"Content-Type: application/json\r\n"
            + extra
            + b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length)
            + body
        )

    return [
        (post(b'{"call_id": "c1", "tool": "\xff", "args": {}}'), True),
        (post(_nested(100_000)), True),
        (post(b'{"call_id": "c1", "tool": "lookup", "args": ' + _nested(100_000) + b"}"), True),
        (
            post(
                b'{"call_id": "c1", "tool": "lookup", "args": {"account": ' + _nested(500) + b"}}"
            ),
            True,
        ),
        (post(b'{"call_id": "c1", "tool": "charge", "args": {"account": 1, "cents": "x"}}'), True),
        (post(b"{}", length=10**12), True),
        (post(b"{}", extra=b"X-Big: " + b"v" * 100_000 + b"\r\n"), True),
        (post(b"{}", extra=b"X-\x01Bad: y\r\n"), True),
        (b"\x00\x01\x02 garbage\r\n\r\n", True),
    ]


def run_frames(
    relay: Relay,
    strategy: st.SearchStrategy[tuple[bytes, bool]],
    examples: int,
    seeds: list[tuple[bytes, bool]],
) -> Batch:
    """Send ``seeds``, then ``examples`` generated frames, one connection each,
    from a worker thread."""
    batch = Batch()
    for frame, complete in seeds:
        raw, sent = relay.frame_from_thread([frame], read_s=ANSWER_S)
        batch.see(frame, raw, must_answer=complete and sent)

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def send(case: tuple[bytes, bool]) -> None:
        frame, complete = case
        raw, sent = relay.frame_from_thread([frame], read_s=ANSWER_S if complete else LINGER_S)
        # A server that refused the frame early and hung up may have lost its
        # answer to the reset; a frame it took whole must be answered.
        batch.see(frame, raw, must_answer=complete and sent)

    send()
    return batch


async def test_generated_raw_frames_get_no_5xx_run_no_handler_and_leave_the_server_serving(
    sup: Supervisor, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as witness, relay_guest(sup, plan) as relay:
        await assert_still_serving(witness, ledger, "warm")
        fds = open_fds(sup)
        runs = sum(ledger.runs.values())
        batches = {}
        for name, strategy, examples, seeds in (
            ("malformed request line and headers", raw_frames(relay), 250 * SCALE, []),
            (
                "hostile identity, content type and body",
                hostile_requests(relay),
                250 * SCALE,
                seed_frames(relay),
            ),
            ("framing", framing_attacks(relay), 40 * SCALE, []),
        ):
            batch = await asyncio.to_thread(run_frames, relay, strategy, examples, seeds)
            batches[name] = batch
            print(f"raw frames, {name}: {batch.sent} sent, {batch.answered} answered")
            print(f"  statuses {dict(batch.statuses)}\n  codes {dict(batch.codes)}")
            assert batch.faults == [], f"{name}: {batch.faults[:5]}"
            assert sum(ledger.runs.values()) == runs, "a refused frame ran a handler"
            await assert_still_serving(witness, ledger, f"after_{len(batches)}")
            runs = sum(ledger.runs.values())
            closed = "the server closed every fuzz connection"
            await wait_until(lambda: open_fds(sup) <= fds, closed)
        records = await sup.store.calls(relay.execution.invocation_id)
    assert records == []
    assert server_faults(caplog.records) == []
    malformed = batches["malformed request line and headers"]
    hostile = batches["hostile identity, content type and body"]
    assert malformed.sent + hostile.sent >= 450
    assert malformed.codes["http-parser"] > 0
    for code in ("unauthenticated", "bad_request", "unsupported_media_type", "invalid_arguments"):
        assert hostile.codes[code] > 0, code


# -- fixed attacks the generators only reach by luck ---------------------------------


async def test_a_slowloris_dribble_does_not_hold_up_other_guests(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as witness, relay_guest(sup, plan) as relay:
        await assert_still_serving(witness, ledger, "warm")
        fds = open_fds(sup)

        def dribbled(n: int) -> list[bytes]:
            body = b'{"call_id": "dribbled_%d", "tool": "lookup", "args": {"account": "slow"}}' % n
            request = (
                b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\nConnection: close\r\n"
                + relay.identity_lines()
                + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body
            )
            return [request[i : i + 12] for i in range(0, len(request), 12)]

        # 16 connections, each sending its request 12 bytes every 50 ms (~2 s).
        dribblers = [
            asyncio.ensure_future(relay.frame(dribbled(n), pause_s=0.05, read_s=STEP_TIMEOUT_S))
            for n in range(16)
        ]
        # Meanwhile another guest's calls are answered at once, one after another.
        latencies = []
        loop = asyncio.get_running_loop()
        while not all(d.done() for d in dribblers) and len(latencies) < 200:
            started = loop.time()
            await assert_still_serving(witness, ledger, f"during_{len(latencies)}")
            latencies.append(loop.time() - started)
        answers = [parse_answer(raw) for raw, _ in await asyncio.gather(*dribblers)]
        # One byte at a time, then silence: the server must not wait for it forever
        # before answering others (it may keep the connection open; we hang up).
        await relay.frame([b"POST /v1/calls HTTP/1.1\r\nHost: h"], close=True)
        await assert_still_serving(witness, ledger, "after")
        await wait_until(lambda: open_fds(sup) <= fds, "the server closed the dribbled connections")
    print(f"slowloris: {len(latencies)} calls meanwhile, slowest {max(latencies) * 1e3:.1f} ms")
    assert len(latencies) >= 5
    assert max(latencies) < 2.0, latencies
    assert [a.json["effect"] if a else None for a in answers] == ["executed"] * 16
    assert ledger.runs["lookup"] == 1 + len(latencies) + 16 + 1


async def test_a_huge_content_length_with_a_tiny_body_is_refused_before_the_body_is_read(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with relay_guest(sup, billing_plan(ledger)) as relay:
        head = (
            b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\n"
            + relay.identity_lines()
            + b"Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{}"
        )
        raw, _ = await relay.frame([head])
    answer = parse_answer(raw)
    assert answer is not None
    assert answer.status == 413
    assert answer.json["error"]["code"] == "payload_too_large"
    assert ledger.runs == {}


async def test_a_guest_that_hangs_up_in_the_middle_of_its_body_is_not_an_internal_error(
    sup: Supervisor, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """The guest's connection closes after half the body it announced: nothing to
    answer, nothing ran, and nothing for the operator to chase as a server fault."""
    async with (
        driven_guest(sup, billing_plan(ledger)) as witness,
        relay_guest(sup, billing_plan(ledger)) as relay,
    ):
        body = b'{"call_id": "c1", "tool": "lookup", "args": {"account": "a"}}'
        head = (
            b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\n"
            + relay.identity_lines()
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        )
        await relay.frame([head + body[:10]], close=True)
        # Bounded: the server notices the hang-up (and logs whatever it logs) at once.
        await assert_still_serving(witness, ledger, "after")
        records = await sup.store.calls(relay.execution.invocation_id)
    assert records == []
    assert ledger.runs == {"lookup": 1}
    assert server_faults(caplog.records) == []


async def test_a_frame_the_http_parser_refuses_gets_a_400_and_nothing_runs(
    sup: Supervisor, ledger: Ledger
) -> None:
    """A frame aiohttp's HTTP parser cannot read never reaches hostcall's code:
    aiohttp answers 400 itself, as text/plain (a documented deviation from
    SPEC §4.3's JSON body, see docs/protocol.md), and closes the connection."""
    async with relay_guest(sup, billing_plan(ledger)) as relay:
        answers = [
            parse_answer((await relay.frame([frame]))[0])
            for frame in (
                b"\x00\x01garbage\r\n\r\n",
                b"GET /v1/plan HTTP/1.1\r\nHost: h\r\nX-\x01Bad: y\r\n\r\n",
                b"GET /v1/plan HTTP/1.1\r\nHost: h\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
            )
        ]
    for answer in answers:
        assert answer is not None
        assert answer.status == 400
    assert ledger.runs == {}


async def test_an_expect_header_that_is_not_utf8_is_refused_not_answered_with_a_500(
    sup: Supervisor, ledger: Ledger
) -> None:
    """aiohttp handles ``Expect`` before any middleware; a value it cannot
    echo back must still not become a 5xx (found by the raw-frame fuzzer)."""
    async with relay_guest(sup, billing_plan(ledger)) as relay:
        answers = []
        for identity in (relay.identity_lines(), b""):
            frame = (
                b"POST /v1/calls HTTP/1.1\r\nHost: hostcall\r\nConnection: close\r\n"
                + identity
                + b"Content-Type: application/json\r\nExpect: \xff\r\nContent-Length: 2\r\n\r\n{}"
            )
            answers.append(parse_answer((await relay.frame([frame]))[0]))
    for answer in answers:
        assert answer is not None
        assert 400 <= answer.status < 500, answer
    assert ledger.runs == {}


@pytest.mark.parametrize(
    ("head", "identified"),
    [
        (b"GET /v1/anything HTTP/1.1\r\n", 404),
        (b"DELETE /v1/plan HTTP/1.1\r\n", 405),
        (b"POST /v1/calls HTTP/1.1\r\nExpect: something-else\r\n", 400),
        (b"POST /v1/calls HTTP/1.1\r\nExpect: 100-continue\r\n", 200),
    ],
    ids=["unknown path", "wrong method", "unknown expectation", "100-continue"],
)
async def test_identity_comes_before_the_route_and_any_expectation(
    sup: Supervisor, ledger: Ledger, head: bytes, identified: int
) -> None:
    """SPEC §4.3: identity checks come before everything else. Without one,
    an unknown path, a wrong method or an ``Expect`` header gets 401
    ``unauthenticated`` — and no ``100 Continue`` inviting its body; with one,
    each gets its own answer."""
    body = b'{"call_id": "e1", "tool": "lookup", "args": {"account": "a"}}'
    async with relay_guest(sup, billing_plan(ledger)) as relay:
        raw = {}
        for identity in (b"", relay.identity_lines()):
            frame = (
                head
                + b"Host: hostcall\r\nConnection: close\r\n"
                + identity
                + b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            raw[bool(identity)] = (await relay.frame([frame]))[0]
    anonymous, identified_answer = parse_answer(raw[False]), parse_answer(raw[True])
    assert anonymous is not None and identified_answer is not None
    assert (anonymous.status, anonymous.json["error"]["code"]) == (401, "unauthenticated")
    assert not raw[False].startswith(b"HTTP/1.1 100")
    assert identified_answer.status == identified
    assert raw[True].startswith(b"HTTP/1.1 100 Continue") == (b"100-continue" in head)
    assert ledger.runs == ({"lookup": 1} if identified == 200 else {})


@pytest.mark.parametrize("depth", [200, 256, 600])
async def test_arguments_nested_too_deep_for_a_json_typed_tool_are_refused_not_an_internal_error(
    sup: Supervisor, ledger: Ledger, caplog: pytest.LogCaptureFixture, depth: int
) -> None:
    """Deep nesting that :mod:`json` parses but the argument model cannot
    serialize must be refused as the guest's fault (4xx, nothing ran)."""
    ran: list[int] = []

    @tool(reversibility="reversible")
    def echo(payload: dict[str, Any]) -> dict[str, Any]:
        ran.append(1)
        return payload

    plan = Plan([*billing_plan(ledger).tools.values(), echo], name="deep")
    async with driven_guest(sup, plan) as guest:
        nested = "[" * depth + "]" * depth
        reply = await guest.request(
            raw='{"call_id": "deep", "tool": "echo", "args": {"payload": {"a": ' + nested + "}}}"
        )
        await assert_still_serving(guest, ledger, "after")
    assert server_faults(caplog.records) == []
    if reply["status"] == 200:
        assert depth < 250
        assert ran == [1]
    else:
        assert reply["status"] in (400, 422), reply
        assert reply["body"]["error"]["code"] in ("bad_request", "invalid_arguments")
        assert reply["body"]["effect"] == "none"
        assert ran == []


# -- schemathesis against the OpenAPI document -----------------------------------------


def http_bytes(request: requests.PreparedRequest) -> bytes:
    """``request`` as HTTP/1.1 bytes, one request per connection."""
    lines = [f"{request.method} {request.path_url} HTTP/1.1", "Host: hostcall"]
    body = request.body or b""
    if isinstance(body, str):
        body = body.encode()
    for name, value in request.headers.items():
        if name.lower() not in ("host", "connection", "content-length"):
            lines.append(f"{name}: {value}")
    if body or request.method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    head = "\r\n".join(lines) + "\r\n\r\n"
    try:
        encoded = head.encode("latin-1")
    except UnicodeEncodeError:
        encoded = head.encode("utf-8", "surrogateescape")
    return encoded + body


class RelayAdapter(requests.adapters.BaseAdapter):
    """A requests transport whose every request is made by the relay guest."""

    def __init__(self, relay: Relay, seen: Callable[[HttpAnswer], None]) -> None:
        super().__init__()
        self._relay = relay
        self._seen = seen
        self._build = requests.adapters.HTTPAdapter()

    def send(  # type: ignore[override]
        self, request: requests.PreparedRequest, **kwargs: Any
    ) -> requests.Response:
        raw, sent = self._relay.frame_from_thread([http_bytes(request)])
        answer = parse_answer(raw, head=request.method == "HEAD")
        if answer is None:
            raise requests.ConnectionError(f"no answer (sent whole: {sent})", request=request)
        self._seen(answer)
        headers = urllib3.HTTPHeaderDict()
        for name, value in answer.headers:
            headers.add(name, value)
        response = urllib3.HTTPResponse(
            body=io.BytesIO(answer.body),
            headers=headers,
            status=answer.status,
            reason=answer.reason,
            version=answer.version,
            preload_content=False,
            decode_content=False,
            request_method=request.method,
        )
        return self._build.build_response(request, response)

    def close(self) -> None:
        self._build.close()


def plan_aware(doc: dict[str, Any], plan_view: dict[str, Any]) -> dict[str, Any]:
    """The document with ``CallRequest`` narrowed to the plan's tools and their
    input schemas, and call ids drawn from a few dozen, so that generated calls
    run, collide, replay and reuse ids. Responses keep their own schemas."""
    doc = json.loads(json.dumps(doc))
    call_ids = {"type": "string", "enum": [f"c{i}" for i in range(40)]}
    doc["components"]["schemas"]["CallRequest"] = {
        "oneOf": [
            {
                "type": "object",
                "required": ["call_id", "tool", "args"],
                "additionalProperties": False,
                "properties": {
                    "call_id": call_ids,
                    "tool": {"const": t["name"]},
                    "args": t["input_schema"],
                },
            }
            for t in plan_view["tools"]
        ]
    }
    return doc


@dataclass
class Fuzzed:
    """What the schemathesis phases saw, all of them together."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    #: Responses that say a handler ran (``executed`` or ``failed``), per tool.
    ran: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def see(self, answer: HttpAnswer) -> None:
        self.statuses[answer.status] += 1
        try:
            body = answer.json
        except ValueError:
            self.failures.append(f"not JSON: {answer.status} {answer.body[:300]!r}")
            return
        if not isinstance(body, dict):
            self.failures.append(f"not an object: {answer.body[:300]!r}")
            return
        if body.get("effect") in ("executed", "failed"):
            self.ran[str(body.get("tool"))] += 1
        code = (
            (body.get("error") or {}).get("code") if isinstance(body.get("error"), dict) else None
        )
        self.codes[str(code or body.get("effect") or "document")] += 1
        if answer.status >= 500 and code not in HANDLER_ERRORS:
            self.failures.append(f"server error: {answer.status} {answer.body[:300]!r}")
        if code in HANDLER_ERRORS and body.get("effect") not in ("failed", "executed", "replayed"):
            self.failures.append(f"a handler error with effect {body.get('effect')!r}")


#: Answers conform to the document: status, content type and body schema.
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz_one_operation(
    session: requests.Session,
    label: str,
    strategy: st.SearchStrategy[schemathesis.Case],
    examples: int,
    checks: list[Any],
    fuzzed: Fuzzed,
) -> None:
    """Send ``examples`` cases of one operation and run the checks on each answer."""

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def send(case: schemathesis.Case) -> None:
        fuzzed.cases[label] += 1
        try:
            response = case.call(session=session, base_url="http://hostcall")
        except requests.RequestException as exc:
            fuzzed.failures.append(f"{label}: transport: {exc}")
            return
        try:
            case.validate_response(response, checks=checks)
        except (Failure, FailureGroup) as exc:
            fuzzed.failures.append(f"{label}: {exc}")

    send()


def run_schemathesis(
    relay: Relay,
    doc: dict[str, Any],
    phase: str,
    identity: dict[str, str] | None,
    examples: Callable[[str], int],
    fuzzed: Fuzzed,
) -> None:
    """Generate, send and check cases for every operation of ``doc`` in both modes.

    ``identity`` fixes the identity headers to the guest's own (so cases get
    past identity and exercise the rest); None leaves them to the generator.
    """
    session = requests.Session()
    session.mount("http://", RelayAdapter(relay, fuzzed.see))
    schema = schemathesis.openapi.from_dict(doc)
    for result in schema.get_all_operations():
        operation = result.ok()
        if phase == "plan-aware" and operation.path != "/v1/calls":
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if (
                mode is GenerationMode.NEGATIVE
                and identity is not None
                and not (operation.body or operation.path_parameters or operation.query)
            ):
                continue  # its only parameters are the fixed identity headers
            label = f"{phase} {mode.value} {operation.method.upper()} {operation.path}"
            strategy = operation.as_strategy(generation_mode=mode, headers=identity)
            # Invalid data must be refused (4xx) - but the plan-aware document is
            # narrower than the server (40 call ids; lax coercion of arguments),
            # so there "negative" cases may be valid ones.
            checks = (
                CONFORMANCE if phase == "plan-aware" else [*CONFORMANCE, negative_data_rejection]
            )
            fuzz_one_operation(session, label, strategy, examples(operation.path), checks, fuzzed)
    session.close()


@pytest.fixture
def fuzz_ledger() -> Ledger:
    ledger = Ledger()
    ledger.release.set()
    return ledger


async def test_schemathesis_cases_from_the_openapi_document_get_conforming_answers_and_no_5xx(
    sup: Supervisor, fuzz_ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = fuzz_ledger
    base = billing_plan(ledger).tools

    @tool(reversibility="reversible")
    def echo(payload: dict[str, Any]) -> dict[str, Any]:
        ledger.record("echo")
        return payload

    # Tools whose every run answers executed or failed (no ambiguous ones), so
    # that runs can be counted from the answers.
    plan = Plan(
        [base[name] for name in ("charge", "lookup", "broken", "bad_result")] + [echo],
        name="fuzz",
    )
    fuzzed = Fuzzed()
    async with driven_guest(sup, plan) as witness, relay_guest(sup, plan) as relay:
        await assert_still_serving(witness, ledger, "warm")
        ledger.runs.clear()
        fds = open_fds(sup)
        own = {
            "Authorization": f"Bearer {relay.identity['credential']}",
            "Hostcall-Invocation": relay.identity["invocation"],
            "Hostcall-Execution": relay.identity["execution"],
            "Hostcall-Plan": relay.identity["plan"],
        }
        served = await relay.frame(
            [b"GET /v1/plan HTTP/1.1\r\nHost: h\r\n" + relay.identity_lines() + b"\r\n"]
        )
        plan_answer = parse_answer(served[0])
        assert plan_answer is not None
        doc = document()
        phases: list[tuple[str, dict[str, Any], dict[str, str] | None, Callable[[str], int]]] = [
            ("unauthenticated", doc, None, lambda path: 20 * SCALE),
            (
                "authenticated",
                doc,
                own,
                lambda path: (60 if path == "/v1/calls" else 25) * SCALE,
            ),
            ("plan-aware", plan_aware(doc, plan_answer.json), own, lambda path: 150 * SCALE),
        ]
        for phase, phase_doc, identity, examples in phases:
            await asyncio.to_thread(
                run_schemathesis, relay, phase_doc, phase, identity, examples, fuzzed
            )
        await assert_still_serving(witness, ledger, "after")
        await wait_until(lambda: open_fds(sup) <= fds, "the server closed every fuzz connection")
    assert fuzzed.failures == [], "\n\n".join(fuzzed.failures[:5])
    assert server_faults(caplog.records) == []
    # At most once, and `effect` tells the truth: every handler run is one
    # answer that says executed or failed, and no answer says so falsely.
    ran = Counter(dict(ledger.runs))
    ran["lookup"] -= 1  # the witness's own call after the fuzzing
    assert +ran == +fuzzed.ran
    print(f"schemathesis: {sum(fuzzed.cases.values())} cases, statuses {dict(fuzzed.statuses)}")
    print(f"  codes/effects {dict(fuzzed.codes)}")
    for label, count in sorted(fuzzed.cases.items()):
        print(f"  {count:4d}  {label}")
    assert sum(fuzzed.cases.values()) >= 500
    assert fuzzed.statuses[401] > 0
    assert fuzzed.statuses[200] > 0
    assert fuzzed.statuses[422] > 0
