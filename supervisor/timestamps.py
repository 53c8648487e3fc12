"""How hostcall writes a moment: RFC 3339 UTC with microseconds."""

from __future__ import annotations

import datetime
import math

__all__ = ["utc_timestamp"]

#: The last whole second written, and its text up to the seconds' dot: a
#: receipt writes two moments per call, nearly always in the same second.
_last: tuple[int, str] = (0, "1970-01-01T00:00:00.")


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 UTC with microseconds, as receipts, the admin API and the CLI show times.

    The same text as ``datetime.fromtimestamp(seconds, UTC).isoformat(
    timespec="microseconds")`` with ``Z`` (a property test holds them
    together), rounded the same way (half to even); a third of the cost.
    """
    fraction, whole = math.modf(seconds)
    micros = round(fraction * 1e6)
    if micros >= 1_000_000:
        whole, micros = whole + 1.0, micros - 1_000_000
    elif micros < 0:
        whole, micros = whole - 1.0, micros + 1_000_000
    second = int(whole)
    last = _last  # one read: another thread may replace it meanwhile
    if last[0] != second:
        moment = datetime.datetime.fromtimestamp(second, tz=datetime.UTC)
        last = _remember(second, moment.isoformat(timespec="seconds")[:19] + ".")
    return f"{last[1]}{micros:06d}Z"


def _remember(second: int, prefix: str) -> tuple[int, str]:
    global _last
    _last = (second, prefix)
    return _last
