"""The errors a guest sees, split by what happened to the tool's effect.

Catch the class that answers the question you have:

* `Refused`: the host did not call the tool for this request. Nothing ran.
* `ToolError`: the tool ran and raised; no effect is in doubt and the host
  released the call, so calling again is safe.
* `ResultInvalid`: the tool ran and its effect happened, but its result broke
  the tool's output schema. Do not call again under a new `call_id`.
* `EffectUnknown`: the tool may be running or may have taken effect. Do not
  call again under a new `call_id`; ask the backend about `idempotency_key`.
* `TransportError`: the host could not be reached (or answered garbage) within
  the retry policy. If it says the call may have run, calling again with the
  *same* `call_id` is safe: the host runs each `call_id` at most once.

Every error carries `code`, `status`, `call_id`, `idempotency_key` and
`response`. No error message ever contains the credential: the messages are
built from response bodies, ids and OS error texts only.

Misuse by the calling program (a malformed `call_id`, a closed client) raises
`ValueError`, `TypeError` or `RuntimeError` instead, outside this hierarchy,
so that `except HostcallError` never hides a bug.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = [
    "ConfigurationError",
    "EffectUnknown",
    "HostcallError",
    "ProtocolError",
    "Refused",
    "ResultInvalid",
    "ToolError",
    "TransportError",
]


class HostcallError(Exception):
    """Root of every error the host, the channel or the environment reports.

    Attributes:
        message: What happened, in words.
        code: Stable machine-readable code: the wire's `error.code` for
            refusals and errors, `"ambiguous"` for an unknown outcome, or a
            client-side code such as `"transport_error"`.
        status: HTTP status of the response, or None when none arrived.
        call_id: The call this error is about, or None.
        idempotency_key: The host's idempotency key of the call, when the
            response named one.
        response: The parsed response body, or None.
    """

    default_code = "hostcall_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        call_id: str | None = None,
        idempotency_key: str | None = None,
        response: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.status = status
        self.call_id = call_id
        self.idempotency_key = idempotency_key
        self.response = response

    def _text(self) -> str:
        return self.message

    def __str__(self) -> str:
        context = []
        if self.status is not None:
            context.append(f"HTTP {self.status}")
        if self.call_id is not None:
            context.append(f"call_id={self.call_id}")
        suffix = f" ({', '.join(context)})" if context else ""
        return f"{self.code}: {self._text()}{suffix}"


class ConfigurationError(HostcallError):
    """This process was not started as a hostcall guest, or its environment
    (the `HOSTCALL_*` variables, the credential) is unusable."""

    default_code = "not_a_guest"


class Refused(HostcallError):
    """The host refused the request; the tool was not called for it.

    `code` names the reason (`budget_exhausted`, `tool_not_allowed`,
    `invalid_arguments`, `call_id_reused`, `unauthenticated`,
    `execution_fenced`, ...).

    Attributes:
        details: For `invalid_arguments`, the list of problems
            (`{"loc": [...], "msg": "..."}`); otherwise None.
    """

    default_code = "refused"

    def __init__(
        self,
        message: str,
        *,
        details: list[Any] | None = None,
        **context: Any,
    ) -> None:
        super().__init__(message, **context)
        self.details = details


class EffectUnknown(HostcallError):
    """The tool may have run: the outcome of the call is in doubt.

    Do not call again under a new `call_id`. Ask the backend whether the
    operation with `idempotency_key` happened, or ask the host later with
    `HostClient.status(call_id)`.

    Attributes:
        reason: `"unknown"` (the host does not know the outcome),
            `"in_flight"` (still running when the deadline passed) or
            `"awaiting_approval"` (still waiting for an operator when the
            deadline passed; it may run once approved).
    """

    default_code = "ambiguous"

    def __init__(self, message: str, *, reason: str, **context: Any) -> None:
        super().__init__(message, **context)
        self.reason = reason


class ToolError(HostcallError):
    """The tool ran and raised an error that leaves no effect in doubt.

    The host released the call, so calling again (with the same or a new
    `call_id`) is safe.

    Attributes:
        type: The exception type the tool raised, as the host reports it.
        message: The tool's error message.
    """

    default_code = "tool_error"

    def __init__(self, message: str, *, error_type: str | None = None, **context: Any) -> None:
        super().__init__(message, **context)
        self.type = error_type

    def _text(self) -> str:
        return f"{self.type}: {self.message}" if self.type else self.message


class ResultInvalid(HostcallError):
    """The tool ran and its effect happened, but its result is not valid.

    The result broke the tool's output schema or was not JSON. The host
    committed the call: the same `call_id` replays this error, and a new
    `call_id` would perform the effect a second time. This is deliberately
    not a `ToolError`, which means "safe to call again".
    """

    default_code = "result_invalid"


class TransportError(HostcallError):
    """The host could not be reached, or the exchange broke, within the retry
    policy's attempts and deadline.

    Attributes:
        may_have_run: True when a request of this call may have reached the
            host, so the tool may have run; calling again with the same
            `call_id` is safe and tells.
    """

    default_code = "transport_error"

    def __init__(self, message: str, *, may_have_run: bool = False, **context: Any) -> None:
        super().__init__(message, **context)
        self.may_have_run = may_have_run


class ProtocolError(TransportError):
    """The host answered something the protocol does not allow (not JSON, an
    unknown `status`, a missing field)."""

    default_code = "protocol_error"
