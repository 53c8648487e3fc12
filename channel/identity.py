"""Identity checks of docs/protocol.md, "Every request carries four headers", in their order.

Bearer credential and execution, then invocation, then plan, then liveness,
then origin. The first failure decides the answer, so a request with a stale
credential learns ``execution_fenced`` and never reaches the origin check, and
an unauthenticated one learns nothing about calls or tools.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from typing import Final

from channel.errors import Refusal
from channel.peer import Peer, is_in_guest_tree, peer_pidfd
from channel.routing import ExecutionDirectory, ExecutionPort

__all__ = [
    "EXECUTION_HEADER",
    "INVOCATION_HEADER",
    "PLAN_HEADER",
    "authenticate",
    "check_origin",
    "spells_credential",
]

EXECUTION_HEADER: Final = "Hostcall-Execution"
INVOCATION_HEADER: Final = "Hostcall-Invocation"
PLAN_HEADER: Final = "Hostcall-Plan"

# Compared against when the execution is unknown, so the work done does not
# tell an attacker which execution ids exist.
_NO_SUCH_CREDENTIAL: Final = hashlib.sha256(b"hostcall: no such execution").digest()
_UNAUTHENTICATED: Final = "missing or invalid credentials"
_NOT_THE_GUEST: Final = "the connecting process is not part of this execution's guest"
#: The uid a guest has when its execution names none; it cannot change.
_SUPERVISOR_UID: Final = os.getuid()


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


def authenticate(
    headers: Mapping[str, str], directory: ExecutionDirectory
) -> tuple[ExecutionPort, bytes]:
    """Checks 1-4 of docs/protocol.md, "Every request carries four headers" on
    the request headers. Returns the execution and the credential presented
    (the request's own: a call may not carry it, see :func:`spells_credential`).

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
    return execution, token


def spells_credential(credential: bytes, decoded: object) -> bool:
    """Whether ``decoded``, a parsed request body, holds ``credential``. The
    caller asks only of a body that has a JSON ``\\u`` escape and does not hold
    it verbatim (``credential in body``, on the hot path): SPEC §3, a call
    carrying it is refused, or it would reach the records and the logs."""
    return credential.decode() in json.dumps(decoded, ensure_ascii=False)


def check_origin(peer: Peer, execution: ExecutionPort, transport: asyncio.BaseTransport) -> None:
    """Check 5 of docs/protocol.md: the peer process belongs to the guest.

    ``peer`` is what the connection's peer was found to be when it was
    accepted. A sandboxed guest (``guest_pidns`` set) and everything it starts
    live in its sandbox's pid namespace and cannot leave it, so the peer must
    be in that namespace and have the guest's uid; that costs nothing per
    request. Otherwise the peer must be the guest process or one of its
    descendants, walked per request (``transport`` gives the pidfd that pins it).

    Raises:
        Refusal: ``origin_denied``.
    """
    guest_uid = execution.guest_uid
    if peer.uid != (_SUPERVISOR_UID if guest_uid is None else guest_uid):
        raise Refusal("origin_denied", _NOT_THE_GUEST)
    guest_pidns = execution.guest_pidns
    if guest_pidns is not None:
        # Its own namespace, and not one nested in another sandbox: namespace
        # inodes are reused as soon as they are freed, and a guest that can
        # make pid namespaces could otherwise chance upon this one's.
        if peer.pidns != guest_pidns or peer.group != ("pidns", guest_pidns):
            raise Refusal("origin_denied", _NOT_THE_GUEST)
        return
    guest_pid = execution.guest_pid
    if peer.pid == guest_pid:
        return  # our own unreaped child: its pid cannot have been reused
    try:
        pidfd = peer_pidfd(transport.get_extra_info("socket"))
    except OSError:
        raise Refusal("origin_denied", "the peer process could not be identified") from None
    try:
        allowed = guest_pid is not None and is_in_guest_tree(peer.pid, guest_pid, pidfd)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    if not allowed:
        raise Refusal("origin_denied", _NOT_THE_GUEST)
