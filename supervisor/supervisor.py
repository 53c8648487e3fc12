"""The :class:`Supervisor`: owns the state dir, the store and the channel, runs guests."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Final

from channel.server import DEFAULT_MAX_BODY, ChannelServer
from supervisor.approvals import ApprovalGate, ApproveAll
from supervisor.broker import Broker
from supervisor.errors import InvocationMismatch
from supervisor.executions import Execution, ExecutionState, ExecutionTable
from supervisor.ids import is_valid_id, mint_credential, new_id
from supervisor.plan import Plan
from supervisor.process import (
    STOP_GRACE_S,
    CredentialTransport,
    GuestIdentity,
    guest_environment,
    launch_guest,
    stop_tree,
)
from supervisor.receipts import ReceiptLog
from supervisor.statedir import StateDir
from supervisor.stores import EffectStore, store_from_spec

__all__ = ["ExecutionOutcome", "RunOutcome", "Supervisor"]

logger = logging.getLogger(__name__)

#: First pause before relaunching a failed attempt; doubles each time.
ATTEMPT_BACKOFF_S: Final = 0.5
ATTEMPT_BACKOFF_MAX_S: Final = 10.0
#: Worker threads for sync handlers (each blocked handler holds one).
HANDLER_THREADS: Final = 64


@dataclass(frozen=True, slots=True)
class ExecutionOutcome:
    """How one attempt ended."""

    execution_id: str
    exit_code: int | None
    signal: int | None
    timed_out: bool
    reason: str  # exited | signalled | timeout | cancelled | launch_failed
    duration_s: float
    calls: Mapping[str, int]

    @property
    def exit_status(self) -> int:
        """The shell's convention: the code, 128+N for signal N, 124 for a timeout."""
        if self.timed_out:
            return 124
        if self.signal is not None:
            return 128 + self.signal
        return self.exit_code if self.exit_code is not None else 1


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a :meth:`Supervisor.run` ended: the last attempt decides the status."""

    invocation_id: str
    executions: tuple[ExecutionOutcome, ...]

    @property
    def last(self) -> ExecutionOutcome:
        """The final attempt."""
        return self.executions[-1]

    @property
    def execution_id(self) -> str:
        """The final attempt's execution id."""
        return self.last.execution_id

    @property
    def exit_code(self) -> int | None:
        """The final attempt's exit code (``None`` if a signal ended it)."""
        return self.last.exit_code

    @property
    def exit_status(self) -> int:
        """What ``hostcall run`` exits with."""
        return self.last.exit_status


@dataclass(eq=False)
class _Invocation:
    plan: Plan
    receipts: ReceiptLog
    deadline_at: float | None
    revoked: set[str] = field(default_factory=set)


class Supervisor:
    """Runs guests and serves their tool calls through one channel.

    Use as ``async with Supervisor(state_dir=...) as sup:``; the state dir is
    locked for as long as the supervisor runs.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str] = ".hostcall",
        *,
        store: EffectStore | str | None = None,
        approver: ApprovalGate | None = None,
        origin_check: bool = True,
        credential_transport: CredentialTransport = "fd",
        max_body: int = DEFAULT_MAX_BODY,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.state = StateDir(state_dir)
        self._store_spec = store
        self._store: EffectStore | None = None
        self._approvals: ApprovalGate = approver or ApproveAll()
        self._origin_check = origin_check
        self._credential_transport: CredentialTransport = credential_transport
        self._max_body = max_body
        self._stop_grace_s = stop_grace_s
        self._executions = ExecutionTable()
        self._invocations: dict[str, _Invocation] = {}
        self._channel: ChannelServer | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.recovered_unknown = 0

    # -- lifecycle ------------------------------------------------------------

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def store(self) -> EffectStore:
        """The effect store (open while the supervisor runs)."""
        if self._store is None:
            raise RuntimeError("the supervisor is not running")
        return self._store

    @property
    def socket_path(self) -> Path:
        """The channel's Unix socket."""
        return self.state.run_dir / "channel.sock"

    async def start(self) -> None:
        """Lock the state dir, open the store (pending rows become unknown), serve."""
        self.state.acquire()
        try:
            spec = self._store_spec
            if spec is None:
                spec = os.environ.get("HOSTCALL_STORE")
            store = spec if spec is not None and not isinstance(spec, str) else None
            self._store = store or store_from_spec(
                spec if isinstance(spec, str) else None, self.state.path
            )
            self.recovered_unknown = await self._store.open()
            if self.recovered_unknown:
                logger.warning(
                    "%d call(s) were in flight when the last supervisor stopped: now unknown",
                    self.recovered_unknown,
                )
            self._executor = ThreadPoolExecutor(HANDLER_THREADS, "hostcall-handler")
            self._channel = ChannelServer(
                self._executions,
                self.socket_path,
                origin_check=self._origin_check,
                max_body=self._max_body,
            )
            await self._channel.start()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop serving and release everything. Idempotent."""
        for execution in self._executions:
            execution.end()
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
        if self._store is not None:
            store, self._store = self._store, None
            await store.close()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=False, cancel_futures=True)
        self.state.release()

    # -- running guests ---------------------------------------------------------

    async def run(
        self,
        plan: Plan,
        argv: Sequence[str],
        *,
        invocation_id: str | None = None,
        timeout_s: float | None = None,
        attempts: int = 1,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        on_start: Callable[[Execution], Awaitable[None] | None] | None = None,
    ) -> RunOutcome:
        """Run a guest for an invocation until it exits; relaunch up to ``attempts``.

        A new ``invocation_id`` starts an invocation; an existing one resumes it
        as a new execution: its budget, effect records and receipts carry over
        and its older executions are fenced.

        Raises:
            InvocationMismatch: the invocation exists with another plan.
            OSError: the command could not be started.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        invocation_id = invocation_id or new_id("inv")
        if not is_valid_id(invocation_id):
            raise ValueError("invocation ids are 1-128 characters of [A-Za-z0-9._:-]")
        invocation = await self._open_invocation(plan, invocation_id)
        outcomes: list[ExecutionOutcome] = []
        for attempt in range(attempts):
            if attempt:
                delay = min(ATTEMPT_BACKOFF_S * 2 ** (attempt - 1), ATTEMPT_BACKOFF_MAX_S)
                await asyncio.sleep(delay)
            outcome = await self._run_once(
                plan,
                invocation_id,
                invocation,
                argv,
                timeout_s,
                env=env,
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                on_start=on_start,
            )
            outcomes.append(outcome)
            if outcome.exit_status == 0:
                break
        return RunOutcome(invocation_id, tuple(outcomes))

    async def _open_invocation(self, plan: Plan, invocation_id: str) -> _Invocation:
        now = time.time()
        deadline = now + plan.budget.deadline_s if plan.budget.deadline_s is not None else None
        record, _ = await self.store.open_invocation(invocation_id, plan.plan_hash, deadline, now)
        if record.plan_hash != plan.plan_hash:
            raise InvocationMismatch(
                f"invocation {invocation_id} runs under plan {record.plan_hash}, "
                f"not {plan.plan_hash}: resume it with the plan it started with"
            )
        invocation = self._invocations.get(invocation_id)
        if invocation is None:
            invocation = _Invocation(
                plan,
                ReceiptLog(self.state.receipts_dir / f"{invocation_id}.jsonl"),
                record.deadline_at,
            )
            self._invocations[invocation_id] = invocation
        return invocation

    async def _run_once(
        self,
        plan: Plan,
        invocation_id: str,
        invocation: _Invocation,
        argv: Sequence[str],
        timeout_s: float | None,
        *,
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike[str] | None,
        stdin: int | IO[Any] | None,
        stdout: int | IO[Any] | None,
        stderr: int | IO[Any] | None,
        on_start: Callable[[Execution], Awaitable[None] | None] | None,
    ) -> ExecutionOutcome:
        for older in self._executions.of_invocation(invocation_id):
            older.end(ExecutionState.FENCED)
        execution_id = new_id("exe")
        credential, digest = mint_credential()
        execution: Execution
        broker = Broker(
            plan=plan,
            invocation_id=invocation_id,
            execution_id=execution_id,
            store=self.store,
            approvals=self._approvals,
            receipts=invocation.receipts,
            is_live=lambda: execution.live,
            revoked=invocation.revoked,
            deadline_at=invocation.deadline_at,
            executor=self._executor,
        )
        execution = Execution(execution_id, invocation_id, plan.plan_hash, digest, broker)
        self._executions.add(execution)
        identity = GuestIdentity(str(self.socket_path), invocation_id, execution_id, plan.plan_hash)
        started = time.monotonic()
        try:
            process = await launch_guest(
                argv,
                env=guest_environment(os.environ if env is None else env, identity),
                credential=credential,
                transport=self._credential_transport,
                cwd=cwd,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
            )
        except BaseException:
            execution.end()
            raise
        del credential  # the supervisor keeps only the digest
        execution.guest_pid = process.pid
        execution.process = process
        execution.state = ExecutionState.RUNNING
        timed_out = False
        try:
            if on_start is not None:
                maybe = on_start(execution)
                if maybe is not None:
                    await maybe
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                timed_out = True
        finally:
            # The credential stops working the moment the execution ends.
            execution.end()
            await asyncio.shield(stop_tree(process, grace_s=self._stop_grace_s))
        returncode = process.returncode
        signum = -returncode if returncode is not None and returncode < 0 else None
        if timed_out:
            reason = "timeout"
        elif signum is not None:
            reason = "signalled"
        else:
            reason = "exited"
        return ExecutionOutcome(
            execution_id=execution_id,
            exit_code=returncode if returncode is not None and returncode >= 0 else None,
            signal=signum,
            timed_out=timed_out,
            reason=reason,
            duration_s=time.monotonic() - started,
            calls=dict(broker.outcomes),
        )

    # -- inspection ------------------------------------------------------------

    def execution(self, execution_id: str) -> Execution | None:
        """An execution of this supervisor, live or ended."""
        return self._executions.lookup(execution_id)

    def revoke(self, invocation_id: str, tool: str) -> None:
        """Refuse every later call and replay of ``tool`` in this invocation."""
        invocation = self._invocations.get(invocation_id)
        if invocation is None:
            raise KeyError(invocation_id)
        invocation.revoked.add(tool)
