"""The ``hostcall`` command line (SPEC §9)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

from supervisor.admin import record_json
from supervisor.admin_client import AdminClient, AdminError, SupervisorNotRunning
from supervisor.audit import audit_receipts, effects_for
from supervisor.console.server import DEFAULT_PORT, Listen, parse_listen
from supervisor.errors import HostcallError
from supervisor.ids import is_valid_id
from supervisor.limits import Limits
from supervisor.metrics import parse_host_port
from supervisor.plan import Plan
from supervisor.statedir import chosen_state_dir
from supervisor.stores.sqlite import read_calls
from supervisor.supervisor import RunOutcome, Supervisor

__all__ = ["main"]

#: Exit status when an operation was refused (not waiting, broken chain, not found).
EXIT_FAILED: Final = 1
#: Exit status when hostcall itself cannot do what was asked (bad plan, busy state dir).
EXIT_USAGE: Final = 2
#: The shell's "command not found" …
EXIT_NOT_FOUND: Final = 127
#: … and "found but cannot be executed".
EXIT_NOT_EXECUTABLE: Final = 126


def _state_dir(args: argparse.Namespace) -> Path:
    """``--state-dir``, given anywhere on the line, or the default (SPEC §9)."""
    return chosen_state_dir(getattr(args, "state_dir", None))


def _id(value: str) -> str:
    if not is_valid_id(value):
        raise argparse.ArgumentTypeError("ids are 1-128 characters of [A-Za-z0-9._:-]")
    return value


def _listen(value: str) -> Listen:
    try:
        return parse_listen(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _host_port(value: str) -> tuple[str, int]:
    try:
        return parse_host_port(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hostcall",
        description="Run agent code as guest processes that call host tools at most once.",
    )

    def state_dir_option(sub: argparse.ArgumentParser) -> None:
        # On every parser of the line (`hostcall approvals --state-dir D list`
        # and `hostcall approvals list --state-dir D` both work); SUPPRESS, so a
        # subcommand's parser does not reset a value an outer one set.
        sub.add_argument(
            "--state-dir",
            default=argparse.SUPPRESS,
            help="state directory (default: $HOSTCALL_STATE_DIR, else ./.hostcall)",
        )

    def limit_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--memory", type=_positive, metavar="MB", help="memory of the guest")
        sub.add_argument("--cpu", type=_positive, metavar="S", help="CPU seconds of the guest")
        sub.add_argument(
            "--max-procs", type=int, metavar="N", help="tasks (processes, threads) of the guest"
        )
        sub.add_argument("--max-files", type=int, metavar="N", help="open files of the guest")

    def operator_options(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--console",
            type=_listen,
            metavar="[HOST:]PORT",
            help="serve the operator console on this loopback port (0: any free one)",
        )
        sub.add_argument(
            "--metrics-listen",
            type=_host_port,
            metavar="HOST:PORT",
            help="serve Prometheus /metrics over TCP here",
        )

    def no_sandbox_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--no-sandbox",
            action="store_true",
            help="start guests without the sandbox (SPEC §13): only for guests you trust",
        )

    state_dir_option(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="launch a guest under a plan and serve its calls")
    state_dir_option(run)
    run.add_argument("--plan", required=True, help="plan file (TOML)")
    run.add_argument("--invocation", type=_id, help="invocation id; an existing one is resumed")
    run.add_argument("--timeout", type=_positive, help="seconds before the guest is stopped")
    run.add_argument("--attempts", type=int, default=1, help="relaunch a failing guest, N in all")
    limit_options(run)
    run.add_argument("--store", help="sqlite (default), sqlite:///PATH, memory or postgresql://…")
    no_sandbox_option(run)
    operator_options(run)
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD [ARG…]")

    serve = commands.add_parser("serve", help="a long-running supervisor: launch guests by API")
    state_dir_option(serve)
    serve.add_argument("--plan", required=True, help="plan file (TOML) guests run under")
    serve.add_argument("--store", help="sqlite (default), sqlite:///PATH, memory or postgresql://…")
    serve.add_argument(
        "--timeout", type=_positive, help="seconds before a launched guest is stopped"
    )
    limit_options(serve)
    no_sandbox_option(serve)
    operator_options(serve)

    console = commands.add_parser(
        "console", help="serve the operator console of a running supervisor"
    )
    state_dir_option(console)
    console.add_argument(
        "--listen",
        "--console",
        dest="listen",
        type=_listen,
        default=f"127.0.0.1:{DEFAULT_PORT}",
        metavar="[HOST:]PORT",
        help=f"loopback address and port (default 127.0.0.1:{DEFAULT_PORT}; 0: any free port)",
    )

    demo = commands.add_parser("demo", help="run the bundled billing example end to end")
    state_dir_option(demo)
    deciding = demo.add_mutually_exclusive_group()
    deciding.add_argument(
        "--manual-approval",
        action="store_true",
        help="wait for you to approve or reject the demo's proposal from a second terminal",
    )
    deciding.add_argument(
        "--auto-approve",
        action="store_true",
        help="approve the demo's proposal unattended (the default)",
    )

    approvals = commands.add_parser("approvals", help="list and decide approval proposals")
    state_dir_option(approvals)
    decisions = approvals.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = decisions.add_parser("list", help="proposals, oldest first")
    state_dir_option(listing)
    listing.add_argument("--json", action="store_true", help="a JSON array")
    listing.add_argument(
        "--state",
        choices=["waiting", "approved", "rejected", "expired", "cancelled", "dispatched"],
        help="only proposals in this state",
    )
    approve = decisions.add_parser("approve", help="let a waiting call run")
    state_dir_option(approve)
    approve.add_argument("id", type=_id, help="proposal id (apr_…)")
    reject = decisions.add_parser("reject", help="refuse a waiting call")
    state_dir_option(reject)
    reject.add_argument("id", type=_id, help="proposal id (apr_…)")
    reject.add_argument("--reason", help="why (shown to the operator log, not the guest)")

    calls = commands.add_parser("calls", help="an invocation's effect records")
    state_dir_option(calls)
    calls.add_argument("invocation", type=_id, help="invocation id")
    calls.add_argument("--json", action="store_true", help="a JSON array")
    calls.add_argument("--store", help="read this store when no supervisor runs")

    receipts = commands.add_parser("receipts", help="check receipt files")
    state_dir_option(receipts)
    receipt_actions = receipts.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = receipt_actions.add_parser("verify", help="check a receipt file's hash chain")
    state_dir_option(verify)
    verify.add_argument("file", type=Path, help="<state_dir>/receipts/<invocation>.jsonl")
    return parser


def _summary(outcome: RunOutcome) -> str:
    return "\n".join(
        f"hostcall: invocation {outcome.invocation_id} {execution.describe()}"
        for execution in outcome.executions
    )


async def _run(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("hostcall run: give the guest's command after --", file=sys.stderr)
        return EXIT_USAGE
    if args.attempts < 1:
        print("hostcall run: --attempts must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    try:
        limits = _limits(args)
    except ValueError as exc:
        print(f"hostcall run: {exc}", file=sys.stderr)
        return EXIT_USAGE
    plan = Plan.load(args.plan)
    async with (
        Supervisor(_state_dir(args), store=args.store, sandbox=not args.no_sandbox) as sup,
        _operator_sites(sup, args, "run"),
    ):
        try:
            outcome = await sup.run(
                plan, argv, invocation_id=args.invocation, limits=limits, attempts=args.attempts
            )
        except FileNotFoundError as exc:
            print(f"hostcall run: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            print(f"hostcall run: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return EXIT_NOT_EXECUTABLE
    if args.json:
        print(json.dumps(outcome.to_json()), file=sys.stderr)
    else:
        print(_summary(outcome), file=sys.stderr)
    return outcome.exit_status


def _limits(args: argparse.Namespace) -> Limits:
    """The limit options of ``run`` and ``serve``.

    Raises:
        ValueError: a limit is not greater than 0.
    """
    return Limits(
        timeout_s=args.timeout,
        memory_bytes=int(args.memory * 2**20) if args.memory else None,
        cpu_s=args.cpu,
        max_processes=args.max_procs,
        max_open_files=args.max_files,
    )


async def _demo(args: argparse.Namespace) -> int:
    from supervisor.demo import run_demo

    return await run_demo(_state_dir(args), auto_approve=not args.manual_approval)


async def _serve(args: argparse.Namespace) -> int:
    try:
        limits = _limits(args)
    except ValueError as exc:
        print(f"hostcall serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    plan = Plan.load(args.plan)
    state_dir = _state_dir(args)
    async with (
        Supervisor(state_dir, store=args.store, plan=plan, sandbox=not args.no_sandbox) as sup,
        _operator_sites(sup, args, "serve"),
    ):
        sup.launch_limits = limits
        print(
            f"hostcall serve: plan {plan.name} ({plan.plan_hash[:19]}…)"
            f"{'' if sup.sandboxed else ', sandbox off'}\n"
            f"  channel: {sup.socket_path}\n  admin:   {sup.state.path / 'admin.sock'}\n"
            "  launch guests with POST /v1/invocations on the admin socket; "
            "stop with Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.Event().wait()  # until SIGINT/SIGTERM cancels us
    return 0


class _CannotListen(HostcallError):
    """A console or metrics address could not be bound."""

    code = "cannot_listen"


@contextlib.asynccontextmanager
async def _operator_sites(
    sup: Supervisor, args: argparse.Namespace, command: str
) -> AsyncIterator[None]:
    """The console and the metrics listener ``--console`` / ``--metrics-listen`` ask for."""
    from supervisor.console import ConsoleServer
    from supervisor.metrics import MetricsListener

    async with contextlib.AsyncExitStack() as stack:
        if args.metrics_listen is not None:
            host, port = args.metrics_listen
            metrics = MetricsListener(sup.metrics, host, port)
            await _bind(metrics.start(), f"--metrics-listen {host}:{port}")
            stack.push_async_callback(metrics.close)
            shown = f"[{host}]" if ":" in host else host
            print(f"hostcall: metrics at http://{shown}:{metrics.port}/metrics", file=sys.stderr)
        if args.console is not None:
            console = ConsoleServer(sup.state.path, args.console)
            await _bind(console.start(), f"--console {args.console.host}:{args.console.port}")
            stack.push_async_callback(console.close)
            print(f"hostcall: console at {console.url}", file=sys.stderr, flush=True)
        yield


async def _bind(start: Coroutine[Any, Any, None], what: str) -> None:
    try:
        await start
    except OSError as exc:
        raise _CannotListen(f"cannot listen on {what.split(' ', 1)[1]}: {exc.strerror}") from None


async def _console(args: argparse.Namespace) -> int:
    from supervisor.admin_client import AsyncAdminClient
    from supervisor.console import ConsoleServer

    state_dir = _state_dir(args)
    await AsyncAdminClient(state_dir).request("GET", "/v1/stats")  # running? else it says so
    console = ConsoleServer(state_dir, args.listen)
    await _bind(console.start(), f"--listen {args.listen.host}:{args.listen.port}")
    try:
        print(
            f"hostcall: console at {console.url}\n"
            f"  of the supervisor on {state_dir}; stop with Ctrl-C",
            file=sys.stderr,
            flush=True,
        )
        await asyncio.Event().wait()  # until SIGINT/SIGTERM cancels us
    finally:
        await console.close()
    return 0


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def _short(value: Any, width: int = 48) -> str:
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def _approvals(args: argparse.Namespace) -> int:
    client = AdminClient(_state_dir(args))
    if args.action == "list":
        query = f"?state={args.state}" if args.state else ""
        proposals = client.request("GET", f"/v1/approvals{query}")
        if args.json:
            print(json.dumps(proposals, indent=2))
        elif not proposals:
            print("no proposals")
        else:
            rows = [
                [
                    p["id"],
                    p["state"],
                    p["tool"],
                    p["call_id"],
                    p["invocation_id"],
                    p["expires_at"],
                    _short(p["args"]),
                ]
                for p in proposals
            ]
            print(_table(rows, ["ID", "STATE", "TOOL", "CALL_ID", "INVOCATION", "EXPIRES", "ARGS"]))
        return 0
    body = {"reason": args.reason} if args.action == "reject" and args.reason else {}
    try:
        proposal = client.request("POST", f"/v1/approvals/{args.id}/{args.action}", body)
    except AdminError as exc:
        print(f"hostcall approvals {args.action}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    print(f"{proposal['id']}: {proposal['state']} ({proposal['tool']} {proposal['call_id']})")
    return 0


def _calls(args: argparse.Namespace) -> int:
    state_dir = _state_dir(args)
    try:
        records = AdminClient(state_dir).request("GET", f"/v1/invocations/{args.invocation}/calls")
    except SupervisorNotRunning:
        records = _calls_offline(state_dir, args.store, args.invocation)
    except AdminError as exc:
        print(f"hostcall calls: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    if records is None:
        print(f"hostcall calls: no invocation {args.invocation}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps(records, indent=2))
        return 0
    rows = [
        [
            r["call_id"],
            r["tool"],
            r["status"],
            r["execution_id"],
            r["updated_at"],
            _short(r["response"].get("result") if r["response"] else None, 40),
        ]
        for r in records
    ]
    print(
        _table(rows, ["CALL_ID", "TOOL", "STATUS", "EXECUTION", "UPDATED", "RESULT"])
        if rows
        else "no calls"
    )
    return 0


def _calls_offline(
    state_dir: Path, store: str | None, invocation_id: str
) -> list[dict[str, Any]] | None:
    """Read a SQLite store directly when no supervisor holds it (read-only)."""
    spec = store or os.environ.get("HOSTCALL_STORE") or "sqlite"
    if spec == "sqlite":
        path = state_dir / "effects.db"
    elif spec.startswith("sqlite:///"):
        path = Path(spec.removeprefix("sqlite:///"))
    else:
        raise SupervisorNotRunning(
            f"no supervisor is running on {state_dir}, and store {spec!r} cannot be read offline"
        )
    if not path.exists():
        raise SupervisorNotRunning(f"no supervisor is running on {state_dir} and no {path}")
    records = read_calls(path, invocation_id)
    return None if records is None else [record_json(r) for r in records]


def _receipts(args: argparse.Namespace) -> int:
    named = getattr(args, "state_dir", None)  # only when --state-dir was given
    try:
        # StoreUnavailable (no effects.db in a named dir, an unreadable store) is
        # a HostcallError: main() prints it and exits 2.
        effects = effects_for(args.file, Path(named) if named is not None else None)
        audit = audit_receipts(args.file, effects=effects)
    except OSError as exc:
        print(f"hostcall receipts verify: cannot read {args.file}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    for line in audit.lines():
        print(line, file=sys.stderr)
    if not audit.ok:
        print(audit.summary(), file=sys.stderr)
        return EXIT_FAILED
    print(audit.summary())
    return 0


def _run_main(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop when installed; TERM and INT cancel it cleanly."""

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hostcall`` command."""
    logging.basicConfig(level=logging.WARNING, format="hostcall: %(levelname)s: %(message)s")
    args = _parser().parse_args(argv)
    async_commands = {"run": _run, "demo": _demo, "serve": _serve, "console": _console}
    sync_commands = {"approvals": _approvals, "calls": _calls, "receipts": _receipts}
    try:
        if args.command in sync_commands:
            return sync_commands[args.command](args)
        return _run_main(async_commands[args.command](args))
    except HostcallError as exc:
        print(f"hostcall {args.command}: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `hostcall … | head`: the reader left; say nothing more.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the exit-time flush
        return 1


if __name__ == "__main__":
    sys.exit(main())
