"""Commands hostcall prints for the operator to type — in another terminal,
where this one's virtual environment is not active."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

__all__ = ["hostcall_command", "state_dir_flag"]


def hostcall_command() -> str:
    """How to type ``hostcall`` in another terminal: the absolute path of this
    one when it lives in a virtual environment (a new shell has not activated
    it), else ``hostcall``."""
    if sys.prefix != sys.base_prefix:
        candidate = Path(sys.prefix) / "bin" / "hostcall"
        if candidate.exists():
            return str(candidate)
    return "hostcall"


def state_dir_flag(state_dir: Path) -> str:
    """`` --state-dir DIR``, unless a command in another terminal of this folder
    would pick that state dir by itself (``./.hostcall``, no variable set)."""
    default = Path(".hostcall").absolute()
    if not os.environ.get("HOSTCALL_STATE_DIR") and state_dir.absolute() == default:
        return ""
    return f" --state-dir {shlex.quote(str(state_dir.absolute()))}"
