"""The OpenAPI document: valid OpenAPI 3.1, current in the repository, served by
the channel, and true of real responses.

The conformance test drives a real guest process through a real supervisor
and checks every body it gets against the schema the document declares for
that path, method and status, with a JSON Schema 2020-12 validator (the
dialect of OpenAPI 3.1). It also checks that the requests made cover every
status and error code the document declares, but for a short, explained list.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_openapi
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from channel.errors import ERROR_STATUS
from channel.openapi import OPENAPI_PATH, OPERATION_CODES, document, document_bytes
from channel.server import MAX_WAIT_S
from supervisor import Supervisor
from tests.harness import (
    STEP_TIMEOUT_S,
    Driver,
    Ledger,
    billing_plan,
    driven_guest,
    identity_headers,
    raw_request,
    wait_until,
)

COMMITTED = Path(__file__).parents[2] / "channel" / "openapi.json"
DOC_URI = "urn:hostcall:channel-openapi"
CHARGE = {"account": "acct_1", "cents": 500}

# Declared but not provoked here, and why.
UNEXERCISED_STATUSES = {
    # The effect store failing is a host fault; the stores' own tests cover it.
    # Too many connections: tests/channel/test_connections.py.
    ("post", "/v1/calls", 503),
    ("get", "/v1/calls/{call_id}", 503),
    ("get", "/v1/plan", 503),
    ("get", OPENAPI_PATH, 503),
    # Only a bug in the channel answers 500 to these.
    ("get", "/v1/plan", 500),
    ("get", OPENAPI_PATH, 500),
}
UNEXERCISED_CODES = {
    # Cancelling an execution ends its guest, which then never reads the answer;
    # tests/supervisor/test_admin.py checks the refusal in the receipt instead.
    "cancelled",
    "store_unavailable",
    "internal_error",
    # Answered to a connection before any request is read: test_connections.py.
    "too_many_connections",
}


def template_of(method: str, path: str) -> str:
    path = path.partition("?")[0]
    if method == "get" and path.startswith("/v1/calls/"):
        return "/v1/calls/{call_id}"
    return path


def schema_ref(method: str, template: str, status: int) -> dict[str, str]:
    pointer = "/".join(
        [
            "",
            "paths",
            template.replace("~", "~0").replace("/", "~1"),
            method,
            "responses",
            str(status),
            "content",
            "application~1json",
            "schema",
        ]
    )
    return {"$ref": f"{DOC_URI}#{quote(pointer)}"}


@dataclass
class Conformance:
    """Checks real answers against the document and remembers what it saw."""

    doc: dict[str, Any] = field(default_factory=document)
    statuses: set[tuple[str, str, int]] = field(default_factory=set)
    codes: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry = Registry().with_resource(DOC_URI, DRAFT202012.create_resource(self.doc))

    def check(self, method: str, path: str, status: int, body: Any) -> None:
        method = method.lower()
        template = template_of(method, path)
        what = f"{method.upper()} {path} -> {status}"
        operation = self.doc["paths"].get(template, {}).get(method)
        if operation is None:
            self.problems.append(f"{what}: the document has no such operation")
            return
        if str(status) not in operation["responses"]:
            self.problems.append(f"{what}: status not declared ({body})")
            return
        self.statuses.add((method, template, status))
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            self.codes.add(body["error"]["code"])
        validator = Draft202012Validator(
            schema_ref(method, template, status), registry=self.registry
        )
        for error in validator.iter_errors(body):
            self.problems.append(f"{what}: {error.message} at {list(error.absolute_path)}")

    async def request(self, guest: Driver, **spec: Any) -> dict[str, Any]:
        """Make one request from the guest and check its answer."""
        reply = await guest.request(**spec)
        assert reply["status"] is not None, reply
        self.check(spec.get("method", "POST"), spec["path"], reply["status"], reply["body"])
        return reply

    async def call(self, guest: Driver, call_id: str, tool: str, args: Any) -> dict[str, Any]:
        body = {"call_id": call_id, "tool": tool, "args": args}
        return await self.request(guest, method="POST", path="/v1/calls", body=body)


async def exercise_calls(sup: Supervisor, ledger: Ledger, seen: Conformance) -> None:
    """Every answer a call can get without approvals or budgets."""
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as guest:
        credential = await guest.credential()
        execution = guest.execution
        for path in ("/v1/plan", OPENAPI_PATH):
            await seen.request(guest, method="GET", path=path)
        first = await seen.call(guest, "c1", "charge", CHARGE)
        again = await seen.call(guest, "c1", "charge", CHARGE)
        await seen.request(guest, method="GET", path="/v1/calls/c1")
        await seen.request(guest, method="GET", path="/v1/calls/never")
        await seen.call(guest, "c2", "broken", {"x": 1})
        await seen.call(guest, "c3", "bad_result", {})
        await seen.request(guest, method="GET", path="/v1/calls/c3")
        await seen.call(guest, "c4", "flaky_send", {"to": "x@example.com"})
        await seen.request(guest, method="GET", path="/v1/calls/c4?wait=0")

        slow = asyncio.ensure_future(seen.call(guest, "s1", "slow_charge", {"account": "a"}))
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        await seen.call(guest, "s1", "slow_charge", {"account": "a"})
        await seen.request(guest, method="GET", path="/v1/calls/s1")
        ledger.release.set()
        await slow

        await seen.call(guest, "c5", "charge", {"cents": "lots", "extra": 1})
        await seen.call(guest, "c6", "charge", {"account": "", "cents": 1})
        await seen.call(guest, "c1", "charge", {**CHARGE, "cents": 1})
        await seen.call(guest, "c7", "no_such_tool", {})

        await seen.request(guest, method="POST", path="/v1/calls", raw="{")
        await seen.call(guest, "bad id", "lookup", {"account": "a"})
        await seen.request(guest, method="GET", path="/v1/calls/" + "x" * 129)
        await seen.request(guest, method="GET", path="/v1/calls/c1?wait=61")
        big = {"call_id": "c8", "tool": "lookup", "args": {"account": "a" * (1024 * 1024)}}
        await seen.request(guest, method="POST", path="/v1/calls", body=big)
        await seen.request(
            guest,
            method="POST",
            path="/v1/calls",
            body={"call_id": "c9", "tool": "lookup", "args": {"account": "a"}},
            headers={"Content-Type": "text/plain"},
        )
        call_body = {"call_id": "c1", "tool": "charge", "args": CHARGE}
        for spec in (
            {"method": "POST", "path": "/v1/calls", "body": call_body},
            {"method": "GET", "path": "/v1/calls/c1"},
            {"method": "GET", "path": "/v1/plan"},
            {"method": "GET", "path": OPENAPI_PATH},
        ):
            await seen.request(guest, **spec, omit=["Authorization"])
            await seen.request(guest, **spec, headers={"Hostcall-Plan": "sha256:" + "0" * 64})
        # The test process is not the guest: its requests are refused by origin.
        headers = identity_headers(execution, credential)
        for path in ("/v1/plan", OPENAPI_PATH, "/v1/calls/c1"):
            status, body = await asyncio.to_thread(
                raw_request, str(sup.socket_path), "GET", path, headers
            )
            seen.check("GET", path, status, body)
            assert body["error"]["code"] == "origin_denied"
        served = await guest.request(method="GET", path=OPENAPI_PATH)
    # The execution has ended: its credential is fenced.
    status, body = await asyncio.to_thread(
        raw_request,
        str(sup.socket_path),
        "POST",
        "/v1/calls",
        {**headers, "Content-Type": "application/json"},
        json.dumps({"call_id": "c1", "tool": "charge", "args": CHARGE}).encode(),
    )
    seen.check("POST", "/v1/calls", status, body)
    assert body["error"]["code"] == "execution_fenced"
    assert first["body"]["effect"] == "executed"
    assert again["body"]["effect"] == "replayed"
    assert served["body"] == seen.doc
    assert ledger.runs["charge"] == 1


async def exercise_approvals(sup: Supervisor, ledger: Ledger, seen: Conformance) -> None:
    """202 while a proposal waits; 200 once approved; 403 when rejected or expired."""
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    async with driven_guest(sup, plan) as guest:
        approved = asyncio.ensure_future(seen.call(guest, "a1", "charge", CHARGE))
        await wait_until(lambda: sup.approvals.waiting() == 1, "a proposal")
        waiting = await seen.request(guest, method="GET", path="/v1/calls/a1")
        sup.approvals.approve(sup.approvals.list("waiting")[0].id)
        assert (await approved)["status"] == 200
        rejected = asyncio.ensure_future(seen.call(guest, "a2", "charge", {**CHARGE, "cents": 2}))
        await wait_until(lambda: sup.approvals.waiting() == 1, "a second proposal")
        sup.approvals.reject(sup.approvals.list("waiting")[0].id)
        assert (await rejected)["body"]["error"]["code"] == "approval_rejected"
    assert waiting["status"] == 202
    short = billing_plan(ledger, require_approval_for_irreversible=True, approval_timeout_s=0.05)
    async with driven_guest(sup, short) as guest:
        expired = await seen.call(guest, "a3", "charge", {**CHARGE, "cents": 3})
    assert expired["body"]["error"]["code"] == "approval_expired"


async def exercise_budget(sup: Supervisor, ledger: Ledger, seen: Conformance) -> None:
    """429 once the invocation's budget is spent."""
    async with driven_guest(sup, billing_plan(ledger, max_calls=1)) as guest:
        await seen.call(guest, "b1", "lookup", {"account": "a"})
        over = await seen.call(guest, "b2", "lookup", {"account": "b"})
    assert over["status"] == 429


async def test_real_responses_for_every_endpoint_and_status_match_the_document(
    sup: Supervisor, ledger: Ledger
) -> None:
    seen = Conformance()

    await exercise_calls(sup, ledger, seen)
    await exercise_approvals(sup, ledger, seen)
    await exercise_budget(sup, ledger, seen)

    assert seen.problems == []
    declared = {
        (method, path, int(status))
        for path, operations in seen.doc["paths"].items()
        for method, operation in operations.items()
        for status in operation["responses"]
    }
    assert declared - seen.statuses == UNEXERCISED_STATUSES
    declared_codes = {code for codes in OPERATION_CODES.values() for code in codes}
    assert declared_codes - seen.codes == UNEXERCISED_CODES


def test_the_document_is_valid_openapi_3_1() -> None:
    doc = document()

    validate_openapi(doc)

    assert doc["openapi"].startswith("3.1.")


def test_the_committed_document_is_the_one_the_channel_serves() -> None:
    assert COMMITTED.read_bytes() == document_bytes(), (
        "channel/openapi.json is stale; regenerate it (see channel/openapi.py)"
    )


def test_every_error_code_the_channel_knows_is_declared_with_its_status() -> None:
    doc = document()
    declared = {code for codes in OPERATION_CODES.values() for code in codes}

    # method_not_allowed answers a method the document has no operation for.
    assert set(ERROR_STATUS) - declared == {"method_not_allowed"}
    for (method, path), codes in OPERATION_CODES.items():
        responses = doc["paths"][path][method]["responses"]
        for code in codes:
            assert str(ERROR_STATUS[code]) in responses, (method, path, code)


def test_the_long_poll_limit_in_the_document_is_the_servers() -> None:
    [wait] = [
        p for p in document()["paths"]["/v1/calls/{call_id}"]["get"]["parameters"] if "name" in p
    ][-1:]
    assert wait["name"] == "wait"
    assert wait["schema"]["maximum"] == MAX_WAIT_S
