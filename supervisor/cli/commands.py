"""The operator's commands: ``approvals``, ``invocations``, ``calls``, ``logs``,
``cancel``, ``revoke``, ``launch``, ``receipts verify``, ``gc``, ``completion``
(docs/operations.md).

They talk to the running supervisor's admin socket; ``invocations``,
``calls``, ``logs``, ``receipts`` and ``gc`` also work on a state dir no
supervisor runs on (read from its files and its SQLite store).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from supervisor.admin_client import AdminClient, AdminError, SupervisorNotRunning
from supervisor.cli.app import (
    EXIT_FAILED,
    EXIT_USAGE,
    inert_json,
    one_line,
    short_json,
    state_dir_of,
)
from supervisor.errors import HostcallError, StoreUnavailable
from supervisor.ids import is_path_safe_id
from supervisor.storespec import parse_store

if TYPE_CHECKING:
    from supervisor.gc import GcReport

__all__ = [
    "approvals",
    "calls",
    "cancel",
    "completion",
    "gc",
    "invocations",
    "launch",
    "logs",
    "receipts",
    "revoke",
]

#: ``logs --follow`` looks for new output this often …
FOLLOW_INTERVAL_S: Final = 0.2
#: … and asks whether the invocation still runs this often.
FOLLOW_CHECK_S: Final = 1.0


class _Unusable(HostcallError):
    code = "usage"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    return "\n".join(lines)


def _failed(command: str, exc: AdminError) -> int:
    print(f"hostcall {command}: {one_line(exc.message)}", file=sys.stderr)
    return EXIT_FAILED


def _sqlite_path(state_dir: Path, store: str | None) -> Path:
    """The SQLite file to read when no supervisor runs on ``state_dir``.

    Raises:
        SupervisorNotRunning: the store cannot be read offline, or is not there.
    """
    try:
        spec = parse_store(store, state_dir)
    except ValueError as exc:
        raise _Unusable(str(exc)) from None
    if spec.kind != "sqlite" or spec.path is None:
        raise SupervisorNotRunning(
            f"no supervisor is running on {state_dir}, and a {spec.kind} store cannot be "
            "read without one"
        )
    if not spec.path.exists():
        raise SupervisorNotRunning(f"no supervisor is running on {state_dir} and no {spec.path}")
    return spec.path


# -- approvals -----------------------------------------------------------------


def approvals(args: argparse.Namespace) -> int:
    """``hostcall approvals list | show | approve | reject``."""
    client = AdminClient(state_dir_of(args))
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
                    short_json(p["args"], 48),
                ]
                for p in proposals
            ]
            print(_table(rows, ["ID", "STATE", "TOOL", "CALL_ID", "INVOCATION", "EXPIRES", "ARGS"]))
            print("(full arguments: hostcall approvals show ID)")
        return 0
    if args.action == "show":
        try:
            proposal = client.request("GET", f"/v1/approvals/{args.id}")
        except AdminError as exc:
            return _failed("approvals show", exc)
        if args.json:
            print(json.dumps(proposal, indent=2))
            return 0
        for key in ("id", "state", "tool", "reversibility", "invocation_id", "execution_id",
                    "call_id", "idempotency_key", "created_at", "expires_at", "decided_at",
                    "decided_by", "reason"):  # fmt: skip
            if proposal.get(key) is not None:
                print(f"{key + ':':17} {proposal[key]}")
        print("args:")
        print(inert_json(proposal["args"], indent=2))
        return 0
    body = {"reason": args.reason} if args.action == "reject" and args.reason else {}
    try:
        proposal = client.request("POST", f"/v1/approvals/{args.id}/{args.action}", body)
    except AdminError as exc:
        return _failed(f"approvals {args.action}", exc)
    print(f"{proposal['id']}: {proposal['state']} ({proposal['tool']} {proposal['call_id']})")
    return 0


# -- invocations, calls --------------------------------------------------------


def _budget_text(budget: dict[str, Any] | None) -> str:
    if not budget:
        return "-"
    parts = []
    if budget.get("max_calls") is not None:
        parts.append(f"{budget['calls_left']}/{budget['max_calls']} calls")
    if budget.get("max_cost") is not None:
        parts.append(f"{budget['cost_left']:g}/{budget['max_cost']:g} cost")
    return ", ".join(parts) or "unlimited"


def _offline_invocations(state_dir: Path, store: str | None) -> list[dict[str, Any]]:
    from supervisor.stores import read_invocations
    from supervisor.timestamps import utc_timestamp

    return [
        {
            "invocation_id": r.invocation_id,
            "plan_hash": r.plan_hash,
            "plan_name": None,
            "state": "idle",
            "created_at": utc_timestamp(r.created_at),
            "deadline_at": utc_timestamp(r.deadline_at) if r.deadline_at else None,
            "calls_used": r.used.calls,
            "cost_used": r.used.cost,
            "budget": None,
            "calls_by_outcome": {},
            "executions": [],
        }
        for r in read_invocations(_sqlite_path(state_dir, store))
    ]


def invocations(args: argparse.Namespace) -> int:
    """``hostcall invocations``."""
    state_dir = state_dir_of(args)
    try:
        found = AdminClient(state_dir).request("GET", "/v1/invocations")
    except SupervisorNotRunning:
        found = _offline_invocations(state_dir, args.store)
    found = sorted(found, key=lambda i: i["created_at"], reverse=True)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print("no invocations")
        return 0
    rows = []
    for inv in found:
        executions = inv["executions"]
        last = executions[-1] if executions else None
        ended = last["outcome"]["reason"] if last and last.get("outcome") else None
        rows.append(
            [
                inv["invocation_id"],
                inv["state"],
                f"{len(executions)} ({last['state']}{', ' + ended if ended else ''})"
                if last
                else "-",
                ", ".join(f"{k} {v}" for k, v in sorted(inv["calls_by_outcome"].items()))
                or f"{inv['calls_used']} used",
                _budget_text(inv.get("budget")),
                inv["created_at"],
            ]
        )
    print(_table(rows, ["INVOCATION", "STATE", "EXECUTIONS", "CALLS", "BUDGET LEFT", "CREATED"]))
    return 0


def calls(args: argparse.Namespace) -> int:
    """``hostcall calls INVOCATION``."""
    state_dir = state_dir_of(args)
    try:
        records = AdminClient(state_dir).request("GET", f"/v1/invocations/{args.invocation}/calls")
    except SupervisorNotRunning:
        from supervisor.admin import record_json
        from supervisor.stores import read_calls

        offline = read_calls(_sqlite_path(state_dir, args.store), args.invocation)
        records = None if offline is None else [record_json(r) for r in offline]
    except AdminError as exc:
        return _failed("calls", exc)
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
            short_json(r["response"].get("result") if r["response"] else None, 40),
        ]
        for r in records
    ]
    print(
        _table(rows, ["CALL_ID", "TOOL", "STATUS", "EXECUTION", "UPDATED", "RESULT"])
        if rows
        else "no calls"
    )
    return 0


# -- logs ----------------------------------------------------------------------


def _log_files(folder: Path, execution: str | None, stream: str | None) -> list[Path]:
    try:
        names = sorted(os.listdir(folder), key=lambda n: (folder / n).stat().st_mtime)
    except OSError:
        return []
    chosen = []
    for name in names:
        exe, _, rest = name.partition(".")
        kind = rest.removesuffix(".log")
        if kind not in ("stdout", "stderr", "host") or not rest.endswith(".log"):
            continue
        if (execution is None or exe == execution) and (stream is None or kind == stream):
            chosen.append(folder / name)
    return chosen


def _still_running(state_dir: Path, invocation_id: str) -> bool:
    try:
        found = AdminClient(state_dir).request("GET", f"/v1/invocations/{invocation_id}")
    except (SupervisorNotRunning, AdminError, OSError):
        return False
    return bool(found.get("state") == "running")


def logs(args: argparse.Namespace) -> int:
    """``hostcall logs INVOCATION [--follow]``: the kept output, file by file;
    with ``--follow``, then what is added, until the invocation no longer runs."""
    state_dir = state_dir_of(args)
    folder = state_dir / "logs" / args.invocation
    files = _log_files(folder, args.execution, args.stream)
    if not files and not args.follow:
        print(f"hostcall logs: no logs of {args.invocation} in {state_dir}", file=sys.stderr)
        return EXIT_FAILED
    out = sys.stdout.buffer
    # Guest output on a terminal: its escapes shown as text, as the pass-through
    # does, a character split between two reads kept whole (one per file).
    from supervisor.terminal import TerminalText

    texts: dict[Path, TerminalText] | None = None if not sys.stdout.isatty() else {}
    offsets: dict[Path, int] = {}
    shown: Path | None = None
    mid_line = False  # what was last written ended inside a line

    def write(data: bytes) -> None:
        nonlocal mid_line
        if data:
            out.write(data)
            out.flush()
            mid_line = not data.endswith(b"\n")

    def under(path: Path) -> None:
        """What follows is ``path``'s: its header, unless it was the last shown."""
        nonlocal shown
        if path != shown:
            write(b"\n" if mid_line else b"")  # a line of one file is not the next's
            write(f"==> {path.name} <==\n".encode())
            shown = path

    def show_new() -> None:
        for path in _log_files(folder, args.execution, args.stream):
            try:
                with open(path, "rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            offsets[path] = offsets.get(path, 0) + len(data)
            under(path)
            write(data if texts is None else texts.setdefault(path, TerminalText()).feed(data))

    def end() -> int:
        for path, text in (texts or {}).items():
            if rest := text.end():  # a file that ended inside a character
                under(path)
                write(rest)
        write(b"\n" if mid_line else b"")
        return 0

    show_new()
    if not args.follow:
        return end()
    last_check = 0.0
    try:
        while True:
            time.sleep(FOLLOW_INTERVAL_S)
            show_new()
            now = time.monotonic()
            if now - last_check >= FOLLOW_CHECK_S:
                last_check = now
                if not _still_running(state_dir, args.invocation):
                    show_new()
                    return end()
    except KeyboardInterrupt:
        return end()


# -- cancel, revoke, launch ------------------------------------------------------


def cancel(args: argparse.Namespace) -> int:
    """``hostcall cancel EXECUTION``."""
    try:
        execution = AdminClient(state_dir_of(args)).request(
            "POST", f"/v1/executions/{args.execution}/cancel"
        )
    except AdminError as exc:
        return _failed("cancel", exc)
    print(f"{execution['execution_id']}: {execution['state']} (its guest is gone)")
    return 0


def revoke(args: argparse.Namespace) -> int:
    """``hostcall revoke INVOCATION TOOL``."""
    try:
        AdminClient(state_dir_of(args)).request(
            "POST", f"/v1/invocations/{args.invocation}/tools/{args.tool}/revoke"
        )
    except AdminError as exc:
        return _failed("revoke", exc)
    print(f"{args.invocation}: {args.tool} revoked (every later call is refused tool_not_allowed)")
    return 0


def launch(args: argparse.Namespace) -> int:
    """``hostcall launch -- CMD…`` on a running ``hostcall serve``."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv and args.wasm is None:
        raise _Unusable("give the guest's command after --: hostcall launch -- CMD [ARG…]")
    body: dict[str, Any] = {"argv": argv}
    if args.wasm is not None:
        # The supervisor opens it: a path relative to here would not be its.
        body["wasm"] = str(Path(args.wasm).absolute())
    if args.invocation:
        body["invocation"] = args.invocation
    if args.timeout:
        body["timeout_s"] = args.timeout
    try:
        execution = AdminClient(state_dir_of(args)).request("POST", "/v1/invocations", body)
    except AdminError as exc:
        return _failed("launch", exc)
    print(f"launched {execution['execution_id']} of invocation {execution['invocation_id']}")
    return 0


# -- receipts, gc, completion ----------------------------------------------------


def receipts(args: argparse.Namespace) -> int:
    """``hostcall receipts verify FILE|INVOCATION``."""
    from supervisor.audit import audit_receipts, effects_for

    named = getattr(args, "state_dir", None)  # only when --state-dir was given
    path = Path(args.file)
    if not path.exists() and is_path_safe_id(args.file):
        path = state_dir_of(args) / "receipts" / f"{args.file}.jsonl"
        if not path.exists():
            raise _Unusable(
                f"no receipt file {args.file}, and no receipts of an invocation {args.file} "
                f"in {path.parent} (none is written before its first call)"
            )
    if not path.exists():
        raise _Unusable(
            f"cannot read {args.file}: no such file (give a receipt file or an invocation id)"
        )
    if not path.is_file():
        raise _Unusable(f"{args.file} is not a receipt file")
    try:
        effects = effects_for(path, Path(named) if named is not None else None)
    except StoreUnavailable as exc:
        # No effects.db in the named dir (a --store elsewhere), or one that
        # cannot be read: the chain can still be checked, and is, alone.
        print(f"hostcall receipts verify: {exc}; checking the chain alone", file=sys.stderr)
        effects = None
    try:
        audit = audit_receipts(path, effects=effects)
    except OSError as exc:
        print(f"hostcall receipts verify: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return EXIT_USAGE
    for line in audit.lines():
        print(line, file=sys.stderr)
    if not audit.ok:
        print(audit.summary(), file=sys.stderr)
        return EXIT_FAILED
    print(audit.summary())
    return 0


def gc(args: argparse.Namespace) -> int:
    """``hostcall gc --older-than AGE``: through the running supervisor, else
    on the state dir itself (locked meanwhile, so none starts)."""
    import asyncio

    from supervisor.gc import GcReport

    state_dir = state_dir_of(args)
    body = {"older_than_s": args.older_than, "dry_run": args.dry_run}
    try:
        report = GcReport(**AdminClient(state_dir).request("POST", "/v1/gc", body))
    except SupervisorNotRunning:
        if not state_dir.is_dir():
            raise _Unusable(f"no state dir {state_dir}") from None
        report = asyncio.run(_gc_offline(args, state_dir))
    for line in report.lines():
        print(line)
    return 0


async def _gc_offline(args: argparse.Namespace, state_dir: Path) -> GcReport:
    from supervisor.gc import collect
    from supervisor.statedir import StateDir
    from supervisor.stores import store_from_spec

    chosen = args.store if args.store is not None else os.environ.get("HOSTCALL_STORE")
    try:
        spec = parse_store(chosen, state_dir)
    except ValueError as exc:
        raise _Unusable(str(exc)) from None
    if spec.kind == "memory":
        raise _Unusable("the memory store keeps nothing between runs: nothing to collect")
    state = StateDir(state_dir)
    state.acquire()  # no supervisor starts on it meanwhile
    try:
        store = store_from_spec(chosen, state.path)
        await store.open()
        try:
            return await collect(
                store,
                state.path,
                older_than_s=args.older_than,
                now=time.time(),
                live=(),
                dry_run=args.dry_run,
            )
        finally:
            await store.close()
    finally:
        state.release()


def completion(args: argparse.Namespace) -> int:
    """``hostcall completion [bash|zsh|fish]``: the shell script that completes
    hostcall's commands and options (argcomplete)."""
    from argcomplete.shell_integration import shellcode

    print(shellcode(["hostcall"], shell=args.shell))
    return 0
