"""SPEC §4.1: every identity failure, in order, refused with zero handler calls."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from supervisor import Supervisor
from tests.harness import (
    STEP_TIMEOUT_S,
    Ledger,
    billing_plan,
    driven_guest,
    identity_headers,
    raw_request,
    wait_until,
)

CHARGE = {"call_id": "c1", "tool": "charge", "args": {"account": "acct_1", "cents": 5}}


@pytest.mark.parametrize(
    ("override", "omit", "status", "code"),
    [
        ({}, ["Authorization"], 401, "unauthenticated"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, [], 401, "unauthenticated"),
        ({"Authorization": "Bearer "}, [], 401, "unauthenticated"),
        (
            {"Authorization": "Bearer AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"},
            [],
            401,
            "unauthenticated",
        ),
        ({"Hostcall-Execution": "exe_does_not_exist"}, [], 401, "unauthenticated"),
        ({}, ["Hostcall-Execution"], 401, "unauthenticated"),
        ({"Hostcall-Invocation": "inv_other"}, [], 401, "unauthenticated"),
        ({}, ["Hostcall-Invocation"], 401, "unauthenticated"),
        ({"Hostcall-Plan": "sha256:" + "0" * 64}, [], 403, "plan_mismatch"),
        ({}, ["Hostcall-Plan"], 403, "plan_mismatch"),
    ],
)
async def test_a_request_with_bad_identity_is_refused_with_its_code_and_runs_nothing(
    sup: Supervisor,
    ledger: Ledger,
    override: dict[str, str],
    omit: list[str],
    status: int,
    code: str,
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(body=CHARGE, headers=override, omit=omit)
        plan = await guest.request(method="GET", path="/v1/plan", headers=override, omit=omit)
        records = await sup.store.calls(guest.execution.invocation_id)
    for answer in (reply, plan):
        assert answer["status"] == status
        assert answer["body"]["status"] == "refused"
        assert answer["body"]["error"]["code"] == code
        assert answer["body"]["effect"] == "none"
    assert records == []
    assert ledger.runs == {}


async def test_an_unauthenticated_request_learns_nothing_even_with_a_malformed_body(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(raw="{not json", omit=["Authorization"])
        status = await guest.request(method="GET", path="/v1/calls/c1", omit=["Authorization"])
    assert reply["status"] == 401
    assert status["status"] == 401
    assert "c1" not in json.dumps(status["body"]["error"])


async def test_a_stolen_credential_used_outside_the_guest_tree_is_denied_by_origin(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        stolen = identity_headers(guest.execution, await guest.credential())
        # This test process is not the guest nor one of its descendants.
        status, body = await asyncio.to_thread(
            raw_request,
            str(sup.socket_path),
            "POST",
            "/v1/calls",
            {**stolen, "Content-Type": "application/json"},
            json.dumps(CHARGE).encode(),
        )
        records = await sup.store.calls(guest.execution.invocation_id)
    assert status == 403
    assert body["error"]["code"] == "origin_denied"
    assert records == []
    assert ledger.runs == {}


async def test_a_descendant_of_the_guest_may_call_with_the_guest_identity(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.send({"op": "spawn_child", "request": {"body": CHARGE}})
    assert reply["status"] == 200
    assert reply["body"]["effect"] == "executed"
    assert ledger.runs["charge"] == 1


async def test_the_credential_of_an_ended_execution_is_fenced_before_origin_is_checked(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as first:
        old = identity_headers(first.execution, await first.credential())
    assert not first.execution.live
    async with driven_guest(sup, plan) as second:
        # A live guest presenting the ended execution's credential.
        reply = await second.request(body=CHARGE, headers=old)
    status, body = await asyncio.to_thread(
        raw_request, str(sup.socket_path), "GET", "/v1/plan", old
    )
    assert reply["status"] == 403
    assert reply["body"]["error"]["code"] == "execution_fenced"
    # From outside any guest tree, too: fencing is decided before origin.
    assert (status, body["error"]["code"]) == (403, "execution_fenced")
    assert ledger.runs == {}


async def test_a_new_execution_of_the_same_invocation_fences_the_older_one(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    body = {"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": 1}}
    async with driven_guest(sup, plan, invocation_id="inv_fence") as first:
        old_headers = identity_headers(first.execution, await first.credential())
        async with driven_guest(sup, plan, invocation_id="inv_fence") as second:
            # The older execution ends: its credential is fenced, its guest stopped.
            old = await second.request(body=body, headers=old_headers)
            new = await second.call("c1", "charge", {"account": "a", "cents": 1})
            await wait_until(lambda: first.execution.outcome is not None, "the old one stopped")
    assert old["status"] == 403
    assert old["body"]["error"]["code"] == "execution_fenced"
    assert new["status"] == 200
    assert first.execution.outcome is not None
    assert first.execution.outcome.reason == "fenced"
    assert ledger.runs["charge"] == 1


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
async def test_a_new_attempt_that_cannot_start_leaves_the_live_one_running(
    tmp_path: Path, ledger: Ledger, sandbox: bool
) -> None:
    """Starting a new execution fences the older (SPEC §2); one whose
    program cannot start never started. The fence came first, so a typo in
    a resumed invocation's command stopped the attempt still running."""
    plan = billing_plan(ledger)
    async with (
        Supervisor(tmp_path / "state", sandbox=sandbox) as sup,
        driven_guest(sup, plan, invocation_id="inv_typo") as first,
    ):
        with pytest.raises(FileNotFoundError):
            await sup.run(plan, [str(tmp_path / "no-such-program")], invocation_id="inv_typo")
        reply = await first.call("c1", "charge", {"account": "a", "cents": 1})
        state = first.execution.state
    assert reply["status"] == 200, reply
    assert state == "running"
    assert ledger.runs["charge"] == 1
    assert first.execution.outcome is not None
    assert first.execution.outcome.reason == "exited"


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
async def test_two_attempts_started_at_once_leave_the_newer_one_running(
    tmp_path: Path, ledger: Ledger, sandbox: bool
) -> None:
    """Two launches of one invocation at once (a double-submitted ``POST
    /v1/invocations``): the newer one fences the older, whichever starts
    first. Each used to fence every other once started, so both were
    fenced, and the one started last then came back to "running" with
    its end already set."""
    plan = billing_plan(ledger)
    async with Supervisor(tmp_path / "state", sandbox=sandbox) as sup:
        runs = [
            asyncio.ensure_future(sup.run(plan, ["/bin/sleep", "30"], invocation_id="inv_twice"))
            for _ in range(2)
        ]
        try:
            await wait_until(
                lambda: [e.launched.is_set() for e in sup.executions("inv_twice")] == [True] * 2,
                "both attempts started",
            )
            older, newer = sup.executions("inv_twice")  # oldest first
            states = (older.state, newer.state, newer.ended.is_set())
            sup.cancel(newer.execution_id)
            async with asyncio.timeout(STEP_TIMEOUT_S):
                outcomes = await asyncio.gather(*runs)
        finally:
            for run in runs:
                run.cancel()
    assert states == ("fenced", "running", False)
    reasons = {o.executions[-1].execution_id: o.executions[-1].reason for o in outcomes}
    assert reasons == {older.execution_id: "fenced", newer.execution_id: "cancelled"}


async def test_the_credential_is_in_neither_the_guest_environment_nor_its_argv(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        credential = await guest.credential()
        pid = guest.execution.guest_pid
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    assert len(credential) == 43  # 32 bytes, base64url without padding
    assert credential.encode() not in environ
    assert credential.encode() not in cmdline
    assert b"HOSTCALL_CREDENTIAL_FD=" in environ
    assert b"HOSTCALL_CREDENTIAL=" not in environ


async def test_a_call_that_carries_the_guests_own_credential_is_refused_and_recorded_nowhere(
    sup: Supervisor, ledger: Ledger
) -> None:
    """SPEC §3: the credential never appears in receipts, logs or the admin API.
    A hostile guest that put it in a call — as its id, its tool, an argument,
    even spelled with JSON escapes — would have it written to all of them."""
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        credential = await guest.credential()
        escaped = "".join(f"\\u{ord(c):04x}" for c in credential)
        raw = '{"call_id": "c5", "tool": "lookup", "args": {"account": "' + escaped + '"}}'
        replies = [
            await guest.call(credential, "lookup", {"account": "a"}),
            await guest.call("c2", credential, {}),
            await guest.call("c3", "lookup", {"account": credential}),
            await guest.call("c4", "lookup", {"account": "a", credential: 1}),
            await guest.request(method="POST", path="/v1/calls", raw=raw),
        ]
        fine = await guest.call("c6", "lookup", {"account": credential[::-1]})
        invocation = guest.execution.invocation_id
        calls = await sup.store.calls(invocation)
    assert [(r["status"], r["body"]["error"]["code"]) for r in replies] == [
        (400, "bad_request")
    ] * 5
    assert fine["status"] == 200
    assert [record.call_id for record in calls] == ["c6"]
    assert ledger.runs["lookup"] == 1
    for path in sup.state.path.rglob("*"):
        if path.is_file() and path.suffix in (".jsonl", ".log"):
            assert credential.encode() not in path.read_bytes(), path


async def test_the_supervisor_own_hostcall_variables_are_not_passed_on(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTCALL_CREDENTIAL", "leaked-from-the-host")
    monkeypatch.setenv("HOSTCALL_SOMETHING", "x")
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.call("c1", "lookup", {"account": "a"})  # it has exec'd by now
        environ = Path(f"/proc/{guest.execution.guest_pid}/environ").read_bytes()
    assert b"leaked-from-the-host" not in environ
    assert b"HOSTCALL_SOMETHING" not in environ
    assert reply["status"] == 200


async def test_with_origin_check_off_a_process_outside_the_tree_is_let_in(
    tmp_path: Path, ledger: Ledger
) -> None:
    async with (
        Supervisor(tmp_path / "s", origin_check=False) as sup,
        driven_guest(sup, billing_plan(ledger)) as guest,
    ):
        headers = identity_headers(guest.execution, await guest.credential())
        status, body = await asyncio.to_thread(
            raw_request, str(sup.socket_path), "GET", "/v1/plan", headers
        )
    assert status == 200
    assert body["plan_hash"] == guest.execution.plan_hash


async def test_the_env_transport_hands_the_credential_through_the_environment(
    tmp_path: Path, ledger: Ledger
) -> None:
    async with (
        Supervisor(tmp_path / "s", credential_transport="env") as sup,
        driven_guest(sup, billing_plan(ledger)) as guest,
    ):
        reply = await guest.call("c1", "lookup", {"account": "a"})  # it has exec'd by now
        environ = Path(f"/proc/{guest.execution.guest_pid}/environ").read_bytes()
    assert b"HOSTCALL_CREDENTIAL=" in environ
    assert b"HOSTCALL_CREDENTIAL_FD" not in environ
    assert reply["status"] == 200


async def test_the_socket_is_0600_in_a_0700_directory(sup: Supervisor) -> None:
    assert sup.socket_path.stat().st_mode & 0o777 == 0o600
    assert sup.socket_path.parent.stat().st_mode & 0o777 == 0o700
