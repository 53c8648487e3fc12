"""The operator console (docs/console.md): a web page on a loopback port.

It is a client of the admin API, like the CLI: every figure it shows is read
from ``<state_dir>/admin.sock``, and Approve / Reject are the admin API's
``POST /v1/approvals/{id}/approve|reject`` — the same approval controller as
``hostcall approvals``. So ``hostcall console`` (another process) and
``--console`` on ``run``/``serve`` (in the supervisor's own) are the same code.

Live: one stream of change notices from the admin API (``GET /v1/events``)
is fanned out to every open page as Server-Sent Events; a page re-reads only
what a notice names. The calls/s chart comes from a sample of the call
counters every :data:`SAMPLE_INTERVAL_S`, kept for :data:`SAMPLES_KEPT`.

Protection, all of it on every request (docs/console.md):

- it listens on a loopback address only;
- a fresh random token per start, in the printed URL: a request without it
  gets 401, before anything else is read or done;
- the ``Host`` header must name the loopback address and port (DNS rebinding);
- a state-changing request is a ``POST`` carrying the token in a header
  (``X-Hostcall-Token``: a page on another origin cannot send one without a
  CORS preflight, which is never granted), JSON, and, when the browser says
  where it comes from (``Origin``, ``Sec-Fetch-Site``), our own origin —
  else 403;
- no CORS headers at all; a Content-Security-Policy that allows only the
  console's own script and style (no inline script), no framing, no referrer
  (the token stays out of other sites' logs).

The page sets every guest-supplied string with ``textContent``, never as HTML.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import quote

from aiohttp import web

from supervisor.activity import EventHub, Topic, notice_json
from supervisor.addresses import Listen, parse_listen
from supervisor.admin_client import AdminError, AsyncAdminClient, SupervisorNotRunning
from supervisor.ids import is_valid_id
from supervisor.tcp import serve_tcp

__all__ = ["ConsoleServer", "Listen", "parse_listen"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

STATIC: Final = Path(__file__).with_name("static")
#: How often the call counters are sampled for the chart …
SAMPLE_INTERVAL_S: Final = 2.0
#: … and how many samples are kept (ten minutes).
SAMPLES_KEPT: Final = 300
#: A page's event stream gets a batch at most this often, a comment when idle.
EVENT_BATCH_S: Final = 0.25
KEEPALIVE_S: Final = 15.0
#: Pause before following the admin API's event stream again after it broke.
RECONNECT_S: Final = 1.0
#: Invocations whose receipts the receipts view verifies at most (newest first).
RECEIPTS_VERIFIED: Final = 50
#: Longest body a console request may have (a reason to reject).
MAX_BODY: Final = 16 * 1024
#: Longest rejection reason kept.
MAX_REASON: Final = 2000

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_TOPICS: Final = frozenset(str(t) for t in Topic)
_STATIC_TYPES: Final = {
    "console.js": "text/javascript",
    "console.css": "text/css",
}


def _refuse(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def _expect(value: object, kind: type[_T], what: str) -> _T:
    """``value``, which the admin API answered, if it is a ``kind``: the page
    is never handed a string where it iterates a list."""
    if not isinstance(value, kind):
        raise AdminError(502, "bad_answer", f"the admin API's {what} is not a JSON {kind.__name__}")
    return value


class ConsoleServer:
    """The console of the supervisor that serves ``<state_dir>/admin.sock``."""

    def __init__(self, state_dir: Path, listen: Listen) -> None:
        self._admin = AsyncAdminClient(state_dir)
        self._listen = listen
        self.token = secrets.token_urlsafe(32)
        self._runner: web.AppRunner | None = None
        self._hub = EventHub()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = asyncio.Event()
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=SAMPLES_KEPT)
        self._upstream = False
        self.port = listen.port

    @property
    def url(self) -> str:
        """The page's address, token included: what the operator opens."""
        host = f"[{self._listen.host}]" if ":" in self._listen.host else self._listen.host
        return f"http://{host}:{self.port}/?token={quote(self.token)}"

    async def start(self) -> None:
        """Listen and start following the supervisor.

        Raises:
            OSError: the address cannot be bound (in use, …).
        """
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY)
        app.router.add_routes(
            [
                web.get("/", self._index),
                web.get("/static/{name}", self._static),
                web.get("/events", self._events),
                web.get("/api/overview", self._overview),
                web.get("/api/invocations/{invocation_id}", self._invocation),
                web.get("/api/receipts", self._receipts),
                web.get("/api/metrics", self._metrics),
                web.get("/api/approvals/{proposal_id}", self._proposal),
                web.post("/api/approvals/{proposal_id}/{decision}", self._decide),
            ]
        )
        self._runner, self.port = await serve_tcp(app, self._listen.host, self._listen.port)
        for job in (self._follow(), self._sample()):
            task = asyncio.create_task(job)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop serving. Idempotent."""
        self._closing.set()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- protection --------------------------------------------------------

    def _allowed_hosts(self) -> set[str]:
        port = self.port
        hosts = {f"{self._listen.host}:{port}"}
        if self._listen.host == "127.0.0.1":
            hosts.add(f"localhost:{port}")
        if self._listen.host == "::1":
            hosts = {f"[::1]:{port}", f"localhost:{port}"}
        return hosts

    def _has_token(self, offered: str | None) -> bool:
        # surrogateescape: a header aiohttp decoded from bytes that are not
        # UTF-8 is compared (and refused), not an error before authentication.
        return offered is not None and hmac.compare_digest(
            offered.encode("utf-8", "surrogateescape"), self.token.encode()
        )

    @web.middleware
    async def _guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        response = await self._checked(request, handler)
        if not response.prepared:  # a stream set its own before it started
            response.headers.update(_SECURITY_HEADERS)
        return response

    async def _checked(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        header = request.headers.get("X-Hostcall-Token")
        if not self._has_token(header) and not self._has_token(request.query.get("token")):
            return _refuse(401, "unauthenticated", "this console needs the token of its URL")
        if request.headers.get("Host", "") not in self._allowed_hosts():
            return _refuse(403, "forbidden", "this console answers its own address only")
        if request.method not in ("GET", "HEAD"):
            problem = self._csrf_problem(request, header)
            if problem is not None:
                return _refuse(403, "csrf", problem)
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _refuse(
                exc.status, "not_found" if exc.status == 404 else "bad_request", exc.reason
            )
        except SupervisorNotRunning as exc:
            return _refuse(503, "supervisor_not_running", exc.message)
        except AdminError as exc:
            return _refuse(exc.status, exc.code, exc.message)
        except Exception:  # boundary: a console bug must not take the supervisor down
            logger.exception("console error on %s %s", request.method, request.path)
            return _refuse(500, "internal_error", "internal error")

    def _csrf_problem(self, request: web.Request, header: str | None) -> str | None:
        if request.method != "POST":
            return "only POST changes anything"
        if not self._has_token(header):
            return "a change needs the token in the X-Hostcall-Token header"
        if request.content_type != "application/json":
            return "a change is a JSON request"
        origin = request.headers.get("Origin")
        if origin is not None and origin.removeprefix("http://") not in self._allowed_hosts():
            return "a change must come from the console's own page"
        if request.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
            return "a change must come from the console's own page"
        return None

    # -- the page ----------------------------------------------------------

    async def _index(self, request: web.Request) -> web.Response:
        html = (STATIC / "index.html").read_text()
        token = quote(self.token)
        html = html.replace("{{token}}", token)
        return web.Response(text=html, content_type="text/html")

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _STATIC_TYPES.get(name)
        if kind is None:
            raise web.HTTPNotFound(reason=f"no {name}")
        return web.Response(body=(STATIC / name).read_bytes(), content_type=kind)

    # -- data --------------------------------------------------------------

    async def _overview(self, request: web.Request) -> web.Response:
        invocations, proposals, stats = await asyncio.gather(
            self._admin.request("GET", "/v1/invocations"),
            # Large arguments as a preview: the page asks for them whole.
            self._admin.request("GET", "/v1/approvals?args=preview"),
            self._admin.request("GET", "/v1/stats"),
        )
        return web.json_response(
            {
                "now": time.time(),
                "connected": self._upstream,
                "invocations": _expect(invocations, list, "invocation list"),
                "approvals": _expect(proposals, list, "approval list"),
                "stats": _expect(stats, dict, "stats"),
            }
        )

    async def _invocation(self, request: web.Request) -> web.Response:
        invocation_id = request.match_info["invocation_id"]
        if not is_valid_id(invocation_id):
            raise web.HTTPNotFound(reason="no such invocation")
        base = f"/v1/invocations/{invocation_id}"
        invocation, activity, logs = await asyncio.gather(
            self._admin.request("GET", base),
            self._admin.request("GET", f"{base}/activity"),
            self._admin.request("GET", f"{base}/logs?tail=200"),
        )
        activity = _expect(activity, dict, "activity")
        logs = _expect(logs, dict, "logs")
        return web.json_response(
            {
                "now": time.time(),
                "invocation": _expect(invocation, dict, "invocation"),
                "calls": _expect(activity.get("calls"), list, "call list"),
                "calls_source": activity.get("source"),
                "logs": _expect(logs.get("logs"), list, "log list"),
            }
        )

    async def _receipts(self, request: web.Request) -> web.Response:
        invocations = _expect(
            await self._admin.request("GET", "/v1/invocations"), list, "invocation list"
        )
        newest = sorted(invocations, key=lambda i: i["created_at"], reverse=True)
        shown = [i["invocation_id"] for i in newest[:RECEIPTS_VERIFIED]]
        # All asked at once: the admin API verifies them one by one, and
        # answers one it is still verifying with a 503 (shown as such), not
        # the whole view's failure.
        reports = await asyncio.gather(*(self._receipt_report(i) for i in shown))
        return web.json_response(
            {"now": time.time(), "shown": len(reports), "of": len(invocations), "reports": reports}
        )

    async def _receipt_report(self, invocation_id: str) -> dict[str, Any]:
        try:
            report = _expect(
                await self._admin.request("GET", f"/v1/invocations/{invocation_id}/receipts"),
                dict,
                "receipt report",
            )
        except AdminError as exc:
            failed = {"status": exc.status, "code": exc.code, "message": exc.message}
            return {"invocation_id": invocation_id, "error": failed}
        return {**report, "invocation_id": invocation_id}

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.json_response({"interval_s": SAMPLE_INTERVAL_S, "samples": list(self._samples)})

    async def _proposal(self, request: web.Request) -> web.Response:
        """One proposal, its arguments whole (the overview lists large ones
        as a preview)."""
        proposal_id = request.match_info["proposal_id"]
        if not is_valid_id(proposal_id):
            raise web.HTTPNotFound(reason="no such proposal")
        proposal = await self._admin.request("GET", f"/v1/approvals/{proposal_id}")
        return web.json_response(_expect(proposal, dict, "proposal"))

    async def _decide(self, request: web.Request) -> web.Response:
        proposal_id = request.match_info["proposal_id"]
        decision = request.match_info["decision"]
        if decision not in ("approve", "reject") or not is_valid_id(proposal_id):
            raise web.HTTPNotFound(reason="no such decision")
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return _refuse(400, "bad_request", "the body must be JSON")
        if not isinstance(body, dict):
            return _refuse(400, "bad_request", "the body must be a JSON object")
        payload: dict[str, Any] = {"by": "console"}
        reason = body.get("reason")
        if decision == "reject" and isinstance(reason, str) and reason.strip():
            payload["reason"] = reason.strip()[:MAX_REASON]
        proposal = await self._admin.request(
            "POST", f"/v1/approvals/{proposal_id}/{decision}", payload
        )
        return web.json_response(proposal)

    # -- live --------------------------------------------------------------

    async def _events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.headers.update(_SECURITY_HEADERS)
        await response.prepare(request)
        with self._hub.subscribe() as subscription, contextlib.suppress(ConnectionError):
            await response.write(b"retry: 2000\nevent: hello\ndata: {}\n\n")
            while not self._closing.is_set():
                notices = await subscription.next(KEEPALIVE_S)
                if not notices:
                    await response.write(b": keepalive\n\n")
                    continue
                await response.write(
                    b"".join(
                        b"data: " + json.dumps(notice_json(n)).encode() + b"\n\n" for n in notices
                    )
                )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EVENT_BATCH_S):
                        await self._closing.wait()
        return response

    async def _follow(self) -> None:
        """Relay the admin API's notices to the pages, reconnecting while it is away."""
        while not self._closing.is_set():
            try:
                async for notice in self._admin.events():
                    if not self._upstream:
                        self._upstream = True
                        self._hub.publish(Topic.RESYNC)  # what changed while away
                    topic = notice.get("topic")
                    invocation_id = notice.get("invocation_id")
                    if isinstance(topic, str) and topic in _TOPICS:
                        self._hub.publish(Topic(topic), invocation_id)
            except (OSError, AdminError, SupervisorNotRunning, ValueError) as exc:
                logger.debug("console: the admin event stream broke: %s", exc)
            if self._upstream:
                self._upstream = False
                self._hub.publish(Topic.RESYNC)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RECONNECT_S):
                    await self._closing.wait()

    async def _sample(self) -> None:
        """Sample the call counters for the chart."""
        while not self._closing.is_set():
            with contextlib.suppress(OSError, AdminError, SupervisorNotRunning, ValueError):
                stats = await self._admin.request("GET", "/v1/stats")
                self._samples.append(
                    {
                        "t": time.time(),
                        "calls_by_outcome": stats.get("calls_by_outcome", {}),
                        "in_flight": stats.get("in_flight", 0),
                        "proposals_waiting": stats.get("proposals_waiting", 0),
                    }
                )
                self._hub.publish(Topic.METRICS)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAMPLE_INTERVAL_S):
                    await self._closing.wait()
