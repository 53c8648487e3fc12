"""The replay table of docs/protocol.md, "The call pipeline", step 5, as one pure function.

Given the effect record found for ``(invocation, call_id)`` (or none) and the
call being made, decide what happens. Everything that decides whether a
handler may run a second time lives in this table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.stores.base import EffectRecord, EffectStatus

__all__ = ["Replay", "ReplayDecision", "decide_replay"]


class Replay(enum.Enum):
    """What to do with a call, given its record."""

    CONTINUE = "continue"  # no record, or unknown + reversible: go on to dispatch
    REUSED = "call_id_reused"  # 422: same call_id, other tool or other arguments
    REPLAY = "replayed"  # 200: return the stored response, run nothing
    IN_FLIGHT = "in_flight"  # 409 ambiguous: pending, it is running now
    UNKNOWN = "unknown"  # 409 ambiguous: the outcome is in doubt


@dataclass(frozen=True, slots=True)
class ReplayDecision:
    """A decision and the record it was made from."""

    action: Replay
    record: EffectRecord | None


def decide_replay(
    record: EffectRecord | None, tool: str, idempotency_key: str, reversible: bool
) -> ReplayDecision:
    """Apply the replay table (docs/protocol.md, step 5) row by row, in its order."""
    if record is None:
        return ReplayDecision(Replay.CONTINUE, None)
    if record.tool != tool or record.idempotency_key != idempotency_key:
        return ReplayDecision(Replay.REUSED, record)
    if record.status is EffectStatus.COMMITTED:
        return ReplayDecision(Replay.REPLAY, record)
    if record.status is EffectStatus.PENDING:
        return ReplayDecision(Replay.IN_FLIGHT, record)
    # unknown: only a reversible tool may run again.
    return ReplayDecision(Replay.CONTINUE if reversible else Replay.UNKNOWN, record)
