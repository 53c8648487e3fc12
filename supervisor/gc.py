"""``hostcall gc``: delete what ended invocations no longer need.

Effect records are the at-most-once memory: a resumed invocation must find
every call that ran, or it runs it again. So gc is careful, per invocation
untouched for the given age and with no live execution:

- **Guest logs** (``logs/<invocation>/``) are deleted: they are for people.
- **Effect records** are deleted only when the invocation's deadline has
  passed. Then no call of it can be admitted again (every call is refused
  ``budget_exhausted`` before BeginDispatch), so forgetting what ran cannot
  run anything twice. The invocation's own row — its budget use and deadline
  — stays, as a tombstone: resuming it is refused, not started afresh.
  Without a passed deadline the records are kept, however old: that is what
  stops a resume from charging a customer twice.
- **Receipts** are kept: they are the audit record (archive or delete them
  yourself; ``hostcall receipts verify`` needs them).
- Records still ``pending`` (a call in flight, or a crash's) are never deleted.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.ids import is_path_safe_id
from supervisor.stores.base import EffectStore, InvocationRecord

__all__ = ["GcReport", "collect"]


@dataclass(slots=True)
class GcReport:
    """What ``hostcall gc`` deleted (or, dry, would delete) and what it kept, and why."""

    dry_run: bool
    older_than_s: float
    #: Invocations whose logs went.
    logs_removed: list[str] = field(default_factory=list)
    #: Invocation → effect records forgotten (deadline passed).
    records_forgotten: dict[str, int] = field(default_factory=dict)
    #: Old enough, but their deadline has not passed (or there is none): records kept.
    records_kept: list[str] = field(default_factory=list)
    #: Skipped: an execution of theirs is live.
    live: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What happened, for people."""
        verb = "would delete" if self.dry_run else "deleted"
        out = [f"{verb} the guest logs of {len(self.logs_removed)} invocation(s)"]
        records = sum(self.records_forgotten.values())
        out.append(
            f"{verb} {records} effect record(s) of {len(self.records_forgotten)} invocation(s) "
            "whose deadline has passed (their budget and deadline stay: a resume is refused)"
        )
        if self.records_kept:
            out.append(
                f"kept the effect records of {len(self.records_kept)} invocation(s) without a "
                "passed deadline: they are what stops a resumed invocation from running a call "
                "twice (give plans a deadline_s to let gc forget them)"
            )
        if self.live:
            out.append(f"skipped {len(self.live)} invocation(s) with a live execution")
        out.append("kept every receipt file: receipts are the audit record")
        return out

    def to_json(self) -> dict[str, Any]:
        """The admin API's form."""
        return {
            "dry_run": self.dry_run,
            "older_than_s": self.older_than_s,
            "logs_removed": self.logs_removed,
            "records_forgotten": self.records_forgotten,
            "records_kept": self.records_kept,
            "live": self.live,
        }


def _mtime(path: Path) -> float:
    """The newest modification time of ``path`` or anything directly in it."""
    try:
        newest = path.stat().st_mtime
    except OSError:
        return 0.0
    if path.is_dir():
        for entry in os.scandir(path):
            try:
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
            except OSError:
                continue
    return newest


async def _last_activity(store: EffectStore, state_dir: Path, inv: InvocationRecord) -> float:
    records = await store.calls(inv.invocation_id)
    files = await asyncio.to_thread(
        lambda: max(
            _mtime(state_dir / "logs" / inv.invocation_id),
            _mtime(state_dir / "receipts" / f"{inv.invocation_id}.jsonl"),
        )
    )
    return max([inv.created_at, files, *(r.updated_at for r in records)])


async def collect(
    store: EffectStore,
    state_dir: Path,
    *,
    older_than_s: float,
    now: float,
    live: Collection[str],
    dry_run: bool,
) -> GcReport:
    """Collect what the invocations of ``store`` untouched for ``older_than_s``
    no longer need (see the module docstring). ``live``: invocations with a
    live execution, which are left alone."""
    report = GcReport(dry_run, older_than_s)
    for inv in await store.list_invocations():
        invocation_id = inv.invocation_id
        if invocation_id in live:
            report.live.append(invocation_id)
            continue
        if now - await _last_activity(store, state_dir, inv) < older_than_s:
            continue
        logs = state_dir / "logs" / invocation_id
        if is_path_safe_id(invocation_id) and logs.is_dir() and not logs.is_symlink():
            report.logs_removed.append(invocation_id)
            if not dry_run:
                await asyncio.to_thread(shutil.rmtree, logs, True)
        if inv.deadline_at is not None and inv.deadline_at <= now:
            if dry_run:
                settled = [
                    r for r in await store.calls(invocation_id) if str(r.status) != "pending"
                ]
                count = len(settled)
            else:
                count = await store.forget_calls(invocation_id)
            if count:
                report.records_forgotten[invocation_id] = count
        elif await store.calls(invocation_id):
            report.records_kept.append(invocation_id)
    return report
