"""Guests in other languages: the protocol needs nothing from Python.

The shell guest (bash and curl) and the Node.js guest (node:http, no npm
packages) in examples/guests/ run as real guests of a real supervisor. Each
reads its credential from the inherited fd, gets the plan, makes a call and
retries it under the same call_id: the retry is replayed and the handler
runs once.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from supervisor import Plan, Supervisor
from supervisor.executions import Execution
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, wait_until

GUESTS = Path(__file__).parents[1] / "examples" / "guests"
SHELL_GUEST = GUESTS / "shell" / "agent.sh"
NODE_GUEST = GUESTS / "node" / "agent.mjs"
CHARGE = {"account": "acct_alice", "cents": 500}


def shell_lines(stdout: str) -> list[dict[str, Any]]:
    """`LABEL STATUS BODY` lines, as the shell guest prints them."""
    answers = []
    for line in stdout.splitlines():
        label, status, body = line.split(" ", 2)
        answers.append({"label": label, "http": int(status), "body": json.loads(body)})
    return answers


def node_lines(stdout: str) -> list[dict[str, Any]]:
    """JSON lines, as the Node guest prints them."""
    return [json.loads(line) for line in stdout.splitlines()]


def argv_of(language: str, *args: str) -> list[str]:
    program = {"shell": "bash", "node": "node"}[language]
    # Not skipped when missing: CI must run both guests (node 20 and curl are
    # part of the machine; see docs/guests.md).
    assert shutil.which(program), f"{program} is needed to run the {language} guest"
    if language == "shell":
        assert shutil.which("curl"), "curl is needed to run the shell guest"
    return [program, str(SHELL_GUEST if language == "shell" else NODE_GUEST), *args]


PARSERS: dict[str, Callable[[str], list[dict[str, Any]]]] = {
    "shell": shell_lines,
    "node": node_lines,
}


async def run_guest(
    sup: Supervisor,
    plan: Plan,
    argv: list[str],
    while_running: Callable[[Execution], Any] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int | None, str, str]:
    """Run a guest to its end; return its exit code, stdout and stderr."""
    started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            plan,
            argv,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S * 2):
            execution = await started
            process = execution.process
            assert process is not None and process.stdout is not None
            assert process.stderr is not None
            output = asyncio.gather(process.stdout.read(), process.stderr.read())
            if while_running is not None:
                await while_running(execution)
            out, err = await output
            outcome = await run
    finally:
        if not run.done():
            run.cancel()
    return outcome.exit_code, out.decode(), err.decode()


@pytest.mark.parametrize("language", ["shell", "node"])
async def test_a_guest_in_another_language_calls_once_and_its_retry_is_replayed(
    sup: Supervisor, ledger: Ledger, language: str
) -> None:
    code, out, err = await run_guest(sup, billing_plan(ledger), argv_of(language))

    assert code == 0, (out, err)
    plan, call, retry = PARSERS[language](out)
    assert (plan["label"], plan["http"]) == ("plan", 200)
    assert "charge" in {tool["name"] for tool in plan["body"]["tools"]}
    assert (call["label"], call["http"], call["body"]["effect"]) == ("call", 200, "executed")
    assert (retry["label"], retry["http"], retry["body"]["effect"]) == ("retry", 200, "replayed")
    assert call["body"]["result"] == retry["body"]["result"]
    assert call["body"]["result"]["charge_id"] == "ch_1"
    assert call["body"]["call_id"] == f"{language}-charge-1"
    assert ledger.runs["charge"] == 1
    assert ledger.args == [("charge", CHARGE)]


@pytest.mark.parametrize("language", ["shell", "node"])
async def test_a_guest_in_another_language_retries_a_timed_out_call_and_long_polls_it(
    sup: Supervisor, ledger: Ledger, language: str
) -> None:
    argv = argv_of(language, "slow_charge", '{"account": "acct_alice"}', "slow-1")

    async def release_once_polled(execution: Execution) -> None:
        # The handler holds the first POST past the guest's 1 s timeout; the
        # guest sends it again, gets 409 in_flight, and long-polls.
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        await wait_until(lambda: execution.broker.outcomes["unknown"] >= 1, "an in_flight")
        ledger.release.set()

    code, out, err = await run_guest(
        sup,
        billing_plan(ledger),
        argv,
        release_once_polled,
        env={**os.environ, "AGENT_REQUEST_TIMEOUT_S": "1"},
    )

    assert code == 0, (out, err)
    _, call, retry = PARSERS[language](out)
    assert call["body"]["result"] == retry["body"]["result"] == "slow_acct_alice"
    assert retry["body"]["effect"] == "replayed"
    assert ledger.runs["slow_charge"] == 1


@pytest.mark.parametrize("language", ["shell", "node"])
async def test_a_guest_in_another_language_waits_out_an_approval_and_runs_the_call_once(
    sup: Supervisor, ledger: Ledger, language: str
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)

    async def approve(execution: Execution) -> None:
        await wait_until(lambda: sup.approvals.waiting() == 1, "a proposal")
        sup.approvals.approve(sup.approvals.list("waiting")[0].id)

    code, out, err = await run_guest(sup, plan, argv_of(language), approve)

    assert code == 0, (out, err)
    _, call, retry = PARSERS[language](out)
    assert call["body"]["effect"] == "executed"
    assert retry["body"]["effect"] == "replayed"
    assert ledger.runs["charge"] == 1


@pytest.mark.parametrize("language", ["shell", "node"])
async def test_a_refused_call_exits_non_zero_and_shows_the_refusal(
    sup: Supervisor, ledger: Ledger, language: str
) -> None:
    argv = argv_of(language, "no_such_tool", "{}", "refused-1")

    code, out, _ = await run_guest(sup, billing_plan(ledger), argv)

    assert code == 1
    answer = PARSERS[language](out)[-1]
    assert answer["http"] == 403
    assert answer["body"]["error"]["code"] == "tool_not_allowed"
    assert answer["body"]["effect"] == "none"
    assert ledger.runs == {}
