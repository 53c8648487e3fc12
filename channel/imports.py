"""The second transport: a WebAssembly guest's ``hostcall`` imports (docs/wasm.md).

A native guest reaches its execution's broker over the Unix socket
(:mod:`channel.server`); a WebAssembly guest calls an import of its own
instance. Both arrive at the same broker, with the same framing and the same
replies: the request and reply bodies of ``call``, ``status`` and ``plan``
are those of ``POST /v1/calls``, ``GET /v1/calls/{id}`` and ``GET /v1/plan``,
and each answers with the HTTP status the endpoint would.

The instance *is* the identity — bound to one execution when it is made, it
carries no credential and reaches no socket — so of the identity checks only
liveness remains: an ended or fenced execution's instance gets 403
``execution_fenced``. No wasmtime here: this module turns bytes into a
status and bytes; :mod:`supervisor.wasm` moves them in and out of the
guest's memory.
"""

from __future__ import annotations

from typing import Final

from channel.errors import Refusal
from channel.ids import is_valid_id
from channel.routing import ExecutionPort
from channel.wire import CallReply, compact_json, parse_call_request

__all__ = ["MAX_WAIT_MS", "Imports"]

#: The longest long-poll ``status`` may ask for, as ``?wait=`` (60 s).
MAX_WAIT_MS: Final = 60_000


class Imports:
    """The imports' side of the broker, shared by every WebAssembly guest of
    one supervisor; :attr:`active` counts the requests it serves now (with the
    channel's, the store's load hint: a call alone commits inline)."""

    def __init__(self, max_body: int) -> None:
        #: The largest ``call`` request, as on the socket.
        self.max_body = max_body
        self.active = 0

    async def call(self, execution: ExecutionPort, request: bytes) -> tuple[int, bytes]:
        """``call``: the body of ``POST /v1/calls`` → (HTTP status, reply body)."""
        if (fenced := _fenced(execution)) is not None:
            return _refused(fenced)
        if len(request) > self.max_body:
            return self.oversized(execution)
        try:
            call = parse_call_request(request)
        except Refusal as refusal:
            return _refused(refusal)
        self.active += 1
        try:
            return _body(await execution.broker.call(call.call_id, call.tool, call.args))
        finally:
            self.active -= 1

    def oversized(self, execution: ExecutionPort) -> tuple[int, bytes]:
        """``call`` with a request over :attr:`max_body` bytes, refused unread."""
        if (fenced := _fenced(execution)) is not None:
            return _refused(fenced)
        return _refused(Refusal("payload_too_large", f"body is over {self.max_body} bytes"))

    async def status(
        self, execution: ExecutionPort, call_id: str, wait_ms: int
    ) -> tuple[int, bytes]:
        """``status``: ``GET /v1/calls/{call_id}?wait=`` (in milliseconds, 0-60000)."""
        if (fenced := _fenced(execution)) is not None:
            return _refused(fenced)
        if not is_valid_id(call_id):
            return _refused(
                Refusal("bad_request", "call_id must be 1-128 characters of [A-Za-z0-9._:-]")
            )
        if not 0 <= wait_ms <= MAX_WAIT_MS:
            return _refused(Refusal("bad_request", "wait must be 0 to 60000 milliseconds"))
        self.active += 1
        try:
            return _body(await execution.broker.status(call_id, wait_ms / 1000))
        finally:
            self.active -= 1

    async def plan(self, execution: ExecutionPort) -> tuple[int, bytes]:
        """``plan``: the body of ``GET /v1/plan``."""
        if (fenced := _fenced(execution)) is not None:
            return _refused(fenced)
        return 200, compact_json(await execution.broker.plan_view()).encode()


def _body(reply: CallReply) -> tuple[int, bytes]:
    return reply.http_status, reply.to_bytes()


def _refused(refusal: Refusal, call_id: str | None = None) -> tuple[int, bytes]:
    return _body(CallReply.refused(call_id, refusal))


def _fenced(execution: ExecutionPort) -> Refusal | None:
    if execution.live:
        return None
    return Refusal("execution_fenced", "this execution has ended or a newer one took over")
