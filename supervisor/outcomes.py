"""How executions and runs ended: the outcome report (CLI summary, ``--json``, admin API)."""

from __future__ import annotations

import signal as signals
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.limits import EXIT_LIMIT, EXIT_TIMEOUT, LIMIT_REASONS, EndReason

__all__ = ["ExecutionOutcome", "RunOutcome"]


@dataclass(frozen=True, slots=True)
class ExecutionOutcome:
    """How one attempt ended, and what it used.

    ``cpu_s`` and ``peak_rss_bytes`` cover the guest's whole process tree, as
    sampled while it ran (see :mod:`supervisor.tracking`).
    """

    execution_id: str
    exit_code: int | None
    signal: int | None
    reason: EndReason
    duration_s: float
    cpu_s: float
    #: ``None`` when nothing counted it: no cgroup, and the guest ended before
    #: the first sample.
    peak_rss_bytes: int | None
    peak_processes: int
    calls: Mapping[str, int]
    #: ``"off"``, or the sandbox's namespaces and how its limits were held (docs/sandbox.md).
    sandbox: Mapping[str, Any] | str = "off"

    @property
    def timed_out(self) -> bool:
        """Whether the wall-clock timeout ended it."""
        return self.reason == "timeout"

    @property
    def exit_status(self) -> int:
        """What ``hostcall run`` exits with: the guest's code; 128+N when signal N
        ended it; 124 for the timeout; 125 for another limit; 143 when a cancel
        stopped a guest that then exited 0."""
        if self.reason == "timeout":
            return EXIT_TIMEOUT
        if self.reason in LIMIT_REASONS:
            return EXIT_LIMIT
        if self.signal is not None:
            return 128 + self.signal
        if self.reason in ("cancelled", "fenced") and not self.exit_code:
            return 128 + signals.SIGTERM
        return self.exit_code if self.exit_code is not None else 1

    def describe(self) -> str:
        """One line for humans."""
        if self.reason == "timeout":
            ended = "was stopped by the timeout"
        elif self.reason in LIMIT_REASONS:
            ended = f"was stopped by its {self.reason.replace('_', ' ')}"
        elif self.reason == "cancelled":
            ended = "was cancelled"
        elif self.reason == "fenced":
            ended = "was stopped: a newer execution of its invocation took over"
        elif self.signal is not None:
            ended = f"was ended by signal {self.signal} ({signals.Signals(self.signal).name})"
        else:
            ended = f"exited with {self.exit_code}"
        calls = ", ".join(f"{k} {v}" for k, v in sorted(self.calls.items())) or "none"
        if isinstance(self.sandbox, Mapping) and "runtime" in self.sandbox:
            sandbox = f"{self.sandbox['runtime']} {self.sandbox.get('version', '')}".rstrip()
            memory = "peak linear memory"
        elif isinstance(self.sandbox, Mapping):
            sandbox = (
                f"sandbox {self.sandbox.get('namespaces')}, limits {self.sandbox.get('limits')}"
            )
            memory = "peak memory"
        else:
            sandbox = "sandbox off"
            memory = "peak rss"
        peak = (
            "not sampled"
            if self.peak_rss_bytes is None
            else f"{self.peak_rss_bytes / 2**20:.1f} MiB"
        )
        return (
            f"execution {self.execution_id} {ended} after {self.duration_s:.2f} s "
            f"(cpu {self.cpu_s:.2f} s, {memory} {peak}; {sandbox}); "
            f"calls: {calls}"
        )

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form."""
        return {
            "execution_id": self.execution_id,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "reason": self.reason,
            "exit_status": self.exit_status,
            "duration_s": round(self.duration_s, 6),
            "cpu_s": round(self.cpu_s, 6),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_processes": self.peak_processes,
            "calls": dict(self.calls),
            "sandbox": dict(self.sandbox) if isinstance(self.sandbox, Mapping) else self.sandbox,
        }


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a :meth:`Supervisor.run` ended: the last attempt decides the status."""

    invocation_id: str
    executions: tuple[ExecutionOutcome, ...]
    #: Why a relaunch (``attempts``) could not start, after the attempts that
    #: ran: its program gone, say. The last attempt that ran gives the status.
    error: str | None = None

    @property
    def last(self) -> ExecutionOutcome:
        """The final attempt."""
        return self.executions[-1]

    @property
    def execution_id(self) -> str:
        """The final attempt's execution id."""
        return self.last.execution_id

    @property
    def exit_code(self) -> int | None:
        """The final attempt's exit code (``None`` if a signal ended it)."""
        return self.last.exit_code

    @property
    def exit_status(self) -> int:
        """What ``hostcall run`` exits with."""
        return self.last.exit_status

    def to_json(self) -> dict[str, Any]:
        """The stable JSON form (``hostcall run --json``)."""
        summary = {
            "invocation_id": self.invocation_id,
            "exit_status": self.exit_status,
            "executions": [e.to_json() for e in self.executions],
        }
        if self.error is not None:
            summary["error"] = self.error
        return summary
