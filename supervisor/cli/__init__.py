"""The ``hostcall`` command line (docs/operations.md)."""

from __future__ import annotations

from supervisor.cli.app import main

__all__ = ["main"]
