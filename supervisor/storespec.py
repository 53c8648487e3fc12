"""What a ``--store`` / ``HOSTCALL_STORE`` value names (docs/operations.md), parsed in one
place. Standard library only: the CLI parses it before it loads a store."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["StoreSpec", "parse_store"]

STORE_CHOICES = "sqlite, sqlite:///PATH, memory or postgresql://…"


@dataclass(frozen=True, slots=True)
class StoreSpec:
    """A parsed store setting: a SQLite file, the memory store, or a PostgreSQL DSN."""

    kind: Literal["sqlite", "memory", "postgresql"]
    path: Path | None = None
    dsn: str | None = None


def parse_store(spec: str | None, state_dir: Path) -> StoreSpec:
    """``spec`` (else ``$HOSTCALL_STORE``, else ``sqlite``) as a :class:`StoreSpec`.

    ``sqlite`` is ``<state_dir>/effects.db``; ``sqlite:///PATH`` takes PATH as
    written (``sqlite:////abs/x.db``, ``sqlite:///rel/x.db``); ``postgresql://``
    and ``postgres://`` are DSNs.

    Raises:
        ValueError: an unknown or unsupported store.
    """
    if spec is None:
        spec = os.environ.get("HOSTCALL_STORE")
    if spec is None or spec in ("", "sqlite"):
        return StoreSpec("sqlite", path=state_dir / "effects.db")
    if spec == "memory":
        return StoreSpec("memory")
    if spec.startswith("sqlite:///"):
        return StoreSpec("sqlite", path=Path(spec.removeprefix("sqlite:///")))
    if spec.startswith(("postgresql://", "postgres://")):
        return StoreSpec("postgresql", dsn=spec)
    shown = spec.split("@")[-1] if "@" in spec else spec  # no password in the message
    raise ValueError(f"unknown store {shown!r}: use {STORE_CHOICES}")
