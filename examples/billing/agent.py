"""The billing example's agent: a guest process that calls host tools.

It runs under a hostcall supervisor (``hostcall demo``, or ``hostcall run
--plan examples/billing/plan.toml -- python examples/billing/agent.py``) and
shows, step by step, what the door between guest and host guarantees:

1. a call runs once;
2. a call whose response was lost is retried with the same ``call_id`` and
   gets the stored result: the bank is charged once;
3. calls the plan does not allow, or with bad arguments, are refused and run
   nothing;
4. a call whose outcome is in doubt is reported as such, and never run again;
5. a call the plan marks ``approval = "always"`` waits for an operator: it runs
   once if approved, and not at all if rejected or left undecided.

The agent cannot reach the bank itself: it only names tools. It exits 0 when
every step behaved as described, 1 otherwise.
"""

from __future__ import annotations

import json
import select
import socket
import sys
from typing import Any, NoReturn

from guest_client import EffectUnknown, GuestEnvironment, HostClient, Refused, connect
from guest_client.http11 import encode_request

#: Upper bound for the one request this agent sends by hand.
WIRE_TIMEOUT_S = 30.0
#: How long the approval step may wait. Longer than the plan's approval lease
#: (``approval_timeout_s = 300``), so the host's answer — approved, rejected or
#: expired — always comes back before the client gives up.
APPROVAL_WAIT_S = 330.0
#: What the host answers when nobody let the call run.
NOT_APPROVED = ("approval_rejected", "approval_expired")


def say(text: str = "") -> None:
    """Print one line of the walkthrough."""
    print(text, flush=True)


def fail(text: str) -> NoReturn:
    """Stop the walkthrough: the host did not behave as described."""
    print(f"   UNEXPECTED: {text}", flush=True)
    sys.exit(1)


def post_and_hang_up(env: GuestEnvironment, call_id: str, tool: str, args: dict[str, Any]) -> None:
    """``POST /v1/calls`` by hand, then drop the connection without reading the answer.

    We wait until the answer is on its way back (the socket turns readable),
    so the host has really run the call; then we close the socket unread, as a
    guest whose connection broke at the wrong moment would.
    """
    body = json.dumps({"call_id": call_id, "tool": tool, "args": args}).encode()
    headers = {**env.identity_headers(), "Content-Type": "application/json"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(WIRE_TIMEOUT_S)
        sock.connect(env.socket_path)
        sock.sendall(encode_request("POST", "/v1/calls", headers, body))
        readable, _, _ = select.select([sock], [], [], WIRE_TIMEOUT_S)
        if not readable:
            fail(f"no answer to {call_id} within {WIRE_TIMEOUT_S:g} s")


def step_executed(client: HostClient) -> None:
    """1. An ordinary call: the handler runs once."""
    say("1. A call is executed")
    args = {"account": "acct_alice", "cents": 1250, "memo": "order 1001"}
    result = client.call("charge", args, call_id="charge-1001")
    say(f"   charge acct_alice 1250 cents (call_id charge-1001) -> {result['charge_id']}")
    say(f"   acct_alice balance is now {result['balance_cents']} cents")


def step_replayed(client: HostClient) -> None:
    """2. The response is lost; the retry with the same call_id is replayed."""
    say("2. A lost response, retried with the same call_id")
    before = client.call("read_balance", {"account": "acct_bob"}, call_id="balance-bob-before")
    args = {"account": "acct_bob", "cents": 800, "memo": "order 1002"}
    post_and_hang_up(client.environment, "charge-1002", "charge", args)
    say("   charge acct_bob 800 cents (call_id charge-1002): sent, connection dropped unread")
    result = client.call("charge", args, call_id="charge-1002")
    say(f"   retry with call_id charge-1002 -> {result['charge_id']} (the stored result)")
    after = client.call("read_balance", {"account": "acct_bob"}, call_id="balance-bob-after")
    if before - after != 800:
        fail(f"acct_bob went from {before} to {after} cents: charged more than once")
    say(f"   acct_bob balance {before} -> {after} cents: charged once, not twice")


def step_refused(client: HostClient) -> None:
    """3. Refusals: the host runs nothing and says why."""
    say("3. Refused calls: nothing runs")
    try:
        client.call("delete_account", {"account": "acct_alice"}, call_id="delete-alice")
    except Refused as exc:
        say(f"   delete_account (not in the plan) -> Refused {exc.code}")
    else:
        fail("delete_account ran, but the plan does not allow it")
    bad = {"account": "alice", "cents": -5, "currency": "EUR"}
    try:
        client.call("charge", bad, call_id="charge-bad")
    except Refused as exc:
        say(f"   charge {json.dumps(bad)}")
        say(f"     -> Refused {exc.code}:")
        for problem in exc.details or []:
            where = ".".join(str(part) for part in problem["loc"]) or "(args)"
            say(f"        {where}: {problem['msg']}")
    else:
        fail("a charge with bad arguments ran")


def step_unknown(client: HostClient) -> None:
    """4. The mail server hangs up: the receipt may or may not have gone out."""
    say("4. An ambiguous outcome: the mail server hung up")
    args = {"account": "acct_alice", "email": "alice@example.com"}
    for attempt in ("send_receipt", "retry, same call_id"):
        try:
            client.call("send_receipt", args, call_id="receipt-1001")
        except EffectUnknown as exc:
            key = (exc.idempotency_key or "?")[:16]
            say(f"   {attempt} -> EffectUnknown ({exc.reason}), idempotency_key {key}…")
        else:
            fail("send_receipt reported success")
    say("   the host will not send it again; ask the mail backend about that key")


def step_approval(client: HostClient) -> None:
    """5. A refund waits for an operator; approved it runs once, otherwise not at all."""
    say("5. A call that needs an operator's approval")
    args = {"account": "acct_bob", "cents": 800, "memo": "refund of order 1002"}
    say("   refund acct_bob 800 cents (call_id refund-1002): waiting for a decision…")
    try:
        result = client.call("refund", args, call_id="refund-1002", timeout=APPROVAL_WAIT_S)
    except Refused as exc:
        if exc.code not in NOT_APPROVED:
            fail(f"refund refused with {exc.code}: {exc}")
        balance = client.call("read_balance", {"account": "acct_bob"}, call_id="balance-bob-end")
        say(f"   -> Refused {exc.code}: nothing ran, acct_bob balance stays {balance} cents")
    else:
        refund_id, balance = result["refund_id"], result["balance_cents"]
        say(f"   -> approved and executed: {refund_id}, acct_bob balance is now {balance} cents")


def main() -> int:
    """Walk through the five steps; 0 when each behaved as described."""
    with connect() as client:
        env = client.environment
        say(f"agent: a guest process of invocation {env.invocation}")
        step_executed(client)
        step_replayed(client)
        step_refused(client)
        step_unknown(client)
        step_approval(client)
    return 0


if __name__ == "__main__":
    sys.exit(main())
