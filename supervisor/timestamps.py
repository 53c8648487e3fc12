"""How hostcall writes a moment: RFC 3339 UTC with microseconds."""

from __future__ import annotations

import datetime

__all__ = ["utc_timestamp"]


def utc_timestamp(seconds: float) -> str:
    """RFC 3339 UTC with microseconds, as receipts, the admin API and the CLI show times."""
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")
