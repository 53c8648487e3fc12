"""Per-execution limits (issue: guest lifecycle) and the reasons an execution ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = ["EXIT_LIMIT", "EXIT_TIMEOUT", "LIMIT_REASONS", "EndReason", "Limits"]

EndReason = Literal[
    "exited",  # the guest exited on its own
    "signalled",  # a signal the supervisor did not send ended it
    "timeout",  # wall-clock timeout
    "cancelled",  # the admin API / Python API / hostcall itself stopped it
    "fenced",  # a newer execution of its invocation took over (docs/security.md, S5)
    "memory_limit",  # RSS of the whole tree over the limit
    "cpu_limit",  # CPU seconds of the whole tree over the limit
    "process_limit",  # more processes in the tree than allowed
    "open_files_limit",  # more open file descriptors in the tree than allowed
]
LIMIT_REASONS: Final = frozenset({"memory_limit", "cpu_limit", "process_limit", "open_files_limit"})

#: ``hostcall run`` exits 124 when the timeout ended the guest (docs/operations.md) …
EXIT_TIMEOUT: Final = 124
#: … and 125 when another limit did (hostcall's choice; the reason is in the summary).
EXIT_LIMIT: Final = 125


@dataclass(frozen=True, slots=True)
class Limits:
    """What one execution may use; ``None`` means unlimited.

    The tree's usage is sampled (``tracking.SAMPLE_INTERVAL_S``): a burst
    shorter than one interval can pass unseen, and a limit trips within about
    one interval of being crossed. Tripping a limit stops the whole tree
    (TERM, grace, KILL) and names the limit as the reason.
    """

    timeout_s: float | None = None
    memory_bytes: int | None = None
    cpu_s: float | None = None
    max_processes: int | None = None
    max_open_files: int | None = None

    def to_json(self) -> dict[str, float | int | None]:
        """The limits as the admin API shows them (``null``: unlimited)."""
        return {
            "timeout_s": self.timeout_s,
            "memory_bytes": self.memory_bytes,
            "cpu_s": self.cpu_s,
            "max_processes": self.max_processes,
            "max_open_files": self.max_open_files,
        }

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_bytes", "cpu_s", "max_processes", "max_open_files"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be greater than 0")
