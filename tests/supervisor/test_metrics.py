"""The metrics' exposition, against the Prometheus client's own metrics."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from supervisor.metrics import LATENCY_BUCKETS, Metrics
from tests.harness import metric_samples

#: A few calls: (tool, outcome, seconds), bucket bounds exactly among them.
CALLS = st.lists(
    st.tuples(
        st.sampled_from(["lookup", "charge", "(not in plan)"]),
        st.sampled_from(["executed", "replayed", "refused"]),
        st.one_of(st.sampled_from(LATENCY_BUCKETS), st.floats(0, 1000, allow_nan=False)),
    ),
    max_size=30,
)


def _reference(calls: list[tuple[str, str, float]]) -> str:
    registry = CollectorRegistry()
    counter = Counter("hostcall_calls", "", ["tool", "outcome"], registry=registry)
    histogram = Histogram(
        "hostcall_call_duration_seconds", "", ["tool"], buckets=LATENCY_BUCKETS, registry=registry
    )
    for tool, outcome, seconds in calls:
        counter.labels(tool=tool, outcome=outcome).inc()
        histogram.labels(tool=tool).observe(seconds)
    return generate_latest(registry).decode()


@given(CALLS)
def test_counts_and_latency_read_as_the_prometheus_clients_own_would(
    calls: list[tuple[str, str, float]],
) -> None:
    metrics = Metrics(lambda: 0)
    for call in calls:
        metrics.observe(*call)
    ours = metric_samples(metrics.render().decode())
    reference = metric_samples(_reference(calls))
    gauges = {("hostcall_calls_in_flight", ()), ("hostcall_proposals_waiting", ())}
    assert set(ours) - gauges == set(reference)
    for key, value in reference.items():
        assert ours[key] == pytest.approx(value)  # sums to rounding, the rest exactly


def test_calls_in_flight_and_proposals_waiting_are_read_when_asked() -> None:
    waiting = [2]
    metrics = Metrics(lambda: waiting[0])
    metrics.in_flight += 3
    metrics.observe("lookup", "executed", 0.01)
    metrics.observe("charge", "executed", 0.02)
    metrics.observe("charge", "refused", 0.0)
    waiting[0] = 5
    samples: dict[Any, float] = metric_samples(metrics.render().decode())
    assert samples[("hostcall_calls_in_flight", ())] == 3
    assert samples[("hostcall_proposals_waiting", ())] == 5
    assert metrics.calls_by_outcome() == {"executed": 2, "refused": 1}
    assert metrics.in_flight_now() == 3
