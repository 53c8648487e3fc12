"""The commands that run a supervisor or a console: ``run``, ``serve``,
``console`` and ``demo`` (docs/operations.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import sys
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from supervisor.cli.app import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, state_dir_of
from supervisor.cli.hints import hostcall_command, state_dir_flag
from supervisor.cli.watch import Watch
from supervisor.errors import HostcallError
from supervisor.executions import Execution
from supervisor.ids import new_id
from supervisor.limits import Limits
from supervisor.logs import Passthrough
from supervisor.outcomes import RunOutcome
from supervisor.plan import Plan
from supervisor.storespec import parse_store
from supervisor.supervisor import Supervisor
from supervisor.terminal import is_terminal

__all__ = ["UsageError", "console", "demo", "run", "run_main", "serve"]


class UsageError(HostcallError):
    """What was asked cannot be done as asked (exit 2, one line)."""

    code = "usage"


def run_main(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop; SIGINT and SIGTERM cancel it, and the exit
    status is then 128 + the signal (130, 143)."""

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        received: list[int] = []
        for signum in (signal.SIGINT, signal.SIGTERM):

            def cancel(signum: int = signum) -> None:
                received.append(signum)
                task.cancel()

            loop.add_signal_handler(signum, cancel)
        try:
            return await coro
        except asyncio.CancelledError:
            if received:
                return 128 + received[0]
            raise

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(guarded())
    return uvloop.run(guarded())


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(
        timeout_s=args.timeout,
        memory_bytes=int(args.memory * 2**20) if args.memory else None,
        cpu_s=args.cpu,
        max_processes=args.max_procs,
        max_open_files=args.max_files,
    )


class _CannotListen(HostcallError):
    code = "cannot_listen"


async def _bind(start: Coroutine[Any, Any, None], what: str) -> None:
    try:
        await start
    except OSError as exc:
        raise _CannotListen(f"cannot listen on {what}: {exc.strerror}") from None


@contextlib.asynccontextmanager
async def _operator_sites(sup: Supervisor, args: argparse.Namespace) -> AsyncIterator[None]:
    """The console and the metrics listener ``--console`` / ``--metrics-listen`` ask for."""
    async with contextlib.AsyncExitStack() as stack:
        if args.metrics_listen is not None:
            from supervisor.metrics import MetricsListener

            host, port = args.metrics_listen
            metrics = MetricsListener(sup.metrics, host, port)
            await _bind(metrics.start(), f"{host}:{port}")
            stack.push_async_callback(metrics.close)
            shown = f"[{host}]" if ":" in host else host
            print(f"hostcall: metrics at http://{shown}:{metrics.port}/metrics", file=sys.stderr)
        if args.console is not None:
            from supervisor.console import ConsoleServer

            console_server = ConsoleServer(sup.state.path, args.console)
            await _bind(console_server.start(), f"{args.console.host}:{args.console.port}")
            stack.push_async_callback(console_server.close)
            print(f"hostcall: console at {console_server.url}", file=sys.stderr, flush=True)
        yield


# -- run ---------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """``hostcall run``."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and args.wasm is None:
        raise UsageError("give the guest's command after --: hostcall run --plan P -- CMD [ARG…]")
    state_dir, limits, plan = _serving(args)
    invocation_id = args.invocation or new_id("inv")
    return run_main(_run(args, plan, argv, limits, state_dir, invocation_id))


def _serving(args: argparse.Namespace) -> tuple[Path, Limits, Plan]:
    """What ``run`` and ``serve`` check before a supervisor starts: the state
    dir, the store setting, the limits and the plan.

    Raises:
        UsageError, PlanError: one of them is wrong (one line, exit 2).
    """
    state_dir = state_dir_of(args)
    try:
        parse_store(args.store, state_dir)
        limits = _limits(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return state_dir, limits, Plan.load(args.plan)


def _resume_hint(args: argparse.Namespace, argv: list[str], state_dir: Path, inv: str) -> str:
    words = [hostcall_command(), "run", "--plan", args.plan, "--invocation", inv]
    if args.store:
        words += ["--store", args.store]
    if args.wasm is not None:
        words += ["--wasm", args.wasm]
    return shlex.join(words) + state_dir_flag(state_dir) + " -- " + shlex.join(argv)


async def _run(
    args: argparse.Namespace,
    plan: Plan,
    argv: list[str],
    limits: Limits,
    state_dir: Path,
    invocation_id: str,
) -> int:
    try:
        async with (
            Supervisor(state_dir, store=args.store, sandbox=not args.no_sandbox) as sup,
            _operator_sites(sup, args),
        ):
            resumed = await sup.store.get_invocation(invocation_id) is not None
            if args.wasm is not None:
                sandbox = "WebAssembly guest"
            else:
                sandbox = "sandbox on" if sup.sandboxed else "sandbox off"
            program = args.wasm if args.wasm is not None else argv[0]
            announced: list[str] = []

            def announce(execution: Execution) -> None:
                # Once the guest runs: a mistake found before (a plan its
                # sandbox refuses, a command that is missing) stays one line.
                if not announced:
                    announced.append(execution.execution_id)
                    print(
                        f"hostcall: invocation {invocation_id}{' (resumed)' if resumed else ''}, "
                        f"plan {plan.name}, {sandbox}",
                        file=sys.stderr,
                        flush=True,
                    )

            watch = Watch(
                sup,
                state_dir,
                prefix="hostcall",
                invocation_id=invocation_id,
                attempts=args.attempts,
                status=is_terminal(2),
            )
            watch.start()
            not_started: tuple[int, str] | None = None
            try:
                outcome = await sup.run(
                    plan,
                    argv,
                    invocation_id=invocation_id,
                    limits=limits,
                    attempts=args.attempts,
                    on_start=announce,
                    wasm=args.wasm,
                )
            except (FileNotFoundError, PermissionError) as exc:
                missing = isinstance(exc, FileNotFoundError)
                message = f"cannot start {program!r}: {exc.strerror}"
                watch.say(f"hostcall run: {message}")
                not_started = (EXIT_NOT_FOUND if missing else EXIT_NOT_EXECUTABLE, message)
            finally:
                await watch.close()
            if not_started is not None:
                status, message = not_started
                summary = {"invocation_id": invocation_id, "exit_status": status}
                _emit_json(args, {**summary, "executions": [], "error": message})
                return status
    except asyncio.CancelledError:
        # SIGINT or SIGTERM: the guest tree was stopped on the way out.
        Passthrough.end_guest_line(sys.stderr)
        print(
            f"hostcall: stopped; the guest tree was ended. Invocation {invocation_id} "
            f"resumes with: {_resume_hint(args, argv, state_dir, invocation_id)}",
            file=sys.stderr,
            flush=True,
        )
        raise
    _report(args, outcome)
    return outcome.exit_status


def _report(args: argparse.Namespace, outcome: RunOutcome) -> None:
    """The summary: a line per execution on stderr, or with ``--json`` the JSON
    outcome as stderr's last line (docs/operations.md: the summary goes to stderr); with
    ``--json FILE`` (``-``: stdout) the lines stay and the JSON goes there,
    apart from any guest output."""
    Passthrough.end_guest_line(sys.stderr)
    if args.json != "":
        for execution in outcome.executions:
            print(
                f"hostcall: invocation {outcome.invocation_id} {execution.describe()}",
                file=sys.stderr,
            )
    _emit_json(args, outcome.to_json())


def _emit_json(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    """``--json``'s object, where it asked for it (nothing without ``--json``).
    A guest that could not start has no execution: ``executions`` is empty
    and ``error`` says why."""
    text = json.dumps(summary)
    if args.json is None:
        return
    if args.json == "":
        print(text, file=sys.stderr)
    elif args.json == "-":
        sys.stdout.flush()
        print(text, flush=True)
    else:
        try:
            Path(args.json).write_text(text + "\n")
        except OSError as exc:
            print(f"hostcall run: cannot write {args.json}: {exc.strerror}", file=sys.stderr)


# -- serve -------------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    """``hostcall serve``."""
    state_dir, limits, plan = _serving(args)
    return run_main(_serve(args, plan, limits, state_dir))


async def _serve(args: argparse.Namespace, plan: Plan, limits: Limits, state_dir: Path) -> int:
    async with (
        Supervisor(state_dir, store=args.store, plan=plan, sandbox=not args.no_sandbox) as sup,
        _operator_sites(sup, args),
    ):
        sup.launch_limits = limits
        print(
            f"hostcall serve: plan {plan.name} ({plan.plan_hash[:19]}…)"
            f"{'' if sup.sandboxed else ', sandbox off'}\n"
            f"  channel: {sup.socket_path}\n  admin:   {sup.state.path / 'admin.sock'}\n"
            f"  launch guests with: {shlex.quote(hostcall_command())} launch"
            f"{state_dir_flag(state_dir)} -- CMD [ARG…]  (or POST /v1/invocations); "
            "stop with Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        watch = Watch(sup, state_dir, prefix="hostcall serve")
        watch.start()
        try:
            await asyncio.Event().wait()  # until SIGINT/SIGTERM cancels us
        finally:
            await watch.close()
    return 0


# -- console, demo -----------------------------------------------------------


def console(args: argparse.Namespace) -> int:
    """``hostcall console``."""
    return run_main(_console(args))


async def _console(args: argparse.Namespace) -> int:
    from supervisor.admin_client import AsyncAdminClient
    from supervisor.console import ConsoleServer

    state_dir = state_dir_of(args)
    await AsyncAdminClient(state_dir).request("GET", "/v1/stats")  # running? else it says so
    server = ConsoleServer(state_dir, args.listen)
    await _bind(server.start(), f"{args.listen.host}:{args.listen.port}")
    try:
        print(
            f"hostcall: console at {server.url}\n"
            f"  of the supervisor on {state_dir}; stop with Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.Event().wait()  # until SIGINT/SIGTERM cancels us
    finally:
        await server.close()
    return 0


def demo(args: argparse.Namespace) -> int:
    """``hostcall demo``."""
    from supervisor.demo import run_demo

    return run_main(
        run_demo(state_dir_of(args), auto_approve=not args.manual_approval, wasm=args.wasm)
    )
