"""The admin socket and the operator CLI against a real running supervisor."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp import web

from supervisor import Supervisor, receipt_worker
from supervisor.admin_client import AdminClient, AdminError, AsyncAdminClient
from supervisor.errors import SupervisorClosing
from supervisor.guests import GuestLauncher, RunningGuest
from supervisor.limits import Limits
from supervisor.sandbox import start as sandbox_start
from supervisor.timestamps import utc_timestamp
from supervisor.views import calls_from_receipts
from tests.harness import (
    DRIVER,
    STEP_TIMEOUT_S,
    Ledger,
    billing_plan,
    driven_guest,
    hostcall_cli,
    metric_samples,
    wait_until,
)

CHARGE = {"account": "acct_1", "cents": 5}


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[Supervisor]:
    """A supervisor whose irreversible tools all wait for approval."""
    async with Supervisor(tmp_path / "state") as supervisor:
        yield supervisor


async def admin(
    sup: Supervisor, method: str, path: str, body: dict[str, object] | None = None
) -> object:
    return await asyncio.to_thread(AdminClient(sup.state.path).request, method, path, body)


async def test_an_operator_lists_and_approves_a_waiting_call_with_the_cli(
    gated: Supervisor, ledger: Ledger
) -> None:
    ledger.release.set()
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    state = str(gated.state.path)
    async with driven_guest(gated, plan) as guest:
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: gated.approvals.waiting() == 1, "a proposal")
        waiting = await guest.request(method="GET", path="/v1/calls/c1")
        code, out, err = await hostcall_cli("approvals", "list", "--json", "--state-dir", state)
        assert code == 0, err
        [proposal] = json.loads(out)
        code, table, _ = await hostcall_cli("approvals", "list", "--state-dir", state)
        code, approved, err = await hostcall_cli(
            "approvals", "approve", proposal["id"], "--state-dir", state
        )
        reply = await call
        again, _, again_err = await hostcall_cli(
            "approvals", "approve", proposal["id"], "--state-dir", state
        )
    assert waiting["status"] == 202
    assert waiting["body"]["status"] == "awaiting_approval"
    assert waiting["body"]["effect"] == "none"
    assert set(proposal) >= {
        "id",
        "state",
        "invocation_id",
        "execution_id",
        "call_id",
        "tool",
        "args",
        "idempotency_key",
        "created_at",
        "expires_at",
    }
    assert proposal["state"] == "waiting"
    assert proposal["call_id"] == "c1"
    assert proposal["args"] == CHARGE
    assert proposal["idempotency_key"] == waiting["body"]["idempotency_key"]
    assert proposal["id"] in table
    assert "STATE" in table
    assert code == 0, err
    assert "approved" in approved
    assert reply["status"] == 200
    assert reply["body"]["effect"] == "executed"
    assert again == 1
    assert "not waiting" in again_err
    assert ledger.runs["charge"] == 1


async def test_an_operator_rejects_with_a_reason_and_nothing_runs(
    gated: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    state = str(gated.state.path)
    async with driven_guest(gated, plan) as guest:
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: gated.approvals.waiting() == 1, "a proposal")
        [proposal] = gated.approvals.list()
        code, _, err = await hostcall_cli(
            "approvals", "reject", proposal.id, "--reason", "wrong account", "--state-dir", state
        )
        reply = await call
    assert code == 0, err
    assert reply["status"] == 403
    assert reply["body"]["error"]["code"] == "approval_rejected"
    assert proposal.reason == "wrong account"
    assert ledger.runs == {}


async def test_unknown_proposal_ids_and_a_stopped_supervisor_exit_non_zero(
    gated: Supervisor, tmp_path: Path
) -> None:
    code, _, err = await hostcall_cli(
        "approvals", "approve", "apr_nope", "--state-dir", str(gated.state.path)
    )
    assert code == 1
    assert "apr_nope" in err
    code, _, err = await hostcall_cli("approvals", "list", "--state-dir", str(tmp_path / "none"))
    assert code == 2
    assert "no supervisor is running" in err


async def test_calls_shows_effect_records_live_and_after_the_supervisor_stopped(
    tmp_path: Path, ledger: Ledger
) -> None:
    state = tmp_path / "state"
    plan = billing_plan(ledger)
    async with Supervisor(state) as sup, driven_guest(sup, plan, invocation_id="inv_c") as guest:
        await guest.call("c1", "charge", CHARGE)
        await guest.call("m1", "flaky_send", {"to": "x@example.com"})
        live_code, live, err = await hostcall_cli(
            "calls", "inv_c", "--json", "--state-dir", str(state)
        )
    assert live_code == 0, err
    code, offline, err = await hostcall_cli("calls", "inv_c", "--json", "--state-dir", str(state))
    assert code == 0, err
    code, table, _ = await hostcall_cli("calls", "inv_c", "--state-dir", str(state))
    missing, _, missing_err = await hostcall_cli("calls", "inv_x", "--state-dir", str(state))
    for listing in (json.loads(live), json.loads(offline)):
        assert [(r["call_id"], r["tool"], r["status"]) for r in listing] == [
            ("c1", "charge", "committed"),
            ("m1", "flaky_send", "unknown"),
        ]
        assert listing[0]["response"]["result"]["charge_id"] == "ch_1"
    assert "committed" in table
    assert "unknown" in table
    assert missing == 1
    assert "no invocation inv_x" in missing_err


async def test_cancelling_an_execution_stops_its_guest_and_refuses_its_waiting_call(
    gated: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(gated, plan) as guest:
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: gated.approvals.waiting() == 1, "a proposal")
        answer = await admin(gated, "POST", f"/v1/executions/{guest.execution.execution_id}/cancel")
        # The cancel answered once the guest was gone: its outcome counts the refusal.
        assert guest.execution.outcome is not None
        assert guest.execution.outcome.calls == {"refused": 1}
        with pytest.raises(AdminError) as again:
            await admin(gated, "POST", f"/v1/executions/{guest.execution.execution_id}/cancel")
        call.cancel()
    assert answer == {
        "execution_id": guest.execution.execution_id,
        "invocation_id": guest.execution.invocation_id,
        "state": "cancelled",
        "created_at": utc_timestamp(guest.execution.created_at),
        "argv": [sys.executable, str(DRIVER)],
        "limits": Limits().to_json(),
        "calls": {"refused": 1},
        "guest_pid": guest.execution.guest_pid,
        "sandbox": dict(guest.execution.sandbox),  # type: ignore[call-overload]
        # Answered once the guest is gone: its outcome is known.
        "outcome": guest.execution.outcome.to_json(),  # type: ignore[union-attr]
    }
    assert again.value.status == 409
    assert gated.approvals.list()[0].state == "cancelled"
    receipts = (gated.state.receipts_dir / f"{guest.execution.invocation_id}.jsonl").read_text()
    assert json.loads(receipts.splitlines()[-1])["error_code"] == "cancelled"
    assert ledger.runs == {}


async def test_a_revoked_tool_stays_revoked_for_later_executions(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan, invocation_id="inv_r") as guest:
        ok = await guest.call("l1", "lookup", {"account": "a"})
        # A misspelt tool must not look revoked: the real one would stay allowed.
        with pytest.raises(AdminError) as misspelt:
            await admin(sup, "POST", "/v1/invocations/inv_r/tools/lokup/revoke")
        await admin(sup, "POST", "/v1/invocations/inv_r/tools/lookup/revoke")
        replay = await guest.call("l1", "lookup", {"account": "a"})
    async with driven_guest(sup, plan, invocation_id="inv_r") as guest:
        later = await guest.call("l2", "lookup", {"account": "b"})
    with pytest.raises(AdminError) as unknown:
        await admin(sup, "POST", "/v1/invocations/inv_nope/tools/lookup/revoke")
    assert ok["status"] == 200
    for reply in (replay, later):
        assert reply["status"] == 403
        assert reply["body"]["error"]["code"] == "tool_not_allowed"
    assert unknown.value.status == 404
    assert (misspelt.value.status, misspelt.value.code) == (404, "not_found")
    assert "no tool lokup" in misspelt.value.message
    assert ledger.runs["lookup"] == 1


async def test_approvals_of_an_unknown_state_or_args_form_is_a_bad_request(sup: Supervisor) -> None:
    assert await admin(sup, "GET", "/v1/approvals?state=waiting") == []
    with pytest.raises(AdminError) as bogus:
        await admin(sup, "GET", "/v1/approvals?state=bogus")
    assert (bogus.value.status, bogus.value.code) == (400, "bad_request")
    assert await admin(sup, "GET", "/v1/approvals?args=preview") == []
    with pytest.raises(AdminError) as bogus:
        await admin(sup, "GET", "/v1/approvals?args=some")
    assert (bogus.value.status, bogus.value.code) == (400, "bad_request")


async def test_invocations_lists_budget_use_and_executions(sup: Supervisor, ledger: Ledger) -> None:
    async with driven_guest(sup, billing_plan(ledger), invocation_id="inv_l") as guest:
        await guest.call("c1", "charge", CHARGE)
        listing = await admin(sup, "GET", "/v1/invocations")
    assert isinstance(listing, list)
    [entry] = listing
    assert entry["invocation_id"] == "inv_l"
    assert entry["calls_used"] == 1
    assert entry["cost_used"] == 10
    assert entry["executions"][0]["execution_id"] == guest.execution.execution_id
    assert entry["executions"][0]["state"] == "running"


async def test_stats_show_the_supervisors_own_process(gated: Supervisor) -> None:
    """What its uid cannot read from outside: the supervisor is not dumpable,
    so as any user but root its descriptors are root's to list (scripts/soak
    samples these)."""
    stats = await admin(gated, "GET", "/v1/stats")
    assert isinstance(stats, dict)
    process = stats["process"]
    assert process["pid"] == os.getpid()  # the supervisor runs in the test's process
    assert process["rss_bytes"] > 2**20
    assert process["threads"] >= 1
    assert process["open_fds"] >= 3  # stdio, the sockets, the store
    assert stats["proposals_waiting"] == 0


async def test_metrics_parse_with_prometheus_own_parser(gated: Supervisor, ledger: Ledger) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    ledger.release.set()
    async with driven_guest(gated, plan) as guest:
        await guest.call("l1", "lookup", {"account": "a"})
        await guest.call("l1", "lookup", {"account": "a"})
        await guest.call("x", "nope", {})
        await guest.call("y", "made_up_by_the_guest", {})
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: gated.approvals.waiting() == 1, "a proposal")
        text = await admin(gated, "GET", "/metrics")
        gated.approvals.approve(gated.approvals.list()[0].id)
        await call
    assert isinstance(text, str)
    samples = metric_samples(text)
    assert samples[("hostcall_calls_total", (("outcome", "executed"), ("tool", "lookup")))] == 1
    assert samples[("hostcall_calls_total", (("outcome", "replayed"), ("tool", "lookup")))] == 1
    # Tool names outside the plan share one label: a guest cannot grow the metrics.
    not_in_plan = (("outcome", "refused"), ("tool", "(not in plan)"))
    assert samples[("hostcall_calls_total", not_in_plan)] == 2
    assert not any("nope" in str(labels) or "made_up" in str(labels) for _, labels in samples)
    assert samples[("hostcall_call_duration_seconds_count", (("tool", "lookup"),))] == 2
    assert samples[("hostcall_proposals_waiting", ())] == 1
    assert samples[("hostcall_calls_in_flight", ())] == 0


async def test_the_admin_socket_is_0600_and_works_from_a_very_long_state_dir(
    tmp_path: Path,
) -> None:
    state = tmp_path / ("a" * 80) / ("b" * 80)
    async with Supervisor(state) as sup:
        socket_path = state / "admin.sock"
        mode = socket_path.stat().st_mode & 0o777
        code, out, err = await hostcall_cli(
            "approvals", "list", "--json", "--state-dir", str(state)
        )
        channel = sup.socket_path
    assert len(str(socket_path)) > 108
    assert mode == 0o600
    assert code == 0, err
    assert json.loads(out) == []
    assert len(str(channel)) <= 107
    assert not socket_path.exists()


async def test_bad_admin_requests_get_clear_errors(sup: Supervisor) -> None:
    for method, path, body, status in [
        ("POST", "/v1/invocations", {"argv": []}, 400),
        ("POST", "/v1/invocations", {"argv": ["true"], "extra": 1}, 400),
        ("POST", "/v1/invocations", {"argv": ["true"], "invocation": "bad id"}, 400),
        ("POST", "/v1/invocations", {"argv": ["true"], "timeout_s": -1}, 400),
        ("POST", "/v1/invocations", {"argv": ["true"]}, 409),  # no served plan
        ("GET", "/v1/approvals/apr_nope", None, 404),
        ("GET", "/v1/invocations/inv_nope/calls", None, 404),
        ("POST", "/v1/executions/exe_nope/cancel", None, 404),
    ]:
        with pytest.raises(AdminError) as error:
            await admin(sup, method, path, body)
        assert error.value.status == status, (method, path, body)


async def test_a_served_plan_launches_guests_through_the_admin_api(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with Supervisor(tmp_path / "s", plan=plan) as sup:
        launched = await admin(
            sup,
            "POST",
            "/v1/invocations",
            {
                "argv": ["python3", "-c", "import sys; sys.stdin.read()"],
                "invocation": "inv_launched",
                "timeout_s": STEP_TIMEOUT_S,
            },
        )
        assert isinstance(launched, dict)
        execution = sup.execution(launched["execution_id"])
        assert execution is not None
        assert execution.live
    assert launched["invocation_id"] == "inv_launched"
    assert not execution.live  # closing the supervisor stopped it


async def test_no_guest_is_launched_once_the_supervisor_is_closing(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() waits for running guests to stop before it closes the admin
    API. A ``POST /v1/invocations`` in that window launched a guest the
    close never ended: it ran on after the supervisor had closed."""
    stopping, release = asyncio.Event(), asyncio.Event()
    stop = RunningGuest.stop

    async def held(self: RunningGuest, grace_s: float) -> None:
        stopping.set()  # the close now waits on this guest: its window
        await release.wait()
        await stop(self, grace_s)

    monkeypatch.setattr(RunningGuest, "stop", held)
    plan = billing_plan(ledger)
    sup = Supervisor(tmp_path / "s", plan=plan, sandbox=False)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await sup.start()
        closing: asyncio.Future[None] | None = None
        try:
            first = await sup.launch(["/bin/sleep", "30"], invocation_id="inv_first")
            closing = asyncio.ensure_future(sup.aclose())
            await stopping.wait()
            with pytest.raises(AdminError) as refused:
                await admin(sup, "POST", "/v1/invocations", {"argv": ["/bin/sleep", "30"]})
            with pytest.raises(SupervisorClosing):
                await sup.run(plan, ["/bin/sleep", "30"], invocation_id="inv_late")
        finally:
            release.set()
            await (closing or sup.aclose())
    assert (refused.value.status, refused.value.code) == (503, "supervisor_closing")
    assert [e.execution_id for e in sup.executions()] == [first.execution_id]
    assert first.outcome is not None and first.outcome.reason == "cancelled"


async def test_a_launch_still_starting_when_the_supervisor_closes_is_refused_not_cancelled(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose() cancels the runs it launched. One still starting raised
    that CancelledError into launch()'s caller, who was never cancelled:
    ``asyncio.timeout`` and task groups count on a CancelledError being theirs."""
    starting = asyncio.Event()
    start = GuestLauncher.start

    async def held(self: GuestLauncher, *args: Any, **kwargs: Any) -> RunningGuest:
        starting.set()
        await asyncio.Event().wait()  # until aclose() cancels its run
        return await start(self, *args, **kwargs)

    monkeypatch.setattr(GuestLauncher, "start", held)
    sup = Supervisor(tmp_path / "s", plan=billing_plan(ledger), sandbox=False)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await sup.start()
        try:
            launching = asyncio.ensure_future(sup.launch(["/bin/sleep", "30"]))
            await starting.wait()
        finally:
            await sup.aclose()
        with pytest.raises(SupervisorClosing):
            await launching
    assert sup.executions() == []


async def test_a_launch_cancelled_while_its_sandbox_is_built_answers_its_ended_execution(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator cancels an execution whose sandbox is still being built:
    its guest is never let run, and the launch answers that execution,
    cancelled (its ``guest_pid`` null), not an error."""
    built, release = asyncio.Event(), asyncio.Event()
    read = sandbox_start._read_to_eof

    async def held(fd: int, timeout_s: float) -> bytes:
        info = await read(fd, timeout_s)
        built.set()
        await release.wait()
        return info

    monkeypatch.setattr(sandbox_start, "_read_to_eof", held)
    async with asyncio.timeout(STEP_TIMEOUT_S):
        async with Supervisor(tmp_path / "s", plan=billing_plan(ledger)) as sup:
            try:
                launching = asyncio.ensure_future(
                    admin(sup, "POST", "/v1/invocations", {"argv": ["/bin/sleep", "30"]})
                )
                await built.wait()
                [starting] = sup.executions()
                cancelling = asyncio.ensure_future(
                    admin(sup, "POST", f"/v1/executions/{starting.execution_id}/cancel")
                )
                await wait_until(lambda: not starting.live, "cancelled")
            finally:
                release.set()
            launched, cancelled = await launching, await cancelling
    assert isinstance(launched, dict) and isinstance(cancelled, dict)
    assert launched["execution_id"] == starting.execution_id
    assert (launched["state"], launched["guest_pid"]) == ("cancelled", None)
    assert cancelled["state"] == "cancelled"
    assert launched["outcome"]["reason"] == "cancelled"
    assert launched["outcome"]["sandbox"] != "off"


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
async def test_a_launch_whose_program_is_missing_leaves_no_execution_behind(
    tmp_path: Path, ledger: Ledger, sandbox: bool
) -> None:
    plan = billing_plan(ledger)
    async with Supervisor(tmp_path / "s", plan=plan, sandbox=sandbox) as sup:
        with pytest.raises(AdminError) as refused:
            await admin(
                sup,
                "POST",
                "/v1/invocations",
                {"argv": [str(tmp_path / "no-such-program")], "invocation": "inv_missing"},
            )
        listed = await admin(sup, "GET", "/v1/invocations")
        # The launch after it, of the same invocation, works as a first one would.
        launched = await admin(
            sup,
            "POST",
            "/v1/invocations",
            {"argv": ["true"], "invocation": "inv_missing", "timeout_s": STEP_TIMEOUT_S},
        )

    assert refused.value.status == 400
    assert "cannot start" in str(refused.value)
    assert isinstance(listed, list)
    missing = [i for i in listed if i["invocation_id"] == "inv_missing"]
    # Nothing ran: no execution without an outcome, and none the guest could call as.
    assert [i["executions"] for i in missing] in ([], [[]])
    assert [e.execution_id for e in sup.executions("inv_missing")] == [
        launched["execution_id"]  # type: ignore[index]
    ]


@pytest.mark.parametrize("sandbox", [True, False], ids=["sandbox", "no-sandbox"])
async def test_a_guest_cannot_use_the_admin_api_to_approve_itself(
    tmp_path: Path, ledger: Ledger, sandbox: bool
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with (
        Supervisor(tmp_path / "state", sandbox=sandbox) as gated,
        driven_guest(gated, plan) as guest,
    ):
        admin_socket = str(gated.state.path / "admin.sock")
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: gated.approvals.waiting() == 1, "a proposal")
        [proposal] = gated.approvals.list()
        attempts = [
            await guest.request(
                socket=admin_socket,
                method="POST",
                path=f"/v1/approvals/{proposal.id}/approve",
                body={},
            ),
            await guest.send(
                {
                    "op": "spawn_child",
                    "request": {
                        "socket": admin_socket,
                        "method": "GET",
                        "path": "/v1/approvals",
                    },
                }
            ),
        ]
        state_while_waiting = proposal.state
        gated.approvals.reject(proposal.id)
        await call
    for attempt in attempts:
        if sandbox:
            # The state dir is absent inside the sandbox: there is no socket to reach.
            assert attempt["status"] is None
            assert "FileNotFoundError" in attempt["error"]
        else:
            # Unsandboxed, the guest is our uid: the admin API refuses it by origin.
            assert attempt["status"] == 403
            assert attempt["body"]["error"]["code"] == "origin_denied"
    assert state_while_waiting == "waiting"
    assert ledger.runs == {}


async def test_the_async_client_reads_a_long_answer_whole_and_refuses_a_broken_one(
    tmp_path: Path,
) -> None:
    # An HTTP server on a Unix socket that answers as the admin API might
    # when it is wrong: the client must not hand a caller text for JSON.
    long = [{"n": n, "pad": "x" * 1000} for n in range(3000)]  # ~3 MB

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/long":
            return web.json_response(long)
        if request.path == "/broken":
            return web.Response(text='{"cut": ', content_type="application/json")
        return web.Response(text="hostcall_calls_total 1\n")

    app = web.Application()
    app.router.add_get("/{name}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "admin.sock")).start()
    try:
        client = AsyncAdminClient(tmp_path)
        got = await client.request("GET", "/long")
        with pytest.raises(AdminError) as broken:
            await client.request("GET", "/broken")
        text = await client.request("GET", "/metrics")
    finally:
        await runner.cleanup()
    assert got == long
    assert broken.value.code == "bad_answer" and broken.value.status == 502
    assert text == "hostcall_calls_total 1\n"


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _receipt_workers() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # a zombie (a guest's, say) has no cmdline
            if "supervisor.receipt_worker" in " ".join(child.cmdline()):
                found.append(child)
    return found


async def test_receipts_are_verified_by_a_lower_priority_worker_that_ends_with_the_supervisor(
    tmp_path: Path, ledger: Ledger
) -> None:
    # Verifying a chain is CPU-bound Python: in the supervisor's own process
    # it would hold the GIL its event loop serves every guest with (F44).
    plan = billing_plan(ledger, max_calls=10)
    async with Supervisor(tmp_path / "state") as sup:
        async with driven_guest(sup, plan) as guest:
            await guest.call("c1", "charge", CHARGE)
            await guest.call("c1", "charge", CHARGE)
            path = f"/v1/invocations/{guest.execution.invocation_id}/receipts"
        first = await admin(sup, "GET", path)
        [worker] = _receipt_workers()
        niceness = (worker.nice(), psutil.Process().nice())
        worker.kill()  # a worker that died is started again
        await wait_until(lambda: _ended(worker), "the worker's end")
        again = await admin(sup, "GET", path)
        [second] = _receipt_workers()
    assert first["chain_intact"] and first["receipts"] == 2 and first["ok"]
    assert first["checked_against"] is not None  # the SQLite store, read by the worker
    assert again == first
    assert niceness[0] == min(19, niceness[1] + 10)
    assert second.pid != worker.pid
    assert _ended(second)
    assert _receipt_workers() == []


async def _receipts_of_one_call(sup: Supervisor, ledger: Ledger) -> str:
    """The receipts endpoint of a new invocation that made one call."""
    async with driven_guest(sup, billing_plan(ledger, max_calls=10)) as guest:
        await guest.call("c1", "charge", CHARGE)
        return f"/v1/invocations/{guest.execution.invocation_id}/receipts"


class _HeldWorker:
    """The receipt worker's exchanges with its process, recorded; the first
    held until ``release(self, running)`` is true of a request as it comes
    (``running``: a verification is under way), every later one never
    answered with ``hang_after``."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        release: Callable[[_HeldWorker, bool], bool],
        *,
        hang_after: bool = False,
    ) -> None:
        self.asked: list[dict[str, Any]] = []
        self.arrived = 0
        go = asyncio.Event()
        exchange = receipt_worker.ReceiptWorker._exchange
        verify = receipt_worker.ReceiptWorker.verify

        async def held(worker: receipt_worker.ReceiptWorker, request: dict[str, Any]) -> bytes:
            self.asked.append(request)
            if len(self.asked) == 1:
                await go.wait()
            elif hang_after:
                await asyncio.Event().wait()
            return await exchange(worker, request)

        async def arriving(worker: receipt_worker.ReceiptWorker, path: Path) -> dict[str, Any]:
            self.arrived += 1
            if release(self, worker._running is not None):
                go.set()
            return await verify(worker, path)

        monkeypatch.setattr(receipt_worker.ReceiptWorker, "_exchange", held)
        monkeypatch.setattr(receipt_worker.ReceiptWorker, "verify", arriving)


async def test_a_file_slower_to_verify_than_a_request_waits_is_503_and_still_verified(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file the worker takes longer over than a request waits used to be
    # killed with the worker (and its cache) at every try: never verified.
    # Now the request is told to ask again, and the worker goes on.
    monkeypatch.setattr(receipt_worker, "ANSWER_WAIT_S", 0.001)  # under the worker's start
    async with Supervisor(tmp_path / "state") as sup:
        path = await _receipts_of_one_call(sup, ledger)
        with pytest.raises(AdminError) as busy:
            await admin(sup, "GET", path)
        [worker] = _receipt_workers()
        monkeypatch.setattr(receipt_worker, "ANSWER_WAIT_S", STEP_TIMEOUT_S)
        report = await admin(sup, "GET", path)  # asked again, as the answer says
        workers = [w.pid for w in _receipt_workers()]
    assert (busy.value.status, busy.value.code) == (503, "verifying")
    assert "ask again" in busy.value.message
    assert workers == [worker.pid]  # the same worker: not killed at the first 503
    assert isinstance(report, dict) and report["chain_intact"] and report["receipts"] == 1


async def test_requests_for_one_file_share_one_verification(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Six requests at once: those in before the first verification started
    # share it (held until all six are in), those after share the next one,
    # which reads what was written since the first started.
    worker = _HeldWorker(monkeypatch, lambda held, running: held.arrived == 6)
    async with Supervisor(tmp_path / "state") as sup:
        path = await _receipts_of_one_call(sup, ledger)
        reports = await asyncio.gather(*(admin(sup, "GET", path) for _ in range(6)))
    assert all(r == reports[0] for r in reports) and reports[0]["receipts"] == 1  # type: ignore[index]
    assert len(worker.asked) in (1, 2)


async def test_a_request_during_a_verification_gets_its_report_if_the_next_is_not_done(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request that comes while its file is verified waits for the next
    # verification (which reads what was written since); when that is not
    # done in time, the one under way when it came is the answer, not 503.
    monkeypatch.setattr(receipt_worker, "ANSWER_WAIT_S", 1.0)
    # The first verification is under way until the second request comes; the
    # next one is never done.
    worker = _HeldWorker(monkeypatch, lambda held, running: running, hang_after=True)
    async with Supervisor(tmp_path / "state") as sup:
        path = await _receipts_of_one_call(sup, ledger)
        first = asyncio.ensure_future(admin(sup, "GET", path))
        await wait_until(lambda: len(worker.asked) == 1, "the first verification under way")
        second = await admin(sup, "GET", path)
        first_report = await first
    assert second == first_report and second["receipts"] == 1  # type: ignore[index]
    assert len(worker.asked) == 2


async def test_a_verification_cut_by_closing_fails_its_waiters_rather_than_say_it_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered = asyncio.Event()
    exchange = receipt_worker.ReceiptWorker._exchange

    async def held(self: receipt_worker.ReceiptWorker, request: dict[str, Any]) -> bytes:
        entered.set()
        await asyncio.Event().wait()  # the worker never answers: cut by close()
        return await exchange(self, request)

    monkeypatch.setattr(receipt_worker.ReceiptWorker, "_exchange", held)
    worker = receipt_worker.ReceiptWorker(tmp_path)
    waiting = asyncio.ensure_future(worker.verify(tmp_path / "inv_1.jsonl"))
    async with asyncio.timeout(STEP_TIMEOUT_S):
        await entered.wait()
        await worker.close()
        outcome = await asyncio.gather(waiting, return_exceptions=True)
    [failed] = outcome
    assert isinstance(failed, receipt_worker.ReceiptWorkerFailed), failed
    assert "closing" in failed.message


async def test_after_a_restart_an_invocations_activity_is_told_by_its_receipts(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=10)
    async with Supervisor(tmp_path / "state") as sup, driven_guest(sup, plan) as guest:
        await guest.call("c1", "charge", CHARGE)
        await guest.call("c1", "charge", CHARGE)
        await guest.call("c2", "charge", {"account": "acct_1", "cents": "many"})
        invocation_id = guest.execution.invocation_id
    async with Supervisor(tmp_path / "state") as restarted:
        activity = await admin(restarted, "GET", f"/v1/invocations/{invocation_id}/activity")
        newest = calls_from_receipts(restarted.state.receipts_dir / f"{invocation_id}.jsonl", 2)
    assert activity["source"] == "receipts"
    assert [c["call_id"] for c in newest] == ["c1", "c2"]  # the last two
    calls = activity["calls"]
    assert [(c["call_id"], c["outcome"], c["effect"]) for c in calls] == [
        ("c1", "executed", "executed"),
        ("c1", "replayed", "replayed"),
        ("c2", "refused", "none"),
    ]
    assert calls[2]["code"] == "invalid_arguments"
    assert all(c["args"] is None and not c["args_kept"] for c in calls)


async def test_the_receipt_worker_imports_nothing_from_the_supervisors_working_directory(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A guest may write the folder the supervisor was started in; the
    # worker runs as the supervisor's uid, unsandboxed.
    planted = tmp_path / "cwd"
    planted.mkdir()
    marker = tmp_path / "ran"
    for name in ("json.py", "supervisor.py"):
        (planted / name).write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(planted)
    async with Supervisor(tmp_path / "state") as sup:
        async with driven_guest(sup, billing_plan(ledger)) as guest:
            await guest.call("c1", "lookup", {"account": "acct_1"})
            path = f"/v1/invocations/{guest.execution.invocation_id}/receipts"
        report = await admin(sup, "GET", path)
    assert report["chain_intact"] and report["receipts"] == 1
    assert not marker.exists()
