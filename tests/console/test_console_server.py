"""The console over HTTP (SPEC §14): its protection, its data, its live stream.

Against a real supervisor, real driven guests on the real channel, and the
console on a real loopback port; the browser tests are in test_browser.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from supervisor import receipt_worker
from supervisor.console import parse_listen
from supervisor.metrics import MetricsListener
from tests.console.conftest import Served
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, driven_guest, wait_until

CHARGE = {"account": "acct_1", "cents": 500}
ROUTES = [
    ("GET", "/"),
    ("GET", "/static/console.js"),
    ("GET", "/static/console.css"),
    ("GET", "/events"),
    ("GET", "/api/overview"),
    ("GET", "/api/invocations/inv_1"),
    ("GET", "/api/receipts"),
    ("GET", "/api/metrics"),
    ("POST", "/api/approvals/apr_1/approve"),
    ("POST", "/api/approvals/apr_1/reject"),
    ("GET", "/no/such/page"),
]


async def status_of(served: Served, method: str, path: str, **kwargs: Any) -> int:
    async with served.http.request(
        method, served.base + path, allow_redirects=False, **kwargs
    ) as response:
        return response.status


async def test_every_request_without_the_right_token_is_refused_401_not_redirected(
    served: Served,
) -> None:
    wrong = "x" * len(served.console.token)
    for method, path in ROUTES:
        assert await status_of(served, method, path) == 401, (method, path)
        assert await status_of(served, method, f"{path}?token={wrong}") == 401, (method, path)
        assert await status_of(served, method, path, headers={"X-Hostcall-Token": wrong}) == 401, (
            method,
            path,
        )
    # The token of the printed URL opens the page.
    assert await status_of(served, "GET", f"/?token={served.console.token}") == 200


async def test_a_token_header_that_is_not_utf8_is_refused_401_not_an_error(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.console.port)
    try:
        writer.write(
            b"GET /api/overview HTTP/1.1\r\n"
            + f"Host: 127.0.0.1:{served.console.port}\r\n".encode()
            + b"X-Hostcall-Token: \xff\xfe\xc3\r\nConnection: close\r\n\r\n"
        )
        async with asyncio.timeout(STEP_TIMEOUT_S):
            status_line = await reader.readline()
            await reader.read()
    finally:
        writer.close()
    assert status_line.split()[1] == b"401"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_request_naming_another_host_is_refused_even_with_the_token(
    served: Served,
) -> None:
    """A DNS-rebinding page (evil.example resolving to 127.0.0.1) is same-origin
    for the browser; the Host header gives it away."""
    headers = served.headers(Host=f"evil.example:{served.console.port}")
    assert await status_of(served, "GET", "/api/overview", headers=headers) == 403
    assert await status_of(served, "GET", "/api/overview", headers=served.headers()) == 200


async def test_pages_forbid_inline_script_framing_referrers_and_send_no_cors(
    served: Served,
) -> None:
    origin = {"Origin": "http://evil.example"}
    for path in ("/", "/static/console.js", "/api/overview"):
        async with served.http.get(
            f"{served.base}{path}?token={served.console.token}", headers=origin
        ) as response:
            assert response.status == 200
            policy = response.headers["Content-Security-Policy"]
            assert "script-src 'self'" in policy
            assert "frame-ancestors 'none'" in policy
            assert "unsafe-inline" not in policy
            assert response.headers["Referrer-Policy"] == "no-referrer"
            assert not [h for h in response.headers if h.lower().startswith("access-control-")]
    # A CORS preflight is never granted.
    async with served.http.options(
        f"{served.base}/api/approvals/apr_1/approve",
        headers={
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-hostcall-token, content-type",
        },
    ) as response:
        assert response.status in (401, 403)
        assert not [h for h in response.headers if h.lower().startswith("access-control-")]


async def test_a_decision_that_fails_the_csrf_checks_decides_nothing(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: served.sup.approvals.waiting() == 1, "a proposal")
        [proposal] = served.sup.approvals.list()
        url = f"/api/approvals/{proposal.id}/approve"
        token = served.console.token
        attempts = {
            "token in the query only": {"params": {"token": token}, "json": {}},
            "another origin": {
                "headers": served.headers(Origin="http://evil.example"),
                "json": {},
            },
            "another port of localhost": {
                "headers": served.headers(Origin="http://127.0.0.1:1"),
                "json": {},
            },
            "a cross-site fetch": {
                "headers": served.headers(**{"Sec-Fetch-Site": "cross-site"}),
                "json": {},
            },
            "a form post": {
                "headers": served.headers(**{"Content-Type": "application/x-www-form-urlencoded"}),
                "data": b"by=attacker",
            },
        }
        refused = {
            name: await status_of(served, "POST", url, **kw) for name, kw in attempts.items()
        }
        still = served.sup.approvals.get(proposal.id).state
        got_get = await status_of(served, "GET", url, headers=served.headers())
        approved = await status_of(served, "POST", url, headers=served.headers(), json={})
        reply = await call
    assert refused == dict.fromkeys(attempts, 403)
    assert still == "waiting"
    assert got_get == 405  # a GET changes nothing
    assert approved == 200
    assert reply["status"] == 200 and reply["body"]["effect"] == "executed"
    assert ledger.runs["charge"] == 1


async def test_approve_and_reject_go_through_the_approval_controller(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(served.sup, plan) as guest:
        first = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await wait_until(lambda: served.sup.approvals.waiting() == 1, "the first proposal")
        [one] = served.sup.approvals.list("waiting")
        async with served.http.post(
            f"{served.base}/api/approvals/{one.id}/reject",
            headers=served.headers(),
            json={"reason": "  not this account  "},
        ) as response:
            rejected = (response.status, await response.json())
        refused = await first
        async with served.http.post(
            f"{served.base}/api/approvals/{one.id}/approve", headers=served.headers(), json={}
        ) as response:
            again = (response.status, await response.json())
    assert rejected[0] == 200
    assert rejected[1]["state"] == "rejected"
    assert rejected[1]["reason"] == "not this account"
    assert rejected[1]["decided_by"] == "console"
    assert refused["status"] == 403 and refused["body"]["error"]["code"] == "approval_rejected"
    assert again[0] == 409 and again[1]["error"]["code"] == "proposal_not_waiting"
    assert ledger.runs["charge"] == 0


@contextlib.asynccontextmanager
async def events(served: Served) -> AsyncIterator[asyncio.Queue[dict[str, Any]]]:
    """The page's event stream, notice by notice, from its first ``hello``."""
    notices: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    hello = asyncio.Event()

    async def read() -> None:
        async with served.http.get(
            f"{served.base}/events?token={served.console.token}",
            timeout=aiohttp.ClientTimeout(total=None),
        ) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            async for line in response.content:
                if line.startswith(b"event: hello"):
                    hello.set()
                elif line.startswith(b"data: ") and line.strip() != b"data: {}":
                    notices.put_nowait(json.loads(line[6:]))

    reader = asyncio.create_task(read())
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await hello.wait()
        yield notices
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def next_notice(notices: asyncio.Queue[dict[str, Any]], topic: str) -> dict[str, Any]:
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while (notice := await notices.get())["topic"] != topic:
            pass
    return notice


async def test_the_event_stream_pushes_what_changed_as_it_changes(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with events(served) as notices, driven_guest(served.sup, plan) as guest:
        started = await next_notice(notices, "invocations")
        call = asyncio.ensure_future(guest.call("c1", "charge", CHARGE))
        await next_notice(notices, "approvals")
        [proposal] = served.sup.approvals.list("waiting")
        served.sup.approvals.approve(proposal.id)
        finished = await next_notice(notices, "calls")
        await call
        await guest.call("c2", "lookup", {"account": "acct_1"})
        another = await next_notice(notices, "calls")
    invocation_id = guest.execution.invocation_id
    assert started["invocation_id"] == invocation_id
    assert finished["invocation_id"] == invocation_id
    assert another["invocation_id"] == invocation_id


async def test_an_invocation_shows_each_call_with_its_arguments_outcome_and_receipt(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=10)
    async with driven_guest(served.sup, plan) as guest:
        executed = await guest.call("c1", "charge", CHARGE)
        replayed = await guest.call("c1", "charge", CHARGE)
        refused = await guest.call("c2", "charge", {"account": "acct_1", "cents": "many"})
        await guest.send({"op": "print", "text": "hello from the guest", "stream": "stderr"})
        invocation_id = guest.execution.invocation_id
        async with served.http.get(
            f"{served.base}/api/invocations/{invocation_id}", headers=served.headers()
        ) as response:
            view = await response.json()
    calls = view["calls"]
    assert [(c["call_id"], c["outcome"], c["effect"]) for c in calls] == [
        ("c1", "executed", "executed"),
        ("c1", "replayed", "replayed"),
        ("c2", "refused", "none"),
    ]
    assert calls[0]["args"] == CHARGE
    assert calls[2]["args"] == {"account": "acct_1", "cents": "many"}  # as sent
    assert calls[2]["code"] == "invalid_arguments"
    assert calls[0]["receipt_id"] == executed["body"]["receipt_id"]
    assert calls[1]["receipt_id"] == replayed["body"]["receipt_id"]
    assert calls[0]["idempotency_key"] == executed["body"]["idempotency_key"]
    assert refused["status"] == 422
    receipts = (served.sup.state.receipts_dir / f"{invocation_id}.jsonl").read_text()
    assert [json.loads(line)["receipt_id"] for line in receipts.splitlines()] == [
        c["receipt_id"] for c in calls
    ]
    invocation = view["invocation"]
    assert invocation["budget"]["max_calls"] == 10
    assert invocation["budget"]["calls_left"] == 9  # the replay and the refusal cost nothing
    assert invocation["calls_by_outcome"] == {"executed": 1, "replayed": 1, "refused": 1}
    [execution] = invocation["executions"]
    assert execution["argv"][-1].endswith("driver.py")
    assert execution["sandbox"] != "off"
    stderr = [log for log in view["logs"] if log["stream"] == "stderr"]
    assert "hello from the guest" in stderr[0]["text"]


async def test_waiting_calls_with_large_arguments_are_previewed_and_shown_whole_on_asking(
    served: Served, ledger: Ledger
) -> None:
    # An answer of the admin API over ~256 KiB used to arrive cut off; the
    # console then handed the page a string for its approval list, and the
    # page showed no approvals at all, for every guest. Then (read whole) a
    # few dozen calls of a megabyte still made the list longer than the
    # console reads: the overview lists large arguments as a preview.
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    large = [{"account": f"acct_{n}_" + "9" * 300_000, "cents": 1} for n in range(8)]
    async with driven_guest(served.sup, plan) as guest:
        calls = [
            *(asyncio.ensure_future(guest.call(f"c{n}", "charge", a)) for n, a in enumerate(large)),
            asyncio.ensure_future(guest.call("small", "charge", CHARGE)),
        ]
        await wait_until(lambda: served.sup.approvals.waiting() == len(calls), "the proposals")
        async with served.http.get(
            f"{served.base}/api/overview", headers=served.headers()
        ) as response:
            overview = (response.status, await response.read())
        listed = {p["call_id"]: p for p in json.loads(overview[1])["approvals"]}
        async with served.http.get(
            f"{served.base}/api/approvals/{listed['c3']['id']}", headers=served.headers()
        ) as response:
            whole = (response.status, await response.json())
        for proposal in served.sup.approvals.list("waiting"):
            served.sup.approvals.reject(proposal.id)
        await asyncio.gather(*calls)
    assert overview[0] == 200
    assert len(overview[1]) < 100_000  # 2.4 MB of arguments asked
    assert listed["small"]["args"] == CHARGE
    for n in range(len(large)):
        shown = listed[f"c{n}"]
        assert shown["args"] is None and shown["args_bytes"] > 300_000
        assert shown["args_preview"].startswith(f'{{\n  "account": "acct_{n}_999')
    assert whole == (200, {**whole[1], "args": large[3], "call_id": "c3"})
    assert ledger.runs["charge"] == 0


async def test_an_invocation_of_many_large_calls_is_shown_not_failed(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=20)
    sent = [{"account": f"acct_{n}_" + "x" * 60_000} for n in range(10)]
    async with driven_guest(served.sup, plan) as guest:
        for n, args in enumerate(sent):
            assert (await guest.call(f"c{n}", "lookup", args))["status"] == 200
        invocation_id = guest.execution.invocation_id
        async with served.http.get(
            f"{served.base}/api/invocations/{invocation_id}", headers=served.headers()
        ) as response:
            view = (response.status, await response.json())
    assert view[0] == 200
    assert [c["args"] for c in view[1]["calls"]] == sent


async def test_a_chain_still_being_verified_is_shown_as_such_not_as_the_views_failure(
    served: Served, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receipt_worker, "ANSWER_WAIT_S", 0.001)  # under the worker's start
    plan = billing_plan(ledger)
    async with driven_guest(served.sup, plan) as guest:
        await guest.call("c1", "lookup", {"account": "acct_1"})
    async with served.http.get(f"{served.base}/api/receipts", headers=served.headers()) as r:
        view = (r.status, await r.json())
    assert view[0] == 200
    [report] = view[1]["reports"]
    assert report["invocation_id"] == guest.execution.invocation_id
    assert (report["error"]["status"], report["error"]["code"]) == (503, "verifying")


async def test_the_receipts_view_tells_an_intact_chain_from_a_tampered_one(
    served: Served, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(served.sup, plan) as first:
        await first.call("c1", "lookup", {"account": "acct_1"})
        await first.call("c2", "lookup", {"account": "acct_2"})
    async with driven_guest(served.sup, plan) as second:
        await second.call("c1", "lookup", {"account": "acct_3"})
    tampered = served.sup.state.receipts_dir / f"{second.execution.invocation_id}.jsonl"
    await wait_until(lambda: tampered.exists() and tampered.stat().st_size > 0, "its receipt")
    tampered.write_text(tampered.read_text().replace("lookup", "charge"))
    async with served.http.get(f"{served.base}/api/receipts", headers=served.headers()) as r:
        reports = {report["invocation_id"]: report for report in (await r.json())["reports"]}
    intact = reports[first.execution.invocation_id]
    broken = reports[second.execution.invocation_id]
    assert (intact["chain_intact"], intact["ok"], intact["receipts"]) == (True, True, 2)
    assert intact["checked_against"] is not None  # the SQLite store beside them
    assert (broken["chain_intact"], broken["ok"]) == (False, False)
    assert any(f["rule"] == "chain" for f in broken["findings"])


async def test_the_metrics_samples_count_calls_by_outcome(served: Served, ledger: Ledger) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(served.sup, plan) as guest:
        await guest.call("c1", "lookup", {"account": "acct_1"})
        await guest.call("c1", "lookup", {"account": "acct_1"})

        async def sampled() -> dict[str, Any]:
            async with served.http.get(
                f"{served.base}/api/metrics", headers=served.headers()
            ) as response:
                return dict(await response.json())

        async with asyncio.timeout(STEP_TIMEOUT_S):
            while not (metrics := await sampled())["samples"] or metrics["samples"][-1][
                "calls_by_outcome"
            ] != {"executed": 1, "replayed": 1}:
                await asyncio.sleep(0.1)  # the sampler's own interval; polled, bounded
    assert metrics["interval_s"] > 0


def test_a_listen_address_that_is_not_loopback_is_refused() -> None:
    assert parse_listen("8000").host == "127.0.0.1"
    assert parse_listen("localhost:0").host == "127.0.0.1"
    assert parse_listen("[::1]:9").host == "::1"
    for bad in ("0.0.0.0:8000", "192.168.1.2:80", "example.com:80", "[::]:1", "127.0.0.1:x"):
        with pytest.raises(ValueError, match=r"loopback|not \[HOST:\]PORT|not an IP"):
            parse_listen(bad)


async def test_metrics_listen_serves_the_prometheus_text_over_tcp(
    served: Served, ledger: Ledger
) -> None:
    listener = MetricsListener(served.sup.metrics, "127.0.0.1", 0)
    await listener.start()
    try:
        async with driven_guest(served.sup, billing_plan(ledger)) as guest:
            await guest.call("c1", "lookup", {"account": "acct_1"})
        async with served.http.get(f"http://127.0.0.1:{listener.port}/metrics") as response:
            text = await response.text()
            kind = response.headers["Content-Type"]
    finally:
        await listener.close()
    assert kind.startswith("text/plain")
    assert 'hostcall_calls_total{outcome="executed",tool="lookup"} 1.0' in text


# -- the CLI ------------------------------------------------------------------

PLAN = """
[plan]
name = "console-cli"

[tools.lookup]
handler = "console_tools:lookup"
reversibility = "reversible"
"""
TOOLS = """
def lookup(account: str) -> dict:
    return {"account": account}
"""


async def _read_line(stream: asyncio.StreamReader, pattern: str) -> re.Match[str]:
    async with asyncio.timeout(STEP_TIMEOUT_S * 2):
        while line := (await stream.readline()).decode():
            if found := re.search(pattern, line):
                return found
    raise AssertionError(f"no line matched {pattern!r}")


async def test_hostcall_console_serves_a_running_supervisor_and_says_where(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(PLAN)
    (tmp_path / "console_tools.py").write_text(TOOLS)
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor.cli", "serve", "--state-dir", str(state),
        "--plan", str(tmp_path / "plan.toml"), stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    console = None
    try:
        assert serve.stderr is not None
        await _read_line(serve.stderr, r"admin:")
        console = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "supervisor.cli", "console", "--state-dir", str(state),
            "--listen", "127.0.0.1:0", stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        assert console.stderr is not None
        found = await _read_line(
            console.stderr, r"hostcall: console at (http://127\.0\.0\.1:(\d+)/\?token=(\S+))"
        )
        url, port, token = found.group(1), found.group(2), found.group(3)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(url) as page:
                html = (page.status, await page.text())
            async with http.get(f"http://127.0.0.1:{port}/") as bare:
                refused = bare.status
            async with http.get(
                f"http://127.0.0.1:{port}/api/overview", headers={"X-Hostcall-Token": token}
            ) as response:
                overview = await response.json()
    finally:
        for process in (console, serve):
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                async with asyncio.timeout(STEP_TIMEOUT_S):
                    await process.wait()
    assert html[0] == 200 and "hostcall console" in html[1]
    assert refused == 401
    assert overview["invocations"] == [] and overview["approvals"] == []
    assert console is not None and console.returncode == 128 + signal.SIGTERM  # as serve


async def test_hostcall_console_without_a_supervisor_exits_2_with_one_line(
    tmp_path: Path,
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor.cli", "console", "--state-dir", str(tmp_path),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(STEP_TIMEOUT_S):
        _, err = await process.communicate()
    lines = err.decode().strip().splitlines()
    assert process.returncode == 2
    assert len(lines) == 1 and "no supervisor is running" in lines[0], lines


async def test_run_with_a_console_on_a_non_loopback_address_exits_2_naming_it(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(PLAN)
    (tmp_path / "console_tools.py").write_text(TOOLS)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(tmp_path / "s"),
        "--plan", str(tmp_path / "plan.toml"), "--console", "0.0.0.0:0", "--", "true",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(STEP_TIMEOUT_S):
        _, err = await process.communicate()
    assert process.returncode == 2
    assert "loopback" in err.decode()


async def test_serve_with_a_console_and_metrics_listen_prints_both_addresses(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(PLAN)
    (tmp_path / "console_tools.py").write_text(TOOLS)
    serve = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "supervisor.cli", "serve", "--state-dir", str(tmp_path / "s"),
        "--plan", str(tmp_path / "plan.toml"), "--console", "0", "--metrics-listen",
        "127.0.0.1:0", stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    try:
        assert serve.stderr is not None
        metrics = (await _read_line(serve.stderr, r"metrics at (http://\S+/metrics)")).group(1)
        console = (await _read_line(serve.stderr, r"console at (http://\S+)")).group(1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.get(metrics) as response:
                scraped = await response.text()
            async with http.get(console) as response:
                page = response.status
    finally:
        serve.send_signal(signal.SIGTERM)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await serve.wait()
    assert "hostcall_calls_in_flight" in scraped
    assert page == 200
