"""Both clients against a scripted host on a real Unix socket.

`client` and `make_client` give the sync `HostClient` and the asyncio
`AsyncHostClient` in turn (see conftest): every behaviour here holds for both.
"""

from __future__ import annotations

import re
import time

import pytest
from client_fakehost import (
    CREDENTIAL,
    DROP,
    EXECUTION,
    FAST_RETRY,
    HANG,
    INVOCATION,
    PLAN_HASH,
    Drip,
    MakeClient,
    Reply,
    ScriptedHost,
    ambiguous,
    ok,
    refused,
)

from guest_client import (
    EffectUnknown,
    HostcallError,
    HostClient,
    ProtocolError,
    Refused,
    ResultInvalid,
    RetryPolicy,
    ToolError,
    TransportError,
)

CALL_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def test_every_request_carries_the_guest_identity_headers(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(ok("call_1", 1), Reply(200, {"plan_hash": PLAN_HASH, "tools": []}))

    client.call("charge", {"cents": 5}, call_id="call_1")
    client.tools()

    post, get = host.requests
    for request in (post, get):
        assert request.headers["authorization"] == f"Bearer {CREDENTIAL}"
        assert request.headers["hostcall-invocation"] == INVOCATION
        assert request.headers["hostcall-execution"] == EXECUTION
        assert request.headers["hostcall-plan"] == PLAN_HASH
        assert request.headers["host"] == "localhost"
    assert post.headers["content-type"] == "application/json"
    assert "content-type" not in get.headers


def test_a_call_posts_call_id_tool_and_args_and_returns_the_result(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(ok("call_7", {"charge_id": "ch_1"}))

    result = client.call("charge", {"account": "acct_1", "cents": 500}, call_id="call_7")

    assert result == {"charge_id": "ch_1"}
    (request,) = host.requests
    assert (request.method, request.path) == ("POST", "/v1/calls")
    assert request.json() == {
        "call_id": "call_7",
        "tool": "charge",
        "args": {"account": "acct_1", "cents": 500},
    }


def test_a_call_without_call_id_mints_one_and_reuses_it_after_a_dropped_attempt(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(DROP, lambda request: ok(request.json()["call_id"], "done"))

    assert client.call("charge", None) == "done"

    first, second = host.requests
    assert first.body == second.body
    call_id = first.json()["call_id"]
    assert CALL_ID_PATTERN.fullmatch(call_id)
    assert first.json()["args"] == {}


def test_two_calls_without_call_id_get_different_ids(
    host: ScriptedHost, client: HostClient
) -> None:
    echo = lambda request: ok(request.json()["call_id"], None)  # noqa: E731
    host.answer(echo, echo)

    client.call("charge")
    client.call("charge")

    assert host.requests[0].json()["call_id"] != host.requests[1].json()["call_id"]


def test_an_in_flight_call_is_long_polled_until_its_result_arrives(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        ambiguous("call_7", "in_flight"),
        ambiguous("call_7", "in_flight"),
        ok("call_7", 42, effect="replayed"),
    )

    assert client.call("charge", {"cents": 1}, call_id="call_7") == 42

    post, *polls = host.requests
    assert post.method == "POST"
    assert [poll.method for poll in polls] == ["GET", "GET"]
    for poll in polls:
        path, _, query = poll.path.partition("?")
        assert path == "/v1/calls/call_7"
        wait = int(query.removeprefix("wait="))
        assert 0 <= wait <= 60


def test_a_call_awaiting_approval_while_polled_keeps_polling(
    host: ScriptedHost, client: HostClient
) -> None:
    awaiting = Reply(202, {"status": "awaiting_approval", "call_id": "c", "effect": "none"})
    host.answer(ambiguous("c", "in_flight"), awaiting, ok("c", "approved"))

    assert client.call("charge", call_id="c") == "approved"
    assert len(host.requests) == 3


def test_an_in_flight_call_whose_record_vanishes_is_posted_again_with_the_same_call_id(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        ambiguous("c", "in_flight"),
        refused(404, "not_found", "c"),
        ok("c", "second run"),
    )

    assert client.call("charge", {"n": 1}, call_id="c") == "second run"

    first_post, poll, second_post = host.requests
    assert (poll.method, second_post.method) == ("GET", "POST")
    assert second_post.body == first_post.body


def test_a_call_still_in_flight_at_the_deadline_raises_effect_unknown_in_flight(
    host: ScriptedHost, client: HostClient
) -> None:
    host.default = ambiguous("c", "in_flight", key="f" * 64)

    started = time.monotonic()
    with pytest.raises(EffectUnknown) as caught:
        client.call("charge", call_id="c", timeout=0.3)

    assert time.monotonic() - started < 3
    assert caught.value.reason == "in_flight"
    assert caught.value.idempotency_key == "f" * 64
    assert caught.value.call_id == "c"


def test_an_unknown_outcome_raises_effect_unknown_carrying_the_idempotency_key(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(ambiguous("c", "unknown", key="e" * 64))

    with pytest.raises(EffectUnknown) as caught:
        client.call("charge", call_id="c")

    error = caught.value
    assert (error.code, error.reason, error.status) == ("ambiguous", "unknown", 409)
    assert error.idempotency_key == "e" * 64
    assert "e" * 64 in str(error)
    assert len(host.requests) == 1  # an unknown outcome is never retried


def test_a_refusal_raises_refused_with_its_code_and_details(
    host: ScriptedHost, client: HostClient
) -> None:
    details = [{"loc": ["cents"], "msg": "must be an integer"}]
    host.answer(refused(422, "invalid_arguments", "c", details=details))

    with pytest.raises(Refused) as caught:
        client.call("charge", {"cents": "x"}, call_id="c")

    error = caught.value
    assert (error.code, error.status, error.call_id) == ("invalid_arguments", 422, "c")
    assert error.details == details
    assert error.response is not None
    assert error.response["effect"] == "none"
    assert "invalid_arguments" in str(error)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (429, "budget_exhausted"),
        (403, "tool_not_allowed"),
        (422, "call_id_reused"),
        (401, "unauthenticated"),
        (403, "execution_fenced"),
    ],
)
def test_every_refusal_code_raises_refused_without_retrying(
    host: ScriptedHost, client: HostClient, status: int, code: str
) -> None:
    host.answer(refused(status, code, "c"))

    with pytest.raises(Refused) as caught:
        client.call("charge", call_id="c")

    assert (caught.value.code, caught.value.status) == (code, status)
    assert len(host.requests) == 1


def test_a_tool_error_raises_tool_error_with_the_error_type_and_message(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        Reply(
            500,
            {
                "status": "error",
                "call_id": "c",
                "effect": "failed",
                "error": {"code": "tool_error", "type": "ValueError", "message": "no such account"},
            },
        )
    )

    with pytest.raises(ToolError) as caught:
        client.call("charge", call_id="c")

    error = caught.value
    assert (error.code, error.type, error.message, error.status) == (
        "tool_error",
        "ValueError",
        "no such account",
        500,
    )
    assert "ValueError: no such account" in str(error)


def test_an_invalid_result_raises_result_invalid_which_is_not_a_tool_error(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        Reply(
            500,
            {
                "status": "error",
                "call_id": "c",
                "effect": "executed",
                "error": {"code": "result_invalid", "message": "result is not an int"},
            },
        )
    )

    with pytest.raises(ResultInvalid) as caught:
        client.call("charge", call_id="c")

    assert not isinstance(caught.value, ToolError)
    assert caught.value.code == "result_invalid"
    assert "effect happened" in str(caught.value)


def test_a_body_that_is_not_json_raises_protocol_error(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(Reply(502, b"<html>bad gateway</html>"))

    with pytest.raises(ProtocolError) as caught:
        client.call("charge", call_id="c")

    assert isinstance(caught.value, TransportError)
    assert caught.value.status == 502
    # The host had the request: the tool may have run. "Did not run" would
    # invite a second run under a new call_id (docs/guests.md).
    assert caught.value.may_have_run


def test_a_garbled_answer_while_polling_keeps_may_have_run_and_the_key(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        Reply(
            409,
            {
                "status": "ambiguous",
                "call_id": "c",
                "effect": "unknown",
                "reason": "in_flight",
                "idempotency_key": "k" * 64,
            },
        )
    )
    host.answer(Reply(502, b"<html>bad gateway</html>"))

    with pytest.raises(ProtocolError) as caught:
        client.call("charge", call_id="c")

    assert caught.value.may_have_run
    assert caught.value.idempotency_key == "k" * 64


def test_a_host_that_drops_every_request_fails_after_the_policy_attempts(
    host: ScriptedHost, client: HostClient
) -> None:
    host.default = DROP

    with pytest.raises(TransportError) as caught:
        client.call("charge", call_id="c")

    assert len(host.requests) == FAST_RETRY.attempts
    assert {request.body for request in host.requests} == {host.requests[0].body}
    error = caught.value
    assert error.code == "transport_error"
    assert error.may_have_run
    assert "outcome is unknown" in str(error)
    assert "same call_id (c)" in str(error)


def test_a_missing_socket_fails_with_transport_error_saying_nothing_ran(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, socket_dir: str
) -> None:
    monkeypatch.setenv("HOSTCALL_SOCKET", f"{socket_dir}/absent.sock")

    with make_client() as client, pytest.raises(TransportError) as caught:
        client.call("charge", call_id="c")

    assert not caught.value.may_have_run
    assert "outcome is unknown" not in str(caught.value)
    assert isinstance(caught.value.__cause__, Exception)


def test_a_host_that_never_answers_fails_by_the_deadline(
    host: ScriptedHost, make_client: MakeClient
) -> None:
    host.default = HANG
    policy = RetryPolicy(attempts=100, backoff_base=0.01, backoff_max=0.02, deadline=0.5)

    started = time.monotonic()
    with make_client(policy) as client, pytest.raises(TransportError) as caught:
        client.call("charge", call_id="c")

    assert time.monotonic() - started < 3
    assert caught.value.may_have_run
    assert "TimeoutError" in str(caught.value)


def test_a_host_that_drips_its_answer_fails_by_the_deadline(
    host: ScriptedHost, make_client: MakeClient
) -> None:
    """A byte every 20 ms would take 4 s to give the whole answer; each read
    alone is quick. The deadline bounds the whole exchange, not each read."""
    host.default = Drip(ok("c", "x" * 100), interval=0.02)
    policy = RetryPolicy(attempts=100, backoff_base=0.01, backoff_max=0.02, deadline=0.5)

    with make_client(policy) as client, pytest.raises(TransportError) as caught:
        client.call("charge", call_id="c")

    assert caught.value.may_have_run
    assert "TimeoutError" in str(caught.value)


def test_a_kept_alive_connection_is_reused(host: ScriptedHost, client: HostClient) -> None:
    host.answer(ok("a", 1), ok("b", 2))

    client.call("charge", call_id="a")
    client.call("charge", call_id="b")

    assert host.requests[0].connection == host.requests[1].connection


@pytest.mark.parametrize("closing", ["connection_close", "close_silently"])
def test_a_connection_the_host_closed_is_replaced_without_a_backoff(
    host: ScriptedHost, make_client: MakeClient, closing: str
) -> None:
    first = ok("a", 1)
    host.answer(Reply(first.status, first.body, **{closing: True}), ok("b", 2))
    sleeps: list[float] = []

    with make_client(sleeps=sleeps) as client:
        assert client.call("charge", call_id="a") == 1
        assert client.call("charge", call_id="b") == 2

    served = [request for request in host.requests if request.json()["call_id"] == "b"]
    assert served[-1].connection != host.requests[0].connection
    assert sleeps == []


def test_status_returns_the_state_of_the_call_without_raising(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(
        refused(404, "not_found", "c"),
        ambiguous("c", "in_flight"),
        ok("c", 3, effect="replayed"),
    )

    assert client.status("c")["error"]["code"] == "not_found"
    assert client.status("c", wait=2)["reason"] == "in_flight"
    assert client.status("c")["result"] == 3

    paths = [request.path for request in host.requests]
    assert paths == ["/v1/calls/c", "/v1/calls/c?wait=2", "/v1/calls/c"]
    assert {request.method for request in host.requests} == {"GET"}


def test_a_status_wait_longer_than_its_timeout_is_shortened_to_fit(
    host: ScriptedHost, client: HostClient
) -> None:
    """The deadline is the whole operation's: asking the host to hold the
    request 30 s when 10 are left would end in a timeout, not an answer."""
    host.answer(ambiguous("c", "in_flight"), ambiguous("c", "in_flight"))

    assert client.status("c", wait=30, timeout=10)["reason"] == "in_flight"
    assert client.status("c", wait=30, timeout=1)["reason"] == "in_flight"

    waits = [float(request.path.partition("?wait=")[2]) for request in host.requests]
    assert 6 <= waits[0] <= 8  # 10 s, less the 2 s the answer may take, in whole seconds
    assert waits[1] == 0


def test_status_raises_refused_when_the_request_itself_is_refused(
    host: ScriptedHost, client: HostClient
) -> None:
    host.answer(refused(403, "execution_fenced"))

    with pytest.raises(Refused) as caught:
        client.status("c")

    assert caught.value.code == "execution_fenced"


def test_tools_and_plan_come_from_get_v1_plan(host: ScriptedHost, client: HostClient) -> None:
    tool = {"name": "charge", "input_schema": {"type": "object"}, "cost": 10}
    plan = {
        "plan_hash": PLAN_HASH,
        "name": "billing",
        "tools": [tool],
        "budget": {"max_calls": 10, "calls_left": 9},
    }
    host.answer(Reply(200, plan), Reply(200, plan))

    assert client.tools() == [tool]
    assert client.plan()["budget"]["calls_left"] == 9
    assert [request.path for request in host.requests] == ["/v1/plan", "/v1/plan"]


def test_a_closed_client_refuses_to_send(host: ScriptedHost, client: HostClient) -> None:
    client.close()

    with pytest.raises(RuntimeError):
        client.call("charge", call_id="c")
    assert host.requests == []


def test_the_credential_appears_in_no_error_message_or_repr(
    host: ScriptedHost, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    host.answer(
        refused(401, "unauthenticated", "a"),
        ambiguous("b", "unknown"),
        Reply(500, {"status": "error", "call_id": "d", "error": {"code": "tool_error"}}),
        Reply(200, b"not json"),
    )
    host.default = DROP
    errors: list[HostcallError] = []
    with make_client() as client:
        for call_id in ("a", "b", "d", "e", "f"):
            try:
                client.call("charge", {"x": 1}, call_id=call_id)
            except HostcallError as error:
                errors.append(error)
        texts = [repr(client), repr(client.environment)]
    monkeypatch.setenv("HOSTCALL_SOCKET", "/nonexistent/channel.sock")
    with make_client(RetryPolicy(attempts=1)) as client:
        try:
            client.call("charge", call_id="g")
        except HostcallError as error:
            errors.append(error)

    assert [type(raised) for raised in errors] == [
        Refused,
        EffectUnknown,
        ToolError,
        ProtocolError,
        TransportError,
        TransportError,
    ]
    for raised in errors:
        texts += [str(raised), repr(raised)]
        cause = raised.__cause__
        while cause is not None:
            texts += [str(cause), repr(cause)]
            cause = cause.__cause__
    assert not [text for text in texts if CREDENTIAL in text]
