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
from typing import IO, Any, Final, cast

from channel.server import DEFAULT_MAX_BODY, ChannelServer
from supervisor.admin import AdminServer
from supervisor.approvals import ApprovalController, Approver
from supervisor.broker import Broker
from supervisor.errors import InvocationMismatch
from supervisor.executions import Execution, ExecutionState, ExecutionTable
from supervisor.ids import is_valid_id, mint_credential, new_id
from supervisor.metrics import Metrics
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
        approver: Approver | None = None,
        plan: Plan | None = None,
        origin_check: bool = True,
        credential_transport: CredentialTransport = "fd",
        max_body: int = DEFAULT_MAX_BODY,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        self.state = StateDir(state_dir)
        self._store_spec = store
        self._store: EffectStore | None = None
        self.approvals = ApprovalController(approver)
        self.metrics = Metrics(self.approvals.waiting)
        #: The plan ``POST /v1/invocations`` launches guests under (``hostcall serve``).
        self.served_plan = plan
        self._origin_check = origin_check
        self._credential_transport: CredentialTransport = credential_transport
        self._max_body = max_body
        self._stop_grace_s = stop_grace_s
        self._executions = ExecutionTable()
        self._invocations: dict[str, _Invocation] = {}
        self._channel: ChannelServer | None = None
        self._admin: AdminServer | None = None
        self._launched: set[asyncio.Task[RunOutcome]] = set()
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
            self._admin = AdminServer(self, self.state.path / "admin.sock")
            await self._admin.start()
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop serving and release everything. Idempotent.

        Guests launched through the admin API are stopped (their trees ended);
        the caller's own :meth:`run` calls should have returned already.
        """
        for task in list(self._launched):
            task.cancel()
        if self._launched:
            await asyncio.gather(*self._launched, return_exceptions=True)
        for execution in self._executions:
            execution.end()
        if self._admin is not None:
            admin, self._admin = self._admin, None
            await admin.close()
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
                set(await self.store.revoked(invocation_id)),
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
            receipts=invocation.receipts,
            approvals=self.approvals,
            dispatch_blocker=lambda: execution.dispatch_blocker(),
            revoked=invocation.revoked,
            deadline_at=invocation.deadline_at,
            executor=self._executor,
            metrics=self.metrics,
        )
        execution = Execution(
            execution_id,
            invocation_id,
            plan.plan_hash,
            digest,
            broker,
            on_end=lambda ended: self.approvals.cancel_execution(ended.execution_id),
        )
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
        reason = "exited"
        try:
            if on_start is not None:
                maybe = on_start(execution)
                if maybe is not None:
                    await maybe
            reason = await _wait_for_guest(process, execution, timeout_s)
        finally:
            # The credential stops working the moment the execution ends.
            execution.end()
            await asyncio.shield(stop_tree(process, grace_s=self._stop_grace_s))
        timed_out = reason == "timeout"
        returncode = process.returncode
        signum = -returncode if returncode is not None and returncode < 0 else None
        if reason == "exited" and signum is not None:
            reason = "signalled"
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

    def executions(self, invocation_id: str | None = None) -> list[Execution]:
        """This supervisor's executions (of one invocation), oldest first."""
        if invocation_id is None:
            return list(self._executions)
        return self._executions.of_invocation(invocation_id)

    async def revoke(self, invocation_id: str, tool: str) -> None:
        """Refuse every later call and replay of ``tool`` in this invocation.

        Persisted in the effect store: it holds for later executions too.
        """
        await self.store.revoke(invocation_id, tool, time.time())
        invocation = self._invocations.get(invocation_id)
        if invocation is not None:
            invocation.revoked.add(tool)

    def cancel(self, execution_id: str) -> bool:
        """Cancel a live execution: its waiting proposals are cancelled, calls not yet
        dispatched are refused ``cancelled``, and its guest tree is stopped.

        Calls already past BeginDispatch run to completion and are recorded.
        Returns False if the execution is unknown or no longer live.
        """
        execution = self._executions.lookup(execution_id)
        if execution is None or not execution.live:
            return False
        execution.end(ExecutionState.CANCELLED)
        return True

    async def launch(
        self,
        argv: Sequence[str],
        *,
        invocation_id: str | None = None,
        timeout_s: float | None = None,
        plan: Plan | None = None,
    ) -> Execution:
        """Start a guest in the background (``POST /v1/invocations``); returns once
        it runs. The supervisor stops it on :meth:`aclose`.

        Raises:
            RuntimeError: no plan given and none served.
            OSError: the command could not be started.
        """
        plan = plan or self.served_plan
        if plan is None:
            raise RuntimeError("this supervisor serves no plan to launch guests under")
        started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            self.run(
                plan,
                argv,
                invocation_id=invocation_id,
                timeout_s=timeout_s,
                stdin=asyncio.subprocess.DEVNULL,
                on_start=started.set_result,
            )
        )
        self._launched.add(task)
        task.add_done_callback(self._launched.discard)
        task.add_done_callback(_log_failure)
        await asyncio.wait(
            [cast("asyncio.Future[object]", started), cast("asyncio.Future[object]", task)],
            return_when=asyncio.FIRST_COMPLETED,
        )
        if not started.done():
            task.result()  # raises why it did not start
            raise RuntimeError("the guest ended before it started")
        return started.result()


async def _wait_for_guest(
    process: asyncio.subprocess.Process, execution: Execution, timeout_s: float | None
) -> str:
    """Wait until the guest exits (``exited``), its execution is cancelled
    (``cancelled``) or the timeout passes (``timeout``).

    A fenced execution keeps running until it exits or times out: a newer
    attempt took over, and every call it makes is refused ``execution_fenced``.
    """
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    exited = asyncio.ensure_future(process.wait())
    stopped = asyncio.ensure_future(execution.ended.wait())
    waiting: set[asyncio.Future[Any]] = {exited, stopped}
    try:
        while not exited.done():
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            done, _ = await asyncio.wait(
                waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                return "timeout"
            if stopped in done:
                waiting.discard(stopped)
                if execution.state is not ExecutionState.FENCED:
                    return "cancelled"
        return "exited"
    finally:
        exited.cancel()
        stopped.cancel()


def _log_failure(task: asyncio.Task[RunOutcome]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a launched guest failed: %s", task.exception())
