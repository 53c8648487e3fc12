"""Read-only views of a state dir for operators: an invocation's calls as its
receipts tell them, whether its receipts verify, and the tail of its logs.

They read files the supervisor writes (blocking I/O: call them in a thread)
and never change anything. Guest-written text comes back as text (invalid
UTF-8 replaced); showing it safely is the viewer's job.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from supervisor.audit import AuditCache, audit_receipts, effects_for
from supervisor.errors import StoreUnavailable
from supervisor.receipts import RECEIPT_FIELDS, ReceiptOutcome
from supervisor.timestamps import utc_timestamp

__all__ = ["calls_from_receipts", "log_tails", "verify_receipts"]

#: Receipts :func:`calls_from_receipts` returns at most (the newest).
MAX_CALLS: Final = 500
#: Bytes read from the end of each log file for its tail.
TAIL_BYTES: Final = 256 * 1024

#: What each receipt outcome says about the handler (docs/protocol.md ``effect``).
_EFFECT: Final[Mapping[str, str]] = {
    ReceiptOutcome.EXECUTED: "executed",
    ReceiptOutcome.RESULT_INVALID: "executed",
    ReceiptOutcome.REPLAYED: "replayed",
    ReceiptOutcome.REFUSED: "none",
    ReceiptOutcome.FAILED: "failed",
    ReceiptOutcome.UNKNOWN: "unknown",
}


def calls_from_receipts(path: Path, limit: int = MAX_CALLS) -> list[dict[str, Any]]:
    """The newest ``limit`` calls of a receipt file, in the journal's shape
    (:meth:`supervisor.activity.CallEntry.to_json`), without their arguments
    (receipts do not keep them). A missing file has no calls.

    Only the last ``limit`` lines are parsed, and none is hashed (that is
    :func:`verify_receipts`' work): this runs in a thread of the supervisor,
    whose event loop waits for the GIL while it does (docs/security.md, F44).
    """
    try:
        with path.open("rb") as f:
            lines = collections.deque(f, maxlen=limit)
    except FileNotFoundError:
        return []
    calls = []
    for raw in lines:
        try:
            receipt = json.loads(raw)
        except ValueError:
            continue
        if isinstance(receipt, dict) and set(receipt) == RECEIPT_FIELDS:
            calls.append(_call_of(receipt))
    return calls


def _call_of(receipt: dict[str, Any]) -> dict[str, Any]:
    started, finished = receipt.get("started_at"), receipt.get("finished_at")
    timed = isinstance(started, int | float) and isinstance(finished, int | float)
    outcome = str(receipt.get("outcome"))
    took = round((finished - started) * 1000, 3) if timed else None  # type: ignore[operator]
    return {
        "execution_id": receipt.get("execution_id"),
        "call_id": receipt.get("call_id"),
        "tool": receipt.get("tool"),
        "args": None,
        "args_kept": False,
        "args_bytes": 0,
        "status": None,
        "outcome": outcome,
        "effect": _EFFECT.get(outcome, "unknown"),
        "code": receipt.get("error_code"),
        "idempotency_key": receipt.get("idempotency_key"),
        "receipt_id": receipt.get("receipt_id"),
        "approval_id": receipt.get("approval_id"),
        "started_at": _when(started),
        "finished_at": _when(finished),
        "duration_ms": took,
    }


def _when(value: Any) -> Any:
    return utc_timestamp(value) if isinstance(value, int | float) else value


def verify_receipts(
    path: Path, state_dir: Path | None, cache: AuditCache | None = None
) -> dict[str, Any]:
    """``hostcall receipts verify`` of one file, as JSON: whether the chain is
    intact, what it was checked against, and each finding (going on from
    the last audit in ``cache``, if the file only grew since)."""
    if not path.exists():
        return {
            "file": str(path),
            "exists": False,
            "ok": True,
            "chain_intact": True,
            "receipts": 0,
            "checked_against": None,
            "summary": "no receipts yet",
            "findings": [],
        }
    effects = None
    if state_dir is not None:
        with contextlib.suppress(StoreUnavailable):  # not the SQLite store: the chain only
            effects = effects_for(path, state_dir)
    audit = audit_receipts(path, effects=effects, cache=cache)
    return {
        "file": str(path),
        "exists": True,
        "ok": audit.ok,
        "chain_intact": audit.chain_intact,
        "receipts": audit.receipts,
        "checked_against": audit.checked_against,
        "summary": audit.summary(),
        "findings": [
            {"severity": f.severity, "rule": f.rule, "message": f.message, "line": f.line}
            for f in audit.findings
        ],
    }


def log_tails(folder: Path, execution_ids: Sequence[str], lines: int) -> list[dict[str, Any]]:
    """The last ``lines`` lines of each execution's stdout and stderr log, for
    the executions named (the supervisor's, oldest first) and any others
    whose logs are in ``folder``."""
    ids = list(execution_ids)
    with contextlib.suppress(OSError):
        found = sorted(
            {
                n.rsplit(".", 2)[0]
                for n in os.listdir(folder)
                if n.endswith((".stdout.log", ".stderr.log"))
            }
        )
        ids += [i for i in found if i not in ids]
    tails = []
    for execution_id in ids:
        for stream in ("stdout", "stderr"):
            text, size = _tail(folder / f"{execution_id}.{stream}.log", lines)
            if text is not None:
                tails.append(
                    {"execution_id": execution_id, "stream": stream, "bytes": size, "text": text}
                )
    return tails


def _tail(path: Path, lines: int) -> tuple[str | None, int]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None, 0
    try:
        size = os.fstat(fd).st_size
        start = max(0, size - TAIL_BYTES)
        data = os.pread(fd, size - start, start)
    finally:
        os.close(fd)
    if start:
        data = data.split(b"\n", 1)[-1]  # the first line is likely cut
    kept = data.decode("utf-8", "replace").splitlines()[-lines:]
    return "\n".join(kept), size
