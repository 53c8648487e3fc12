"""Receipts (SPEC §8): one hash-chained line per call that reached a broker."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from supervisor import Supervisor
from supervisor.receipts import ReceiptOutcome, make_receipt, receipt_digest, seal
from tests.harness import Ledger, billing_plan, driven_guest, hostcall_cli

FIELDS = {
    "receipt_id",
    "invocation_id",
    "execution_id",
    "plan_hash",
    "call_id",
    "tool",
    "idempotency_key",
    "outcome",
    "error_code",
    "result_sha256",
    "approval_id",
    "started_at",
    "finished_at",
    "prev_hash",
    "hash",
}


async def _a_run_with_every_outcome(sup: Supervisor, ledger: Ledger) -> tuple[Path, str]:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan, invocation_id="inv_rc") as guest:
        await guest.call("c1", "charge", {"account": "a", "cents": 5})  # executed
        await guest.call("c1", "charge", {"account": "a", "cents": 5})  # replayed
        await guest.call("n1", "nope", {})  # refused
        await guest.call("b1", "broken", {"x": 1})  # failed
        await guest.call("m1", "flaky_send", {"to": "x@example.com"})  # unknown
        await guest.call("x1", "bad_result", {})  # result_invalid
        await guest.request(body={"call_id": "z"}, omit=["Authorization"])  # no broker: no line
        credential = await guest.credential()
    return sup.state.receipts_dir / "inv_rc.jsonl", credential


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_every_call_that_reached_a_broker_has_one_chained_receipt(
    sup: Supervisor, ledger: Ledger
) -> None:
    path, credential = await _a_run_with_every_outcome(sup, ledger)
    receipts = _lines(path)
    assert [(r["call_id"], r["outcome"], r["error_code"]) for r in receipts] == [
        ("c1", "executed", None),
        ("c1", "replayed", None),
        ("n1", "refused", "tool_not_allowed"),
        ("b1", "failed", "tool_error"),
        ("m1", "unknown", "unknown"),
        ("x1", "result_invalid", "result_invalid"),
    ]
    previous = "0" * 64
    for receipt in receipts:
        assert set(receipt) == FIELDS
        assert receipt["prev_hash"] == previous
        body = {k: v for k, v in receipt.items() if k != "hash"}
        assert receipt["hash"] == hashlib.sha256(rfc8785.dumps(body)).hexdigest()
        previous = receipt["hash"]
    result = {"charge_id": "ch_1", "account": "a", "cents": 5}
    expected = hashlib.sha256(rfc8785.dumps(result)).hexdigest()
    assert receipts[0]["result_sha256"] == receipts[1]["result_sha256"] == expected
    assert receipts[2]["result_sha256"] is None
    assert credential not in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600


async def test_the_chain_continues_across_executions_and_verifies(
    sup: Supervisor, ledger: Ledger
) -> None:
    path, _ = await _a_run_with_every_outcome(sup, ledger)
    async with driven_guest(sup, billing_plan(ledger), invocation_id="inv_rc") as guest:
        await guest.call("c1", "charge", {"account": "a", "cents": 5})
    receipts = _lines(path)
    code, out, err = await hostcall_cli("receipts", "verify", str(path))
    assert len({r["execution_id"] for r in receipts}) == 2
    assert receipts[-1]["prev_hash"] == receipts[-2]["hash"]
    assert code == 0, err
    assert "7 receipt(s), hash chain intact" in out


async def _verify(path: Path) -> tuple[int, str]:
    code, _, err = await hostcall_cli("receipts", "verify", str(path))
    return code, err


async def test_a_changed_byte_is_found_and_named_by_line(sup: Supervisor, ledger: Ledger) -> None:
    path, _ = await _a_run_with_every_outcome(sup, ledger)
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = lines[2].replace("tool_not_allowed", "tool_not_allowes")
    path.write_text("".join(lines))
    code, err = await _verify(path)
    assert code == 1
    assert "line 3: hash does not match" in err


async def test_a_removed_line_is_found(sup: Supervisor, ledger: Ledger) -> None:
    path, _ = await _a_run_with_every_outcome(sup, ledger)
    lines = path.read_text().splitlines(keepends=True)
    del lines[1]
    path.write_text("".join(lines))
    code, err = await _verify(path)
    assert code == 1
    assert "line 2: prev_hash does not match" in err


async def test_reordered_lines_are_found(sup: Supervisor, ledger: Ledger) -> None:
    path, _ = await _a_run_with_every_outcome(sup, ledger)
    lines = path.read_text().splitlines(keepends=True)
    lines[3], lines[4] = lines[4], lines[3]
    path.write_text("".join(lines))
    code, err = await _verify(path)
    assert code == 1
    assert "line 4" in err


async def test_a_rewritten_line_with_a_recomputed_hash_breaks_the_next_link(
    sup: Supervisor, ledger: Ledger
) -> None:
    path, _ = await _a_run_with_every_outcome(sup, ledger)
    receipts = _lines(path)
    forged = {k: v for k, v in receipts[0].items() if k != "hash"}
    forged["outcome"] = "refused"
    forged["hash"] = hashlib.sha256(rfc8785.dumps(forged)).hexdigest()
    receipts[0] = forged
    path.write_text("".join(json.dumps(r) + "\n" for r in receipts))
    code, err = await _verify(path)
    assert code == 1
    assert "line 2: prev_hash" in err


async def test_garbage_and_missing_files_are_reported(tmp_path: Path) -> None:
    garbage = tmp_path / "g.jsonl"
    garbage.write_text("not json\n")
    code, err = await _verify(garbage)
    assert code == 1
    assert "line 1: not valid JSON" in err
    code, err = await _verify(tmp_path / "missing.jsonl")
    assert code == 2
    assert "cannot read" in err


_texts = st.text() | st.sampled_from(
    ["é", "\U0001f600", "\ue000", "\u2028", "\x7f", "\ud800", '"\\']
)
_receipts = st.dictionaries(
    st.sampled_from(sorted(FIELDS)) | st.text(max_size=6),
    st.none() | _texts | st.integers() | st.floats(allow_nan=False),
    max_size=16,
)


#: A call's receipt as make_receipt orders it, with any text or null values.
_call_receipts = st.fixed_dictionaries(
    {
        name: st.none() | _texts
        for name in (
            "receipt_id",
            "invocation_id",
            "execution_id",
            "plan_hash",
            "call_id",
            "tool",
            "idempotency_key",
            "outcome",
            "error_code",
            "result_sha256",
            "approval_id",
            "started_at",
            "finished_at",
        )
    }
)


@settings(max_examples=400, deadline=None)
@given(_receipts | _call_receipts, st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
def test_seal_writes_the_line_of_json_dumps_and_the_hash_of_rfc8785(
    receipt: dict[str, Any], prev_hash: str
) -> None:
    # seal quotes text values itself (it runs once per call): it must give
    # exactly json.dumps's line and the sha256 of the rfc8785 package's JCS.
    sealed = {**receipt, "prev_hash": prev_hash}
    try:
        reference = rfc8785.dumps(sealed)
    except Exception:
        with pytest.raises(ValueError, match="not canonical JSON"):
            seal(receipt, prev_hash)
        return
    line, digest = seal(receipt, prev_hash)
    assert digest == hashlib.sha256(reference).hexdigest()
    expected = {**sealed, "hash": digest}
    assert line == json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


@settings(max_examples=400, deadline=None)
@given(_receipts | _call_receipts, st.text(alphabet="0123456789abcdef", min_size=64, max_size=64))
def test_a_verified_line_is_hashed_as_rfc8785_would_on_every_path(
    receipt: dict[str, Any], prev_hash: str
) -> None:
    # Verification takes seal's own path for the lines hostcall writes (and
    # the general one for any other): both must be the JCS hash, read back.
    assume("hash" not in receipt)  # its own hash field is sealed over, then replaced
    try:
        reference = hashlib.sha256(rfc8785.dumps({**receipt, "prev_hash": prev_hash})).hexdigest()
    except Exception:
        return  # not I-JSON: seal refuses it (above), nothing to read back
    line, _ = seal(receipt, prev_hash)
    read = json.loads(line)
    del read["hash"]
    assert receipt_digest(read) == reference


@pytest.mark.parametrize("outcome", list(ReceiptOutcome))
def test_every_receipt_hostcall_makes_is_sealed_without_the_general_path(
    outcome: ReceiptOutcome, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The general path (rfc8785's pure-Python encoder) costs ~100 µs per
    # call; an enum outcome once sent every receipt down it unnoticed.
    def general_path(value: Any) -> bytes:
        raise AssertionError(f"sealed on the general path: {value!r}")

    monkeypatch.setattr("supervisor.receipts.jcs", general_path)
    receipt = make_receipt(
        invocation_id="inv_1",
        execution_id="exe_1",
        plan_hash="ab" * 32,
        call_id="c1",
        tool="refund",
        idempotency_key="cd" * 32,
        outcome=outcome,
        error_code=None,
        result_sha256="ef" * 32,
        approval_id=None,
        started_at=1.5,
        finished_at=2.25,
    )
    line, digest = seal(receipt, "0" * 64)
    sealed = json.loads(line)
    assert sealed["outcome"] == outcome.value
    assert digest == hashlib.sha256(rfc8785.dumps({**receipt, "prev_hash": "0" * 64})).hexdigest()
