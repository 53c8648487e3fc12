"""The admin API (docs/operations.md): ``<state_dir>/admin.sock``, same uid only, mode 0600.

Operators (and ``hostcall approvals``/``calls``) decide proposals, list
invocations and calls, cancel executions, revoke tools and scrape metrics.
Every answer is JSON (``/metrics`` excepted); errors are
``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import psutil
from aiohttp import web

from channel.connections import ChannelConnection, ChannelListener
from channel.ids import is_path_safe_id
from channel.peer import peer_credentials, still_alive
from channel.wire import parse_strict_json
from supervisor.activity import Activity, notice_json
from supervisor.approvals import (
    PROPOSAL_STATES,
    ApprovalController,
    ProposalNotFound,
    ProposalNotWaiting,
)
from supervisor.errors import HostcallError, Refusal, SupervisorClosing, WasmBusy, WasmError
from supervisor.executions import Execution
from supervisor.gc import collect
from supervisor.metrics import CONTENT_TYPE, Metrics
from supervisor.plan import Plan
from supervisor.receipt_worker import ReceiptWorker, ReceiptWorkerBusy, ReceiptWorkerFailed
from supervisor.sockets import reachable_path
from supervisor.statedir import StateDir
from supervisor.stores.base import EffectRecord, EffectStore, InvocationRecord, budget_left
from supervisor.timestamps import utc_timestamp
from supervisor.views import calls_from_receipts, log_tails

__all__ = ["AdminPort", "AdminServer", "record_json"]

logger = logging.getLogger(__name__)

#: How long ``close()`` lets in-flight admin requests finish.
SHUTDOWN_GRACE_S: Final = 2.0
#: Longest request body the admin API reads.
MAX_BODY: Final = 64 * 1024
#: Open admin connections at most (operators' CLIs and scrapers).
MAX_CONNECTIONS: Final = 64
#: An admin connection that sends no whole request this long is closed.
IDLE_TIMEOUT_S: Final = 30.0
LISTEN_BACKLOG: Final = 128
#: An event stream sends one batch of notices at most this often …
EVENT_BATCH_S: Final = 0.25
#: … and a keep-alive comment after this long without one.
KEEPALIVE_S: Final = 15.0
#: Most log lines ``GET /v1/invocations/{id}/logs`` returns per stream.
MAX_LOG_TAIL: Final = 2000

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def record_json(record: EffectRecord) -> dict[str, Any]:
    """An effect record as ``hostcall calls --json`` and the admin API show it."""
    return {
        "invocation_id": record.invocation_id,
        "call_id": record.call_id,
        "tool": record.tool,
        "idempotency_key": record.idempotency_key,
        "status": str(record.status),
        "execution_id": record.execution_id,
        "created_at": utc_timestamp(record.created_at),
        "updated_at": utc_timestamp(record.updated_at),
        "response": record.response,
    }


class AdminPort(Protocol):
    """What the admin API needs of the supervisor it serves (``Supervisor`` is one)."""

    @property
    def state(self) -> StateDir: ...

    @property
    def store(self) -> EffectStore: ...

    @property
    def approvals(self) -> ApprovalController: ...

    @property
    def activity(self) -> Activity: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def served_plan(self) -> Plan | None: ...

    def plan_for(self, plan_hash: str) -> Plan | None: ...

    def execution(self, execution_id: str) -> Execution | None: ...

    def executions(self, invocation_id: str | None = None) -> list[Execution]: ...

    def guest_of(self, pid: int) -> str | None: ...

    def cancel(self, execution_id: str) -> bool: ...

    async def wait_stopped(self, execution_id: str) -> bool: ...

    async def revoke(self, invocation_id: str, tool: str) -> None: ...

    async def launch(
        self,
        argv: Sequence[str],
        *,
        invocation_id: str | None = None,
        timeout_s: float | None = None,
        plan: Plan | None = None,
        wasm: str | None = None,
    ) -> Execution: ...


class AdminServer:
    """Serves the admin API of one supervisor."""

    def __init__(self, supervisor: AdminPort, path: Path) -> None:
        self._sup = supervisor
        self.path = path
        self._runner: web.AppRunner | None = None
        self._listener: ChannelListener | None = None
        self._closing = asyncio.Event()
        self._receipt_worker = ReceiptWorker(supervisor.state.path)

    async def start(self) -> None:
        """Bind ``path`` (any length) with mode 0600 and serve."""
        app = web.Application(middlewares=[self._boundary], client_max_size=MAX_BODY)
        routes = [
            web.post("/v1/invocations", self._launch),
            web.get("/v1/invocations", self._invocations),
            web.get("/v1/invocations/{invocation_id}/calls", self._calls),
            web.post("/v1/invocations/{invocation_id}/tools/{tool}/revoke", self._revoke),
            web.post("/v1/executions/{execution_id}/cancel", self._cancel),
            web.get("/v1/approvals", self._approvals),
            web.get("/v1/approvals/{proposal_id}", self._approval),
            web.post("/v1/approvals/{proposal_id}/approve", self._approve),
            web.post("/v1/approvals/{proposal_id}/reject", self._reject),
            web.get("/metrics", self._metrics),
            # For the operator's console (docs/console.md), and anyone else.
            web.get("/v1/events", self._events),
            web.get("/v1/stats", self._stats),
            web.get("/v1/invocations/{invocation_id}", self._invocation),
            web.get("/v1/invocations/{invocation_id}/activity", self._activity),
            web.get("/v1/invocations/{invocation_id}/logs", self._logs),
            web.get("/v1/invocations/{invocation_id}/receipts", self._receipts),
            web.post("/v1/gc", self._gc),
        ]
        app.router.add_routes(routes)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S
        )
        await runner.setup()
        self._runner = runner
        server = runner.server
        assert server is not None
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with reachable_path(self.path) as bindable:
                sock.bind(bindable)
            os.chmod(self.path, 0o600)
            sock.listen(LISTEN_BACKLOG)
            # The channel's own listener: it keeps accepting through EMFILE
            # (uvloop's would drop the listener for good), so a guest that
            # exhausts descriptors never locks the operator out (docs/security.md, S9).
            listener = ChannelListener(
                sock,
                lambda slot: ChannelConnection(server, slot, idle_timeout_s=IDLE_TIMEOUT_S),
                per_group=MAX_CONNECTIONS,
                total=MAX_CONNECTIONS,
            )
        except BaseException:
            sock.close()
            raise
        listener.start()
        self._listener = listener

    async def close(self) -> None:
        """Stop serving and remove the socket."""
        self._closing.set()  # event streams end
        if self._listener is not None:
            listener, self._listener = self._listener, None
            listener.close()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self._receipt_worker.close()
        self.path.unlink(missing_ok=True)

    @web.middleware
    async def _boundary(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        assert request.transport is not None
        refusal = self._refusal(request.transport.get_extra_info("socket"))
        if refusal is not None:
            return _error(403, "origin_denied", refusal)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _error(
                exc.status, "not_found" if exc.status == 404 else "bad_request", exc.reason
            )
        except (ProposalNotFound, KeyError) as exc:
            return _error(404, "not_found", str(exc.args[0]) if exc.args else "not found")
        except ProposalNotWaiting as exc:
            return _error(409, exc.code, exc.message)
        except Refusal as exc:
            return _error(400, exc.code, exc.message)
        except HostcallError as exc:
            return _error(409, exc.code, exc.message)
        except Exception:  # boundary: an admin bug must not take the supervisor down
            logger.exception("admin API error on %s %s", request.method, request.path)
            return _error(500, "internal_error", "internal error")

    def _refusal(self, sock: Any) -> str | None:
        """Why the peer may not use the admin API, or None. Fails closed: a
        peer it cannot attribute with certainty is refused (docs/security.md, S4)."""
        try:
            peer = peer_credentials(sock)
        except OSError:
            return "the peer could not be identified"
        try:
            if peer.uid != os.getuid():
                return "the admin API is for the supervisor's own uid"
            if peer.pid <= 0:
                return "the peer is not visible from the supervisor's pid namespace"
            try:
                owner = self._sup.guest_of(peer.pid)
            except LookupError:
                return "the peer could not be attributed"
            if owner is not None:
                # Guests may run as our uid: without this one could approve itself.
                return "guests may not use the admin API"
            if peer.pidfd is not None and not still_alive(peer.pidfd):
                # It exited while we looked: its pid may be someone else's now.
                return "the peer exited"
        finally:
            if peer.pidfd is not None:
                os.close(peer.pidfd)
        return None

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        body = parse_strict_json(raw)
        if not isinstance(body, dict):
            raise Refusal("bad_request", "the body must be a JSON object")
        return body

    # -- approvals ---------------------------------------------------------

    async def _approvals(self, request: web.Request) -> web.Response:
        state = request.query.get("state")
        if state is not None and state not in PROPOSAL_STATES:
            raise Refusal("bad_request", f"state must be one of {', '.join(PROPOSAL_STATES)}")
        args = request.query.get("args", "whole")
        if args not in ("whole", "preview"):
            raise Refusal("bad_request", "args must be whole or preview")
        preview = args == "preview"
        return web.json_response(
            [p.to_json(preview=preview) for p in self._sup.approvals.list(state)]
        )

    async def _approval(self, request: web.Request) -> web.Response:
        return web.json_response(
            self._sup.approvals.get(request.match_info["proposal_id"]).to_json()
        )

    async def _approve(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        proposal = self._sup.approvals.approve(
            request.match_info["proposal_id"], by=str(body.get("by", "operator"))
        )
        return web.json_response(proposal.to_json())

    async def _reject(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        reason = body.get("reason")
        proposal = self._sup.approvals.reject(
            request.match_info["proposal_id"],
            reason=str(reason) if reason is not None else None,
            by=str(body.get("by", "operator")),
        )
        return web.json_response(proposal.to_json())

    # -- invocations, calls, executions ------------------------------------

    async def _invocations(self, request: web.Request) -> web.Response:
        records = await self._sup.store.list_invocations()
        return web.json_response([self._invocation_json(r) for r in records])

    async def _invocation(self, request: web.Request) -> web.Response:
        record = await self._known_invocation(request)
        return web.json_response(self._invocation_json(record))

    async def _known_invocation(self, request: web.Request) -> InvocationRecord:
        invocation_id = request.match_info["invocation_id"]
        record = await self._sup.store.get_invocation(invocation_id)
        if record is None:
            raise KeyError(f"no invocation {invocation_id}")
        return record

    def _invocation_json(self, record: InvocationRecord) -> dict[str, Any]:
        executions = self._sup.executions(record.invocation_id)
        plan = self._sup.plan_for(record.plan_hash)
        calls: collections.Counter[str] = collections.Counter()
        for execution in executions:
            calls.update(execution.calls())
        return {
            "invocation_id": record.invocation_id,
            "plan_hash": record.plan_hash,
            "plan_name": plan.name if plan is not None else None,
            "state": "running" if any(e.live for e in executions) else "idle",
            "created_at": utc_timestamp(record.created_at),
            "deadline_at": (utc_timestamp(record.deadline_at) if record.deadline_at else None),
            "calls_used": record.used.calls,
            "cost_used": record.used.cost,
            "budget": (
                budget_left(plan.budget, record.used, record.deadline_at)
                if plan is not None
                else None
            ),
            "calls_by_outcome": dict(calls),
            "executions": [e.describe() for e in executions],
        }

    async def _calls(self, request: web.Request) -> web.Response:
        invocation_id = request.match_info["invocation_id"]
        if await self._sup.store.get_invocation(invocation_id) is None:
            return _error(404, "not_found", f"no invocation {invocation_id}")
        records = await self._sup.store.calls(invocation_id)
        return web.json_response([record_json(r) for r in records])

    async def _cancel(self, request: web.Request) -> web.Response:
        execution_id = request.match_info["execution_id"]
        execution = self._sup.execution(execution_id)
        if execution is None:
            return _error(404, "not_found", f"no execution {execution_id}")
        if not self._sup.cancel(execution_id):
            return _error(
                409, "execution_not_live", f"execution {execution_id} is {execution.state}"
            )
        # Answer once its guest is gone (S5): "cancelled" means nothing of it runs.
        await self._sup.wait_stopped(execution_id)
        return web.json_response(execution.describe())

    async def _revoke(self, request: web.Request) -> web.Response:
        invocation_id = request.match_info["invocation_id"]
        tool = request.match_info["tool"]
        if await self._sup.store.get_invocation(invocation_id) is None:
            return _error(404, "not_found", f"no invocation {invocation_id}")
        try:
            await self._sup.revoke(invocation_id, tool)
        except KeyError:
            return _error(404, "not_found", f"invocation {invocation_id}'s plan has no tool {tool}")
        return web.json_response({"invocation_id": invocation_id, "tool": tool, "revoked": True})

    async def _launch(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        wasm = body.get("wasm")
        if wasm is not None and (not isinstance(wasm, str) or not wasm):
            raise Refusal("bad_request", "wasm must be the path of a WebAssembly module")
        # A WebAssembly guest's argv is its arguments; a native guest's starts with the program.
        argv = body.get("argv", [] if wasm is not None else None)
        if (
            not isinstance(argv, list)
            or not (argv or wasm is not None)
            or not all(isinstance(a, str) for a in argv)
        ):
            raise Refusal("bad_request", "argv must be a non-empty list of strings")
        unknown = set(body) - {"argv", "invocation", "timeout_s", "wasm"}
        if unknown:
            raise Refusal("bad_request", f"unknown fields {sorted(unknown)}")
        invocation = body.get("invocation")
        if invocation is not None and (
            not isinstance(invocation, str) or not is_path_safe_id(invocation)
        ):
            raise Refusal(
                "bad_request", "invocation ids are 1-128 characters of [A-Za-z0-9._:-], not . or .."
            )
        timeout_s = body.get("timeout_s")
        if timeout_s is not None and (
            not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool) or timeout_s <= 0
        ):
            raise Refusal("bad_request", "timeout_s must be a number of seconds > 0")
        if self._sup.served_plan is None:
            return _error(409, "no_plan", "this supervisor serves no plan (use hostcall serve)")
        try:
            execution = await self._sup.launch(
                argv, invocation_id=invocation, timeout_s=timeout_s, wasm=wasm
            )
        except OSError as exc:
            program = wasm if wasm is not None else argv[0]
            raise Refusal("bad_request", f"cannot start {program!r}: {exc.strerror}") from None
        except WasmError as exc:
            raise Refusal("bad_request", str(exc)) from None
        except (WasmBusy, SupervisorClosing) as exc:
            return _error(503, exc.code, str(exc))
        return web.json_response(execution.describe(), status=201)

    async def _activity(self, request: web.Request) -> web.Response:
        """The invocation's recent calls with their arguments (this supervisor's
        memory), or, when it holds none, what its receipts say (no arguments)."""
        record = await self._known_invocation(request)
        kept = self._sup.activity.journal.calls(record.invocation_id)
        if kept is not None:
            return web.json_response({"source": "journal", "calls": [e.to_json() for e in kept]})
        path = self._sup.state.receipts_dir / f"{record.invocation_id}.jsonl"
        calls = await asyncio.to_thread(calls_from_receipts, path)
        return web.json_response({"source": "receipts", "calls": calls})

    async def _logs(self, request: web.Request) -> web.Response:
        record = await self._known_invocation(request)
        try:
            tail = int(request.query.get("tail", "200"))
        except ValueError:
            raise Refusal("bad_request", "tail must be a number of lines") from None
        tail = max(1, min(tail, MAX_LOG_TAIL))
        folder = self._sup.state.logs_dir / record.invocation_id
        ids = [e.execution_id for e in self._sup.executions(record.invocation_id)]
        logs = await asyncio.to_thread(log_tails, folder, ids, tail)
        return web.json_response({"invocation_id": record.invocation_id, "logs": logs})

    async def _receipts(self, request: web.Request) -> web.Response:
        record = await self._known_invocation(request)
        path = self._sup.state.receipts_dir / f"{record.invocation_id}.jsonl"
        try:
            report = await self._receipt_worker.verify(path)
        except ReceiptWorkerBusy as exc:
            busy = _error(503, exc.code, exc.message)
            busy.headers["Retry-After"] = "5"
            return busy
        except ReceiptWorkerFailed as exc:
            return _error(500, exc.code, exc.message)
        return web.json_response(report)

    async def _gc(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        older = body.get("older_than_s")
        if not isinstance(older, int | float) or isinstance(older, bool) or older < 0:
            raise Refusal("bad_request", "older_than_s must be a number of seconds >= 0")
        unknown = set(body) - {"older_than_s", "dry_run"}
        if unknown:
            raise Refusal("bad_request", f"unknown fields {sorted(unknown)}")
        live = {e.invocation_id for e in self._sup.executions() if e.live or e.outcome is None}
        report = await collect(
            self._sup.store,
            self._sup.state.path,
            older_than_s=float(older),
            now=time.time(),
            live=live,
            dry_run=bool(body.get("dry_run", False)),
        )
        return web.json_response(report.to_json())

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "now": utc_timestamp(time.time()),
                "calls_by_outcome": self._sup.metrics.calls_by_outcome(),
                "in_flight": self._sup.metrics.in_flight_now(),
                "proposals_waiting": self._sup.approvals.waiting(),
                "process": _own_process(),
            }
        )

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Change notices as Server-Sent Events: ``data: {"topic", "invocation_id"}``.

        Coalesced (see :mod:`supervisor.activity`) and sent at most every
        :data:`EVENT_BATCH_S`; a comment line every :data:`KEEPALIVE_S` while
        nothing changes. Ends when the supervisor closes.
        """
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        with (
            self._sup.activity.events.subscribe() as subscription,
            contextlib.suppress(
                ConnectionError  # the reader left
            ),
        ):
            await response.write(b"event: hello\ndata: {}\n\n")
            while not self._closing.is_set():
                notices = await subscription.next(KEEPALIVE_S)
                if self._closing.is_set():
                    break
                if not notices:
                    await response.write(b": keepalive\n\n")
                    continue
                chunk = b"".join(
                    b"data: " + json.dumps(notice_json(n)).encode() + b"\n\n" for n in notices
                )
                await response.write(chunk)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EVENT_BATCH_S):
                        await self._closing.wait()
        return response

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=self._sup.metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response


def _own_process() -> dict[str, int | None]:
    """The supervisor's own process, which its uid cannot inspect from outside
    (the supervisor is not dumpable: its descriptors are root's to list)."""
    process = psutil.Process()
    try:
        with process.oneshot():
            return {
                "pid": process.pid,
                "rss_bytes": process.memory_info().rss,
                "open_fds": process.num_fds(),
                "threads": process.num_threads(),
            }
    except psutil.Error:
        return {"pid": process.pid, "rss_bytes": None, "open_fds": None, "threads": None}
