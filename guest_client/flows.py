"""The client's operations as sans-IO flows.

A flow is a generator: it yields what to do next (`Request`, `Sleep`) and is
sent back what happened (a `Response` or a `TransportFailure` for a request,
None after a sleep). It returns the operation's value or raises its error.
All retry, polling and deadline decisions live here, so the sync client and
an async one drive the same logic and differ only in how they wait and send.
"""

from __future__ import annotations

import json

from guest_client.errors import EffectUnknown, ProtocolError, ToolError, TransportError
from guest_client.responses import (
    Missing,
    Pending,
    Settled,
    interpret_call,
    interpret_plan,
    interpret_status,
    unknown_message,
)
from guest_client.retry import backoff_delay
from guest_client.wire import (
    CALLS_PATH,
    PLAN_PATH,
    Request,
    Response,
    Sleep,
    TransportFailure,
    call_path,
    encode_call,
    validate_call_id,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Mapping
    from typing import Any, TypeAlias, TypeVar

    from guest_client.retry import Budget
    from guest_client.wire import Action, Reply

    T = TypeVar("T")
    Flow: TypeAlias = Generator[Action, Reply, T]

__all__ = ["call_flow", "plan_flow", "poll_wait", "status_flow"]

# docs/protocol.md, "Endpoints": `?wait=` is 0-60 s.
MAX_POLL_WAIT_S = 60
# Time the host gets, past `?wait=`, to answer a long-poll.
POLL_GRACE_S = 2.0
# The least time any request is given, even right at the deadline.
MIN_REQUEST_TIMEOUT_S = 0.1


def poll_wait(remaining: float) -> int:
    """The `?wait=` for a long-poll with `remaining` seconds left: whole
    seconds, at most 60, leaving `POLL_GRACE_S` for the answer to arrive."""
    return int(max(0.0, min(float(MAX_POLL_WAIT_S), remaining - POLL_GRACE_S)))


def call_flow(budget: Budget, call_id: str, tool: str, args: Mapping[str, Any] | None) -> Flow[Any]:
    """`POST /v1/calls` until the call settles; returns the tool's result.

    Transport failures resend the same body (same `call_id`, so the host runs
    it at most once). `ambiguous in_flight` long-polls the call. A call whose
    record vanished while polling (its running attempt failed and was
    released) is posted again, at most `policy.attempts` times in all.

    Raises (from the generator):
        Refused, ToolError, ResultInvalid, EffectUnknown, TransportError:
            See `guest_client.errors`.
        ValueError, TypeError: Bad `call_id`, `tool` or `args` (raised at
            once, before the flow starts).
    """
    body = encode_call(call_id, tool, args)
    return _call(budget, call_id, body)


def _call(budget: Budget, call_id: str, body: bytes) -> Flow[Any]:
    def post(timeout: float) -> Request:
        return Request("POST", CALLS_PATH, body, timeout)

    posts = 0
    key: str | None = None
    while True:
        posts += 1
        response = yield from _send(budget, post, call_id, posting=True, key=key)
        outcome = _interpreted(response, call_id, key, polling=False)
        if isinstance(outcome, Pending):
            key = outcome.idempotency_key or key
            outcome = yield from _settle(budget, call_id, outcome)
        if isinstance(outcome, Settled):
            return outcome.result
        # Missing: the attempt that was running failed and the host released
        # its record, reporting the error to that attempt's request, not ours.
        # Nothing is pending, so posting again is safe.
        if posts >= budget.policy.attempts or budget.remaining() <= 0:
            raise ToolError(
                f"the call failed {posts} time(s) in an attempt whose error went "
                "to another request; the host released it, calling again is safe",
                status=404,
                call_id=call_id,
                idempotency_key=key,
                response=outcome.body,
            )


def _interpreted(
    response: Response, call_id: str, key: str | None, *, polling: bool
) -> Settled | Pending | Missing:
    """:func:`interpret_call`, but an answer the protocol does not allow is one
    the host gave to a request it had: the tool may have run, so the error says
    so (calling again with the same `call_id` is safe and tells; a new one is not)."""
    try:
        return interpret_call(response, call_id, polling=polling)
    except ProtocolError as exc:
        exc.may_have_run = True
        exc.idempotency_key = exc.idempotency_key or key
        raise


def _settle(budget: Budget, call_id: str, pending: Pending) -> Flow[Settled | Missing]:
    """Long-poll `GET /v1/calls/{id}?wait=` until the call is no longer pending."""
    budget.may_have_run = True
    polls = 0
    asked = 0

    def poll(timeout: float) -> Request:
        nonlocal asked
        asked = poll_wait(timeout)
        return Request("GET", call_path(call_id, asked), None, min(timeout, asked + POLL_GRACE_S))

    while True:
        if budget.remaining() <= 0:
            raise EffectUnknown(
                unknown_message(pending.reason, pending.idempotency_key),
                reason=pending.reason,
                call_id=call_id,
                idempotency_key=pending.idempotency_key,
                response=pending.body,
            )
        started = budget.clock()
        response = yield from _send(budget, poll, call_id, key=pending.idempotency_key)
        outcome = _interpreted(response, call_id, pending.idempotency_key, polling=True)
        if not isinstance(outcome, Pending):
            return outcome
        if outcome.idempotency_key is None:
            outcome.idempotency_key = pending.idempotency_key
        pending = outcome
        polls += 1
        if budget.clock() - started < asked or asked == 0:
            # The host answered before the wait was up (it does not long-poll
            # this state, or little time is left): pause so as not to spin.
            delay = min(
                backoff_delay(budget.policy, polls, budget.uniform),
                budget.remaining(),
            )
            if delay > 0:
                yield Sleep(delay)


def status_flow(budget: Budget, call_id: str, wait: float | None) -> Flow[dict[str, Any]]:
    """`GET /v1/calls/{id}[?wait=]`; returns the call's state as the host
    reports it, `not_found` included.

    Raises (from the generator):
        Refused: The request itself was refused (identity, bad request).
        TransportError: The host could not be reached.
        ValueError: Bad `call_id` or `wait` (raised at once).
    """
    validate_call_id(call_id)
    if wait is not None and (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not 0 <= wait <= MAX_POLL_WAIT_S
    ):
        raise ValueError(f"wait must be 0-{MAX_POLL_WAIT_S} seconds, not {wait!r}")
    return _status(budget, call_id, wait)


def _status(budget: Budget, call_id: str, wait: float | None) -> Flow[dict[str, Any]]:
    def get(timeout: float) -> Request:
        if wait is None:
            return Request("GET", call_path(call_id), None, timeout)
        # The deadline wins: a wait that would outlast it is shortened, as a
        # call's long-poll is.
        asked = wait if timeout >= wait + POLL_GRACE_S else poll_wait(timeout)
        return Request("GET", call_path(call_id, asked), None, timeout)

    response = yield from _send(budget, get, call_id)
    return interpret_status(response, call_id)


def plan_flow(budget: Budget) -> Flow[dict[str, Any]]:
    """`GET /v1/plan`; returns the plan as the guest sees it.

    Raises (from the generator):
        Refused: The request was refused.
        TransportError: The host could not be reached.
    """

    def get(timeout: float) -> Request:
        return Request("GET", PLAN_PATH, None, timeout)

    response = yield from _send(budget, get, None)
    return interpret_plan(response)


def _send(
    budget: Budget,
    make_request: Callable[[float], Request],
    call_id: str | None,
    *,
    posting: bool = False,
    key: str | None = None,
) -> Flow[Response]:
    """One request, resent after transport failures with backoff, within the
    budget's attempts and deadline. `make_request` gets the time left; `key`
    is the call's idempotency key, when an earlier answer named it."""
    while True:
        reply = yield make_request(max(budget.remaining(), MIN_REQUEST_TIMEOUT_S))
        if isinstance(reply, Response) and _connection_refused(reply):
            # The host turned the connection away before reading any request
            # (this guest holds too many): nothing ran, so it is a transport
            # failure to retry like any other.
            reply = TransportFailure(
                "the host holds too many connections of this guest", request_sent=False
            )
        if isinstance(reply, Response):
            return reply
        if not isinstance(reply, TransportFailure):
            raise TypeError(
                f"a Request must be answered with a Response or a TransportFailure, not {reply!r}"
            )
        if posting and reply.request_sent:
            budget.may_have_run = True
        budget.failures += 1
        if budget.failures >= budget.policy.attempts:
            when = f"after {budget.failures} attempts"
            raise _gave_up(budget, reply, call_id, key, when) from reply
        delay = budget.next_delay()
        if delay >= budget.remaining():
            raise _gave_up(budget, reply, call_id, key, "before the deadline") from reply
        yield Sleep(delay)


def _connection_refused(response: Response) -> bool:
    """A 503 ``too_many_connections``: answered before any request was read."""
    if response.status != 503:
        return False
    try:
        body = json.loads(response.body)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and error.get("code") == "too_many_connections"


def _gave_up(
    budget: Budget, failure: TransportFailure, call_id: str | None, key: str | None, when: str
) -> TransportError:
    message = f"gave up on the host {when}: {failure}"
    if budget.may_have_run and call_id is not None:
        message += (
            "; the outcome is unknown: the call may have run. Calling again with "
            f"the same call_id ({call_id}) is safe and tells"
        )
    return TransportError(
        message, may_have_run=budget.may_have_run, call_id=call_id, idempotency_key=key
    )
