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
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Final

from supervisor.errors import HostcallError
from supervisor.ids import is_valid_id
from supervisor.plan import Plan
from supervisor.supervisor import RunOutcome, Supervisor

__all__ = ["main"]

#: Exit status when hostcall itself cannot do what was asked (bad plan, busy state dir).
EXIT_USAGE: Final = 2
#: The shell's "command not found".
EXIT_NOT_FOUND: Final = 127


def _state_dir(value: str | None) -> Path:
    return Path(value or os.environ.get("HOSTCALL_STATE_DIR") or ".hostcall")


def _id(value: str) -> str:
    if not is_valid_id(value):
        raise argparse.ArgumentTypeError("ids are 1-128 characters of [A-Za-z0-9._:-]")
    return value


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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def state_dir_option(sub: argparse.ArgumentParser) -> None:
        sub.add_argument(
            "--state-dir",
            help="state directory (default: $HOSTCALL_STATE_DIR, else ./.hostcall)",
        )

    run = commands.add_parser("run", help="launch a guest under a plan and serve its calls")
    state_dir_option(run)
    run.add_argument("--plan", required=True, help="plan file (TOML)")
    run.add_argument("--invocation", type=_id, help="invocation id; an existing one is resumed")
    run.add_argument("--timeout", type=_positive, help="seconds before the guest is stopped")
    run.add_argument("--attempts", type=int, default=1, help="relaunch a failing guest, N in all")
    run.add_argument("--store", help="sqlite (default), sqlite:///PATH or memory")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD [ARG…]")

    demo = commands.add_parser("demo", help="run the bundled billing example end to end")
    state_dir_option(demo)
    return parser


def _summary(outcome: RunOutcome) -> str:
    lines = []
    for execution in outcome.executions:
        if execution.reason == "timeout":
            ended = "was stopped by the timeout"
        elif execution.signal is not None:
            ended = f"was ended by signal {execution.signal}"
        else:
            ended = f"exited with {execution.exit_code}"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(execution.calls.items())) or "none"
        lines.append(
            f"hostcall: invocation {outcome.invocation_id} execution {execution.execution_id} "
            f"{ended} after {execution.duration_s:.2f} s; calls: {calls}"
        )
    return "\n".join(lines)


def _outcome_json(outcome: RunOutcome) -> dict[str, Any]:
    return {
        "invocation_id": outcome.invocation_id,
        "exit_status": outcome.exit_status,
        "executions": [
            {
                "execution_id": e.execution_id,
                "exit_code": e.exit_code,
                "signal": e.signal,
                "timed_out": e.timed_out,
                "reason": e.reason,
                "duration_s": round(e.duration_s, 6),
                "calls": dict(e.calls),
            }
            for e in outcome.executions
        ],
    }


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
    plan = Plan.load(args.plan)
    async with Supervisor(_state_dir(args.state_dir), store=args.store) as sup:
        try:
            outcome = await sup.run(
                plan,
                argv,
                invocation_id=args.invocation,
                timeout_s=args.timeout,
                attempts=args.attempts,
            )
        except FileNotFoundError as exc:
            print(f"hostcall run: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
            return EXIT_NOT_FOUND
    if args.json:
        print(json.dumps(_outcome_json(outcome)), file=sys.stderr)
    else:
        print(_summary(outcome), file=sys.stderr)
    return outcome.exit_status


async def _demo(args: argparse.Namespace) -> int:
    from supervisor.demo import run_demo

    return await run_demo(args.state_dir)


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
    handlers = {"run": _run, "demo": _demo}
    try:
        return _run_main(handlers[args.command](args))
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
