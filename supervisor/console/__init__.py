"""The operator console: a live web page served by hostcall itself (docs/console.md)."""

from __future__ import annotations

from supervisor.console.server import DEFAULT_PORT, ConsoleServer, Listen, parse_listen

__all__ = ["DEFAULT_PORT", "ConsoleServer", "Listen", "parse_listen"]
