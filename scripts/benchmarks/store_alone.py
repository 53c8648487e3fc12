"""The SQLite effect store alone: a call's two transactions, no HTTP, no broker.

Each call is what the broker asks of the store for a tool without approval:
``begin`` (the pending row and the budget charge in one transaction, one
fsync), then ``commit`` of its response with its receipt journaled in the
same transaction (one more fsync). ``--inflight`` calls run at once on one
event loop, as requests would. Prints calls/s, the process's CPU per call
(user and system: an fsync costs system CPU too) and SQLite's statements by
kind — how many per call and how long each ``execute`` took, timed through a
connection subclass.

    python scripts/benchmarks/store_alone.py --inflight 1 --calls 5000
    python scripts/benchmarks/store_alone.py --inflight 32 --work-dir /var/tmp

With one call at a time the store commits on the loop itself, as it does
for a lone request; with more, ops queued in one turn of the loop are
batched (``supervisor/stores/sqlite.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from supervisor.budget import BudgetLimits, Charge
from supervisor.receipts import ReceiptOutcome, make_receipt
from supervisor.stores.base import StartCall
from supervisor.stores.sqlite import SQLiteEffectStore

#: Per statement kind (its text up to the first parenthesis): count, seconds.
_STATEMENTS: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])


class _TimedConnection(sqlite3.Connection):
    """A connection that times each ``execute`` by statement kind."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        started = time.perf_counter()
        try:
            return super().execute(sql, *args)
        finally:
            kind = _STATEMENTS[sql.split("(")[0].strip()[:60]]
            kind[0] += 1
            kind[1] += time.perf_counter() - started


_connect: Final = sqlite3.connect


def _timed_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
    return _connect(*args, factory=_TimedConnection, **kwargs)


async def measure(work: Path, inflight: int, calls: int) -> dict[str, Any]:
    """Run ``calls`` calls, ``inflight`` at a time, against a new store in ``work``."""
    store = SQLiteEffectStore(work / "effects.db")
    await store.open()
    # As many requests in progress as calls in flight: one commits on the
    # loop, more are batched (the server's own hint counts its requests).
    store.set_load_hint(lambda: inflight)
    await store.open_invocation("inv_bench", "ab" * 32, None, time.time())
    receipts = store.receipts(work / "receipts.jsonl", None)
    limits = BudgetLimits()
    gate = asyncio.Semaphore(inflight)

    async def call(n: int) -> None:
        async with gate:
            call_id, key = f"c{n}", f"{n:064x}"
            start = StartCall("inv_bench", call_id, "noop", key, "exe_bench", False)
            begun = await store.begin(start, time.time(), Charge("noop", 0.0, limits, None))
            assert begun.won
            receipt = make_receipt(
                invocation_id="inv_bench",
                execution_id="exe_bench",
                plan_hash="ab" * 32,
                call_id=call_id,
                tool="noop",
                idempotency_key=key,
                outcome=ReceiptOutcome.EXECUTED,
                error_code=None,
                result_sha256="cd" * 32,
                approval_id=None,
                started_at=time.time(),
                finished_at=time.time(),
            )
            response = {"status": "ok", "call_id": call_id, "effect": "executed", "result": n}
            await receipts.commit("inv_bench", call_id, response, time.time(), receipt)

    _STATEMENTS.clear()
    wall, before = time.perf_counter(), os.times()
    await asyncio.gather(*(call(n) for n in range(calls)))
    wall, after = time.perf_counter() - wall, os.times()
    await store.close()
    statements = {
        kind: {"per_call": count / calls, "us_each": seconds / count * 1e6}
        for kind, (count, seconds) in sorted(_STATEMENTS.items(), key=lambda kv: -kv[1][1])
    }
    return {
        "inflight": inflight,
        "calls": calls,
        "calls_per_s": calls / wall,
        "user_us_per_call": (after.user - before.user) / calls * 1e6,
        "system_us_per_call": (after.system - before.system) / calls * 1e6,
        "statements_us_per_call": sum(s for _, s in _STATEMENTS.values()) / calls * 1e6,
        "statements": statements,
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, measure, print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inflight", type=int, default=1)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument(
        "--work-dir", type=Path, help="where the database goes (its fsync is measured)"
    )
    args = parser.parse_args(argv)
    if args.inflight < 1 or args.calls < 1:
        parser.error("--inflight and --calls must be at least 1")
    sqlite3.connect = _timed_connect  # type: ignore[assignment]  # the store's, timed
    with tempfile.TemporaryDirectory(prefix="hostcall-store-", dir=args.work_dir) as work:
        result = asyncio.run(measure(Path(work), args.inflight, args.calls))
    print(
        f"store alone, {result['inflight']} in flight, {result['calls']} calls: "
        f"{result['calls_per_s']:,.0f} calls/s, CPU per call "
        f"{result['user_us_per_call']:.0f} µs user + {result['system_us_per_call']:.0f} µs system, "
        f"statements {result['statements_us_per_call']:.0f} µs"
    )
    for kind, row in result["statements"].items():
        print(f"  {row['per_call']:5.2f} per call, {row['us_each']:7.1f} µs each  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
