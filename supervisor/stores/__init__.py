"""Effect stores (SPEC §6) and how a ``--store`` value selects one."""

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
    StartCall,
)
from supervisor.stores.memory import MemoryEffectStore
from supervisor.stores.postgres import PostgresEffectStore
from supervisor.stores.sqlite import SQLiteEffectStore

__all__ = [
    "Begun",
    "BudgetUse",
    "Charge",
    "EffectRecord",
    "EffectStatus",
    "EffectStore",
    "InvocationRecord",
    "MemoryEffectStore",
    "PostgresEffectStore",
    "SQLiteEffectStore",
    "StartCall",
    "store_from_spec",
]


def store_from_spec(spec: str | None, state_dir: Path) -> EffectStore:
    """The store a ``--store`` / ``HOSTCALL_STORE`` value names (SPEC §9).

    ``sqlite`` (default: ``<state_dir>/effects.db``), ``sqlite:///PATH`` (PATH as
    written: ``sqlite:////abs/x.db`` or ``sqlite:///rel/x.db``),
    ``memory``, ``postgresql://…`` / ``postgres://…`` (shared by replicas; the
    replica's id is kept in ``<state_dir>/replica-id``, so a restart on the same
    state dir recovers its own pending rows at once).

    Raises:
        ValueError: an unknown or unsupported store.
    """
    if spec is None or spec in ("", "sqlite"):
        return SQLiteEffectStore(state_dir / "effects.db")
    if spec == "memory":
        return MemoryEffectStore()
    if spec.startswith("sqlite:///"):
        return SQLiteEffectStore(Path(spec.removeprefix("sqlite:///")))
    if spec.startswith(("postgresql://", "postgres://")):
        return PostgresEffectStore(spec, identity_file=state_dir / "replica-id")
    raise ValueError(
        f"unknown store {spec!r}: use sqlite, sqlite:///PATH, memory or postgresql://…"
    )
