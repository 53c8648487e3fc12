"""The client's decisions without sockets: flows driven by hand, a fake clock,
the backoff schedule and what each response means."""

from __future__ import annotations

import json
import re
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guest_client import (
    EffectUnknown,
    ProtocolError,
    Refused,
    RetryPolicy,
    ToolError,
    TransportError,
)
from guest_client.flows import (
    MAX_POLL_WAIT_S,
    POLL_GRACE_S,
    call_flow,
    poll_wait,
    status_flow,
)
from guest_client.responses import error_for, interpret_call
from guest_client.retry import Budget, backoff_delay
from guest_client.wire import (
    Request,
    Response,
    Sleep,
    TransportFailure,
    call_path,
    is_call_id,
    mint_call_id,
    validate_call_id,
)

#: docs/protocol.md, "Endpoints".
CALL_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class FakeClock:
    """Time that moves only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def top(low: float, high: float) -> float:
    """Jitter that always draws the top of the range."""
    return high


def respond(status: int, body: dict[str, Any]) -> Response:
    return Response(status, json.dumps(body).encode())


IN_FLIGHT = respond(
    409,
    {"status": "ambiguous", "call_id": "c", "reason": "in_flight", "idempotency_key": "k"},
)
DONE = respond(200, {"status": "ok", "call_id": "c", "effect": "executed", "result": 7})
LOST = TransportFailure("reset", request_sent=True)
REFUSED_AT_CONNECT = TransportFailure("refused", request_sent=False)


def start(flow: Generator[Any, Any, Any]) -> Any:
    return flow.send(None)


def send(flow: Generator[Any, Any, Any], reply: Any) -> Any:
    return flow.send(reply)


def finish(flow: Generator[Any, Any, Any], reply: Any) -> Any:
    with pytest.raises(StopIteration) as stop:
        flow.send(reply)
    return stop.value.value


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    policy = RetryPolicy(backoff_base=0.05, backoff_max=2.0)

    ceilings = [backoff_delay(policy, n, top) for n in range(1, 9)]

    assert ceilings == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert backoff_delay(policy, 10_000, top) == 2.0


def test_backoff_draws_its_jitter_from_zero_to_the_ceiling() -> None:
    policy = RetryPolicy(backoff_base=0.1, backoff_max=2.0)
    ranges: list[tuple[float, float]] = []

    def spy(low: float, high: float) -> float:
        ranges.append((low, high))
        return low

    assert backoff_delay(policy, 3, spy) == 0.0
    assert ranges == [(0.0, 0.4)]
    assert 0.0 <= backoff_delay(policy, 3) <= 0.4


def test_the_default_retry_policy_is_bounded() -> None:
    policy = RetryPolicy()

    assert (policy.attempts, policy.backoff_base, policy.backoff_max, policy.deadline) == (
        5,
        0.05,
        2.0,
        120.0,
    )
    assert policy == RetryPolicy()
    assert hash(policy) == hash(RetryPolicy())


def test_a_retry_policy_is_frozen_and_checks_its_bounds() -> None:
    policy = RetryPolicy()
    with pytest.raises(AttributeError):
        policy.attempts = 9  # type: ignore[misc]
    for bad in (
        {"attempts": 0},
        {"backoff_base": 0},
        {"backoff_max": 0.01},
        {"deadline": -1},
        {"deadline": float("inf")},
        {"deadline": float("nan")},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RetryPolicy(**bad)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan")])
def test_an_operation_timeout_must_be_a_finite_number_of_seconds(timeout: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        Budget(RetryPolicy(), FakeClock(), timeout=timeout)


def test_a_transport_failure_resends_the_same_request_after_a_backoff() -> None:
    clock = FakeClock()
    flow = call_flow(Budget(RetryPolicy(), clock, uniform=top), "c", "charge", {"n": 1})

    first = start(flow)
    pause = send(flow, LOST)
    clock.now += pause.seconds
    second = send(flow, None)

    assert isinstance(first, Request)
    assert isinstance(second, Request)
    assert (first.method, first.path, first.body) == (second.method, second.path, second.body)
    assert isinstance(pause, Sleep)
    assert pause.seconds == 0.05
    assert finish(flow, DONE) == 7


def test_transport_failures_stop_after_the_policy_attempts() -> None:
    flow = call_flow(Budget(RetryPolicy(attempts=3), FakeClock(), uniform=top), "c", "t", None)

    start(flow)
    for _ in range(2):
        assert isinstance(send(flow, REFUSED_AT_CONNECT), Sleep)
        assert isinstance(send(flow, None), Request)
    with pytest.raises(TransportError) as caught:
        send(flow, REFUSED_AT_CONNECT)

    assert not caught.value.may_have_run
    assert caught.value.__cause__ is REFUSED_AT_CONNECT
    assert "after 3 attempts" in str(caught.value)


def test_a_backoff_that_would_pass_the_deadline_gives_up_at_once() -> None:
    policy = RetryPolicy(attempts=50, backoff_base=1.0, backoff_max=1.0, deadline=0.5)
    flow = call_flow(Budget(policy, FakeClock(), uniform=top), "c", "t", None)

    start(flow)
    with pytest.raises(TransportError, match="before the deadline") as caught:
        send(flow, LOST)

    assert caught.value.may_have_run


def test_a_request_gets_the_time_left_as_its_timeout() -> None:
    clock = FakeClock()
    flow = call_flow(Budget(RetryPolicy(deadline=30), clock), "c", "t", None)

    assert start(flow).timeout == 30


def test_a_poll_asks_to_wait_as_long_as_the_deadline_allows_at_most_sixty_seconds() -> None:
    assert poll_wait(1000) == MAX_POLL_WAIT_S
    assert poll_wait(10.9) == int(10.9 - POLL_GRACE_S)
    assert poll_wait(1.0) == 0

    clock = FakeClock()
    flow = call_flow(Budget(RetryPolicy(deadline=20), clock), "c", "t", None)
    start(flow)
    poll = send(flow, IN_FLIGHT)

    assert poll.path == "/v1/calls/c?wait=18"
    assert poll.timeout == 20
    assert finish(flow, DONE) == 7


def test_polls_answered_early_pause_and_give_up_at_the_deadline_with_effect_unknown() -> None:
    clock = FakeClock()
    flow = call_flow(Budget(RetryPolicy(deadline=1.0), clock, uniform=top), "c", "t", None)
    start(flow)
    action = send(flow, IN_FLIGHT)
    pauses = 0

    def drive() -> None:
        nonlocal action, pauses
        for _ in range(100):
            if isinstance(action, Sleep):
                pauses += 1
                clock.now += action.seconds
                action = send(flow, None)
            else:
                action = send(flow, IN_FLIGHT)

    with pytest.raises(EffectUnknown) as caught:
        drive()

    assert pauses > 0
    assert clock.now <= 1001.0 + 1e-9
    assert (caught.value.reason, caught.value.idempotency_key) == ("in_flight", "k")


def test_a_call_whose_record_keeps_vanishing_stops_with_a_tool_error() -> None:
    gone = respond(404, {"status": "refused", "error": {"code": "not_found"}})
    flow = call_flow(Budget(RetryPolicy(attempts=2), FakeClock()), "c", "t", None)

    assert start(flow).method == "POST"
    assert send(flow, IN_FLIGHT).method == "GET"
    assert send(flow, gone).method == "POST"
    assert send(flow, IN_FLIGHT).method == "GET"
    with pytest.raises(ToolError, match="calling again is safe") as caught:
        send(flow, gone)

    assert (caught.value.call_id, caught.value.idempotency_key) == ("c", "k")


def test_giving_up_on_polling_an_in_flight_call_names_its_idempotency_key() -> None:
    flow = call_flow(Budget(RetryPolicy(attempts=2), FakeClock(), uniform=top), "c", "t", None)

    start(flow)
    assert send(flow, IN_FLIGHT).method == "GET"
    assert isinstance(send(flow, LOST), Sleep)
    assert send(flow, None).method == "GET"
    with pytest.raises(TransportError) as caught:
        send(flow, LOST)

    error = caught.value
    assert (error.call_id, error.idempotency_key, error.may_have_run) == ("c", "k", True)


def test_status_checks_its_arguments_before_sending_anything() -> None:
    budget = Budget(RetryPolicy(), FakeClock())
    with pytest.raises(ValueError, match="call_id"):
        status_flow(budget, "bad id", None)
    for wait in (-1, 61, True, "5"):
        with pytest.raises(ValueError, match="wait"):
            status_flow(budget, "c", wait)  # type: ignore[arg-type]


@pytest.mark.parametrize("call_id", ["c", "call_7", "a.b:c-d_e", "x" * 128])
def test_valid_call_ids_are_accepted(call_id: str) -> None:
    assert validate_call_id(call_id) == call_id


@pytest.mark.parametrize("call_id", ["", "x" * 129, "a b", "a/b", "é", "a?b"])
def test_malformed_call_ids_are_refused_before_sending(call_id: str) -> None:
    with pytest.raises(ValueError, match="call_id"):
        call_flow(Budget(RetryPolicy(), FakeClock()), call_id, "t", None)


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet=st.characters(max_codepoint=0x17F), max_size=130) | st.from_regex(CALL_ID))
def test_the_call_id_check_agrees_with_the_protocols_pattern(text: str) -> None:
    assert is_call_id(text) is (CALL_ID.fullmatch(text) is not None)


def test_minted_call_ids_are_valid_and_fresh() -> None:
    minted = {mint_call_id() for _ in range(100)}

    assert len(minted) == 100
    assert all(validate_call_id(call_id) for call_id in minted)


def test_wait_is_sent_in_whole_or_fractional_seconds() -> None:
    assert call_path("c", 0) == "/v1/calls/c?wait=0"
    assert call_path("c", 2.5) == "/v1/calls/c?wait=2.5"
    assert call_path("c", 60.0) == "/v1/calls/c?wait=60"


@pytest.mark.parametrize(
    ("args", "error"),
    [([1, 2], TypeError), ({"x": float("nan")}, ValueError), ({"x": object()}, TypeError)],
)
def test_args_that_are_not_a_json_object_are_refused_before_sending(
    args: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        call_flow(Budget(RetryPolicy(), FakeClock()), "c", "t", args)


@pytest.mark.parametrize(
    ("effect", "expected"),
    [("none", Refused), ("failed", ToolError), ("unknown", EffectUnknown), (None, EffectUnknown)],
)
def test_an_unknown_error_code_is_read_by_its_effect(
    effect: str | None, expected: type[Exception]
) -> None:
    body = {"status": "error", "effect": effect, "error": {"code": "store_unavailable"}}

    error = error_for(body, 500, "c")

    assert type(error) is expected
    assert error.code == "store_unavailable"


@pytest.mark.parametrize(
    "body",
    [
        {"status": "teleported"},
        {"status": "ok", "call_id": "c"},
        {"status": "ok", "call_id": "other", "result": 1},
    ],
)
def test_a_response_outside_the_protocol_raises_protocol_error(body: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError):
        interpret_call(respond(200, body), "c", polling=False)


def test_not_found_means_missing_only_while_polling() -> None:
    gone = respond(404, {"status": "refused", "error": {"code": "not_found"}})

    assert type(interpret_call(gone, "c", polling=True)).__name__ == "Missing"
    with pytest.raises(Refused):
        interpret_call(gone, "c", polling=False)
