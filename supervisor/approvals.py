"""Approvals (docs/approvals.md): proposals, their lease, and who may decide them.

A proposal is one concrete call — invocation, execution, call_id, tool,
canonical args, idempotency key — waiting for a human (or an ``approver``
callback) to decide. Its states, and the only moves between them, are the
table :data:`TRANSITIONS`. Approval means "may enter BeginDispatch", not "has
run": the broker claims an approved proposal (``approved → dispatched``) in
the same synchronous step as its liveness check, right before the effect
store's ``begin``. A lease that runs out or a cancel that lands before that
claim leaves the handler uncalled; one that lands after it cannot undo the
effect.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import io
import json
import logging
import time
import typing
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal, Protocol

from supervisor.errors import HostcallError
from supervisor.ids import new_id
from supervisor.timestamps import utc_timestamp

__all__ = [
    "ARGS_LISTED_BYTES",
    "ENDED",
    "ENDED_KEPT",
    "ENDED_KEPT_BYTES",
    "PROPOSAL_STATES",
    "TRANSITIONS",
    "ApprovalController",
    "ApprovalGate",
    "ApprovalTicket",
    "Approver",
    "Proposal",
    "ProposalNotFound",
    "ProposalNotWaiting",
    "ProposalRequest",
    "ProposalState",
    "next_state",
]

logger = logging.getLogger(__name__)

ProposalState = Literal["waiting", "approved", "rejected", "expired", "cancelled", "dispatched"]
#: Every state, in its lifecycle's order (``?state=`` of the admin API).
PROPOSAL_STATES: Final[tuple[ProposalState, ...]] = typing.get_args(ProposalState)
Event = Literal["approve", "reject", "expire", "cancel", "dispatch"]
#: States nothing moves a proposal out of.
ENDED: Final[frozenset[ProposalState]] = frozenset(
    {"rejected", "expired", "cancelled", "dispatched"}
)
#: Ended proposals listed (the newest); older ones are forgotten.
ENDED_KEPT: Final = 256
#: … and no more of them than hold this many bytes of arguments in all.
ENDED_KEPT_BYTES: Final = 32 * 1024 * 1024
#: Arguments over this many bytes (their JSON) are listed as a preview by
#: ``GET /v1/approvals?args=preview`` (the console's overview), so that a
#: guest's large calls cannot make a list of proposals too long to read;
#: ``GET /v1/approvals/{id}`` has them whole.
ARGS_LISTED_BYTES: Final = 16 * 1024
#: Characters of the JSON text such a preview shows.
ARGS_PREVIEW_CHARS: Final = 2048
_PREVIEW_ENCODER: Final = json.JSONEncoder(ensure_ascii=False, indent=2)
#: Rejected calls remembered, so that a retry is not asked again (F41).
REJECTED_KEPT: Final = 10_000

#: docs/approvals.md: ``waiting → approved | rejected | expired | cancelled``;
#: ``approved → dispatched | expired | cancelled``. Nothing else moves.
TRANSITIONS: Final[Mapping[tuple[ProposalState, Event], ProposalState]] = {
    ("waiting", "approve"): "approved",
    ("waiting", "reject"): "rejected",
    ("waiting", "expire"): "expired",
    ("waiting", "cancel"): "cancelled",
    ("approved", "dispatch"): "dispatched",
    ("approved", "expire"): "expired",
    ("approved", "cancel"): "cancelled",
}


def next_state(state: ProposalState, event: Event) -> ProposalState | None:
    """The state ``event`` moves ``state`` to, or ``None`` if it may not."""
    return TRANSITIONS.get((state, event))


class ProposalNotFound(HostcallError):
    """No proposal has this id."""

    code = "proposal_not_found"


class ProposalNotWaiting(HostcallError):
    """A decision was made on a proposal that is no longer ``waiting``."""

    code = "proposal_not_waiting"


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    """One concrete call that needs a decision before dispatch."""

    invocation_id: str
    execution_id: str
    call_id: str
    tool: str
    args: dict[str, Any]
    idempotency_key: str
    timeout_s: float
    #: The tool's tag, for the operator who decides (reversible, costly, irreversible).
    reversibility: str = "irreversible"


@dataclass(eq=False)
class Proposal:
    """An approval request for one call, with a lease (``expires_at``)."""

    id: str
    invocation_id: str
    execution_id: str
    call_id: str
    tool: str
    args: dict[str, Any]
    idempotency_key: str
    created_at: float
    expires_at: float
    reversibility: str = "irreversible"
    state: ProposalState = "waiting"
    decided_at: float | None = None
    decided_by: str | None = None
    reason: str | None = None
    _clock: Callable[[], float] = field(default=time.time, repr=False)
    _settled: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def approval_id(self) -> str:
        """The id receipts record as ``approval_id``."""
        return self.id

    @property
    def decision(self) -> ProposalState:
        """The state once the wait is over (what the broker acts on)."""
        return self.state

    def move(self, event: Event, *, by: str | None = None, reason: str | None = None) -> bool:
        """Apply ``event`` if the table allows it; whether it did."""
        target = next_state(self.state, event)
        if target is None:
            return False
        self.state = target
        if event != "dispatch":
            self.decided_at = self._clock()
            self.decided_by = by
            self.reason = reason
        self._settled.set()  # any move ends the wait for a decision
        return True

    def claim_dispatch(self) -> ProposalState:
        """BeginDispatch's half: ``approved → dispatched`` if the lease still runs.

        Synchronous on purpose: nothing can interleave between this and the
        broker's liveness check. Returns the state afterwards.
        """
        if self.state == "approved" and self._clock() >= self.expires_at:
            self.move("expire", by="lease")
        else:
            self.move("dispatch")
        return self.state

    @functools.cached_property
    def args_size(self) -> int:
        """Bytes of the arguments' JSON (measured once: they never change)."""
        return len(json.dumps(self.args, ensure_ascii=False, separators=(",", ":")).encode())

    def to_json(self, *, preview: bool = False) -> dict[str, Any]:
        """The stable JSON form (``hostcall approvals list --json``, admin API).

        ``preview``: arguments over :data:`ARGS_LISTED_BYTES` are ``null``,
        with ``args_preview`` (the start of their JSON text) instead; every
        proposal then says ``args_bytes``."""
        listed = self._listed() if preview else {}
        return {
            "id": self.id,
            "state": self.state,
            "invocation_id": self.invocation_id,
            "execution_id": self.execution_id,
            "call_id": self.call_id,
            "tool": self.tool,
            "args": self.args,
            "idempotency_key": self.idempotency_key,
            "reversibility": self.reversibility,
            "created_at": utc_timestamp(self.created_at),
            "expires_at": utc_timestamp(self.expires_at),
            "decided_at": utc_timestamp(self.decided_at) if self.decided_at else None,
            "decided_by": self.decided_by,
            "reason": self.reason,
            **listed,
        }

    def _listed(self) -> dict[str, Any]:
        if self.args_size <= ARGS_LISTED_BYTES:
            return {"args_bytes": self.args_size}
        return {"args": None, "args_bytes": self.args_size, "args_preview": self._args_preview}

    @functools.cached_property
    def _args_preview(self) -> str:
        """The start of the arguments' indented JSON, encoded only as far as
        it shows: indented whole, a megabyte nested deep is hundreds."""
        text = io.StringIO()
        for piece in _PREVIEW_ENCODER.iterencode(self.args):
            text.write(piece)
            if text.tell() >= ARGS_PREVIEW_CHARS:
                break
        return text.getvalue()[:ARGS_PREVIEW_CHARS]


class ApprovalTicket(Protocol):
    """What the broker holds after asking: a decision and the right to dispatch once."""

    @property
    def decision(self) -> ProposalState: ...

    @property
    def approval_id(self) -> str: ...

    def claim_dispatch(self) -> ProposalState: ...


class ApprovalGate(Protocol):
    """Opens a proposal and waits, bounded by its lease, for a decision."""

    async def request(self, proposal: ProposalRequest) -> ApprovalTicket: ...


#: ``approver(proposal)`` → True/"approve" (approve), False/"reject" (reject),
#: None (leave it to an operator); sync or async. A sync approver runs in a
#: worker thread, so it may block (e.g. ask on a terminal).
Approver = Callable[[Proposal], "bool | str | Awaitable[bool | str | None] | None"]


class ApprovalController:
    """Every proposal of one supervisor, and the decisions made on them."""

    def __init__(
        self,
        approver: Approver | None = None,
        *,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._approver = approver
        self._clock = clock
        self._on_change = on_change
        self._proposals: dict[str, Proposal] = {}
        #: Rejected calls, by (invocation, call_id, idempotency key): a retry of
        #: one is answered with its rejection, not asked again. The newest
        #: :data:`REJECTED_KEPT`; those no longer listed without their arguments.
        self._rejected: dict[tuple[str, str, str], Proposal] = {}

    # -- the broker's side ---------------------------------------------------

    async def request(self, request: ProposalRequest) -> Proposal:
        """Open a proposal and wait until it is decided or its lease runs out.

        A call an operator (or the approver) rejected stays rejected: its
        retry gets the same proposal back at once. A guest may not ask again
        until someone clicks approve; a new call is a new ``call_id``, and is
        listed as a new proposal.
        """
        call = (request.invocation_id, request.call_id, request.idempotency_key)
        rejected = self._rejected.get(call)
        if rejected is not None:
            return rejected
        now = self._clock()
        proposal = Proposal(
            id=new_id("apr"),
            invocation_id=request.invocation_id,
            execution_id=request.execution_id,
            call_id=request.call_id,
            tool=request.tool,
            args=request.args,
            idempotency_key=request.idempotency_key,
            created_at=now,
            expires_at=now + request.timeout_s,
            reversibility=request.reversibility,
            _clock=self._clock,
        )
        self._proposals[proposal.id] = proposal
        self._changed()
        asker = asyncio.create_task(self._ask(proposal)) if self._approver else None
        try:
            async with asyncio.timeout(max(0.0, proposal.expires_at - self._clock())):
                await proposal._settled.wait()
        except TimeoutError:
            if proposal.move("expire", by="lease"):
                self._changed()
        finally:
            if asker is not None and not asker.done():
                asker.cancel()
        if proposal.state == "rejected":
            # Forgotten already (rejected after 256 newer ones ended)? Then
            # without its arguments, as _forget_old keeps the others.
            listed = self._proposals.get(proposal.id) is proposal
            self._rejected[call] = proposal if listed else replace(proposal, args={})
            if len(self._rejected) > REJECTED_KEPT:
                del self._rejected[next(iter(self._rejected))]
        return proposal

    async def _ask(self, proposal: Proposal) -> None:
        assert self._approver is not None
        try:
            if inspect.iscoroutinefunction(self._approver):
                answer = await self._approver(proposal)
            else:
                answer = await asyncio.to_thread(self._approver, proposal)
                if inspect.isawaitable(answer):
                    answer = await answer
        except Exception:  # boundary: a broken approver leaves it to an operator
            logger.exception("approver failed on proposal %s", proposal.id)
            return
        if answer is None or proposal.state != "waiting":
            return
        approve = answer is True or answer in ("approve", "approved")
        reject = answer is False or answer in ("reject", "rejected")
        if approve or reject:
            proposal.move("approve" if approve else "reject", by="approver")
            self._changed()
        else:
            logger.error("approver answered %r on %s: ignored", answer, proposal.id)

    # -- the operator's side -------------------------------------------------

    def get(self, proposal_id: str) -> Proposal:
        """The proposal with this id.

        Raises:
            ProposalNotFound: no such proposal.
        """
        try:
            return self._proposals[proposal_id]
        except KeyError:
            raise ProposalNotFound(f"no proposal {proposal_id}") from None

    def list(self, state: str | None = None) -> list[Proposal]:
        """Proposals, oldest first, optionally only those in ``state``."""
        return [p for p in self._proposals.values() if state is None or p.state == state]

    def approve(self, proposal_id: str, *, by: str = "operator") -> Proposal:
        """Let a waiting call enter BeginDispatch.

        Raises:
            ProposalNotFound, ProposalNotWaiting.
        """
        return self._decide(proposal_id, "approve", by=by, reason=None)

    def reject(
        self, proposal_id: str, *, reason: str | None = None, by: str = "operator"
    ) -> Proposal:
        """Refuse a waiting call (the guest gets ``approval_rejected``).

        Raises:
            ProposalNotFound, ProposalNotWaiting.
        """
        return self._decide(proposal_id, "reject", by=by, reason=reason)

    def _decide(self, proposal_id: str, event: Event, *, by: str, reason: str | None) -> Proposal:
        proposal = self.get(proposal_id)
        if proposal.state == "waiting" and self._clock() >= proposal.expires_at:
            proposal.move("expire", by="lease")
        if proposal.state != "waiting" or not proposal.move(event, by=by, reason=reason):
            raise ProposalNotWaiting(f"proposal {proposal_id} is {proposal.state}, not waiting")
        self._changed()
        return proposal

    def cancel_execution(self, execution_id: str) -> int:
        """Cancel every undispatched proposal of an execution; how many."""
        cancelled = sum(
            proposal.move("cancel", by="supervisor")
            for proposal in self._proposals.values()
            if proposal.execution_id == execution_id
        )
        if cancelled:
            self._changed()
        return cancelled

    def waiting(self) -> int:
        """How many proposals wait for a decision."""
        return sum(p.state == "waiting" for p in self._proposals.values())

    def _changed(self) -> None:
        self._forget_old()
        if self._on_change is not None:
            self._on_change()

    def _forget_old(self) -> None:
        """Keep the newest ended proposals, at most :data:`ENDED_KEPT` and
        :data:`ENDED_KEPT_BYTES` of arguments: what a guest asks is never
        kept without bound (its arguments may be a megabyte)."""
        ended = [p for p in self._proposals.values() if p.state in ENDED]
        kept, held = 0, 0
        for proposal in reversed(ended):
            held += proposal.args_size
            if kept == ENDED_KEPT or (kept and held > ENDED_KEPT_BYTES):
                break
            kept += 1
        for proposal in ended[: len(ended) - kept]:
            del self._proposals[proposal.id]
            call = (proposal.invocation_id, proposal.call_id, proposal.idempotency_key)
            if self._rejected.get(call) is proposal:  # still answers its retries
                self._rejected[call] = replace(proposal, args={})
