"""Error codes of the wire protocol and the one table that maps them to HTTP.

Every refusal or error a guest can see has a stable ``code`` (docs/protocol.md). The
HTTP status of a response is derived from that code here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = [
    "ERROR_STATUS",
    "HostcallError",
    "Refusal",
    "http_status_for",
]

#: docs/protocol.md, "What a response means": every error code and the HTTP status it is sent with.
ERROR_STATUS: Final[Mapping[str, int]] = {
    "bad_request": 400,
    "unauthenticated": 401,
    "plan_mismatch": 403,
    "execution_fenced": 403,
    "origin_denied": 403,
    "tool_not_allowed": 403,
    "approval_rejected": 403,
    "approval_expired": 403,
    "not_found": 404,
    # Not in the protocol's table: a known path with the wrong method (HTTP's own answer).
    "method_not_allowed": 405,
    "cancelled": 409,
    "payload_too_large": 413,
    "unsupported_media_type": 415,
    "invalid_arguments": 422,
    "target_required": 422,
    "call_id_reused": 422,
    "budget_exhausted": 429,
    "tool_error": 500,
    "result_invalid": 500,
    # Host faults: the store could not record the call, so it was not run.
    "store_unavailable": 503,
    # docs/security.md, S9: the connection was refused before any request was read.
    "too_many_connections": 503,
    "internal_error": 500,
}


def http_status_for(code: str) -> int:
    """The HTTP status a refusal or error with ``code`` is sent with."""
    return ERROR_STATUS.get(code, 500)


class HostcallError(Exception):
    """Root of every error hostcall raises on purpose, with a stable ``code``."""

    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        """The human-readable message (never holds a secret)."""
        return str(self.args[0]) if self.args else self.code


class Refusal(HostcallError):
    """The guest's request is refused; the handler was not called (``effect: none``)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        details: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.details = list(details) if details is not None else None
        #: The approval proposal this refusal came from, if any (for receipts).
        self.approval_id: str | None = None
