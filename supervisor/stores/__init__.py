"""Effect stores (docs/operations.md, "Stores") and how a ``--store`` value selects one."""

from __future__ import annotations

from pathlib import Path

from supervisor.stores.base import (
    Begun,
    BudgetUse,
    Charge,
    EffectRecord,
    EffectStatus,
    EffectStore,
    InvocationRecord,
    NotPending,
    StartCall,
)
from supervisor.stores.memory import MemoryEffectStore
from supervisor.stores.postgres import PostgresEffectStore
from supervisor.stores.sqlite import SQLiteEffectStore
from supervisor.stores.sqlite_sql import read_calls, read_invocations, read_snapshot
from supervisor.storespec import parse_store

__all__ = [
    "Begun",
    "BudgetUse",
    "Charge",
    "EffectRecord",
    "EffectStatus",
    "EffectStore",
    "InvocationRecord",
    "MemoryEffectStore",
    "NotPending",
    "PostgresEffectStore",
    "SQLiteEffectStore",
    "StartCall",
    "read_calls",
    "read_invocations",
    "read_snapshot",
    "store_from_spec",
]


def store_from_spec(spec: str | None, state_dir: Path) -> EffectStore:
    """The store a ``--store`` value names (see :func:`supervisor.storespec.parse_store`;
    ``None`` here means the default, not ``$HOSTCALL_STORE``). A PostgreSQL
    replica's id is kept in ``<state_dir>/replica-id``, so a restart on the same
    state dir recovers its own pending rows at once.

    Raises:
        ValueError: an unknown or unsupported store.
    """
    parsed = parse_store(spec if spec is not None else "sqlite", state_dir)
    if parsed.kind == "memory":
        return MemoryEffectStore()
    if parsed.kind == "postgresql":
        assert parsed.dsn is not None
        return PostgresEffectStore(parsed.dsn, identity_file=state_dir / "replica-id")
    assert parsed.path is not None
    return SQLiteEffectStore(parsed.path)
