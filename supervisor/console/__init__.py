"""The operator console: a live web page served by hostcall itself (docs/console.md)."""

from __future__ import annotations

from supervisor.addresses import Listen, parse_listen
from supervisor.console.server import ConsoleServer

__all__ = ["ConsoleServer", "Listen", "parse_listen"]
