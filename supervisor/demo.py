"""``hostcall demo``: the bundled billing example, end to end, with no setup.

It runs ``examples/billing/agent.py`` as a guest under
``examples/billing/plan.toml``. The tools write to a real SQLite "bank" in the
state dir; the agent walks through an executed call, a replayed one, refused
ones, one whose outcome is unknown and one that waits for an operator's
approval. Then the demo prints what the host recorded (receipts, effect
records, proposals) and what the bank holds, so the at-most-once guarantee can
be checked against the bank itself.

docs/operations.md asks for the example "end to end, with no setup", so by default the
approval step decides itself (an ``approver`` callback approves at once). With
``auto_approve=False`` (``hostcall demo --manual-approval``) an operator
decides it from a second terminal (``hostcall approvals approve ID`` or
``reject ID``; the demo prints both commands when the proposal opens).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import sqlite3
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import supervisor
from supervisor.approvals import Proposal
from supervisor.cli.hints import hostcall_command
from supervisor.plan import Plan
from supervisor.statedir import chosen_state_dir
from supervisor.stores.base import EffectRecord
from supervisor.supervisor import Supervisor

__all__ = ["BANK_ENV", "EXIT_NO_EXAMPLE", "example_dir", "run_demo"]

#: The supervisor-side variable naming the bank's file; ``billing_tools`` reads it.
BANK_ENV: Final = "BILLING_BANK_DB"
#: Exit status when the example is not installed (as the CLI's usage errors).
EXIT_NO_EXAMPLE: Final = 2
#: The guest is stopped if it runs longer than this plus the plan's approval
#: lease (its approval step may wait that long for an operator).
GUEST_TIMEOUT_S: Final = 60.0
#: The reason the printed ``reject`` command gives.
REJECT_REASON: Final = "no refund without a ticket"
_RULE: Final = "─" * 72
#: What each receipt outcome means, for a reader new to hostcall.
_MEANING: Final[Mapping[str, str]] = {
    "executed": "the handler ran",
    "replayed": "stored result returned, nothing ran",
    "refused": "refused, nothing ran",
    "failed": "the handler raised, no effect",
    "unknown": "in doubt: it may have run",
    "result_invalid": "ran, but its result is invalid",
}


def example_dir() -> Path:
    """The bundled ``examples/billing`` folder, next to the ``supervisor`` package.

    Raises:
        FileNotFoundError: hostcall was installed without its examples (only a
            source checkout or an editable install has them).
    """
    folder = Path(supervisor.__file__).resolve().parents[1] / "examples" / "billing"
    if not (folder / "plan.toml").is_file() or not (folder / "agent.py").is_file():
        raise FileNotFoundError(
            f"the demo's example is not at {folder}: `hostcall demo` needs a source "
            "checkout of hostcall (or an editable install: pip install -e .)"
        )
    return folder


async def run_demo(
    state_dir: str | os.PathLike[str] | None, *, auto_approve: bool = True, wasm: bool = False
) -> int:
    """Run the billing example and print what happened; returns the agent's exit status.

    Returns ``EXIT_NO_EXAMPLE`` (after saying why on stderr) when the example
    is not installed.

    Args:
        state_dir: Where the supervisor keeps its state and the demo its bank;
            when ``None``, ``$HOSTCALL_STATE_DIR``, else ``./.hostcall`` (docs/operations.md).
            The bank is made anew on every run; receipts accumulate.
        auto_approve: Approve the agent's proposal at once (the default: the
            demo runs unattended). Otherwise the demo prints how to decide it
            from a second terminal and waits, at most for the plan's
            ``approval_timeout_s``, after which it expires.
        wasm: Run the agent as a WebAssembly guest: ``examples/billing/agent.c``,
            built with the ziglang wheel (docs/wasm.md), the same five steps
            through the ``hostcall`` imports.
    """
    try:
        folder = example_dir()
    except FileNotFoundError as exc:
        print(f"hostcall demo: {exc}", file=sys.stderr)
        return EXIT_NO_EXAMPLE
    plan = Plan.load(folder / "plan.toml")
    path, absolute = _state_dir(state_dir)
    bank = absolute / "bank.db"
    repo_root = str(folder.parents[1])
    guest_env = {k: v for k, v in os.environ.items() if k != BANK_ENV}
    # The guest imports guest_client from this checkout, whatever is installed.
    guest_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (repo_root, os.environ.get("PYTHONPATH")) if p
    )
    module = None
    if wasm:
        from supervisor.errors import WasmError
        from supervisor.wasm_build import build_c

        try:
            module = await asyncio.to_thread(build_c, folder / "agent.c", absolute / "wasm")
        except WasmError as exc:
            print(f"hostcall demo: {exc}", file=sys.stderr)
            return EXIT_NO_EXAMPLE
    print("hostcall demo: a billing agent calls host tools through one audited door")
    if module is not None:
        print(f"agent: {folder / 'agent.c'} as a WebAssembly guest ({module.name})")
    print(f"state dir: {path} (effects.db, receipts/, bank.db)")
    print(f"plan: {folder / 'plan.toml'} ({plan.plan_hash[:19]}…)")
    if not auto_approve:
        print("step 5 waits for you: approve or reject it from a second terminal")
    print(_RULE, flush=True)
    approver = _approver(absolute, auto_approve)
    async with Supervisor(state_dir=path, approver=approver) as sup:
        # Only once the state dir is ours (locked): a fresh bank for every demo run.
        await asyncio.to_thread(_remove_bank, bank)
        with _environ(BANK_ENV, str(bank)):
            outcome = await sup.run(
                plan,
                [sys.executable, str(folder / "agent.py")] if module is None else [],
                env=guest_env if module is None else None,
                timeout_s=GUEST_TIMEOUT_S + plan.approval_timeout_s,
                wasm=module,
            )
        records = await sup.store.calls(outcome.invocation_id)
        proposals = [p for p in sup.approvals.list() if p.invocation_id == outcome.invocation_id]
        receipts_path = sup.state.receipts_dir / f"{outcome.invocation_id}.jsonl"
    sys.stdout.flush()
    print(_RULE)
    _print_receipts(receipts_path)
    _print_records(records)
    _print_proposals(proposals)
    _print_bank(bank)
    print(_RULE)
    if outcome.exit_status == 0:
        print(
            "no effect happened twice: each call ran once, was replayed, refused or left unknown."
        )
    else:
        print(f"the agent failed (exit status {outcome.exit_status}); see its output above.")
    return outcome.exit_status


def _state_dir(given: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    """The state dir as chosen (docs/operations.md), and made absolute."""
    path = chosen_state_dir(given)
    return path, path.absolute()


def _approver(state_dir: Path, auto_approve: bool) -> Callable[[Proposal], Awaitable[bool | None]]:
    """The supervisor's ``approver``: called once when a proposal opens.

    It approves at once with ``auto_approve``; otherwise it only tells the
    operator how to decide and leaves the decision to them (``None``). Async,
    so it runs on the loop and its lines fall between the agent's, in order.
    """

    async def approver(proposal: Proposal) -> bool | None:
        args = json.dumps(proposal.args, separators=(",", ":"))
        print(f"   host: {proposal.call_id} needs approval, proposal {proposal.id}")
        print(f"     {proposal.tool} {args}")
        if auto_approve:
            print(
                "   host: approved automatically"
                " (to decide it yourself: hostcall demo --manual-approval)",
                flush=True,
            )
            return True
        where = shlex.quote(str(state_dir))
        reason = shlex.quote(REJECT_REASON)
        lease = proposal.expires_at - proposal.created_at
        until = time.strftime("%H:%M:%S %Z", time.localtime(proposal.expires_at))
        # As typed in a new terminal: there the venv is not on PATH.
        hostcall = shlex.quote(hostcall_command())
        print("   In a second terminal, approve it:")
        print(f"     {hostcall} approvals approve {proposal.id} --state-dir {where}")
        print("   or reject it:")
        print(
            f"     {hostcall} approvals reject {proposal.id} --state-dir {where} --reason {reason}"
        )
        print(f"   Undecided at {until} (after {lease:g} s), it expires and is refused.")
        sys.stdout.flush()
        return None

    return approver


def _remove_bank(bank: Path) -> None:
    """Delete the bank a previous demo run left in the state dir, and make it
    anew, empty and 0600 like every file there (SQLite gives its journal the
    same mode); the tools fill it."""
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{bank}{suffix}").unlink(missing_ok=True)
    os.close(os.open(bank, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    """Set one variable of this process for the duration (the tools run here)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print rows under headers, columns aligned, the last one left ragged."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers[:-1])]
    for row in (headers, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  " + "  ".join([*cells, row[-1]]).rstrip())


def _print_receipts(path: Path) -> None:
    print(f"Every request, as the host recorded it (receipts/{path.name}):")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        print("  (no requests)")
        return
    rows = []
    seen: set[str] = set()
    for line in lines:
        receipt: dict[str, Any] = json.loads(line)
        call_id, outcome, code = (
            str(receipt["call_id"]),
            str(receipt["outcome"]),
            receipt["error_code"],
        )
        meaning = _MEANING.get(outcome, "")
        if approval_id := receipt.get("approval_id"):
            meaning = (
                f"ran after approval {approval_id}"
                if outcome == "executed"
                else f"{meaning}, approval {approval_id}"
            )
        if outcome == "refused" and code:
            meaning = f"{code}: nothing ran"
        elif outcome == "unknown" and call_id in seen:
            meaning = "still in doubt: not run again"
        seen.add(call_id)
        rows.append([call_id, str(receipt["tool"]), outcome, meaning])
    _table(["call_id", "tool", "outcome", "meaning"], rows)


def _print_records(records: Sequence[EffectRecord]) -> None:
    print()
    print("Effect records (effects.db; a refused call leaves none):")
    rows = [[r.call_id, r.tool, str(r.status), _short_response(r)] for r in records]
    _table(["call_id", "tool", "status", "stored response"], rows)


def _short_response(record: EffectRecord, width: int = 48) -> str:
    if record.response is None:
        return "(none: the outcome is in doubt)"
    text = json.dumps(record.response.get("result"), separators=(",", ":"))
    return text if len(text) <= width else text[: width - 1] + "…"


def _print_proposals(proposals: Sequence[Proposal]) -> None:
    print()
    print("Approval proposals (decisions on calls that needed one):")
    if not proposals:
        print("  (none)")
        return
    rows = []
    for p in proposals:
        decided = p.decided_by or ""
        if p.reason:
            decided = f"{decided}: {p.reason}"
        rows.append([p.id, p.call_id, p.state, decided])
    _table(["proposal", "call_id", "state", "decided by"], rows)


def _print_bank(bank: Path) -> None:
    print()
    print(f"The bank ({bank.name}, written only by the tools):")
    if not bank.exists():
        print("  (never opened: no tool reached it)")
        return
    with contextlib.closing(sqlite3.connect(bank)) as db:
        balances = db.execute("SELECT account, balance_cents FROM accounts ORDER BY account")
        for account, cents in balances:
            print(f"  {account:<12} {cents:>6} cents")
        charges = db.execute("SELECT count(*) FROM charges").fetchone()[0]
        refunds = db.execute("SELECT count(*) FROM refunds").fetchone()[0]
        outbox = db.execute("SELECT count(*) FROM outbox").fetchone()[0]
    print(f"  charges: {charges}   refunds: {refunds}   mails in the outbox: {outbox}")
