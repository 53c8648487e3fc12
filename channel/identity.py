"""Identity checks of SPEC §4.1, in the order the spec fixes.

Bearer credential and execution, then invocation, then plan, then liveness,
then origin. The first failure decides the answer, so a request with a stale
credential learns ``execution_fenced`` and never reaches the origin check, and
an unauthenticated one learns nothing about calls or tools.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Any, Final

from channel.errors import Refusal
from channel.peer import is_in_guest_tree, peer_credentials
from channel.routing import ExecutionDirectory, ExecutionPort

__all__ = [
    "EXECUTION_HEADER",
    "INVOCATION_HEADER",
    "PLAN_HEADER",
    "authenticate",
    "check_origin",
]

EXECUTION_HEADER: Final = "Hostcall-Execution"
INVOCATION_HEADER: Final = "Hostcall-Invocation"
PLAN_HEADER: Final = "Hostcall-Plan"

# Compared against when the execution is unknown, so the work done does not
# tell an attacker which execution ids exist.
_NO_SUCH_CREDENTIAL: Final = hashlib.sha256(b"hostcall: no such execution").digest()
_UNAUTHENTICATED: Final = "missing or invalid credentials"


def _bearer_token(authorization: str | None) -> bytes | None:
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > 512:
        return None
    try:
        return token.encode("ascii")
    except UnicodeEncodeError:
        return None


def authenticate(headers: Mapping[str, str], directory: ExecutionDirectory) -> ExecutionPort:
    """Checks 1-4 of SPEC §4.1 on the request headers.

    Raises:
        Refusal: ``unauthenticated``, ``plan_mismatch`` or ``execution_fenced``.
    """
    token = _bearer_token(headers.get("Authorization"))
    execution_id = headers.get(EXECUTION_HEADER)
    execution = directory.lookup(execution_id) if execution_id else None
    expected = execution.credential_sha256 if execution is not None else _NO_SUCH_CREDENTIAL
    presented = hashlib.sha256(token if token is not None else b"").digest()
    if not hmac.compare_digest(presented, expected) or token is None or execution is None:
        raise Refusal("unauthenticated", _UNAUTHENTICATED)
    if headers.get(INVOCATION_HEADER) != execution.invocation_id:
        raise Refusal("unauthenticated", _UNAUTHENTICATED)
    if headers.get(PLAN_HEADER) != execution.plan_hash:
        raise Refusal("plan_mismatch", "Hostcall-Plan does not match the execution's plan")
    if not execution.live:
        raise Refusal(
            "execution_fenced", "this execution has ended, was cancelled or was superseded"
        )
    return execution


def check_origin(sock: Any, execution: ExecutionPort) -> None:
    """Check 5 of SPEC §4.1: the peer process belongs to the guest's tree.

    Raises:
        Refusal: ``origin_denied``.
    """
    guest_pid = execution.guest_pid
    try:
        peer = peer_credentials(sock, pidfd=False)
        if peer.pid != guest_pid:
            # Not the guest itself (our unreaped child): pin the process we inspect.
            peer = peer_credentials(sock)
    except OSError:
        raise Refusal("origin_denied", "the peer process could not be identified") from None
    try:
        allowed = guest_pid is not None and is_in_guest_tree(peer, guest_pid)
    finally:
        if peer.pidfd is not None:
            os.close(peer.pidfd)
    if not allowed:
        raise Refusal(
            "origin_denied", "the connecting process is not part of this execution's guest"
        )
