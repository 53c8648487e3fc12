"""The broker: one per execution, every call of that execution goes through it.

The pipeline (docs/protocol.md, "The call pipeline"), in its order: plan
lookup, canonicalize, replay check, target args, budget, approval,
BeginDispatch, handler, result and receipt. Every decision is a pure
function's — :mod:`supervisor.replay`, :mod:`supervisor.admission`,
:mod:`supervisor.budget` — and this module only loads, asks, persists and
acts, whatever transport brought the call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Set
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, ValidationError

from channel.frozen import fast_init
from channel.wire import CallReply
from supervisor.activity import MAX_ARGS_BYTES, Activity, CallEntry
from supervisor.admission import (
    budget_refusal,
    claim_refusal,
    decision_refusal,
    reused_refusal,
    target_refusal,
)
from supervisor.approvals import ApprovalGate, ApprovalTicket, ProposalRequest
from supervisor.canonical import (
    MAX_NESTING,
    idempotency_key_sized,
    jcs,
    nested_deeper_than,
    sha256_hex,
)
from supervisor.errors import Refusal, StoreUnavailable
from supervisor.faults import crash_point
from supervisor.metrics import Metrics
from supervisor.plan import Plan
from supervisor.receipts import ReceiptOutcome, Receipts, make_receipt
from supervisor.replay import Replay, decide_replay
from supervisor.stores.base import (
    Charge,
    EffectRecord,
    EffectStatus,
    EffectStore,
    NotPending,
    StartCall,
    budget_left,
)
from supervisor.timeouts import Deadline
from supervisor.tools import Tool, has_non_finite

__all__ = ["Broker"]

logger = logging.getLogger(__name__)

#: How often a long-poll re-reads a pending record that another process owns.
POLL_INTERVAL_S: Final = 0.05
#: The metrics label of calls to a tool the plan does not have.
NOT_IN_PLAN: Final = "(not in plan)"


@fast_init
@dataclass(frozen=True, slots=True)
class _Call:
    call_id: str
    tool: Tool
    model: BaseModel
    args: dict[str, Any]
    key: str
    started_at: float


@dataclass(eq=False, slots=True)
class _Admission:
    """A call between the replay check and BeginDispatch; retries join it."""

    tool: str
    key: str
    settled: asyncio.Future[CallReply | None]  # None: it crossed BeginDispatch
    awaiting_approval: bool = False


@dataclass(eq=False, slots=True)
class _Outcome:
    """What the pipeline decided, before the receipt is written."""

    reply: CallReply
    receipt_outcome: ReceiptOutcome
    #: sha256 hex of the result's JCS, for the receipt (``None``: no result).
    result_sha256: str | None = None
    approval_id: str | None = None
    #: Set when the receipt was recorded with the call's commit.
    receipt_id: str | None = None


@dataclass(eq=False)
class Broker:
    """Admits, approves, dispatches and records every call of one execution."""

    plan: Plan
    invocation_id: str
    execution_id: str
    store: EffectStore
    approvals: ApprovalGate
    receipts: Receipts
    #: Why the execution may not dispatch now (ended, cancelled, fenced), or None.
    dispatch_blocker: Callable[[], Refusal | None]
    revoked: Set[str] = frozenset()
    deadline_at: float | None = None
    executor: Executor | None = None
    metrics: Metrics | None = None
    #: Where the operator's console learns of each call (``None``: nobody asks).
    activity: Activity | None = None
    #: ``extra=`` of log records about this execution (its host log, see
    #: :mod:`supervisor.hostlog`).
    log_context: Mapping[str, Any] = field(default_factory=dict)
    clock: Callable[[], float] = time.time
    #: Calls of this execution by receipt outcome.
    outcomes: Counter[str] = field(default_factory=Counter)
    _admissions: dict[str, _Admission] = field(default_factory=dict)
    #: Calls past BeginDispatch, done when their outcome is recorded (long polls wait).
    _dispatched: dict[str, asyncio.Future[None]] = field(default_factory=dict)

    # -- the channel's port -------------------------------------------------

    async def call(self, call_id: str, tool: str, args: dict[str, Any]) -> CallReply:
        """Run one call through the pipeline and return its reply."""
        started_at = self.clock()
        resolved: Tool | None = None
        key: str | None = None
        canonical: dict[str, Any] | None = None
        size = 0
        try:
            resolved = self._lookup(tool)
            model, canonical = resolved.canonicalize(args)
            key, size = _key_of(resolved.name, canonical)
            outcome = await self._run(_Call(call_id, resolved, model, canonical, key, started_at))
        except Refusal as refusal:
            outcome = _Outcome(
                CallReply.refused(call_id, refusal, tool=tool, idempotency_key=key),
                ReceiptOutcome.REFUSED,
                approval_id=refusal.approval_id,
            )
        except StoreUnavailable as exc:
            logger.error("call %s of %s refused: %s", call_id, self.invocation_id, exc)
            unavailable = Refusal(
                "store_unavailable", "the effect store is unavailable; nothing ran"
            )
            outcome = _Outcome(
                CallReply.refused(call_id, unavailable, tool=tool, idempotency_key=key),
                ReceiptOutcome.REFUSED,
            )
        self.outcomes[outcome.receipt_outcome] += 1
        receipt_id = outcome.receipt_id
        if receipt_id is None:
            receipt = self._receipt(call_id, tool, key, outcome, started_at)
            await self.receipts.record(receipt)
            receipt_id = receipt["receipt_id"]
        if self.metrics is not None:
            # A name the guest made up is not a label: labels must stay few.
            label = tool if tool in self.plan.tools else NOT_IN_PLAN
            self.metrics.observe(label, outcome.receipt_outcome, self.clock() - started_at)
        if self.activity is not None:
            reply = outcome.reply
            error = reply.error
            entry = CallEntry(
                self.execution_id,
                call_id,
                tool,
                args if canonical is None else canonical,
                size or _size_of(args),
                reply.status,
                outcome.receipt_outcome,
                reply.effect,
                str(error["code"]) if error is not None else reply.reason,
                key,
                receipt_id,
                outcome.approval_id,
                started_at,
                self.clock(),
            )
            self.activity.call_finished(self.invocation_id, entry)
        if outcome.reply.status in ("ok", "error") and outcome.reply.effect != "failed":
            # The reply carries this request's own receipt, replayed or not.
            return outcome.reply.with_receipt(receipt_id)
        return outcome.reply

    async def status(self, call_id: str, wait_s: float) -> CallReply:
        """``GET /v1/calls/{id}``: the call's state, long-polling up to ``wait_s``."""
        deadline = time.monotonic() + wait_s
        while True:
            admission = self._admissions.get(call_id)
            if admission is not None:
                if not await _wait(admission.settled, deadline):
                    if admission.awaiting_approval:
                        return CallReply(
                            "awaiting_approval",
                            call_id,
                            "none",
                            tool=admission.tool,
                            idempotency_key=admission.key,
                        )
                    return _not_found(call_id)
                continue
            record = await self.store.get(self.invocation_id, call_id)
            if record is None:
                return _not_found(call_id)
            if record.status is not EffectStatus.PENDING or time.monotonic() >= deadline:
                return _reply_for_record(record)
            done = self._dispatched.get(call_id)
            if done is not None:
                await _wait(done, deadline)
            else:  # dispatched by an earlier execution or another process
                await asyncio.sleep(min(POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))

    async def plan_view(self) -> dict[str, Any]:
        """The plan as the guest sees it, with the budget left (docs/protocol.md, "Endpoints")."""
        record = await self.store.get_invocation(self.invocation_id)
        return {
            "plan_hash": self.plan.plan_hash,
            "name": self.plan.name,
            "tools": [
                # The rule in force: the plan may ask approval of every irreversible tool.
                {**t.describe(), "approval": "always" if self.plan.needs_approval(t) else "never"}
                for name, t in sorted(self.plan.tools.items())
                if name not in self.revoked
            ],
            "budget": budget_left(
                self.plan.budget, record.used if record is not None else None, self.deadline_at
            ),
            "approval_timeout_s": self.plan.approval_timeout_s,
        }

    # -- the pipeline ---------------------------------------------------------

    def _lookup(self, name: str) -> Tool:
        resolved = self.plan.tools.get(name)
        if resolved is None or name in self.revoked:
            raise Refusal("tool_not_allowed", f"tool {name!r} is not allowed by this plan")
        return resolved

    async def _run(self, call: _Call) -> _Outcome:
        # A transport retry of a call that is still being admitted joins it
        # instead of reserving budget or opening a proposal of its own.
        while (joined := self._admissions.get(call.call_id)) is not None:
            if (joined.tool, joined.key) != (call.tool.name, call.key):
                raise reused_refusal()
            settled = await asyncio.shield(joined.settled)
            if settled is not None:
                return _outcome_of(settled)
            dispatched = self._dispatched.get(call.call_id)
            if dispatched is not None and self.plan.needs_approval(call.tool):
                # It joined the proposal (SPEC §5.8) and shared its decision: it
                # shares the call's outcome too (replayed from the record), rather
                # than find the call in flight the moment it was approved.
                await asyncio.shield(dispatched)
        admission = _Admission(call.tool.name, call.key, asyncio.get_running_loop().create_future())
        self._admissions[call.call_id] = admission
        try:
            outcome = await self._admit(call, admission)
        except Refusal as refusal:
            # Joined retries of this call get the same refusal.
            admission.settled.set_result(
                CallReply.refused(
                    call.call_id, refusal, tool=call.tool.name, idempotency_key=call.key
                )
            )
            raise
        except BaseException:
            admission.settled.set_result(None)  # joiners re-check the store
            raise
        finally:
            del self._admissions[call.call_id]
        if isinstance(outcome, _Outcome):
            admission.settled.set_result(outcome.reply)
            return outcome
        admission.settled.set_result(None)
        # In this request's own task, no task of its own: a guest that hangs up
        # never cancels it (the channel turns aiohttp's handler cancellation
        # off). Only a shutdown may; _dispatch then marks the record unknown if
        # the store still answers, else the next start finds it pending and does.
        done = asyncio.get_running_loop().create_future()
        self._dispatched[call.call_id] = done
        if self.metrics is not None:
            self.metrics.in_flight += 1
        try:
            return await self._dispatch(call, outcome)
        finally:
            done.set_result(None)
            # A reversible call marked unknown may be dispatched again by a retry
            # before this one gets here: leave that one's entry alone.
            if self._dispatched.get(call.call_id) is done:
                del self._dispatched[call.call_id]
            if self.metrics is not None:
                self.metrics.in_flight -= 1

    def _start(self, call: _Call) -> StartCall:
        return StartCall(
            self.invocation_id,
            call.call_id,
            call.tool.name,
            call.key,
            self.execution_id,
            call.tool.reversible,
        )

    async def _admit(self, call: _Call, admission: _Admission) -> _Outcome | ApprovalTicket | None:
        """Steps 5-9, in their order; the decisions are :mod:`supervisor.admission`'s.

        Returns an outcome (answered without running anything), or the ticket
        (``None`` without approval) of a call that won BeginDispatch. A call
        that needs no approval has nothing between its budget and
        BeginDispatch, so its replay check, budget charge and ``pending``
        insert are one atomic store operation (one fsync); the replay check
        still comes first where a refusal would otherwise precede it.
        """
        tool = call.tool
        approval = self.plan.needs_approval(tool)
        target = target_refusal(tool.name, tool.reversibility, tool.target_args, call.args)
        if approval or target is not None:
            early = self._replay_outcome(  # step 5 on its own
                call, await self.store.get(self.invocation_id, call.call_id)
            )
            if early is not None:
                return early
            if target is not None:  # step 6
                raise target
        if not approval:
            return await self._begin_dispatch(
                call, None, Charge(tool.name, tool.cost, self.plan.budget, self.deadline_at)
            )
        if self.deadline_at is not None and self.clock() >= self.deadline_at:  # step 7
            raise budget_refusal("deadline")
        # An operator's rejection holds for the call's retries, also on another
        # supervisor or after a restart (this one's approvals remember it too).
        rejected = await self.store.rejection(self.invocation_id, call.call_id)
        if rejected is not None and rejected[0] == call.key:
            refused = decision_refusal("rejected", rejected[1])
            assert refused is not None
            raise refused
        # Durable: if this supervisor dies while the call waits, the next one's
        # store gives it back (the call never ran).
        charge = Charge(tool.name, tool.cost, self.plan.budget, self.deadline_at)
        reservation = await self.store.reserve(
            self.invocation_id, tool.name, tool.cost, self.plan.budget
        )
        if reservation is None:
            raise budget_refusal("limits")
        dispatched = False
        try:
            ticket = await self._approve(call, admission)  # step 8
            outcome = await self._begin_dispatch(call, ticket, charge, reservation)
            dispatched = outcome is ticket
            return outcome
        finally:
            if not dispatched:  # the reservation goes back: it never reached dispatch
                try:
                    await self.store.refund(reservation)
                except StoreUnavailable as exc:
                    # The store's next start gives it back; the call's own
                    # answer (or error) is what the guest must get.
                    logger.error(
                        "call %s: its reservation stays until restart: %s", call.call_id, exc
                    )

    async def _begin_dispatch(
        self,
        call: _Call,
        ticket: ApprovalTicket | None,
        charge: Charge,
        reservation: str | None = None,
    ) -> _Outcome | ApprovalTicket | None:
        """Step 9, the linearization point: the liveness check and the approval
        claim in one synchronous step (nothing interleaves), then the store's
        atomic insert (with the budget in the same step: ``reservation`` if
        the call has one still, else ``charge``). Returns
        ``ticket`` if the call won; an outcome if another request (or replica)
        had a record. A cancel or expiry after this point cannot stop it.

        Raises:
            Refusal: not live, the approval lapsed, or (with ``charge``) the budget.
        """
        blocked = self.dispatch_blocker()
        if blocked is not None:
            raise blocked
        # A reservation was made before the approval wait, and the store
        # checks the deadline only for a charge: no call dispatches after it.
        deadline = self.deadline_at
        if reservation is not None and deadline is not None and self.clock() >= deadline:
            raise budget_refusal("deadline")
        if ticket is not None:
            lapsed = claim_refusal(ticket.claim_dispatch(), ticket.approval_id)
            if lapsed is not None:
                raise lapsed
        crash_point("before_begin")
        begun = await self.store.begin(self._start(call), self.clock(), charge, reservation)
        if begun.won:
            crash_point("after_begin")
            return ticket
        early = self._replay_outcome(call, begun.record)
        if early is not None:
            return early
        # Only a charge can lose without a record to answer from: it did not fit.
        raise budget_refusal("deadline" if begun.exhausted == "deadline" else "limits")

    def _replay_outcome(self, call: _Call, record: EffectRecord | None) -> _Outcome | None:
        decision = decide_replay(record, call.tool.name, call.key, call.tool.reversible)
        if decision.action is Replay.CONTINUE:
            return None
        if decision.action is Replay.REUSED:
            raise reused_refusal()
        assert record is not None
        return _outcome_of(_reply_for_record(record))

    async def _approve(self, call: _Call, admission: _Admission) -> ApprovalTicket:
        """Step 8: open a proposal and wait, within its lease, for the decision."""
        admission.awaiting_approval = True
        try:
            ticket = await self.approvals.request(
                ProposalRequest(
                    self.invocation_id,
                    self.execution_id,
                    call.call_id,
                    call.tool.name,
                    call.args,
                    call.key,
                    self.plan.approval_timeout_s,
                    call.tool.reversibility,
                )
            )
        finally:
            admission.awaiting_approval = False
        if ticket.decision == "rejected":
            try:
                await self.store.reject(
                    self.invocation_id, call.call_id, call.key, ticket.approval_id, self.clock()
                )
            except StoreUnavailable as exc:  # this supervisor still remembers it
                logger.error("call %s: its rejection is not stored: %s", call.call_id, exc)
        refusal = decision_refusal(ticket.decision, ticket.approval_id)
        if refusal is not None:
            raise refusal
        return ticket

    async def _dispatch(self, call: _Call, ticket: ApprovalTicket | None) -> _Outcome:
        """Steps 10-11: run the handler once, then record what happened."""
        approval_id = ticket.approval_id if ticket is not None else None
        tool = call.tool
        ambiguous: tuple[type[BaseException], ...] = (*tool.ambiguous_errors, TimeoutError)
        unknown = self.store.mark_unknown
        in_doubt: BaseException | None = None
        try:
            async with Deadline(tool.timeout_s):
                raw = await self._invoke(tool, call.model)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                # The supervisor is shutting down mid-handler: the outcome is in doubt.
                await self._settle(unknown(self.invocation_id, call.call_id, self.clock()))
                raise
            # The handler's own: something it awaited was cancelled midway, which
            # leaves its effect in doubt, as a timeout does.
            in_doubt = exc
        except ambiguous as exc:
            in_doubt = exc
        except KeyboardInterrupt as exc:
            # In doubt: a SIGINT lands wherever the main thread is, after the
            # effect as likely as before. On the loop (an async handler) it may
            # be the operator's Ctrl-C, where Python turns SIGINT into
            # KeyboardInterrupt: recorded, then passed on. Anywhere else it is
            # the handler's own, and answered.
            if tool.is_async and _sigint_raises():
                await self._settle(unknown(self.invocation_id, call.call_id, self.clock()))
                raise
            in_doubt = exc
        except (Exception, SystemExit) as exc:  # boundary: any other error leaves no
            # effect; SystemExit too (argparse on bad input, sys.exit): a handler
            # must not stop the supervisor.
            self._log_raised("call %s: %s raised %s: %s", call, exc)
            await self._settle(self.store.release(self.invocation_id, call.call_id))
            reply = CallReply(
                "error",
                call.call_id,
                "failed",
                tool=tool.name,
                idempotency_key=call.key,
                error={"code": "tool_error", "type": type(exc).__name__, "message": str(exc)},
            )
            return _Outcome(reply, ReceiptOutcome.FAILED, approval_id=approval_id)
        if in_doubt is not None:
            self._log_raised("call %s: %s: outcome unknown (%s: %s)", call, in_doubt)
            await self._settle(unknown(self.invocation_id, call.call_id, self.clock()))
            reply = CallReply.ambiguous(call.call_id, tool.name, "unknown", call.key)
            return _Outcome(reply, ReceiptOutcome.UNKNOWN, approval_id=approval_id)
        crash_point("after_handler")
        try:
            result, digest, problem = _checked_result(tool, raw)
        except Exception as exc:  # boundary: a result's own code (a dict subclass …) failed
            result, digest, problem = None, None, f"the result cannot be checked: {exc!r}"[:500]
        if problem is None:
            reply = CallReply(
                "ok",
                call.call_id,
                "executed",
                tool=tool.name,
                result=result,
                idempotency_key=call.key,
            )
            outcome = _Outcome(reply, ReceiptOutcome.EXECUTED, digest, approval_id)
        else:
            logger.warning(
                "call %s: %s returned an invalid result: %s",
                call.call_id,
                tool.name,
                problem,
                extra=self.log_context,
            )
            reply = CallReply(
                "error",
                call.call_id,
                "executed",
                tool=tool.name,
                idempotency_key=call.key,
                error={"code": "result_invalid", "message": problem},
            )
            outcome = _Outcome(reply, ReceiptOutcome.RESULT_INVALID, approval_id=approval_id)
        receipt = self._receipt(call.call_id, tool.name, call.key, outcome, call.started_at)
        try:
            # The record and its receipt: one transaction where the store journals receipts.
            await self.receipts.commit(
                self.invocation_id, call.call_id, reply.to_json(), self.clock(), receipt
            )
        except StoreUnavailable as exc:
            # It ran, but we could not record it: the row stays pending and
            # becomes unknown at the next start. Never claim it did not run.
            logger.error("call %s ran but could not be committed: %s", call.call_id, exc)
            reply = CallReply.ambiguous(call.call_id, tool.name, "unknown", call.key)
            return _Outcome(reply, ReceiptOutcome.UNKNOWN, approval_id=approval_id)
        except NotPending as exc:
            # Another supervisor took the record from us (a replica whose lease
            # ran out is taken for dead) and says the outcome is in doubt: so
            # does the reply, or a retry would contradict it. Not ours to mark.
            logger.error("call %s ran but could not be committed: %s", call.call_id, exc)
            reply = CallReply.ambiguous(call.call_id, tool.name, "unknown", call.key)
            return _Outcome(reply, ReceiptOutcome.UNKNOWN, approval_id=approval_id)
        except Exception as exc:  # boundary: e.g. a reply the store cannot serialize
            # Nothing was committed (the store's own errors are StoreUnavailable):
            # the row is pending; mark it unknown now, not at the next start.
            logger.error("call %s ran but could not be committed: %r", call.call_id, exc)
            await self._settle(unknown(self.invocation_id, call.call_id, self.clock()))
            reply = CallReply.ambiguous(call.call_id, tool.name, "unknown", call.key)
            return _Outcome(reply, ReceiptOutcome.UNKNOWN, approval_id=approval_id)
        crash_point("before_reply")
        outcome.receipt_id = receipt["receipt_id"]
        return outcome

    def _log_raised(self, message: str, call: _Call, exc: BaseException) -> None:
        """What a handler raised, with its traceback, in this execution's host
        log: ``message`` takes the call id, the tool, the type and the text."""
        logger.warning(
            message,
            call.call_id,
            call.tool.name,
            type(exc).__name__,
            exc,
            exc_info=exc,
            extra=self.log_context,
        )

    async def _invoke(self, tool: Tool, model: BaseModel) -> Any:
        args, kwargs = tool.bind(model)
        handler = tool.handler
        if tool.is_async:
            return await _consume_async(handler(*args, **kwargs))
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self.executor, _call_sync, handler, args, kwargs)
        if inspect.isawaitable(result) or inspect.isasyncgen(result):
            return await _consume_async(result)
        return result

    async def _settle(self, write: Any) -> None:
        try:
            await write
        except StoreUnavailable as exc:
            # The row stays pending and becomes unknown at the next start.
            logger.error("cannot record a call's outcome: %s", exc)

    def _receipt(
        self,
        call_id: str,
        tool: str,
        key: str | None,
        outcome: _Outcome,
        started_at: float,
    ) -> dict[str, Any]:
        error = outcome.reply.error
        return make_receipt(
            invocation_id=self.invocation_id,
            execution_id=self.execution_id,
            plan_hash=self.plan.plan_hash,
            call_id=call_id,
            tool=tool,
            idempotency_key=key,
            outcome=outcome.receipt_outcome,
            error_code=str(error["code"]) if error is not None else outcome.reply.reason,
            result_sha256=outcome.result_sha256,
            approval_id=outcome.approval_id,
            started_at=started_at,
            finished_at=self.clock(),
        )


def _sigint_raises() -> bool:
    """Whether Python itself turns a SIGINT into KeyboardInterrupt here: on
    the main thread (Python raises it nowhere else), with its default handler
    installed (``run_until_complete`` with no handler of the loop's). Not
    under ``hostcall run`` or ``serve``, nor after a host program's
    ``loop.add_signal_handler``, nor on a loop in another thread.
    ``asyncio.run`` cancels its main task on the first Ctrl-C; a second one,
    or a host's own handler that raises, is taken for the handler's own."""
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )


def _key_of(tool: str, canonical_args: dict[str, Any]) -> tuple[str, int]:
    """The idempotency key, and the size of the JCS it hashes."""
    try:
        return idempotency_key_sized(tool, canonical_args)
    except ValueError as exc:
        # Valid JSON that is not I-JSON: lone surrogates, integers past 2**53.
        raise Refusal(
            "invalid_arguments",
            "arguments cannot be canonicalized (RFC 8785)",
            details=[{"loc": [], "msg": str(exc)}],
        ) from None


def _size_of(args: Any) -> int:
    """About how large arguments that were never canonicalized are."""
    try:
        return len(json.dumps(args, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        return MAX_ARGS_BYTES + 1  # not kept


def _call_sync(handler: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = handler(*args, **kwargs)
    if isinstance(result, Iterator) and not isinstance(result, (str, bytes)):
        return list(result)  # a lazy result is consumed inside the dispatch
    return result


#: What a handler usually returns: nothing to await or consume (checked by
#: exact type first: the ABC checks below are slow).
_PLAIN: Final = frozenset({dict, list, str, int, float, bool, type(None)})


async def _consume_async(result: Any) -> Any:
    if inspect.iscoroutine(result):  # the usual: an async def's (never an async iterator)
        result = await result
    elif isinstance(result, AsyncIterator):
        return [item async for item in result]
    elif inspect.isawaitable(result):
        result = await result
    if type(result) in _PLAIN:
        return result
    if isinstance(result, Iterator) and not isinstance(result, (str, bytes)):
        return list(result)
    return result


def _checked_result(tool: Tool, raw: Any) -> tuple[Any, str | None, str | None]:
    """The JSON result and the sha256 of its JCS (checking it is JSON makes
    that JCS once), or the reason it is invalid (docs/protocol.md ``result_invalid``)."""
    result = raw
    if tool.output_nulls_non_finite and has_non_finite(raw):
        # Its serializer would write them as null: a value the tool never returned.
        return None, None, "the result is not JSON: it holds NaN or an infinity"
    if tool.output_adapter is not None:
        try:
            result = tool.output_adapter.dump_python(
                tool.output_adapter.validate_python(raw), mode="json"
            )
        except (ValidationError, ValueError, TypeError) as exc:
            return None, None, f"the result does not match {tool.name}'s output schema: {exc}"
    try:
        canonical = jcs(result)
    except ValueError as exc:
        return None, None, f"the result is not JSON: {exc}"
    # Each level of arrays or objects writes two bytes, so only a long result
    # can be too deep: one that passed here could fail to be written or
    # replayed later, where the stack is deeper (a committed call's 500).
    if len(canonical) > 2 * MAX_NESTING and nested_deeper_than(result, MAX_NESTING):
        return None, None, f"the result is not JSON: nested more than {MAX_NESTING} levels"
    return result, sha256_hex(canonical), None


def _reply_for_record(record: EffectRecord) -> CallReply:
    if record.status is EffectStatus.COMMITTED:
        assert record.response is not None
        return CallReply.from_json(record.response).as_replayed()
    reason: Literal["in_flight", "unknown"] = (
        "in_flight" if record.status is EffectStatus.PENDING else "unknown"
    )
    return CallReply.ambiguous(record.call_id, record.tool, reason, record.idempotency_key)


def _outcome_of(reply: CallReply) -> _Outcome:
    """The outcome of a request answered without running anything now."""
    if reply.effect == "replayed":
        digest = sha256_hex(jcs(reply.result)) if reply.status == "ok" else None
        return _Outcome(reply, ReceiptOutcome.REPLAYED, digest)
    if reply.status == "ambiguous":
        return _Outcome(reply, ReceiptOutcome.UNKNOWN)
    return _Outcome(reply, ReceiptOutcome.REFUSED)


def _not_found(call_id: str) -> CallReply:
    return CallReply.refused(call_id, Refusal("not_found", "no call with this call_id"))


async def _wait(future: asyncio.Future[Any], deadline: float) -> bool:
    """Wait for ``future`` until ``deadline`` (monotonic); whether it is done."""
    remaining = deadline - time.monotonic()
    if remaining > 0 and not future.done():
        await asyncio.wait([future], timeout=remaining)
    return future.done()
