"""The channel: HTTP/1.1 over one Unix socket, serving every execution (docs/protocol.md).

Each connection is attributed to its guest and counted when it is accepted
(:mod:`channel.connections`). Each request is authenticated first (headers
only, before the body is read), then framed, then handed to the execution's
broker. Every answer, including the channel's own refusals, is a JSON reply
built by :class:`CallReply`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import stat
from pathlib import Path
from typing import Final, cast

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from channel.connections import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS_PER_GROUP,
    ChannelConnection,
    ChannelListener,
    Slot,
    default_max_connections,
)
from channel.errors import Refusal
from channel.identity import authenticate, check_origin, spells_credential
from channel.openapi import OPENAPI_PATH, document_bytes
from channel.routing import ExecutionDirectory, ExecutionPort
from channel.wire import CallReply, compact_json, is_valid_id, parse_call_request

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_BODY",
    "DEFAULT_MAX_CONNECTIONS_PER_GROUP",
    "MAX_WAIT_S",
    "ChannelServer",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY: Final = 1024 * 1024
#: docs/protocol.md, "Endpoints": the longest long-poll a guest may ask for.
MAX_WAIT_S: Final = 60.0
#: How long ``close()`` lets in-flight requests finish before dropping them.
SHUTDOWN_GRACE_S: Final = 5.0
#: How long a request may wait for its guest's launch to be recorded.
LAUNCH_WAIT_S: Final = 5.0
#: Many guests connect at once (hundreds per supervisor): a deep accept queue.
LISTEN_BACKLOG: Final = 1024


def _json_response(reply: CallReply) -> web.Response:
    return web.Response(
        body=reply.to_bytes(),
        status=reply.http_status,
        content_type="application/json",
    )


def _refusal_response(refusal: Refusal, call_id: str | None = None) -> web.Response:
    response = _json_response(CallReply.refused(call_id, refusal))
    if refusal.code in ("payload_too_large", "bad_request"):
        # The rest of the body may still be on the wire: do not reuse the stream.
        response.force_close()
    return response


class ChannelServer:
    """Serves the guest protocol on ``socket_path`` for every execution in ``directory``.

    The socket's directory must already exist with mode 0700; the socket file
    is made 0600 before any connection can be accepted from outside it.

    Args:
        directory: Where requests find their execution.
        socket_path: Where to listen.
        origin_check: Check 5 of docs/protocol.md (connections are attributed and
            counted either way).
        max_body: Longest request body accepted, in bytes.
        max_connections_per_group: Open connections allowed per sandbox (or,
            for an unsandboxed guest, per session): per execution.
        max_connections: Open connections allowed in all; None: half the soft
            ``RLIMIT_NOFILE`` when the server starts.
        idle_timeout_s: A connection that has not sent a whole request this
            long after it opened or got its last answer is closed; so is one
            whose request body takes longer than this to arrive.
    """

    def __init__(
        self,
        directory: ExecutionDirectory,
        socket_path: Path,
        *,
        origin_check: bool = True,
        max_body: int = DEFAULT_MAX_BODY,
        max_connections_per_group: int = DEFAULT_MAX_CONNECTIONS_PER_GROUP,
        max_connections: int | None = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self._directory = directory
        self.socket_path = socket_path
        self._origin_check = origin_check
        self._max_body = max_body
        self._max_per_group = max_connections_per_group
        self._max_connections = max_connections
        self._idle_timeout_s = idle_timeout_s
        self._runner: web.ServerRunner | None = None
        self._listener: ChannelListener | None = None
        #: Requests being served right now (long polls included).
        self.active_requests = 0

    @property
    def open_connections(self) -> int:
        """Connections admitted and not yet closed."""
        return self._listener.open_connections if self._listener is not None else 0

    @property
    def orphaned_requests(self) -> int:
        """Requests still being handled whose guest has hung up (each still
        counts against its execution's connection limit)."""
        return self._listener.orphaned_requests if self._listener is not None else 0

    async def start(self) -> None:
        """Bind the socket and start serving."""
        parent = self.socket_path.parent
        mode = stat.S_IMODE(parent.stat().st_mode)
        if mode & 0o077:
            raise RuntimeError(f"socket directory {parent} must be mode 0700, is {mode:04o}")
        self.socket_path.unlink(missing_ok=True)
        # aiohttp's low-level server: four routes need no application, router
        # or middleware chain (_handle routes and is the boundary itself).
        server = web.Server(
            self._handle,
            # A guest that hangs up must not cancel the request: a dispatched
            # handler runs in it (docs/guarantees.md, "Disconnect = cancel").
            handler_cancellation=False,
        )
        runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        self._runner = runner
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.socket_path))
            # The directory is 0700, so nobody else could connect in between.
            os.chmod(self.socket_path, 0o600)
            sock.listen(LISTEN_BACKLOG)
            idle_timeout_s = self._idle_timeout_s

            def connection(slot: Slot) -> ChannelConnection:
                return ChannelConnection(server, slot, idle_timeout_s=idle_timeout_s)

            listener = ChannelListener(
                sock,
                connection,
                per_group=self._max_per_group,
                total=(
                    self._max_connections
                    if self._max_connections is not None
                    else default_max_connections()
                ),
            )
        except BaseException:
            sock.close()
            await self.close()
            raise
        listener.start()
        self._listener = listener

    async def close(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), remove the socket."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        self.socket_path.unlink(missing_ok=True)

    # -- request handling -------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """Every request: route it, and turn every failure into the protocol's
        JSON answer."""
        self.active_requests += 1
        # The request holds its connection's place in the execution's limit
        # until it is answered, even if the guest hangs up first (Slot).
        slot = cast(ChannelConnection, request.protocol).slot
        slot.request_started()
        try:
            response = await self._route(request)
        except Refusal as refusal:
            return _refusal_response(refusal)
        except web.HTTPException as exc:
            code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
                exc.status, "bad_request"
            )
            return _refusal_response(Refusal(code, exc.reason))
        except asyncio.CancelledError:
            raise
        except Exception:
            # Boundary: a bug must not take the server down or leak a traceback.
            logger.exception("internal error serving %s %s", request.method, request.path)
            return web.json_response(
                {
                    "status": "error",
                    "call_id": None,
                    "effect": "unknown",
                    "error": {"code": "internal_error", "message": "internal error"},
                },
                status=500,
            )
        finally:
            self.active_requests -= 1
            slot.request_ended()
        return response

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        """Identify the caller, then find the endpoint (docs/protocol.md,
        "Endpoints"), as aiohttp's router would: on the path with ``%2F`` kept
        encoded, a call id decoded after. A GET endpoint answers HEAD too.

        Identity comes before everything else (SPEC §4.3): an unknown path, a
        wrong method or an ``Expect`` header (whose ``100 Continue`` would
        invite a body) is answered only to an identified guest.
        """
        execution, credential = await self._identify(request)
        if request.headers.get("Expect") is not None:
            refused = await _expect(request)
            if refused is not None:
                return refused
        path, method = request.rel_url.path_safe, request.method
        if path == "/v1/calls" and method == "POST":
            return await self._post_call(request, execution, credential)
        if method in ("GET", "HEAD"):
            if path == "/v1/plan":
                return await self._get_plan(execution)
            if path == OPENAPI_PATH:
                # The socket serves guests; the document is in the repository
                # for everyone else.
                return web.Response(body=document_bytes(), content_type="application/json")
            call_id = path.removeprefix("/v1/calls/")
            if call_id != path and _CALL_ID_SEGMENT.fullmatch(call_id):
                return await self._get_call(request, execution, _unquote_path_safe(call_id))
        return _no_such_route(request)

    async def _identify(self, request: web.BaseRequest) -> tuple[ExecutionPort, bytes]:
        execution, credential = authenticate(request.headers, self._directory)
        if self._origin_check:
            if execution.guest_pid is None:
                await execution.wait_launched(LAUNCH_WAIT_S)
            connection = request.protocol
            assert isinstance(connection, ChannelConnection)
            transport = request.transport
            if transport is None:
                # The guest hung up while its launch was being recorded: there
                # is no one left to answer, and no peer to check.
                raise Refusal("origin_denied", "the connection closed before it was checked")
            check_origin(connection.peer, execution, transport)
        return execution, credential

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        if request.content_type != "application/json":
            raise Refusal("unsupported_media_type", "Content-Type must be application/json")
        length = request.content_length
        if length is not None and length > self._max_body:
            raise Refusal("payload_too_large", f"body is over {self._max_body} bytes")
        if request.content.is_eof():  # the usual case: the body came with the head
            return await self._receive_body(request, length)
        # aiohttp's idle timer stops once the head is in: a body trickled in
        # (or never sent) must not hold the connection forever.
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                return await self._receive_body(request, length)
        except TimeoutError:
            raise Refusal(
                "bad_request", f"the request body did not arrive within {self._idle_timeout_s} s"
            ) from None

    async def _receive_body(self, request: web.BaseRequest, length: int | None) -> bytes:
        try:
            if length is not None:  # the common case: one read of a known size
                return await request.content.readexactly(length)
            body = bytearray()
            async for chunk in request.content.iter_any():
                body += chunk
                if len(body) > self._max_body:
                    raise Refusal("payload_too_large", f"body is over {self._max_body} bytes")
            return bytes(body)
        except (ConnectionResetError, HttpProcessingError, asyncio.IncompleteReadError) as exc:
            # The guest hung up (or broke the framing) mid-body: its fault, not ours.
            raise Refusal("bad_request", f"the request body did not arrive whole: {exc}") from None

    async def _post_call(
        self, request: web.BaseRequest, execution: ExecutionPort, credential: bytes
    ) -> web.StreamResponse:
        body = await self._read_body(request)
        call = parse_call_request(body)
        if credential in body or (
            b"\\u" in body and spells_credential(credential, [call.call_id, call.tool, call.args])
        ):
            raise Refusal("bad_request", "a call may not carry the guest's credential")
        reply = await execution.broker.call(call.call_id, call.tool, call.args)
        return _json_response(reply)

    async def _get_call(
        self, request: web.BaseRequest, execution: ExecutionPort, call_id: str
    ) -> web.StreamResponse:
        if not is_valid_id(call_id):
            raise Refusal("bad_request", "call_id must be 1-128 characters of [A-Za-z0-9._:-]")
        wait_s = _parse_wait(request.query.get("wait"))
        return _json_response(await execution.broker.status(call_id, wait_s))

    async def _get_plan(self, execution: ExecutionPort) -> web.StreamResponse:
        body = await execution.broker.plan_view()
        return web.Response(
            body=compact_json(body).encode(),
            content_type="application/json",
        )


_KNOWN_PATHS: Final = re.compile(r"/v1/calls(/[^/]+)?|/v1/plan|" + re.escape(OPENAPI_PATH))
#: What aiohttp's router took for ``{call_id}``.
_CALL_ID_SEGMENT: Final = re.compile(r"[^{}/]+")


def _unquote_path_safe(segment: str) -> str:
    """A path segment as aiohttp's router gives it to a handler."""
    if "%" not in segment:
        return segment
    return segment.replace("%2F", "/").replace("%25", "%")


def _no_such_route(request: web.BaseRequest) -> web.StreamResponse:
    if _KNOWN_PATHS.fullmatch(request.path):
        raise Refusal("method_not_allowed", f"{request.method} is not allowed on {request.path}")
    raise Refusal("not_found", f"no endpoint {request.path}")


async def _expect(request: web.BaseRequest) -> web.StreamResponse | None:
    """``Expect: 100-continue`` as HTTP/1.1 asks; any other expectation is refused
    as a bad request (aiohttp's own answer to those is a plain-text 417, or a
    500 when the value is not ASCII)."""
    if request.headers.get("Expect", "").lower() == "100-continue":
        if request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # the real response is still to come
        return None
    return _refusal_response(Refusal("bad_request", "unsupported Expect header"))


def _parse_wait(raw: str | None) -> float:
    if raw is None:
        return 0.0
    try:
        wait_s = float(raw)
    except ValueError:
        raise Refusal("bad_request", "wait must be a number of seconds from 0 to 60") from None
    if not 0.0 <= wait_s <= MAX_WAIT_S:  # also refuses NaN
        raise Refusal("bad_request", "wait must be a number of seconds from 0 to 60")
    return wait_s
