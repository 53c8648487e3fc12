"""SPEC §4.2/§4.3: every bad input gets its code, and nothing is recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor import Supervisor
from tests.harness import Ledger, billing_plan, driven_guest

GOOD_ARGS = '{"account": "acct_1", "cents": 5}'


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("{not json", "bad_request"),
        ("", "bad_request"),
        ("[]", "bad_request"),
        ('"a string"', "bad_request"),
        ('{"call_id": "c1", "tool": "charge", "args": ' + GOOD_ARGS + ', "x": 1}', "bad_request"),
        (
            '{"call_id": "c1", "call_id": "c2", "tool": "charge", "args": ' + GOOD_ARGS + "}",
            "bad_request",
        ),
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "a", "account": "b",'
            ' "cents": 5}}',
            "bad_request",
        ),
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": NaN}}',
            "bad_request",
        ),
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": Infinity}}',
            "bad_request",
        ),
        # Past a double's range json parses to inf without a word: Infinity too.
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": 1e400}}',
            "bad_request",
        ),
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": [-1E999]}}',
            "bad_request",
        ),
        # The tool name is echoed (reply, receipt, console): 1-256 characters of text.
        ('{"call_id": "c1", "tool": "", "args": {}}', "bad_request"),
        ('{"call_id": "c1", "tool": "' + "x" * 257 + '", "args": {}}', "bad_request"),
        ('{"call_id": "c1", "tool": "\\ud800", "args": {}}', "bad_request"),
        ('{"call_id": "c1", "tool": "charge", "args": [1, 2]}', "bad_request"),
        ('{"call_id": "c1", "tool": "charge", "args": "x"}', "bad_request"),
        ('{"call_id": "c1", "tool": "charge"}', "bad_request"),
        ('{"tool": "charge", "args": {}}', "bad_request"),
        ('{"call_id": 7, "tool": "charge", "args": {}}', "bad_request"),
        ('{"call_id": "", "tool": "charge", "args": {}}', "bad_request"),
        ('{"call_id": "has space", "tool": "charge", "args": {}}', "bad_request"),
        ('{"call_id": "' + "x" * 129 + '", "tool": "charge", "args": {}}', "bad_request"),
        ('{"call_id": "c/1", "tool": "charge", "args": {}}', "bad_request"),
        (
            '{"call_id": "c1", "tool": "charge", "args": {"account": "\\ud800", "cents": 5}}',
            "invalid_arguments",
        ),
    ],
)
async def test_a_malformed_call_is_refused_with_its_code_and_nothing_is_recorded(
    sup: Supervisor, ledger: Ledger, raw: str, code: str
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(raw=raw)
        records = await sup.store.calls(guest.execution.invocation_id)
    assert reply["body"]["status"] == "refused"
    assert reply["body"]["error"]["code"] == code
    assert reply["status"] == {"bad_request": 400, "invalid_arguments": 422}[code]
    assert reply["body"]["effect"] == "none"
    assert records == []
    assert ledger.runs == {}


@pytest.mark.parametrize("tool", ["x" * 256, "ch\u00e4rge", "\U0001f600"])
async def test_a_well_formed_tool_the_plan_lacks_is_not_allowed_and_echoed_as_sent(
    sup: Supervisor, ledger: Ledger, tool: str
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(body={"call_id": "c1", "tool": tool, "args": {}})
    assert reply["status"] == 403
    assert reply["body"]["error"]["code"] == "tool_not_allowed"
    assert reply["body"]["tool"] == tool
    assert ledger.runs == {}


async def test_invalid_utf8_in_the_body_is_a_bad_request(sup: Supervisor, ledger: Ledger) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        # surrogateescape turns \udcff back into the single byte 0xff.
        reply = await guest.request(raw='{"call_id": "c1", "tool": "\udcff", "args": {}}')
    assert reply["status"] == 400
    assert reply["body"]["error"]["code"] == "bad_request"


@pytest.mark.parametrize(
    ("content_type", "status", "code"),
    [
        ("text/plain", 415, "unsupported_media_type"),
        ("application/x-www-form-urlencoded", 415, "unsupported_media_type"),
        ("application/json; charset=utf-8", 200, None),
    ],
)
async def test_only_json_bodies_are_accepted(
    sup: Supervisor, ledger: Ledger, content_type: str, status: int, code: str | None
) -> None:
    body = {"call_id": "c1", "tool": "lookup", "args": {"account": "a"}}
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(body=body, headers={"Content-Type": content_type})
    assert reply["status"] == status
    if code is not None:
        assert reply["body"]["error"]["code"] == code
        assert ledger.runs == {}


async def test_a_body_over_the_limit_gets_413_and_runs_nothing(
    tmp_path: Path, ledger: Ledger
) -> None:
    async with (
        Supervisor(tmp_path / "s", max_body=4096) as sup,
        driven_guest(sup, billing_plan(ledger)) as guest,
    ):
        big = {"call_id": "c1", "tool": "lookup", "args": {"account": "a" * 5000}}
        reply = await guest.request(body=big)
        small = await guest.call("c2", "lookup", {"account": "a"})
    assert reply["status"] == 413
    assert reply["body"]["error"]["code"] == "payload_too_large"
    assert small["status"] == 200
    assert ledger.runs["lookup"] == 1


async def test_the_default_body_limit_is_one_mebibyte(sup: Supervisor, ledger: Ledger) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        over = {"call_id": "c1", "tool": "lookup", "args": {"account": "a" * (1024 * 1024)}}
        reply = await guest.request(body=over)
    assert reply["status"] == 413


async def test_arguments_that_fail_the_schema_get_422_with_one_detail_per_problem(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.call("c1", "charge", {"cents": "lots", "extra": 1})
        records = await sup.store.calls(guest.execution.invocation_id)
    assert reply["status"] == 422
    error = reply["body"]["error"]
    assert error["code"] == "invalid_arguments"
    by_loc = {tuple(d["loc"]): d["msg"] for d in error["details"]}
    assert set(by_loc) == {("account",), ("cents",), ("extra",)}
    assert all(isinstance(msg, str) and msg for msg in by_loc.values())
    assert records == []
    assert ledger.runs == {}


async def test_a_call_with_thousands_of_problems_lists_the_first_hundred(
    sup: Supervisor, ledger: Ledger
) -> None:
    # One 1 MiB body can hold 100,000s of problems: the reply lists 99 and
    # how many more, instead of growing to tens of megabytes.
    extra = {f"k{n}": 1 for n in range(5000)}
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.call("c1", "charge", extra)
    assert reply["status"] == 422
    details = reply["body"]["error"]["details"]
    assert len(details) == 100
    assert all(d["loc"] and d["msg"] for d in details[:99])
    # 5,000 unknown fields, and account and cents missing.
    assert details[-1] == {"loc": [], "msg": "and 4903 more"}
    assert ledger.runs == {}


@pytest.mark.parametrize("account", ["", None])
async def test_an_irreversible_tool_needs_a_target(
    sup: Supervisor, ledger: Ledger, account: Any
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        if account is None:
            reply = await guest.call("c1", "charge", {"cents": 5})
        else:
            reply = await guest.call("c1", "charge", {"account": account, "cents": 5})
    expected = ("target_required", 422) if account == "" else ("invalid_arguments", 422)
    assert (reply["body"]["error"]["code"], reply["status"]) == expected
    assert ledger.runs == {}


async def test_a_tool_outside_the_plan_is_not_allowed(sup: Supervisor, ledger: Ledger) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.call("c1", "delete_everything", {})
        records = await sup.store.calls(guest.execution.invocation_id)
    assert reply["status"] == 403
    assert reply["body"]["error"]["code"] == "tool_not_allowed"
    assert records == []


async def test_a_revoked_tool_is_refused_for_new_calls_and_replays(
    sup: Supervisor, ledger: Ledger
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        before = await guest.call("c1", "lookup", {"account": "a"})
        await sup.revoke(guest.execution.invocation_id, "lookup")
        replay = await guest.call("c1", "lookup", {"account": "a"})
        plan = await guest.request(method="GET", path="/v1/plan")
    assert before["status"] == 200
    assert replay["status"] == 403
    assert replay["body"]["error"]["code"] == "tool_not_allowed"
    assert "lookup" not in [t["name"] for t in plan["body"]["tools"]]
    assert ledger.runs["lookup"] == 1


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/v1/calls/bad%20id", 400, "bad_request"),
        ("GET", "/v1/calls/" + "x" * 129, 400, "bad_request"),
        ("GET", "/v1/calls/c1?wait=61", 400, "bad_request"),
        ("GET", "/v1/calls/c1?wait=-1", 400, "bad_request"),
        ("GET", "/v1/calls/c1?wait=soon", 400, "bad_request"),
        ("GET", "/v1/calls/c1?wait=nan", 400, "bad_request"),
        ("GET", "/v1/calls/never_made", 404, "not_found"),
        ("GET", "/v1/calls/never_made?wait=0.2", 404, "not_found"),
        ("GET", "/v2/nothing", 404, "not_found"),
        ("DELETE", "/v1/calls/c1", 405, "method_not_allowed"),
        # The channel routes requests itself, as aiohttp's router did (the
        # answers of these were recorded from it).
        ("GET", "/v1/calls", 405, "method_not_allowed"),
        ("POST", "/v1/plan", 405, "method_not_allowed"),
        ("OPTIONS", "/v1/calls", 405, "method_not_allowed"),
        ("GET", "/v1/calls/", 404, "not_found"),
        ("GET", "/v1/calls/a/b", 404, "not_found"),
        ("GET", "/v1/plan/", 404, "not_found"),
        ("GET", "/V1/plan", 404, "not_found"),
        ("GET", "/v1/calls/a%2Fb", 400, "bad_request"),  # "a/b", not a valid id
        ("GET", "/v1/calls/never%5Fmade", 404, "not_found"),  # "never_made", decoded
    ],
)
async def test_bad_paths_and_queries_get_their_codes(
    sup: Supervisor, ledger: Ledger, method: str, path: str, status: int, code: str
) -> None:
    async with driven_guest(sup, billing_plan(ledger)) as guest:
        reply = await guest.request(method=method, path=path)
    assert reply["status"] == status
    assert reply["body"]["error"]["code"] == code


async def test_the_plan_endpoint_describes_tools_and_the_budget_left(
    tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, max_calls=10, max_cost=100)
    async with Supervisor(tmp_path / "s") as sup, driven_guest(sup, plan) as guest:
        await guest.call("c1", "charge", {"account": "a", "cents": 1})
        reply = await guest.request(method="GET", path="/v1/plan")
    body = reply["body"]
    assert body["plan_hash"] == plan.plan_hash
    assert body["name"] == "billing-test"
    charge = next(t for t in body["tools"] if t["name"] == "charge")
    assert set(charge) == {
        "name",
        "description",
        "input_schema",
        "output_schema",
        "reversibility",
        "approval",
        "cost",
    }
    assert charge["reversibility"] == "irreversible"
    assert charge["input_schema"]["required"] == ["account", "cents"]
    assert body["budget"] == {
        "max_calls": 10,
        "calls_left": 9,
        "max_cost": 100,
        "cost_left": 90,
        "deadline_at": None,
    }
