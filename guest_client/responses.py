"""What a response means (docs/protocol.md): a result, a call still pending, a call
with no record, or an error to raise.

Plain functions of a `Response`; no I/O. Every protocol violation the client
can see becomes a `ProtocolError` here, the one place where host data enters.
"""

from __future__ import annotations

from guest_client.errors import (
    EffectUnknown,
    HostcallError,
    ProtocolError,
    Refused,
    ResultInvalid,
    ToolError,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from guest_client.wire import Response

__all__ = [
    "Missing",
    "Pending",
    "Settled",
    "decode_body",
    "error_for",
    "interpret_call",
    "interpret_plan",
    "interpret_status",
]

# The `status` values of a call's state that GET /v1/calls/{id} may report.
_CALL_STATES = frozenset({"ok", "ambiguous", "awaiting_approval", "error", "refused"})


class Settled:
    """The call is done and succeeded; `result` is the tool's result."""

    __slots__ = ("body", "result")

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.result: Any = body["result"]


class Pending:
    """The call is not settled yet: running (`in_flight`) or waiting for an
    operator (`awaiting_approval`). Poll it."""

    __slots__ = ("body", "idempotency_key", "reason")

    def __init__(self, body: dict[str, Any], reason: str) -> None:
        self.body = body
        self.reason = reason
        self.idempotency_key = _text(body.get("idempotency_key"))


class Missing:
    """The host holds no record of the call (404 `not_found` on a GET).

    After an `in_flight`, this means the attempt that was running failed and
    its record was released: the call may be made again.
    """

    __slots__ = ("body",)

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body


def decode_body(response: Response, call_id: str | None = None) -> dict[str, Any]:
    """The response body as a JSON object.

    Raises:
        ProtocolError: It is not JSON, or not an object.
    """
    import json

    try:
        body = json.loads(response.body)
    except ValueError as exc:
        raise ProtocolError(
            f"the host answered HTTP {response.status} with a body that is not JSON",
            status=response.status,
            call_id=call_id,
        ) from exc
    if not isinstance(body, dict):
        raise ProtocolError(
            f"the host answered HTTP {response.status} with JSON that is not an object",
            status=response.status,
            call_id=call_id,
        )
    return body


def error_for(body: dict[str, Any], http_status: int, call_id: str | None = None) -> HostcallError:
    """The error a refusal, error or ambiguous body stands for."""
    status = body.get("status")
    raw_error = body.get("error")
    error: dict[str, Any] = raw_error if isinstance(raw_error, dict) else {}
    code = _text(error.get("code"))
    message = _text(error.get("message"))
    key = _text(body.get("idempotency_key"))
    context: dict[str, Any] = {
        "status": http_status,
        "call_id": _text(body.get("call_id")) or call_id,
        "idempotency_key": key,
        "response": body,
    }
    if status == "refused":
        details = error.get("details")
        return Refused(
            message or "the host refused the request; the tool did not run",
            code=code or "refused",
            details=details if isinstance(details, list) else None,
            **context,
        )
    if status == "ambiguous":
        reason = _text(body.get("reason")) or "unknown"
        return EffectUnknown(unknown_message(reason, key), reason=reason, **context)
    if status == "error":
        effect = body.get("effect")
        if code == "result_invalid":
            return ResultInvalid(
                "the tool ran and its effect happened, but its result is invalid"
                f" ({message or 'no detail'}); do not call it again under a new"
                " call_id",
                code=code,
                **context,
            )
        if code == "tool_error" or effect == "failed":
            return ToolError(
                message or "the tool raised an error",
                error_type=_text(error.get("type")),
                code=code or "tool_error",
                **context,
            )
        if effect == "none":
            return Refused(
                message or "the host failed before calling the tool",
                code=code or "error",
                **context,
            )
        # An error this client does not know, with the effect not ruled out:
        # the only safe reading is that the tool may have run.
        return EffectUnknown(
            f"the host reported an error ({message or 'no detail'}) and the tool "
            f"may have run; {_advice(key)}",
            reason="unknown",
            code=code or "error",
            **context,
        )
    return ProtocolError(
        f"the host answered HTTP {http_status} with an unknown status {status!r}",
        **context,
    )


def unknown_message(reason: str, idempotency_key: str | None) -> str:
    """Why an `EffectUnknown` was raised, and what to do about it."""
    if reason == "in_flight":
        what = "the call was still running when the deadline passed"
    elif reason == "awaiting_approval":
        what = (
            "the call was still awaiting approval when the deadline passed; "
            "it runs if an operator approves it"
        )
    else:
        what = "the outcome of the call is in doubt: the tool may have run"
    return f"{what}; {_advice(idempotency_key)}"


def _advice(idempotency_key: str | None) -> str:
    where = (
        f"ask the backend about idempotency_key={idempotency_key}"
        if idempotency_key
        else "ask the host with status(call_id)"
    )
    return f"do not call it again under a new call_id; {where}"


def interpret_call(
    response: Response, call_id: str, *, polling: bool
) -> Settled | Pending | Missing:
    """What a response to `POST /v1/calls` (or, `polling`, to
    `GET /v1/calls/{id}`) means for the call.

    Raises:
        HostcallError: The call was refused, failed, or its outcome is in
            doubt (the subclass says which).
    """
    body = decode_body(response, call_id)
    echoed = body.get("call_id")
    if echoed is not None and echoed != call_id:
        raise ProtocolError(
            f"the host answered about call_id {echoed!r}",
            status=response.status,
            call_id=call_id,
            response=body,
        )
    status = body.get("status")
    if status == "ok":
        if "result" not in body:
            raise ProtocolError(
                "the host answered ok without a result",
                status=response.status,
                call_id=call_id,
                response=body,
            )
        return Settled(body)
    if status == "ambiguous" and body.get("reason") == "in_flight":
        return Pending(body, "in_flight")
    if status == "awaiting_approval":
        return Pending(body, "awaiting_approval")
    if polling and status == "refused" and _code(body) == "not_found":
        return Missing(body)
    raise error_for(body, response.status, call_id)


def interpret_status(response: Response, call_id: str) -> dict[str, Any]:
    """The body of `GET /v1/calls/{id}`: the call's state, whatever it is.

    Raises:
        Refused: The request itself was refused (identity, bad request);
            a call with no record is not an error (`status: refused`,
            `error.code: not_found` is returned).
        ProtocolError: The body is not a call state.
    """
    body = decode_body(response, call_id)
    status = body.get("status")
    if status == "refused" and _code(body) != "not_found":
        raise error_for(body, response.status, call_id)
    if status not in _CALL_STATES:
        raise error_for(body, response.status, call_id)
    return body


def interpret_plan(response: Response) -> dict[str, Any]:
    """The body of `GET /v1/plan`.

    Raises:
        HostcallError: The request was refused (`Refused`) or the body is not
            a plan (`ProtocolError`).
    """
    body = decode_body(response)
    if response.status != 200:
        raise error_for(body, response.status)
    if not isinstance(body.get("tools"), list):
        raise ProtocolError("the host's plan has no list of tools", status=200, response=body)
    return body


def _code(body: dict[str, Any]) -> str | None:
    error = body.get("error")
    return _text(error.get("code")) if isinstance(error, dict) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
