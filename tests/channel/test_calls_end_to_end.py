"""The replay table of SPEC §5.5, row by row, through a real guest and socket.

Each test counts the handler's real executions in the ledger.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from supervisor import Plan, Supervisor, tool
from supervisor.canonical import MAX_NESTING
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, driven_guest, wait_until

REPO = Path(__file__).resolve().parents[2]


async def test_a_new_call_runs_once_and_its_retry_replays_the_stored_result(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("c1", "charge", {"account": "acct_1", "cents": 500})
        again = await guest.call("c1", "charge", {"account": "acct_1", "cents": 500})
    assert first["status"] == 200
    assert first["body"]["effect"] == "executed"
    assert first["body"]["result"] == {"charge_id": "ch_1", "account": "acct_1", "cents": 500}
    assert again["status"] == 200
    assert again["body"]["effect"] == "replayed"
    assert again["body"]["result"] == first["body"]["result"]
    assert again["body"]["idempotency_key"] == first["body"]["idempotency_key"]
    assert ledger.runs["charge"] == 1


async def test_a_call_id_reused_with_other_arguments_is_refused_and_runs_nothing(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        await guest.call("c1", "charge", {"account": "acct_1", "cents": 500})
        other_args = await guest.call("c1", "charge", {"account": "acct_1", "cents": 501})
        other_tool = await guest.call("c1", "lookup", {"account": "acct_1"})
    for reply in (other_args, other_tool):
        assert reply["status"] == 422
        assert reply["body"]["error"]["code"] == "call_id_reused"
        assert reply["body"]["effect"] == "none"
    assert ledger.runs == {"charge": 1}


async def test_lax_coercion_gives_the_same_key_so_a_retry_with_equal_input_replays(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("c1", "charge", {"account": "acct_1", "cents": 500})
        coerced = await guest.call("c1", "charge", {"cents": "500", "account": "acct_1"})
        other_id = await guest.call("c2", "charge", {"account": "acct_1", "cents": 500})
    assert coerced["body"]["effect"] == "replayed"
    # The key is a function of the business input, not of the call id.
    assert other_id["body"]["idempotency_key"] == first["body"]["idempotency_key"]
    assert ledger.runs["charge"] == 2


async def test_a_retry_while_the_handler_runs_is_ambiguous_in_flight_and_runs_nothing(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        # The first request blocks in the handler; a grandchild retries meanwhile.
        first = asyncio.ensure_future(guest.call("s1", "slow_charge", {"account": "a"}))
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        retry = await guest.send(
            {
                "op": "spawn_child",
                "request": {
                    "body": {"call_id": "s1", "tool": "slow_charge", "args": {"account": "a"}}
                },
            }
        )
        status = await guest.request(method="GET", path="/v1/calls/s1")
        ledger.release.set()
        done = await first
        after = await guest.call("s1", "slow_charge", {"account": "a"})
    assert retry["status"] == 409
    assert retry["body"]["status"] == "ambiguous"
    assert retry["body"]["reason"] == "in_flight"
    assert retry["body"]["effect"] == "unknown"
    assert status["status"] == 409 and status["body"]["reason"] == "in_flight"
    assert done["status"] == 200 and done["body"]["effect"] == "executed"
    assert after["body"]["effect"] == "replayed"
    assert ledger.runs["slow_charge"] == 1


async def test_an_irreversible_call_with_an_unknown_outcome_is_never_run_again(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("m1", "flaky_send", {"to": "a@example.com"})
        retry = await guest.call("m1", "flaky_send", {"to": "a@example.com"})
        status = await guest.request(method="GET", path="/v1/calls/m1")
    for reply in (first, retry, status):
        assert reply["status"] == 409
        assert reply["body"]["status"] == "ambiguous"
        assert reply["body"]["reason"] == "unknown"
        assert reply["body"]["effect"] == "unknown"
        assert len(reply["body"]["idempotency_key"]) == 64
    assert ledger.runs["flaky_send"] == 1


async def test_a_reversible_call_with_an_unknown_outcome_runs_again_on_retry(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("r1", "flaky_read", {"key": "k"})
        retry = await guest.call("r1", "flaky_read", {"key": "k"})
        third = await guest.call("r1", "flaky_read", {"key": "k"})
    assert first["status"] == 409 and first["body"]["reason"] == "unknown"
    assert retry["status"] == 200 and retry["body"]["effect"] == "executed"
    assert retry["body"]["result"] == "value_k"
    assert third["body"]["effect"] == "replayed"
    assert ledger.runs["flaky_read"] == 2


async def test_a_plain_handler_error_releases_the_record_so_the_call_may_run_again(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("b1", "broken", {"x": 1})
        status = await guest.request(method="GET", path="/v1/calls/b1")
        again = await guest.call("b1", "broken", {"x": 1})
    assert first["status"] == 500
    assert first["body"]["status"] == "error"
    assert first["body"]["effect"] == "failed"
    assert first["body"]["error"] == {
        "code": "tool_error",
        "type": "ValueError",
        "message": "no such thing",
    }
    assert status["status"] == 404 and status["body"]["error"]["code"] == "not_found"
    assert again["body"]["effect"] == "failed"
    assert ledger.runs["broken"] == 2


async def test_an_invalid_result_is_committed_and_the_same_error_is_replayed(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("x1", "bad_result", {})
        again = await guest.call("x1", "bad_result", {})
    assert first["status"] == 500
    assert first["body"]["error"]["code"] == "result_invalid"
    assert first["body"]["effect"] == "executed"
    assert again["status"] == 500
    assert again["body"]["error"]["code"] == "result_invalid"
    assert again["body"]["effect"] == "replayed"
    assert ledger.runs["bad_result"] == 1


class _Loose(BaseModel):
    """A result model with an untyped field (pydantic writes its NaN as null)."""

    d: dict[str, Any]


async def test_nan_or_infinity_in_a_typed_result_is_result_invalid_not_null(
    sup: Supervisor, ledger: Ledger
) -> None:
    """pydantic writes NaN where the type is Any (a dict's values) as null:
    the guest got 200 with ``{"v": null}``, a value the tool never returned."""

    @tool(reversibility="reversible")
    def nan_dict() -> dict[str, Any]:
        ledger.record("nan_dict")
        return {"v": float("nan")}

    @tool(reversibility="reversible")
    def inf_list() -> list[dict[str, Any]]:
        return [{"v": float("inf")}]

    @tool(reversibility="reversible")
    def nan_model() -> _Loose:  # a model keeps its own config: NaN looked for first
        return _Loose(d={"v": float("nan")})

    @tool(reversibility="reversible")
    def nan_models() -> list[_Loose]:
        return [_Loose(d={"v": float("-inf")})]

    @tool(reversibility="reversible")
    def fine() -> dict[str, Any]:
        return {"v": 1.5, "w": None}

    plan = Plan([nan_dict, inf_list, nan_model, nan_models, fine], name="nan-test")
    async with driven_guest(sup, plan) as guest:
        nan = await guest.call("n1", "nan_dict", {})
        again = await guest.call("n1", "nan_dict", {})
        inf = await guest.call("i1", "inf_list", {})
        model = await guest.call("m1", "nan_model", {})
        models = await guest.call("m2", "nan_models", {})
        ok = await guest.call("f1", "fine", {})
    for reply in (nan, inf, model, models):
        assert (reply["status"], reply["body"]["error"]["code"]) == (500, "result_invalid")
    assert (again["status"], again["body"]["effect"]) == (500, "replayed")
    assert ledger.runs["nan_dict"] == 1
    assert ok["body"]["result"] == {"v": 1.5, "w": None}


async def test_fifty_concurrent_requests_with_one_call_id_run_the_handler_once(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    body = {"call_id": "same", "tool": "charge", "args": {"account": "acct_9", "cents": 1}}
    async with driven_guest(sup, plan) as guest:
        answer = await guest.send({"op": "burst", "n": 50, "request": {"body": body}})
        settled = await guest.request(method="GET", path="/v1/calls/same?wait=10")
    responses = answer["responses"]
    assert len(responses) == 50
    executed = [r for r in responses if r["status"] == 200 and r["body"]["effect"] == "executed"]
    others = [r for r in responses if r not in executed]
    assert len(executed) == 1
    for reply in others:
        assert (reply["status"], reply["body"]["effect"]) in {
            (200, "replayed"),
            (409, "unknown"),
        }, reply
        if reply["status"] == 409:
            assert reply["body"]["reason"] == "in_flight"
    assert settled["body"]["effect"] == "replayed"
    assert ledger.runs["charge"] == 1


@tool(reversibility="reversible", name="echo")
async def _echo(text: str) -> str:
    """The call that shows the supervisor still serves after an odd handler."""
    return text


async def test_a_cyclic_result_is_result_invalid_and_the_supervisor_serves_on(
    sup: Supervisor, ledger: Ledger
) -> None:
    # A handler (host code, not the guest) returns a list that holds itself:
    # the result check must refuse it, not walk it forever on the event loop.
    @tool(reversibility="irreversible")
    async def cyclic() -> Any:
        ledger.record("cyclic")
        looped: list[Any] = [1.5]
        looped.append(looped)
        return looped

    plan = Plan([cyclic, _echo], name="cyclic-test")
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("x1", "cyclic", {})
        after = await guest.call("x2", "echo", {"text": "still here"})
    assert first["status"] == 500
    assert first["body"]["error"]["code"] == "result_invalid"
    assert first["body"]["effect"] == "executed"
    assert after["status"] == 200 and after["body"]["result"] == "still here"
    assert ledger.runs["cyclic"] == 1


async def test_a_handler_past_its_time_limit_is_cancelled_and_its_outcome_is_unknown(
    sup: Supervisor, ledger: Ledger
) -> None:
    # An irreversible call whose handler outlives the tool's timeout_s may
    # have had its effect: ambiguous, unknown, and never run again.
    @tool(reversibility="irreversible", timeout_s=0.2)
    async def hangs() -> str:
        ledger.record("hangs")
        try:
            await asyncio.Event().wait()  # until the time limit cancels it
        except asyncio.CancelledError:
            ledger.record("hangs cancelled")
            raise
        return "never"

    await _in_doubt_twice_then_served(sup, hangs)
    assert (ledger.runs["hangs"], ledger.runs["hangs cancelled"]) == (1, 1)


async def _in_doubt_twice_then_served(sup: Supervisor, handler: Any) -> None:
    """Call ``handler`` (a tool taking no arguments) and retry it: both are
    409 ambiguous unknown; the guest's next call is still served."""
    plan = Plan([handler, _echo], name="in-doubt-test")
    name = handler.__name__
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("d1", name, {})
        retry = await guest.call("d1", name, {})
        after = await guest.call("d2", "echo", {"text": "still here"})
    for reply in (first, retry):
        assert reply["status"] == 409, reply
        assert (reply["body"]["status"], reply["body"]["effect"]) == ("ambiguous", "unknown")
    assert after["status"] == 200 and after["body"]["result"] == "still here"


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_handler_that_raises_system_exit_is_a_tool_error_not_the_end(
    sup: Supervisor, ledger: Ledger, kind: str
) -> None:
    # argparse on a guest's input calls sys.exit(2): that may not stop the
    # supervisor (nor leave the record pending).
    raised = SystemExit

    def exits() -> int:
        ledger.record("exits")
        raise raised(2)

    async def exits_async() -> int:
        return exits()

    handler = tool(reversibility="irreversible", name="exits")(
        exits if kind == "sync" else exits_async
    )

    plan = Plan([handler, _echo], name="exits-test")
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("x1", "exits", {})
        after = await guest.call("x2", "echo", {"text": "still here"})
        records = await sup.store.calls(guest.execution.invocation_id)
    assert first["body"]["error"]["code"] == "tool_error"
    assert first["body"]["error"]["type"] == raised.__name__
    assert first["body"]["effect"] == "failed"
    assert after["status"] == 200 and after["body"]["result"] == "still here"
    assert [r.call_id for r in records] == ["x2"]  # the failed call was released
    assert ledger.runs["exits"] == 1


async def test_a_keyboard_interrupt_in_a_sync_handler_is_in_doubt_and_never_run_again(
    sup: Supervisor, ledger: Ledger
) -> None:
    """A KeyboardInterrupt may come after the handler's effect. It was
    answered failed and the record released, so a retry ran the handler
    again. In a worker thread it is the handler's own (signals go to the
    main thread): in doubt, answered, and the supervisor goes on."""

    @tool(reversibility="irreversible")
    def interrupted() -> int:
        ledger.record("interrupted")
        raise KeyboardInterrupt

    await _in_doubt_twice_then_served(sup, interrupted)
    assert ledger.runs["interrupted"] == 1


async def test_an_async_handlers_own_keyboard_interrupt_is_in_doubt_where_sigint_cannot_raise_it(
    sup: Supervisor, ledger: Ledger
) -> None:
    """Where the loop handles SIGINT (``hostcall run``, ``serve``, a host
    program's ``add_signal_handler``), Python never turns it into a
    KeyboardInterrupt: one in an async handler is the handler's own. It
    was passed on and stopped the supervisor, every guest with it; it is
    in doubt, answered, and the supervisor goes on, as for a sync handler."""

    @tool(reversibility="irreversible")
    async def interrupted_async() -> int:
        ledger.record("interrupted")
        raise KeyboardInterrupt

    loop = asyncio.get_running_loop()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # not pytest's Runner's
    loop.add_signal_handler(signal.SIGINT, lambda: None)
    try:
        await _in_doubt_twice_then_served(sup, interrupted_async)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)
    assert ledger.runs["interrupted"] == 1


async def test_an_async_handlers_own_keyboard_interrupt_on_a_loop_in_a_thread_is_in_doubt(
    tmp_path: Path, ledger: Ledger
) -> None:
    """Python raises a SIGINT's KeyboardInterrupt only in the main thread:
    on a loop in another thread one is the handler's own, even with the
    default SIGINT handler installed. It was passed on, and ended that loop."""

    @tool(reversibility="irreversible")
    async def interrupted_in_thread() -> int:
        ledger.record("interrupted")
        raise KeyboardInterrupt

    async def on_its_own_loop() -> None:
        async with Supervisor(tmp_path / "state", sandbox=False) as sup:
            await _in_doubt_twice_then_served(sup, interrupted_in_thread)

    # Python's own handler, as under run_until_complete (pytest-asyncio's
    # Runner has its own while a test runs).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        await asyncio.wait_for(
            asyncio.to_thread(asyncio.run, on_its_own_loop()), STEP_TIMEOUT_S * 2
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ledger.runs["interrupted"] == 1


#: A host program that leaves SIGINT to Python (run_until_complete, no signal
#: handler of asyncio's): its async tool pays, then the operator's Ctrl-C
#: lands while it still runs. argv: state dir, ledger file, "first" or "again".
SIGINT_HOST = r"""
import asyncio, json, os, signal, sys, time
from supervisor import Plan, Supervisor, tool
from tests.harness import driven_guest

state, ledger, phase = sys.argv[1:4]

@tool(reversibility="irreversible")
async def pay(account: str) -> str:
    with open(ledger, "a") as f:
        f.write(account + "\n")  # the effect has happened
    if phase == "first":
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # where the KeyboardInterrupt lands
            pass
    return "paid"

async def main():
    async with Supervisor(state, sandbox=False) as sup:
        async with driven_guest(sup, Plan([pay], name="pay"), invocation_id="inv_kb") as g:
            reply = await g.call("c1", "pay", {"account": "a"})
    print(json.dumps(reply["body"]), flush=True)

asyncio.new_event_loop().run_until_complete(main())
"""


def test_an_operators_ctrl_c_in_an_async_handler_stops_the_host_and_leaves_the_call_unknown(
    tmp_path: Path,
) -> None:
    """On the loop, a KeyboardInterrupt may be the operator's Ctrl-C: it is
    passed on (the host program stops), and the call is recorded in doubt,
    so the resumed invocation's retry is answered unknown, never run again."""
    state, ledger = tmp_path / "state", tmp_path / "ledger"
    command = [sys.executable, "-c", SIGINT_HOST, str(state), str(ledger)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    first = subprocess.run(
        [*command, "first"], capture_output=True, text=True, timeout=STEP_TIMEOUT_S * 2, env=env
    )
    again = subprocess.run(
        [*command, "again"], capture_output=True, text=True, timeout=STEP_TIMEOUT_S * 2, env=env
    )
    assert first.returncode != 0 and "KeyboardInterrupt" in first.stderr, first.stderr[-2000:]
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["effect"] == "unknown"
    assert ledger.read_text() == "a\n"  # paid once


async def test_a_handler_whose_own_await_was_cancelled_is_in_doubt_and_answered(
    sup: Supervisor, ledger: Ledger
) -> None:
    """An async handler that raises CancelledError of its own (something it
    awaited was cancelled midway) used to get no answer at all: the request's
    task took it for its own cancellation. Its effect is in doubt, as after a
    timeout: 409 ambiguous unknown, and a retry never runs it again."""

    @tool(reversibility="irreversible")
    async def cancels() -> int:
        ledger.record("cancels")
        inner = asyncio.get_running_loop().create_future()
        inner.cancel()
        return int(await inner)

    plan = Plan([cancels, _echo], name="cancels-test")
    async with driven_guest(sup, plan) as guest:
        first = await guest.call("k1", "cancels", {})
        again = await guest.call("k1", "cancels", {})
        after = await guest.call("k2", "echo", {"text": "still here"})
    assert (first["status"], first["body"]["effect"], first["body"]["reason"]) == (
        409,
        "unknown",
        "unknown",
    )
    assert (again["status"], again["body"]["effect"]) == (409, "unknown")
    assert after["status"] == 200
    assert ledger.runs["cancels"] == 1


class _Unreadable(dict[str, Any]):
    """A result whose own code fails when it is read (dict() asks keys())."""

    def __iter__(self) -> Any:
        return iter(self.keys())

    def keys(self) -> Any:
        raise RuntimeError("unreadable")


class _ReadableOnce(dict[str, Any]):
    """A result that can be checked, then not serialized to be recorded."""

    def __init__(self) -> None:
        super().__init__(ok=True)
        self.reads = 0

    def __iter__(self) -> Any:
        return iter(self.keys())

    def keys(self) -> Any:
        return self._read().keys()

    def items(self) -> Any:
        return self._read().items()

    def _read(self) -> dict[str, Any]:
        self.reads += 1
        if self.reads > 1:
            raise RuntimeError("gone")
        return dict(super().items())


async def test_a_result_whose_own_code_fails_is_result_invalid_and_replayed(
    sup: Supervisor, ledger: Ledger
) -> None:
    @tool(reversibility="irreversible")
    async def odd() -> Any:
        ledger.record("odd")
        return _Unreadable(x=1)

    async with driven_guest(sup, Plan([odd], name="odd-test")) as guest:
        first = await guest.call("x1", "odd", {})
        again = await guest.call("x1", "odd", {})
    assert first["status"] == 500
    assert first["body"]["error"]["code"] == "result_invalid"
    assert first["body"]["effect"] == "executed"
    assert again["body"]["error"]["code"] == "result_invalid"
    assert again["body"]["effect"] == "replayed"
    assert ledger.runs["odd"] == 1


async def test_a_call_that_ran_but_cannot_be_recorded_is_unknown_not_pending(
    sup: Supervisor, ledger: Ledger
) -> None:
    # The handler ran; recording its reply failed with no store error: the
    # record must say unknown now (a retry: ambiguous, never a second run),
    # not stay pending until the next start.
    @tool(reversibility="irreversible")
    async def fragile() -> Any:
        ledger.record("fragile")
        return _ReadableOnce()

    async with driven_guest(sup, Plan([fragile], name="fragile-test")) as guest:
        first = await guest.call("x1", "fragile", {})
        again = await guest.call("x1", "fragile", {})
        records = await sup.store.calls(guest.execution.invocation_id)
    assert first["status"] == 409
    assert (first["body"]["reason"], first["body"]["effect"]) == ("unknown", "unknown")
    assert again["status"] == 409 and again["body"]["reason"] == "unknown"
    assert [r.status.value for r in records] == ["unknown"]
    assert ledger.runs["fragile"] == 1


def _nested(depth: int) -> Any:
    """``[[...[1]...]]``: ``depth`` arrays, one inside the other."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("store", ["memory", "sqlite"])
@pytest.mark.parametrize(
    ("depth", "accepted"), [(MAX_NESTING, True), (MAX_NESTING + 1, False), (940, False)]
)
async def test_a_result_nested_too_deep_is_invalid_and_every_retry_gets_the_same_answer(
    tmp_path: Path, ledger: Ledger, store: str, depth: int, accepted: bool
) -> None:
    # 940 deep passed the check where the handler returns, then its retry (one
    # stack frame deeper or so) failed with a 500 internal_error: a committed
    # call without its stored answer. Past the bound it is result_invalid,
    # and whatever is accepted is replayed and looked up like any other.
    @tool(reversibility="irreversible")
    async def deep() -> Any:
        ledger.record("deep")
        return _nested(depth)

    plan = Plan([deep], name="deep-test")
    async with (
        Supervisor(tmp_path / "state", store=store) as sup,
        driven_guest(sup, plan) as guest,
    ):
        first = await guest.call("x1", "deep", {})
        again = await guest.call("x1", "deep", {})
        looked_up = await guest.request(method="GET", path="/v1/calls/x1")
    if accepted:
        assert first["status"] == 200 and first["body"]["result"] == _nested(depth)
        assert again["status"] == 200 and again["body"]["effect"] == "replayed"
        assert again["body"]["result"] == first["body"]["result"]
    else:
        assert first["status"] == 500
        assert first["body"]["error"]["code"] == "result_invalid"
        if depth == MAX_NESTING + 1:  # deeper, JCS itself may give up first
            assert f"nested more than {MAX_NESTING} levels" in first["body"]["error"]["message"]
        assert again["status"] == 500 and again["body"]["effect"] == "replayed"
        assert again["body"]["error"] == first["body"]["error"]
    assert looked_up["status"] == first["status"]
    assert looked_up["body"]["effect"] == "replayed"
    assert ledger.runs["deep"] == 1


def _open_channel_connections(sup: Supervisor) -> int:
    channel = sup._channel  # what the test waits on: the server saw the hang-up
    assert channel is not None
    return channel.open_connections


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_guest_that_hangs_up_mid_call_does_not_cancel_the_handler(
    sup: Supervisor, ledger: Ledger, kind: str
) -> None:
    # docs/guarantees.md: a guest that disconnects never cancels a dispatched
    # handler; the result is committed and a retry gets it. A cancelled
    # handler would leave the record unknown, and the retry ambiguous.
    def slow(account: str) -> str:
        ledger.record("slow")
        ledger.started.set()
        if not ledger.release.wait(STEP_TIMEOUT_S):
            raise RuntimeError("the test never released the handler")
        return f"done_{account}"

    async def slow_async(account: str) -> str:
        return await asyncio.to_thread(slow, account)

    handler = tool(reversibility="irreversible", name="slow")(
        slow if kind == "sync" else slow_async
    )
    body = {"call_id": "h1", "tool": "slow", "args": {"account": "a"}}
    async with driven_guest(sup, Plan([handler], name="hang-up-test")) as guest:
        assert (await guest.send({"op": "send_only", "name": "h1", "body": body}))["sent"]
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        assert (await guest.send({"op": "hang_up", "name": "h1"}))["closed"]
        await wait_until(lambda: _open_channel_connections(sup) == 0, "the hang-up was seen")
        ledger.release.set()
        looked_up = await guest.request(method="GET", path="/v1/calls/h1?wait=30")
        retry = await guest.call("h1", "slow", {"account": "a"})
        records = await sup.store.calls(guest.execution.invocation_id)
    assert looked_up["status"] == 200 and looked_up["body"]["result"] == "done_a"
    assert retry["status"] == 200 and retry["body"]["effect"] == "replayed"
    assert retry["body"]["result"] == "done_a"
    assert [r.status.value for r in records] == ["committed"]
    assert ledger.runs["slow"] == 1
