"""The ``hostcall`` command line's grammar (docs/operations.md). Standard library only:
``hostcall --help`` loads nothing else (docs/operations.md, "A fast start")."""

from __future__ import annotations

import argparse
import re
from typing import Final, NoReturn

from supervisor.addresses import CONSOLE_PORT, Listen, parse_host_port, parse_listen
from supervisor.ids import is_path_safe_id

__all__ = ["build_parser", "parse_age"]

PROPOSAL_STATES: Final = ("waiting", "approved", "rejected", "expired", "cancelled", "dispatched")
_AGE: Final = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_AGE_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _id(value: str) -> str:
    if not is_path_safe_id(value):
        raise argparse.ArgumentTypeError("ids are 1-128 characters of [A-Za-z0-9._:-], not . or ..")
    return value


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not number > 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return number


def _count(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


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


def parse_age(value: str) -> float:
    """``30s``, ``15m``, ``12h``, ``7d``, ``2w`` → seconds.

    Raises:
        argparse.ArgumentTypeError: not such an age.
    """
    found = _AGE.match(value.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{value!r} is not an age like 30m, 12h, 7d or 2w")
    return float(found.group(1)) * _AGE_UNITS[found.group(2)]


def _common(sub: argparse.ArgumentParser) -> None:
    """Options every level of the line takes (``hostcall approvals --state-dir D
    list`` and ``hostcall approvals list --state-dir D`` both work): SUPPRESS,
    so an inner parser does not reset what an outer one set."""
    sub.add_argument(
        "--state-dir",
        default=argparse.SUPPRESS,
        help="state directory (default: $HOSTCALL_STATE_DIR, else ./.hostcall)",
    )
    sub.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="say more (-v: info, -vv: debug, with tracebacks)",
    )
    sub.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default=argparse.SUPPRESS,
        help="how much hostcall itself logs on stderr (default: warning)",
    )


def _limits(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--memory", type=_positive, metavar="MB", help="memory of the guest")
    sub.add_argument("--cpu", type=_positive, metavar="S", help="CPU seconds of the guest")
    sub.add_argument(
        "--max-procs", type=_count, metavar="N", help="tasks (processes, threads) of the guest"
    )
    sub.add_argument("--max-files", type=_count, metavar="N", help="open files of the guest")


def _serving(sub: argparse.ArgumentParser) -> None:
    """What ``run`` and ``serve`` share."""
    sub.add_argument("--plan", required=True, help="plan file (TOML)")
    sub.add_argument("--store", help="sqlite (default), sqlite:///PATH, memory or postgresql://…")
    _limits(sub)
    sub.add_argument(
        "--no-sandbox",
        action="store_true",
        help="start guests without the sandbox (docs/sandbox.md): only for guests you trust",
    )
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


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (what is wrong, where to look), exit 2."""

    def error(self, message: str) -> NoReturn:
        message = message.removeprefix("argument ")
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = _Parser(
        prog="hostcall",
        description="Run agent code as guest processes that call host tools at most once.",
        epilog="Exit codes and every error are in docs/operations.md.",
    )
    parser.add_argument("--version", action="store_true", help="print hostcall's version")
    _common(parser)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _common(sub)
        return sub

    run = command("run", "launch a guest under a plan and serve its calls until it exits")
    _serving(run)
    run.add_argument("--invocation", type=_id, help="invocation id; an existing one is resumed")
    run.add_argument("--timeout", type=_positive, metavar="S", help="stop the guest after S s")
    run.add_argument(
        "--attempts", type=_count, default=1, metavar="N", help="relaunch a failing guest, N in all"
    )
    run.add_argument(
        "--json",
        nargs="?",
        const="",
        metavar="FILE",
        help="the outcome as JSON: the last line of stderr, or FILE ('-': stdout)",
    )
    run.add_argument(
        "--wasm", metavar="MODULE", help="run this WebAssembly (WASI) module; ARGs after --"
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD [ARG…]")

    serve = command("serve", "a long-running supervisor: launch guests through the admin API")
    _serving(serve)
    serve.add_argument(
        "--timeout", type=_positive, metavar="S", help="stop each launched guest after S s"
    )

    launch = command("launch", "launch a guest on the running `hostcall serve`")
    launch.add_argument("--invocation", type=_id, help="invocation id; an existing one is resumed")
    launch.add_argument("--timeout", type=_positive, metavar="S", help="stop the guest after S s")
    launch.add_argument(
        "--wasm", metavar="MODULE", help="run this WebAssembly (WASI) module; ARGs after --"
    )
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD [ARG…]")

    console = command("console", "serve the operator console of the running supervisor")
    console.add_argument(
        "--listen",
        "--console",
        dest="listen",
        type=_listen,
        default=f"127.0.0.1:{CONSOLE_PORT}",
        metavar="[HOST:]PORT",
        help=f"loopback address and port (default 127.0.0.1:{CONSOLE_PORT}; 0: any)",
    )

    demo = command("demo", "run the bundled billing example end to end")
    deciding = demo.add_mutually_exclusive_group()
    deciding.add_argument(
        "--manual-approval",
        action="store_true",
        help="wait for you to approve or reject the demo's proposal from a second terminal",
    )
    deciding.add_argument(
        "--auto-approve", action="store_true", help="approve the demo's proposal (the default)"
    )
    demo.add_argument(
        "--wasm",
        action="store_true",
        help="run the agent as a WebAssembly guest (examples/billing/agent.c; needs ziglang)",
    )

    invocations = command("invocations", "the invocations of the store, newest first")
    invocations.add_argument("--json", action="store_true", help="a JSON array")
    invocations.add_argument("--store", help="read this store when no supervisor runs")

    calls = command("calls", "an invocation's effect records")
    calls.add_argument("invocation", type=_id, help="invocation id")
    calls.add_argument("--json", action="store_true", help="a JSON array")
    calls.add_argument("--store", help="read this store when no supervisor runs")

    logs = command("logs", "an invocation's guest output (and host log), as kept in the state dir")
    logs.add_argument("invocation", type=_id, help="invocation id")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing as it grows")
    logs.add_argument("--execution", type=_id, help="only this execution")
    logs.add_argument("--stream", choices=["stdout", "stderr", "host"], help="only this stream")

    cancel = command("cancel", "cancel a live execution and stop its guest")
    cancel.add_argument("execution", type=_id, help="execution id (exe_…)")

    revoke = command("revoke", "refuse every later call of a tool in an invocation")
    revoke.add_argument("invocation", type=_id, help="invocation id")
    revoke.add_argument("tool", help="tool name")

    approvals = command("approvals", "list, show and decide approval proposals")
    decisions = approvals.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, help_text: str) -> argparse.ArgumentParser:
        sub = decisions.add_parser(name, help=help_text, description=help_text)
        _common(sub)
        return sub

    listing = action("list", "proposals, oldest first")
    listing.add_argument("--json", action="store_true", help="a JSON array")
    listing.add_argument("--state", choices=PROPOSAL_STATES, help="only proposals in this state")
    show = action("show", "one proposal with its full arguments")
    show.add_argument("id", type=_id, help="proposal id (apr_…)")
    show.add_argument("--json", action="store_true", help="as JSON")
    approve = action("approve", "let a waiting call run")
    approve.add_argument("id", type=_id, help="proposal id (apr_…)")
    reject = action("reject", "refuse a waiting call")
    reject.add_argument("id", type=_id, help="proposal id (apr_…)")
    reject.add_argument("--reason", help="why (kept with the proposal, not told to the guest)")

    receipts = command("receipts", "check receipts")
    receipt_actions = receipts.add_subparsers(dest="action", required=True, metavar="ACTION")
    verify = receipt_actions.add_parser(
        "verify", help="check a receipt file's hash chain and what it claims"
    )
    _common(verify)
    verify.add_argument(
        "file", help="an invocation id, or a receipt file (<state_dir>/receipts/<id>.jsonl)"
    )

    gc = command("gc", "delete what ended invocations no longer need")
    gc.add_argument(
        "--older-than",
        type=parse_age,
        required=True,
        metavar="AGE",
        help="untouched for this long: 30m, 12h, 7d, 2w",
    )
    gc.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    gc.add_argument("--store", help="the store, when no supervisor runs (default: sqlite)")

    completion = command("completion", "print the shell completion script")
    completion.add_argument("shell", nargs="?", default="bash", choices=["bash", "zsh", "fish"])
    return parser
