"""Prometheus metrics of one supervisor, served on the admin socket's ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from supervisor.tcp import serve_tcp

__all__ = ["CONTENT_TYPE", "Metrics", "MetricsListener"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: Latency buckets (seconds): a replay takes well under a millisecond, a
#: handler that waits for approval may take minutes.
_BUCKETS: Final = (
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


class Metrics:
    """Calls by tool and outcome, latency, calls in flight, proposals waiting.

    Each supervisor has its own registry, so two supervisors in one process
    (tests) do not share counters.
    """

    def __init__(self, proposals_waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._calls_by: dict[tuple[str, str], Any] = {}
        self._latency_by: dict[str, Any] = {}
        self.calls = Counter(
            "hostcall_calls",
            "Calls that reached a broker, by tool and outcome (receipt outcomes).",
            ["tool", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hostcall_call_duration_seconds",
            "Time from a call reaching its broker to its reply, by tool.",
            ["tool"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "hostcall_calls_in_flight",
            "Handlers running now (calls past BeginDispatch, not yet recorded).",
            registry=self.registry,
        )
        waiting = Gauge(
            "hostcall_proposals_waiting",
            "Approval proposals waiting for a decision.",
            registry=self.registry,
        )
        waiting.set_function(lambda: float(proposals_waiting()))

    def observe(self, tool: str, outcome: str, seconds: float) -> None:
        """Count one call that reached a broker."""
        counter = self._calls_by.get((tool, outcome))
        if counter is None:  # label lookups are not free: once per pair
            counter = self._calls_by[tool, outcome] = self.calls.labels(tool=tool, outcome=outcome)
        histogram = self._latency_by.get(tool)
        if histogram is None:
            histogram = self._latency_by[tool] = self.latency.labels(tool=tool)
        counter.inc()
        histogram.observe(seconds)

    def calls_by_outcome(self) -> dict[str, int]:
        """Calls so far by receipt outcome, all tools together."""
        totals: dict[str, int] = {}
        for family in self.calls.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    totals[outcome] = totals.get(outcome, 0) + int(sample.value)
        return totals

    def in_flight_now(self) -> int:
        """Handlers running now."""
        return int(self.registry.get_sample_value("hostcall_calls_in_flight") or 0)

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
