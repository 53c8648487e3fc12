"""The :class:`Supervisor`: owns the state dir, the store and the channel, runs guests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Final, cast

from channel.imports import Imports
from channel.server import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_CONNECTIONS_PER_GROUP,
    ChannelServer,
)
from supervisor.activity import Activity, Topic
from supervisor.admin import AdminServer
from supervisor.approvals import ApprovalController, Approver
from supervisor.broker import Broker
from supervisor.cgroups import CgroupHost
from supervisor.errors import HostcallError, InvocationMismatch, SupervisorClosing, WasmBusy
from supervisor.executions import Execution, ExecutionState, ExecutionTable
from supervisor.guests import GuestLauncher
from supervisor.hostlog import HostLog, about
from supervisor.ids import is_path_safe_id, mint_credential, new_id
from supervisor.limits import EndReason, Limits
from supervisor.logs import (
    EXECUTION_OUTPUT_LIMIT,
    INVOCATION_OUTPUT_LIMIT,
    GuestLog,
    OutputBudget,
    Passthrough,
    Redactor,
    pump,
)
from supervisor.metrics import Metrics
from supervisor.outcomes import ExecutionOutcome, RunOutcome
from supervisor.plan import Plan
from supervisor.process import (
    STOP_GRACE_S,
    CredentialTransport,
    GuestIdentity,
    guest_environment,
    wait_exited,
)
from supervisor.protection import protect_process, unprotect_process
from supervisor.receipts import Receipts
from supervisor.sandbox import GUEST_SOCKET, SandboxHost
from supervisor.sandbox.start import StartAbandoned
from supervisor.spawn import GuestProcess
from supervisor.statedir import StateDir
from supervisor.stores import EffectStore, store_from_spec
from supervisor.terminal import StdinRelay, is_terminal
from supervisor.tracking import TreeTracker, become_subreaper

if TYPE_CHECKING:
    from supervisor.wasm import Compiled, ModuleCache, WasmGuest, WasmOutcome

__all__ = ["ExecutionOutcome", "Limits", "RunOutcome", "Supervisor"]

logger = logging.getLogger(__name__)

#: First pause before relaunching a failed attempt; doubles each time.
ATTEMPT_BACKOFF_S: Final = 0.5
ATTEMPT_BACKOFF_MAX_S: Final = 10.0
#: Worker threads for sync handlers (each blocked handler holds one).
HANDLER_THREADS: Final = 64
#: WebAssembly guests stopped while asleep in WASI, still holding their thread
#: and memory, past which no new WebAssembly guest starts (docs/wasm.md).
MAX_ASLEEP_WASM: Final = 8
#: Beyond the stop's grace periods, how long a stop may take to be reported.
STOPPED_SLACK_S: Final = 5.0


@dataclass(eq=False)
class _Invocation:
    plan: Plan
    receipts: Receipts
    deadline_at: float | None
    #: Output all its executions here may still keep (docs/security.md, S9).
    output: OutputBudget
    revoked: set[str] = field(default_factory=set)


class Supervisor:
    """Runs guests and serves their tool calls through one channel.

    Use as ``async with Supervisor(state_dir=...) as sup:``; the state dir is
    locked for as long as the supervisor runs.

    Every guest runs in a sandbox (docs/sandbox.md) unless ``sandbox=False``;
    ``guest_uid`` is the uid guests run as when the supervisor is root
    (default 65534). Each guest may hold ``max_connections_per_execution``
    channel connections, idle ones closed after ``idle_timeout_s``; its output
    is cut at ``execution_output_limit`` bytes, and all of an invocation's at
    ``invocation_output_limit``.
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
        execution_output_limit: int = EXECUTION_OUTPUT_LIMIT,
        invocation_output_limit: int = INVOCATION_OUTPUT_LIMIT,
        sandbox: bool = True,
        guest_uid: int | None = None,
        max_connections_per_execution: int = DEFAULT_MAX_CONNECTIONS_PER_GROUP,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.state = StateDir(state_dir)
        #: Whether guests run in a sandbox (docs/sandbox.md); the default.
        self.sandboxed = sandbox
        self._guest_uid = guest_uid
        self._max_connections = max_connections_per_execution
        self._idle_timeout_s = idle_timeout_s
        self._launcher: GuestLauncher | None = None
        self._store_spec = store
        self._store: EffectStore | None = None
        #: Change notices and recent calls, for the console (``GET /v1/events``).
        self.activity = Activity()
        self.approvals = ApprovalController(
            approver, on_change=lambda: self.activity.changed(Topic.APPROVALS)
        )
        self.metrics = Metrics(self.approvals.waiting)
        #: The plan ``POST /v1/invocations`` launches guests under (``hostcall serve``).
        self.served_plan = plan
        #: The limits every guest launched that way runs under (``hostcall serve
        #: --memory …``); a request's ``timeout_s`` overrides their timeout.
        self.launch_limits = Limits()
        self._origin_check = origin_check
        self._credential_transport: CredentialTransport = credential_transport
        self._max_body = max_body
        self._stop_grace_s = stop_grace_s
        self._execution_output_limit = execution_output_limit
        self._invocation_output_limit = invocation_output_limit
        self._tracker = TreeTracker()
        self._executions = ExecutionTable()
        self._invocations: dict[str, _Invocation] = {}
        #: Every plan this supervisor has run an invocation under, by hash.
        self._plans: dict[str, Plan] = {} if plan is None else {plan.plan_hash: plan}
        self._receipt_logs: weakref.WeakValueDictionary[str, Receipts] = (
            weakref.WeakValueDictionary()
        )
        self._channel: ChannelServer | None = None
        self._admin: AdminServer | None = None
        self._launched: set[asyncio.Task[RunOutcome]] = set()
        #: Wind-downs under way (held here: the loop keeps only weak references).
        self._stopping: set[asyncio.Future[ExecutionOutcome]] = set()
        #: Set by aclose(): from then on, no guest is launched.
        self._closing = False
        self._executor: ThreadPoolExecutor | None = None
        self._cgroups: CgroupHost | None = None
        self._host_log: HostLog | None = None
        #: Whether this supervisor holds the process non-dumpable (protection).
        self._protecting = False
        self._module_cache: ModuleCache | None = None  # made with the first WebAssembly guest
        #: WebAssembly guests that did not stop in time, until they end.
        self._asleep: set[asyncio.Future[WasmOutcome]] = set()
        #: Where WebAssembly guests' calls come in (their socket, so to speak).
        self._imports = Imports(max_body)
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
        """Lock the state dir, open the store (pending rows become unknown), serve.

        Raises:
            SandboxError: a sandbox was asked for and this host cannot give one.
            StateDirBusy: another supervisor runs on the state dir.
        """
        self._closing = False  # a supervisor closed before may be started again
        sandbox_host = None
        if self.sandboxed:
            # First: a host that cannot sandbox must not get half a supervisor.
            sandbox_host = await asyncio.to_thread(SandboxHost.probe, self._guest_uid)
        self.state.acquire()
        try:
            # Not dumpable, enough descriptors (docs/sandbox.md: the supervisor protects itself).
            protect_process()
            self._protecting = True
            # Orphans of a guest's tree become our children, not init's: none escapes.
            become_subreaper()
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
                max_connections_per_group=self._max_connections,
                idle_timeout_s=self._idle_timeout_s,
            )
            await self._channel.start()
            channel, imports = self._channel, self._imports
            self._store.set_load_hint(lambda: channel.active_requests + imports.active)
            cgroups = None
            if sandbox_host is not None:
                cgroups = await asyncio.to_thread(CgroupHost.detect)
                if sandbox_host.root:
                    # The guest's uid must reach the socket bound into its sandbox;
                    # nobody else can: its folder stays 0700, root's.
                    account = sandbox_host.account
                    os.chown(self.socket_path, account.uid, account.gid)
            self._cgroups = cgroups
            self._launcher = GuestLauncher(
                self._tracker,
                sandbox=sandbox_host,
                cgroups=cgroups,
                state_dir=self.state.path,
                socket_path=self.socket_path,
                hidden=[self.state.run_dir] if self.state.run_dir.parent != self.state.path else [],
                credential_transport=self._credential_transport,
            )
            self._admin = AdminServer(self, self.state.path / "admin.sock")
            await self._admin.start()
            self._host_log = HostLog(
                self.state.logs_dir, lambda e: self._executions.lookup(e) is not None
            )
            logging.getLogger("supervisor").addHandler(self._host_log)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Stop serving and release everything. Idempotent.

        From its start, no guest is launched (:class:`SupervisorClosing`, the
        admin API's ``POST /v1/invocations`` too). Guests launched through the
        admin API are stopped (their trees ended). The caller's own :meth:`run`
        calls should have returned already; any still running, or still
        starting, get their execution ended, and their guests are stopped
        before this returns (bounded).
        """
        self._closing = True
        for task in list(self._launched):
            task.cancel()
        if self._launched:
            await asyncio.gather(*self._launched, return_exceptions=True)
        unretired = [e for e in self._executions if e.outcome is None]
        for execution in unretired:
            execution.end()  # a run still waiting on its guest winds it down now
        # Until each is retired (every process of it ended) or, for one that
        # was still starting, could not start; bounded.
        # (Each wind-down in _stopping retires an execution among these.)
        retired = [asyncio.ensure_future(e.stopped.wait()) for e in unretired]
        if retired:
            await asyncio.wait(retired, timeout=self._stop_grace_s * 3 + STOPPED_SLACK_S)
        for waiting in retired:
            waiting.cancel()
        if self._host_log is not None:
            logging.getLogger("supervisor").removeHandler(self._host_log)
            self._host_log = None
        await self._tracker.close()
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
        if self._cgroups is not None:
            cgroups, self._cgroups = self._cgroups, None
            with contextlib.suppress(OSError):
                cgroups.close()
        self._launcher = None
        if self._protecting:
            self._protecting = False
            unprotect_process()
        self.state.release()

    # -- running guests ---------------------------------------------------------

    async def run(
        self,
        plan: Plan,
        argv: Sequence[str],
        *,
        invocation_id: str | None = None,
        timeout_s: float | None = None,
        limits: Limits | None = None,
        attempts: int = 1,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin: int | IO[Any] | None = None,
        stdout: int | IO[Any] | None = None,
        stderr: int | IO[Any] | None = None,
        on_start: Callable[[Execution], Awaitable[None] | None] | None = None,
        wasm: str | os.PathLike[str] | None = None,
    ) -> RunOutcome:
        """Run a guest for an invocation until it ends; relaunch up to ``attempts``.

        A new ``invocation_id`` starts an invocation; an existing one resumes it
        as a new execution: its budget, effect records and receipts carry over
        and its older executions are fenced. A guest that exits non-zero is
        relaunched (with backoff) until ``attempts`` are used up.

        ``stdout``/``stderr`` left as ``None`` pass the guest's output through
        to this process's own and keep it under ``<state_dir>/logs/``; anything
        else is handed to the guest as is (and not logged).

        With ``wasm``, the guest is that WebAssembly module (docs/wasm.md) and
        ``argv`` its arguments: it sees ``[module file name, *argv]``, an
        environment of ``env`` (else nothing) and the ``HOSTCALL_*`` names,
        and no socket. ``stdin`` and ``cwd`` do not apply.

        Raises:
            InvocationMismatch: the invocation exists with another plan.
            OSError: the command (or module) could not be started. (When a
                relaunch cannot, the attempts before it are returned, with
                :attr:`RunOutcome.error` saying why.)
            WasmError: the module is not one hostcall can run.
            WasmBusy: too many WebAssembly guests stopped while asleep in WASI
                have not woken yet (:data:`MAX_ASLEEP_WASM`).
            SupervisorClosing: :meth:`aclose` has begun. (On a relaunch, the
                attempts before it are returned, as for one that cannot start.)
            Whatever ``on_start`` raises, as it is (its guest is stopped and
            its execution retired all the same).

        An async ``on_start`` still running when its guest exits by itself,
        its execution ends (a cancel, a fence, a limit, :meth:`aclose`) or its
        timeout passes is cancelled, and the guest stopped for that reason
        (``exited``, …). The timeout counts from the start.
        """
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        self._check_open()
        if timeout_s is not None:
            limits = Limits(
                timeout_s=timeout_s,
                memory_bytes=limits.memory_bytes if limits else None,
                cpu_s=limits.cpu_s if limits else None,
                max_processes=limits.max_processes if limits else None,
                max_open_files=limits.max_open_files if limits else None,
            )
        invocation_id = invocation_id or new_id("inv")
        if not is_path_safe_id(invocation_id):
            raise ValueError("invocation ids are 1-128 characters of [A-Za-z0-9._:-], not . or ..")
        module = Path(wasm) if wasm is not None else None
        with self._while_open():
            if module is not None:
                self._check_wasm_room()
                await self._wasm_modules(module)  # refuses a bad module before any invocation
            await self._open_invocation(plan, invocation_id)  # refuses a mismatched plan first
        launch = _Launch(
            argv, limits or Limits(), env, cwd, stdin, stdout, stderr, on_start, module
        )
        outcomes: list[ExecutionOutcome] = []
        for attempt in range(attempts):
            if attempt:
                delay = min(ATTEMPT_BACKOFF_S * 2 ** (attempt - 1), ATTEMPT_BACKOFF_MAX_S)
                await asyncio.sleep(delay)
            failure: OSError | HostcallError | None = None
            try:
                with _not_started(), self._while_open():  # else: the attempts that ran
                    invocation = await self._open_invocation(plan, invocation_id)
                outcome = await self._run_once(plan, invocation_id, invocation, launch)
            except _NotStarted as not_started:
                failure = not_started.error
            if failure is not None:
                if not outcomes:
                    raise failure  # outside the except: no _NotStarted in its context
                # The attempts before it ran: their outcomes are the answer.
                why = f"attempt {attempt + 1} could not start: {failure}"
                logger.error("invocation %s: %s", invocation_id, why)
                return RunOutcome(invocation_id, tuple(outcomes), why)
            outcomes.append(outcome)
            if outcome.exit_status == 0 or outcome.reason in ("cancelled", "fenced"):
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
        self._plans.setdefault(plan.plan_hash, plan)
        invocation = self._invocations.get(invocation_id)
        if invocation is None:
            path = self.state.receipts_dir / f"{invocation_id}.jsonl"
            receipts = self._receipt_logs.get(str(path))
            if receipts is None:
                # One writer per file, even while an ended execution's handler
                # still finishes: the chain must never fork.
                receipts = self._receipt_logs[str(path)] = self.store.receipts(path, self._executor)
            invocation = _Invocation(
                plan,
                receipts,
                record.deadline_at,
                OutputBudget.for_invocation(
                    self.state.logs_dir / invocation_id, self._invocation_output_limit
                ),
                set(await self.store.revoked(invocation_id)),
            )
            self._invocations[invocation_id] = invocation
        return invocation

    def _check_open(self) -> None:
        if self._closing:
            raise SupervisorClosing("the supervisor is closing: it launches no guest any more")

    @contextlib.contextmanager
    def _while_open(self) -> Iterator[None]:
        """Code that prepares a launch across awaits: refused once aclose()
        has begun, before it or after it; and what fails in it if aclose()
        began meanwhile (the store closed under it, say) is that,
        :class:`SupervisorClosing`."""
        self._check_open()
        try:
            yield
        except Exception as exc:
            if not self._closing:
                raise
            raise SupervisorClosing(
                "the supervisor is closing: it launches no guest any more"
            ) from exc
        self._check_open()

    def _new_execution(
        self,
        plan: Plan,
        invocation_id: str,
        invocation: _Invocation,
        digest: bytes,
        launch: _Launch,
    ) -> Execution:
        """A new execution of the invocation, routable but not yet started:
        its older ones are fenced once its guest has started (:meth:`_fence_older`).

        Raises:
            SupervisorClosing: aclose() has begun. Checked here, with no
                await before the execution is registered: aclose() sees
                every execution that may still launch a guest.
        """
        self._check_open()
        execution_id = new_id("exe")
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
            activity=self.activity,
            log_context=about(invocation_id, execution_id, self.state.logs_dir),
        )
        execution = Execution(
            execution_id,
            invocation_id,
            plan.plan_hash,
            digest,
            broker,
            argv=tuple(launch.argv) if launch.wasm is None else (str(launch.wasm), *launch.argv),
            limits=launch.limits,
            on_end=self._execution_ended,
        )
        self._executions.add(execution)
        self.activity.changed(Topic.INVOCATIONS, invocation_id)
        return execution

    def _fence_older(self, execution: Execution) -> None:
        """Its guest has started: every older execution of its invocation is
        fenced (SPEC §2). Not before the start: a new attempt that cannot
        start (a typo in a resumed invocation's command) leaves the one
        running live. Both are live while the new one starts: a call of
        either is answered as it would be a moment earlier or later, each
        ``call_id`` still at most once (the store decides that, not the fence)."""
        if not execution.live:  # a newer one started first and fenced it
            return
        for other in self._executions.of_invocation(execution.invocation_id):  # oldest first
            if other is execution:
                return  # newer ones (still starting) are not this one's to fence
            other.end(ExecutionState.FENCED)

    def _execution_ended(self, execution: Execution) -> None:
        self.approvals.cancel_execution(execution.execution_id)
        self.activity.changed(Topic.INVOCATIONS, execution.invocation_id)

    async def _run_once(
        self, plan: Plan, invocation_id: str, invocation: _Invocation, launch: _Launch
    ) -> ExecutionOutcome:
        launcher = self._launcher
        if launcher is None:
            raise RuntimeError("the supervisor is not running")
        if launch.wasm is not None:
            return await self._run_wasm_once(plan, invocation_id, invocation, launch, launch.wasm)
        credential, digest = mint_credential()
        with _not_started():
            execution = self._new_execution(plan, invocation_id, invocation, digest, launch)
        socket = GUEST_SOCKET if launcher.sandbox is not None else self.socket_path
        identity = _identity(plan, execution, str(socket))
        capture_out = launch.stdout is None
        capture_err = launch.stderr is None
        # A sandboxed guest never gets the operator's terminal (see supervisor.terminal).
        relay_stdin = launch.stdin is None and launcher.sandbox is not None and is_terminal(0)

        started = time.monotonic()
        try:
            with _not_started():
                guest = await launcher.start(
                    execution.execution_id,
                    launch.argv,
                    env=guest_environment(
                        os.environ if launch.env is None else launch.env, identity
                    ),
                    credential=credential,
                    limits=launch.limits,
                    on_violation=execution.stop_for,
                    policy=plan.sandbox,
                    plan_key=plan.plan_hash,
                    plan_path=plan.path,
                    cwd=launch.cwd,
                    stdin=asyncio.subprocess.PIPE if relay_stdin else launch.stdin,
                    stdout=asyncio.subprocess.PIPE if capture_out else launch.stdout,
                    stderr=asyncio.subprocess.PIPE if capture_err else launch.stderr,
                    ended=execution.ended,
                )
        except StartAbandoned as abandoned:
            # Ended (a cancel, a fence, aclose()) while its sandbox was built:
            # its guest never ran, and it fences nothing.
            execution.sandbox = abandoned.sandbox
            outcome = _without_guest(execution, _why_ended(execution), started)
            self._retire(execution, outcome)
            return outcome
        except BaseException:
            self._never_started(execution)
            raise
        self._fence_older(execution)
        process = guest.process
        execution.started(
            process,
            pidns=guest.pidns,
            uid=launcher.sandbox.account.uid if launcher.sandbox is not None else None,
            sandbox=guest.sandbox,
        )
        self.activity.changed(Topic.INVOCATIONS, invocation_id)
        if relay_stdin and process.stdin is not None:
            StdinRelay.shared().attach(process.stdin)
        pumps = self._start_pumps(
            execution,
            invocation,
            credential.encode(),
            process.stdout if capture_out else None,
            process.stderr if capture_err else None,
        )
        del credential  # the redactors hold it until the guest's output ends
        reason: EndReason = "cancelled"  # unless it ends by itself or for a limit
        try:
            deadline = _deadline(launch.limits.timeout_s)
            reason = await _started(
                launch, execution, deadline, lambda: wait_exited(process)
            ) or await _wait_for_guest(process, execution, deadline)
        finally:
            # The credential stops working the moment the execution ends.
            execution.end()
            if relay_stdin and process.stdin is not None:
                StdinRelay.shared().detach(process.stdin)

            async def stop() -> ExecutionOutcome:
                await guest.stop(self._stop_grace_s)
                await self._drain(pumps)
                # Its calls' live count, not a copy: a dispatched call runs on after
                # its guest has gone (nothing cancels it halfway), counted when it ends.
                return guest.outcome(reason, time.monotonic() - started, execution.calls())

            outcome = await self._wind_down(execution, stop(), reason, started)
        return outcome

    async def _wind_down(
        self,
        execution: Execution,
        stop: Coroutine[Any, Any, ExecutionOutcome],
        reason: EndReason,
        started: float,
    ) -> ExecutionOutcome:
        """Stop what is left of an ended execution's guest, then retire it.
        Shielded, and awaited by aclose() too: a run cancelled, or whose
        ``on_start`` raised, still ends every process of its guest, and its
        execution still gets its outcome. It never raises into the run: if
        stopping fails, that is logged and the outcome says only ``reason``."""

        async def stop_then_retire() -> ExecutionOutcome:
            outcome: ExecutionOutcome | None = None
            try:
                outcome = await stop
            except Exception:  # boundary: the run's own error or cancel goes on
                logger.exception(
                    "stopping the guest of %s failed",
                    execution.execution_id,
                    extra=about(
                        execution.invocation_id, execution.execution_id, self.state.logs_dir
                    ),
                )
            finally:
                if outcome is None:
                    outcome = _without_guest(execution, reason, started)
                self._retire(execution, outcome)
            return outcome

        stopping = asyncio.ensure_future(stop_then_retire())
        self._stopping.add(stopping)
        stopping.add_done_callback(self._stopping.discard)
        return await asyncio.shield(stopping)

    async def _drain(self, pumps: list[asyncio.Task[None]]) -> None:
        """Let the guest's output pumps log what is left (bounded)."""
        if pumps:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._stop_grace_s):
                    await asyncio.shield(asyncio.gather(*pumps, return_exceptions=True))

    def _retire(self, execution: Execution, outcome: ExecutionOutcome) -> None:
        """It ended and nothing of it runs: keep its outcome, free the rest."""
        self._executions.retire(execution, outcome)
        self._forget_if_idle(execution.invocation_id)

    def _never_started(self, execution: Execution) -> None:
        """Its guest could not start: the caller is told why (the exception),
        and the execution is not kept as one that ran and has no outcome."""
        execution.end()
        self._executions.discard(execution)
        self._forget_if_idle(execution.invocation_id)
        execution.stopped.set()  # nothing of it runs: aclose() need not wait for it

    def _forget_if_idle(self, invocation_id: str) -> None:
        self.activity.changed(Topic.INVOCATIONS, invocation_id)
        if not any(e.live for e in self._executions.of_invocation(invocation_id)):
            # Nothing of it runs here now; a resume rebuilds it from the store.
            self._invocations.pop(invocation_id, None)

    async def _run_wasm_once(
        self,
        plan: Plan,
        invocation_id: str,
        invocation: _Invocation,
        launch: _Launch,
        module_path: Path,
    ) -> ExecutionOutcome:
        """One attempt of a WebAssembly guest: an instance bound to a new
        execution, its calls through the same broker (docs/wasm.md)."""
        from supervisor.wasm import WasmGuest

        with _not_started():
            self._check_wasm_room()  # again for each attempt: others may have fallen asleep
            compiled = await self._wasm_modules(module_path)
        _, digest = mint_credential()  # nobody holds it: no socket call can be this execution
        with _not_started():
            execution = self._new_execution(plan, invocation_id, invocation, digest, launch)
        env = guest_environment(launch.env or {}, _identity(plan, execution, None))
        started = time.monotonic()
        try:
            with _not_started():
                guest = WasmGuest(
                    compiled,
                    [module_path.name, *launch.argv],
                    env,
                    execution,
                    launch.limits,
                    imports=self._imports,
                    workdir=plan.sandbox.workdir,
                    # Its instance (or a start section's first call) is its start:
                    # a module that cannot be linked fences nothing.
                    on_instance=lambda: self._fence_older(execution),
                )
        except BaseException:
            self._never_started(execution)
            raise
        execution.started_wasm(guest.sandbox)
        self.activity.changed(Topic.INVOCATIONS, invocation_id)
        pumps = self._start_pumps(
            execution,
            invocation,
            b"",
            guest.stdout.reader if launch.stdout is None else None,
            guest.stderr.reader if launch.stderr is None else None,
        )
        running = asyncio.ensure_future(guest.run())
        reason: EndReason = "cancelled"  # unless it ends by itself or for a limit
        try:
            deadline = _deadline(launch.limits.timeout_s)
            reason = await _started(
                launch, execution, deadline, lambda: asyncio.shield(running)
            ) or await _wait_for_wasm(running, execution, deadline)
            if reason != "exited":
                guest.stop(reason)
        finally:
            execution.end()
            guest.stop(execution.stop_reason or "cancelled")  # a no-op once it ended

            async def stop() -> ExecutionOutcome:
                result: WasmOutcome | None = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._stop_grace_s + STOPPED_SLACK_S):
                        result = await asyncio.shield(running)
                await self._drain(pumps)
                if result is None:
                    result = self._left_asleep(execution, guest, running)
                if result.trap is not None:
                    logger.warning(
                        "the WebAssembly guest trapped: %s",
                        result.trap,
                        extra=about(invocation_id, execution.execution_id, self.state.logs_dir),
                    )
                ended = result.reason
                if ended in ("exited", "signalled") and execution.state is ExecutionState.FENCED:
                    ended = "fenced"
                return ExecutionOutcome(
                    execution_id=execution.execution_id,
                    exit_code=result.exit_code,
                    signal=None,
                    reason=ended,
                    duration_s=time.monotonic() - started,
                    cpu_s=result.cpu_s,
                    peak_rss_bytes=result.peak_memory_bytes or None,
                    peak_processes=0,
                    calls=execution.calls(),  # live, as for a native guest
                    sandbox=guest.sandbox,
                )

            outcome = await self._wind_down(execution, stop(), reason, started)
        return outcome

    def _left_asleep(
        self, execution: Execution, guest: WasmGuest, running: asyncio.Future[WasmOutcome]
    ) -> WasmOutcome:
        """A WebAssembly guest that did not stop in time: asleep in a
        component's WASI call (docs/wasm.md). Its thread is left to it, and
        the execution ends for what stopped it."""
        from supervisor.wasm import WasmOutcome

        logger.error("WebAssembly guest of %s did not stop in time", execution.execution_id)
        self._asleep.add(running)
        running.add_done_callback(self._asleep.discard)
        return WasmOutcome(None, guest.stop_reason or "cancelled", 0.0, 0, "did not stop")

    def _check_wasm_room(self) -> None:
        """Refuse a new WebAssembly guest while :data:`MAX_ASLEEP_WASM` that
        did not stop still hold their threads and memory. (Guests already
        running when the count is reached may add to it.)"""
        if len(self._asleep) >= MAX_ASLEEP_WASM:
            raise WasmBusy(
                f"{len(self._asleep)} WebAssembly guests stopped while asleep in WASI "
                "still hold their threads and memory: no new one until one wakes"
            )

    async def _wasm_modules(self, path: Path) -> Compiled:
        """A fresh engine and ``path``'s compiled code (compiled once per content,
        kept in the state dir's ``wasm-cache/``)."""
        if self._module_cache is None:
            from supervisor.wasm import ModuleCache  # wasmtime takes 50 ms to import

            self._module_cache = ModuleCache(self.state.path / "wasm-cache")
        return await asyncio.to_thread(self._module_cache.load, path)

    def _start_pumps(
        self,
        execution: Execution,
        invocation: _Invocation,
        secret: bytes,
        stdout: asyncio.StreamReader | None,
        stderr: asyncio.StreamReader | None,
    ) -> list[asyncio.Task[None]]:
        folder = self.state.logs_dir / execution.invocation_id
        invocation_id = execution.invocation_id
        events = self.activity.events

        def wrote() -> None:
            events.publish(Topic.LOGS, invocation_id)

        # Both streams share the execution's budget; all executions, the invocation's.
        budgets = (OutputBudget.for_execution(self._execution_output_limit), invocation.output)
        pumps = []
        for name, reader, ours in (("stdout", stdout, sys.stdout), ("stderr", stderr, sys.stderr)):
            if reader is None:
                continue
            pumps.append(
                asyncio.create_task(
                    pump(
                        reader,
                        log=GuestLog(folder / f"{execution.execution_id}.{name}.log"),
                        passthrough=Passthrough.to(ours),
                        redactor=Redactor(secret),
                        budgets=budgets,
                        on_output=wrote,
                    )
                )
            )
        return pumps

    # -- inspection ------------------------------------------------------------

    def execution(self, execution_id: str) -> Execution | None:
        """An execution of this supervisor, live or ended."""
        return self._executions.lookup(execution_id)

    def plan_for(self, plan_hash: str) -> Plan | None:
        """The plan with this hash, if this supervisor has run one under it."""
        return self._plans.get(plan_hash)

    def guest_of(self, pid: int) -> str | None:
        """The execution whose guest tree process ``pid`` belongs to, if any."""
        return self._tracker.owner_of(pid)

    def executions(self, invocation_id: str | None = None) -> list[Execution]:
        """This supervisor's executions (of one invocation), oldest first."""
        if invocation_id is None:
            return list(self._executions)
        return self._executions.of_invocation(invocation_id)

    async def revoke(self, invocation_id: str, tool: str) -> None:
        """Refuse every later call and replay of ``tool`` in this invocation.

        Persisted in the effect store: it holds for later executions too.

        Raises:
            KeyError: the invocation's plan is known here and has no ``tool``
                (a misspelt name would leave the real tool allowed).
        """
        plan = await self._plan_of(invocation_id)
        if plan is not None and tool not in plan.tools:
            raise KeyError(tool)
        await self.store.revoke(invocation_id, tool, time.time())
        invocation = self._invocations.get(invocation_id)
        if invocation is not None:
            invocation.revoked.add(tool)

    async def _plan_of(self, invocation_id: str) -> Plan | None:
        """The invocation's plan, when this supervisor has it: a running
        invocation's, or the served plan if the invocation was made with it."""
        invocation = self._invocations.get(invocation_id)
        if invocation is not None:
            return invocation.plan
        served = self.served_plan
        record = await self.store.get_invocation(invocation_id)
        if served is not None and record is not None and record.plan_hash == served.plan_hash:
            return served
        return None

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

    async def wait_stopped(self, execution_id: str) -> bool:
        """Wait (bounded by the stop's own grace periods) until an ended
        execution's guest is gone; returns whether it is."""
        execution = self._executions.lookup(execution_id)
        if execution is None:
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._stop_grace_s * 3 + STOPPED_SLACK_S):
                await execution.stopped.wait()
        return execution.stopped.is_set()

    async def launch(
        self,
        argv: Sequence[str],
        *,
        invocation_id: str | None = None,
        timeout_s: float | None = None,
        plan: Plan | None = None,
        wasm: str | os.PathLike[str] | None = None,
    ) -> Execution:
        """Start a guest in the background (``POST /v1/invocations``); returns once
        it runs, under :attr:`launch_limits` (``timeout_s`` overrides their
        timeout). The supervisor stops it on :meth:`aclose`. An execution
        cancelled while its sandbox was built is returned ended: its guest
        never ran.

        Raises:
            RuntimeError: no plan given and none served.
            OSError: the command could not be started.
            SupervisorClosing: :meth:`aclose` has begun.
        """
        self._check_open()
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
                limits=self.launch_limits,
                stdin=asyncio.subprocess.DEVNULL,
                on_start=started.set_result,
                wasm=wasm,
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
            if task.cancelled() and self._closing:  # aclose() stopped it, not our caller
                raise SupervisorClosing("the supervisor closed before the guest started")
            outcome = task.result()  # raises why it did not start
            # Or it was cancelled while its sandbox was built, and never ran.
            execution = self._executions.lookup(outcome.last.execution_id)
            if execution is None:
                raise RuntimeError("the guest ended before it started")
            return execution
        return started.result()


class _NotStarted(Exception):
    """An attempt's guest never started, for ``error``: :meth:`Supervisor.run`
    keeps the attempts before it. Anything raised once a guest has started
    (a caller's ``on_start``, a cancel) is not this, and passes as it is."""

    def __init__(self, error: OSError | HostcallError) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def _not_started() -> Iterator[None]:
    """Code that runs before an attempt's guest starts: what fails in it means
    the attempt never started."""
    try:
        yield
    except (OSError, HostcallError) as exc:
        raise _NotStarted(exc) from None


async def _started(
    launch: _Launch,
    execution: Execution,
    deadline: float | None,
    exit: Callable[[], Awaitable[object]],
) -> EndReason | None:
    """Tell the caller its guest runs (``on_start``, sync or async). An async
    ``on_start`` still running when the guest exits by itself (``exit``
    returns: ``exited``), the execution ends (a cancel, a fence, a limit, the
    supervisor closing) or its timeout passes is cancelled, and that reason
    returned: nothing of the guest is left running, its credential live, for
    as long as the caller's code takes. None once ``on_start`` returned
    first; what it raises, as is."""
    if launch.on_start is None:
        return None
    maybe = launch.on_start(execution)
    if maybe is None:
        return None
    told = asyncio.ensure_future(maybe)
    ended = asyncio.ensure_future(execution.ended.wait())
    exited = asyncio.ensure_future(exit())
    try:
        done, _ = await asyncio.wait(
            {told, ended, exited},
            timeout=_remaining(deadline),
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        ended.cancel()
        if exited.done() and not exited.cancelled():
            exited.exception()  # a guest that failed to run: its own wait reports it
        exited.cancel()  # the wait on it, not the guest
        if not told.done():
            told.cancel()  # not awaited: its clean-up is the caller's, and may take long
            told.add_done_callback(_log_late_failure)
    if told in done:
        told.result()
        return None
    if exited in done:
        return "exited"
    return _why_ended(execution) if ended in done else "timeout"


def _deadline(timeout_s: float | None) -> float | None:
    """When a guest started now times out, on the loop's clock."""
    return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s


def _remaining(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())


def _without_guest(execution: Execution, reason: EndReason, started: float) -> ExecutionOutcome:
    """The outcome of an execution whose guest never ran, or could not be
    measured as it stopped: ``reason``, and nothing of the guest's own."""
    return ExecutionOutcome(
        execution_id=execution.execution_id,
        exit_code=None,
        signal=None,
        reason=reason,
        duration_s=time.monotonic() - started,
        cpu_s=0.0,
        peak_rss_bytes=None,
        peak_processes=0,
        calls=execution.calls(),
        sandbox=execution.sandbox,
    )


def _why_ended(execution: Execution) -> EndReason:
    """Why an execution that ended before its guest did was ended."""
    if execution.state is ExecutionState.FENCED:
        return "fenced"
    return execution.stop_reason or "cancelled"


def _identity(plan: Plan, execution: Execution, socket: str | None) -> GuestIdentity:
    """What a guest is told about itself (``socket`` None: it has none)."""
    return GuestIdentity(
        socket,
        execution.invocation_id,
        execution.execution_id,
        plan.plan_hash,
        {
            name: plan.approval_timeout_s
            for name, tool in plan.tools.items()
            if plan.needs_approval(tool)
        },
    )


async def _wait_for_wasm(
    running: asyncio.Future[WasmOutcome], execution: Execution, deadline: float | None
) -> EndReason:
    """:func:`_wait_for_guest` for a WebAssembly guest: it ends by itself
    (``exited``), or must be stopped for a cancel, a limit, a fence or the timeout."""
    stopped = asyncio.ensure_future(execution.ended.wait())
    waiting: set[asyncio.Future[Any]] = {running, stopped}
    try:
        done, _ = await asyncio.wait(
            waiting, timeout=_remaining(deadline), return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        stopped.cancel()
    if running in done:
        return "exited"
    if not done:
        return "timeout"
    return _why_ended(execution)


async def _wait_for_guest(
    process: GuestProcess, execution: Execution, deadline: float | None
) -> EndReason:
    """Wait until the guest exits (``exited``), its execution is cancelled
    (``cancelled``, or a limit's reason), fenced by a newer attempt
    (``fenced``) or the ``deadline`` passes (``timeout``). The caller then ends
    its whole tree: nothing of an ended execution may run on (docs/security.md, S5).
    """
    exited = asyncio.ensure_future(wait_exited(process))
    stopped = asyncio.ensure_future(execution.ended.wait())
    waiting: set[asyncio.Future[Any]] = {exited, stopped}
    try:
        while not exited.done():
            done, _ = await asyncio.wait(
                waiting, timeout=_remaining(deadline), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                return "timeout"
            if stopped in done:
                return _why_ended(execution)
        return "exited"
    finally:
        exited.cancel()
        stopped.cancel()


@dataclass(frozen=True, slots=True)
class _Launch:
    """How to start each attempt's guest."""

    argv: Sequence[str]
    limits: Limits
    env: Mapping[str, str] | None
    cwd: str | os.PathLike[str] | None
    stdin: int | IO[Any] | None
    stdout: int | IO[Any] | None
    stderr: int | IO[Any] | None
    on_start: Callable[[Execution], Awaitable[None] | None] | None
    #: The WebAssembly module to run instead of ``argv[0]``, if any.
    wasm: Path | None = None


def _log_failure(task: asyncio.Task[RunOutcome]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("a launched guest failed: %s", task.exception())


def _log_late_failure(told: asyncio.Future[Any]) -> None:
    """An ``on_start`` cancelled as its execution ended raised all the same."""
    if not told.cancelled() and told.exception() is not None:
        logger.error("on_start raised after its execution ended: %r", told.exception())
