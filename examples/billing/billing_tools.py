"""The billing example's tools: they write to a small SQLite "bank".

These handlers run in the supervisor's process, never in the guest: the guest
only names them through the channel. The bank is a real SQLite file whose path
comes from ``BILLING_BANK_DB`` (in the supervisor's environment; default
``billing-bank.db`` in the working directory). It is created and seeded with
two accounts on first use.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from pydantic import Field

from supervisor import tool

__all__ = ["BANK_ENV", "charge", "read_balance", "refund", "send_receipt"]

#: The supervisor-side variable that names the bank's database file.
BANK_ENV = "BILLING_BANK_DB"
_DEFAULT_BANK = "billing-bank.db"
_OPENING_BALANCES = {"acct_alice": 50_00, "acct_bob": 20_00}
_SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    account TEXT PRIMARY KEY,
    balance_cents INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS charges (
    charge_id INTEGER PRIMARY KEY AUTOINCREMENT,
    account TEXT NOT NULL REFERENCES accounts(account),
    cents INTEGER NOT NULL,
    memo TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS refunds (
    refund_id INTEGER PRIMARY KEY AUTOINCREMENT,
    account TEXT NOT NULL REFERENCES accounts(account),
    cents INTEGER NOT NULL,
    memo TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    message_id INTEGER PRIMARY KEY AUTOINCREMENT,
    account TEXT NOT NULL,
    email TEXT NOT NULL,
    body TEXT NOT NULL
);
"""

Account = Annotated[str, Field(pattern=r"^acct_[a-z0-9_]+$", max_length=64)]
Cents = Annotated[int, Field(gt=0, le=1_000_000)]


@contextmanager
def _bank() -> Iterator[sqlite3.Connection]:
    """One transaction on the bank (created and seeded if it does not exist)."""
    db = sqlite3.connect(os.environ.get(BANK_ENV, _DEFAULT_BANK), timeout=10)
    try:
        with db:
            db.executescript(_SCHEMA)
            db.executemany(
                "INSERT OR IGNORE INTO accounts (account, balance_cents) VALUES (?, ?)",
                _OPENING_BALANCES.items(),
            )
        with db:
            yield db
    finally:
        db.close()


def _balance(db: sqlite3.Connection, account: str) -> int:
    row = db.execute("SELECT balance_cents FROM accounts WHERE account = ?", (account,)).fetchone()
    if row is None:
        # A plain error: nothing happened, so the host releases the call.
        raise LookupError(f"no account {account!r}")
    return int(row[0])


@tool(reversibility="reversible")
def read_balance(account: Account) -> int:
    """The account's balance in cents. Reading twice changes nothing."""
    with _bank() as db:
        return _balance(db, account)


@tool(reversibility="irreversible", target_args=["account"], cost=10)
def charge(account: Account, cents: Cents, memo: str = "") -> dict[str, Any]:
    """Take ``cents`` from the account and record the charge. Never run it twice."""
    with _bank() as db:
        # One conditional UPDATE: two concurrent charges cannot both pass the check.
        taken = db.execute(
            "UPDATE accounts SET balance_cents = balance_cents - ?"
            " WHERE account = ? AND balance_cents >= ?",
            (cents, account, cents),
        ).rowcount
        if not taken:
            balance = _balance(db, account)
            raise ValueError(f"{account} has {balance} cents, cannot charge {cents}")
        cursor = db.execute(
            "INSERT INTO charges (account, cents, memo) VALUES (?, ?, ?)", (account, cents, memo)
        )
        return {"charge_id": f"ch_{cursor.lastrowid}", "balance_cents": _balance(db, account)}


@tool(reversibility="irreversible", target_args=["account"], cost=10)
def refund(account: Account, cents: Cents, memo: str = "") -> dict[str, Any]:
    """Give ``cents`` back to the account. Money out of the house: the plan asks a human first."""
    with _bank() as db:
        _balance(db, account)  # a refund to an unknown account is a plain error
        db.execute(
            "UPDATE accounts SET balance_cents = balance_cents + ? WHERE account = ?",
            (cents, account),
        )
        cursor = db.execute(
            "INSERT INTO refunds (account, cents, memo) VALUES (?, ?, ?)", (account, cents, memo)
        )
        return {"refund_id": f"rf_{cursor.lastrowid}", "balance_cents": _balance(db, account)}


@tool(reversibility="irreversible", target_args=["account"], cost=1)
def send_receipt(account: Account, email: str) -> dict[str, Any]:
    """Mail a receipt. The mail server of this example hangs up after accepting it.

    The message is in the outbox (it was sent), but the connection drops before
    the server confirms: the caller cannot know that it went out. The host
    records the call as ``unknown`` and never runs it again.
    """
    with _bank() as db:
        db.execute(
            "INSERT INTO outbox (account, email, body) VALUES (?, ?, ?)",
            (account, email, f"Thank you for your payment, {account}."),
        )
    raise ConnectionResetError("the mail server hung up before confirming delivery")
