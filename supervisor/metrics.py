"""Prometheus metrics of one supervisor, served on the admin socket's ``/metrics``."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from itertools import accumulate
from typing import Final

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from supervisor.tcp import serve_tcp

__all__ = ["CONTENT_TYPE", "LATENCY_BUCKETS", "Metrics", "MetricsListener"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: Latency buckets (seconds): a replay takes well under a millisecond, a
#: handler that waits for approval may take minutes.
LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)
_BUCKET_NAMES: Final = (*map(floatToGoString, LATENCY_BUCKETS), "+Inf")


class _Latency:
    """One tool's latency histogram: a count per bucket (not cumulative) and a sum."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.total = 0.0


class Metrics(Collector):
    """Calls by tool and outcome, latency, calls in flight, proposals waiting.

    Counted in plain numbers on the event loop's thread, where every call is
    answered (the Prometheus client's own metrics take a lock and walk the
    buckets on each call: ~6 µs of a call's CPU, measured in place); turned
    into Prometheus families only when ``/metrics`` is read. Each supervisor
    has its own registry, so two supervisors in one process (tests) do not
    share counters.
    """

    def __init__(self, proposals_waiting: Callable[[], int]) -> None:
        #: Handlers running now (calls past BeginDispatch, not yet recorded).
        self.in_flight = 0
        self._calls: dict[tuple[str, str], int] = {}
        self._latency: dict[str, _Latency] = {}
        self._proposals_waiting = proposals_waiting
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def observe(self, tool: str, outcome: str, seconds: float) -> None:
        """Count one call that reached a broker."""
        pair = (tool, outcome)
        self._calls[pair] = self._calls.get(pair, 0) + 1
        latency = self._latency.get(tool)
        if latency is None:
            latency = self._latency[tool] = _Latency()
        latency.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # le: bound included
        latency.total += seconds

    def calls_by_outcome(self) -> dict[str, int]:
        """Calls so far by receipt outcome, all tools together."""
        totals: dict[str, int] = {}
        for (_, outcome), count in self._calls.items():
            totals[outcome] = totals.get(outcome, 0) + count
        return totals

    def in_flight_now(self) -> int:
        """Handlers running now."""
        return self.in_flight

    def collect(self) -> Iterator[Metric]:
        """Every metric as a Prometheus family, as of now (the registry asks)."""
        calls = CounterMetricFamily(
            "hostcall_calls",
            "Calls that reached a broker, by tool and outcome (receipt outcomes).",
            labels=["tool", "outcome"],
        )
        for (tool, outcome), count in self._calls.items():
            calls.add_metric([tool, outcome], count)
        yield calls
        latency = HistogramMetricFamily(
            "hostcall_call_duration_seconds",
            "Time from a call reaching its broker to its reply, by tool.",
            labels=["tool"],
        )
        for tool, histogram in self._latency.items():
            buckets = list(zip(_BUCKET_NAMES, accumulate(histogram.counts), strict=True))
            latency.add_metric([tool], buckets, histogram.total)
        yield latency
        yield GaugeMetricFamily(
            "hostcall_calls_in_flight",
            "Handlers running now (calls past BeginDispatch, not yet recorded).",
            value=self.in_flight,
        )
        yield GaugeMetricFamily(
            "hostcall_proposals_waiting",
            "Approval proposals waiting for a decision.",
            value=self._proposals_waiting(),
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class MetricsListener:
    """``GET /metrics`` over TCP for Prometheus (``--metrics-listen``; docs/console.md).

    No token: metrics carry no secrets (tool names of the plan, counts, times).
    """

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self._metrics = metrics
        self._host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound.
        """
        app = web.Application()
        app.router.add_get("/metrics", self._serve)
        self._runner, self.port = await serve_tcp(app, self._host, self.port)

    async def close(self) -> None:
        """Stop listening. Idempotent."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _serve(self, request: web.Request) -> web.Response:
        response = web.Response(body=self._metrics.render())
        response.headers["Content-Type"] = CONTENT_TYPE
        return response
