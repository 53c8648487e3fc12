"""Each execution's host log: what the supervisor has to say about it, in full.

``<state_dir>/logs/<invocation>/<execution>.host.log`` (0600) gets every log
record that names the execution — a handler's traceback first of all — with
its traceback, while hostcall's own stderr shows one line that points here
(``hostcall logs INVOCATION --stream host``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

__all__ = ["HostLog", "about"]

#: The ``extra`` keys of a record about one execution.
EXECUTION: Final = "hostcall_execution"
INVOCATION: Final = "hostcall_invocation"
WHERE: Final = "hostcall_host_log"


def about(invocation_id: str, execution_id: str, logs_dir: Path | None = None) -> dict[str, Any]:
    """``extra=`` for a log record about this execution."""
    extra: dict[str, Any] = {EXECUTION: execution_id, INVOCATION: invocation_id}
    if logs_dir is not None:
        extra[WHERE] = str(path_of(logs_dir, invocation_id, execution_id))
    return extra


def path_of(logs_dir: Path, invocation_id: str, execution_id: str) -> Path:
    """Where that execution's host log is."""
    return logs_dir / invocation_id / f"{execution_id}.host.log"


class HostLog(logging.Handler):
    """Writes the records about the executions ``owns`` says are ours to their
    host logs (several supervisors may share a process: each writes its own)."""

    def __init__(self, logs_dir: Path, owns: Callable[[str], bool]) -> None:
        super().__init__(logging.DEBUG)
        self._logs_dir = logs_dir
        self._owns = owns
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        execution_id = getattr(record, EXECUTION, None)
        invocation_id = getattr(record, INVOCATION, None)
        if not isinstance(execution_id, str) or not isinstance(invocation_id, str):
            return
        if not self._owns(execution_id):
            return
        try:
            text = self.format(record) + "\n"
            path = path_of(self._logs_dir, invocation_id, execution_id)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
            try:
                os.write(fd, text.encode("utf-8", "replace"))
            finally:
                os.close(fd)
        except Exception:  # boundary: logging must never raise into the caller
            self.handleError(record)
