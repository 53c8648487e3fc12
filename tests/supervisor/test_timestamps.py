"""utc_timestamp writes what datetime writes, a third of the cost."""

from __future__ import annotations

import datetime
import threading

from hypothesis import example, given, settings
from hypothesis import strategies as st

from supervisor.timestamps import utc_timestamp


def _reference(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


_seconds = st.floats(min_value=-6e10, max_value=2.5e11, allow_nan=False)
_half_micros = st.integers(min_value=0, max_value=2**33).map(lambda s: s + 0.0000005)


@settings(max_examples=1000, deadline=None)
@given(_seconds | _half_micros | st.integers(min_value=0, max_value=2**33).map(float))
@example(0.0)
@example(-0.0000005)
@example(1764745000.9999995)  # rounds up into the next second
@example(1764745000.0000005)
@example(-1.5)
def test_it_writes_what_datetime_writes(seconds: float) -> None:
    assert utc_timestamp(seconds) == _reference(seconds)


def test_seconds_written_from_many_threads_stay_their_own() -> None:
    # The remembered second is shared: a thread must never take another's.
    moments = [1764745000.25 + n * 1.5 for n in range(64)]
    wrong: list[float] = []

    def write() -> None:
        for _ in range(200):
            for moment in moments:
                if utc_timestamp(moment) != _reference(moment):
                    wrong.append(moment)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not wrong
