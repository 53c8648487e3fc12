"""Effect stores (SPEC §6) and how a ``--store`` value selects one."""

from __future__ import annotations

from pathlib import Path

from supervisor.stores.base import (
    Begun,
    BudgetUse,
    EffectRecord,
    EffectStatus,
    EffectStore,
    InvocationRecord,
    StartCall,
)
from supervisor.stores.memory import MemoryEffectStore
from supervisor.stores.sqlite import SQLiteEffectStore

__all__ = [
    "Begun",
    "BudgetUse",
    "EffectRecord",
    "EffectStatus",
    "EffectStore",
    "InvocationRecord",
    "MemoryEffectStore",
    "SQLiteEffectStore",
    "StartCall",
    "store_from_spec",
]


def store_from_spec(spec: str | None, state_dir: Path) -> EffectStore:
    """The store a ``--store`` / ``HOSTCALL_STORE`` value names (SPEC §9).

    ``sqlite`` (default: ``<state_dir>/effects.db``), ``sqlite:///PATH`` (PATH as
    written: ``sqlite:////abs/x.db`` or ``sqlite:///rel/x.db``),
    ``memory``.

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
        raise ValueError("the PostgreSQL store is not available in this version of hostcall")
    raise ValueError(
        f"unknown store {spec!r}: use sqlite, sqlite:///PATH, memory or postgresql://…"
    )
