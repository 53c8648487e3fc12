"""The server's CPU over each point's window, sampled from outside the guest.

A sandboxed guest cannot see its supervisor (SPEC §13, S3: its own pid
namespace and ``/proc``), so the load generator cannot read the server's CPU
as it does for the echo server. Instead whoever started the supervisor samples
its CPU time in a thread, stamped with ``CLOCK_MONOTONIC``, and each point's
server CPU is read off that trace at the two ends of the window the load
generator reports (``window_monotonic``: bubblewrap makes no time namespace,
so the guest's monotonic clock is ours). The same method runs with the sandbox
off, so the two are compared like with like.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final

#: Time between two samples. The kernel counts a process's CPU in ticks of
#: 10 ms (``/proc/<pid>/stat``), so sampling faster would add nothing there.
SAMPLE_S: Final = 0.01
#: Bound on the sampling thread's exit.
JOIN_TIMEOUT_S: Final = 5.0


def process_cpu(pid: int) -> Callable[[], float]:
    """A reader of ``pid``'s CPU seconds (user + system, all its threads)."""
    import psutil

    process = psutil.Process(pid)

    def read() -> float:
        times = process.cpu_times()
        return float(times.user + times.system)

    return read


class CpuTrace:
    """Samples ``read()`` every ``period_s`` in a thread while in a ``with`` block.

    ``read`` may raise ``OSError`` or psutil's errors once its process is gone;
    sampling stops there.
    """

    def __init__(self, read: Callable[[], float], period_s: float = SAMPLE_S) -> None:
        self._read = read
        self._period_s = period_s
        self._times: list[float] = []
        self._cpu: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-trace", daemon=True)

    def _sample(self) -> bool:
        try:
            cpu = self._read()
        except Exception:  # boundary: the process ended (psutil.NoSuchProcess, OSError)
            return False
        self._times.append(time.monotonic())
        self._cpu.append(cpu)
        return True

    def _run(self) -> None:
        while self._sample() and not self._stop.wait(self._period_s):
            pass

    def __enter__(self) -> CpuTrace:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)

    def at(self, moment: float) -> float | None:
        """CPU seconds at ``moment`` (monotonic), interpolated; None outside the trace."""
        times, cpu = self._times, self._cpu
        i = bisect.bisect_left(times, moment)
        if i < len(times) and times[i] == moment:
            return cpu[i]
        if i == 0 or i == len(times):
            return None
        t0, t1 = times[i - 1], times[i]
        return cpu[i - 1] + (cpu[i] - cpu[i - 1]) * (moment - t0) / (t1 - t0)

    def per_call_us(self, window: list[float], calls: int) -> float | None:
        """Server CPU per call (µs) over ``window`` (its monotonic start and end)."""
        start, end = self.at(window[0]), self.at(window[1])
        if start is None or end is None or not calls:
            return None
        return round((end - start) * 1e6 / calls, 1)

    def fill(self, points: list[dict[str, Any]]) -> None:
        """Set ``server_cpu_us_per_call`` of every point from this trace."""
        for found in points:
            found["server_cpu_us_per_call"] = self.per_call_us(
                found["window_monotonic"], found["calls"]
            )
            found["server_cpu_from"] = "trace"
