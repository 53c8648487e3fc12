"""Receipts: one hash-chained JSON line per call that reached a broker
(docs/approvals.md, "Receipts"). The chain itself, no I/O but reading a file.

``hash = sha256(JCS(receipt without hash))`` and ``prev_hash`` is the previous
line's ``hash`` (64 zeros for the first), so changing, removing or reordering a
line breaks the chain.

Who writes them is the effect store's business (``EffectStore.receipts``): a
:class:`~supervisor.receipt_files.ReceiptLog` chains and fsyncs the file
itself; the SQLite store journals each line in the transaction that records
its call, one fsync for both (:mod:`supervisor.stores.journal`). Both are
:class:`Receipts`.
"""

from __future__ import annotations

import contextlib
import enum
import json
import operator
from collections.abc import Generator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from supervisor.canonical import jcs, sha256_hex
from supervisor.ids import new_id
from supervisor.timestamps import utc_timestamp

__all__ = [
    "GENESIS_HASH",
    "RECEIPT_FIELDS",
    "ChainCheck",
    "ChainError",
    "ReceiptOutcome",
    "Receipts",
    "make_receipt",
    "read_receipts",
    "receipt_digest",
    "seal",
    "verify_chain",
]

GENESIS_HASH: Final = "0" * 64
#: json's own string quoting (its C encoder's, ``ensure_ascii=False``), which is JCS's.
_quote: Final = json.encoder.encode_basestring
_FIELDS: Final = (
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
)
#: The fields of a receipt, each line's and no other.
RECEIPT_FIELDS: Final = frozenset(_FIELDS)
_QUOTED_NAMES: Final = {name: _quote(name) + ":" for name in _FIELDS}
#: The receipt of every call (make_receipt's fields, then prev_hash): its
#: names quoted once, and the order JCS sorts them in (ASCII names sort the
#: same by code point and by UTF-16 unit).
_CALL_FIELDS: Final = _FIELDS[:-1]
_CALL_NAMES: Final = tuple(_QUOTED_NAMES[name] for name in _CALL_FIELDS)
_CALL_SORTED: Final = operator.itemgetter(
    *sorted(range(len(_CALL_FIELDS)), key=_CALL_FIELDS.__getitem__)
)
_TEXT_OR_NULL: Final = frozenset({str, type(None)})


def make_receipt(
    *,
    invocation_id: str,
    execution_id: str,
    plan_hash: str,
    call_id: str | None,
    tool: str | None,
    idempotency_key: str | None,
    outcome: str,
    error_code: str | None,
    result_sha256: str | None = None,
    approval_id: str | None,
    started_at: float,
    finished_at: float,
) -> dict[str, Any]:
    """A receipt without its place in the chain (``prev_hash`` and ``hash``).

    ``result_sha256``: sha256 hex of the result's JCS, ``None`` when there is none.
    """
    return {
        "receipt_id": new_id("rcpt"),
        "invocation_id": invocation_id,
        "execution_id": execution_id,
        "plan_hash": plan_hash,
        "call_id": call_id,
        "tool": tool,
        "idempotency_key": idempotency_key,
        # A plain str, not the enum: seal's fast path takes exact types only.
        "outcome": str(outcome),
        "error_code": error_code,
        "result_sha256": result_sha256,
        "approval_id": approval_id,
        "started_at": utc_timestamp(started_at),
        "finished_at": utc_timestamp(finished_at),
    }


def seal(receipt: Mapping[str, Any], prev_hash: str) -> tuple[bytes, str]:
    """Chain ``receipt`` after ``prev_hash``: its JSON line and its ``hash``.

    The line is ``json.dumps(sealed, separators=(",", ":"), ensure_ascii=False)``
    (fields in the receipt's own order, ``prev_hash`` and ``hash`` last); the
    hash is of the JCS of everything but ``hash``.
    """
    sealed = {**receipt, "prev_hash": prev_hash}
    # Every receipt hostcall writes: each value quoted once, for the hash's
    # sorted JCS and for the line in its own order (one receipt per call).
    pairs = _call_pairs(sealed)
    if pairs is not None:
        canonical = "{" + ",".join(_CALL_SORTED(pairs)) + "}"
    else:
        quoted = _quoted(sealed)
        if quoted is None:  # not only ASCII names and text or null values: the general path
            sealed["hash"] = digest = sha256_hex(jcs(sealed))
            line = json.dumps(sealed, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
            return line, digest
        canonical = "{" + ",".join([quoted[name] for name in sorted(quoted)]) + "}"
        pairs = list(quoted.values())
    try:
        digest = sha256_hex(canonical.encode())
        line = ("{" + ",".join(pairs) + f',"hash":"{digest}"}}\n').encode()
    except UnicodeEncodeError as exc:  # a lone surrogate: not JSON text
        raise ValueError(f"not canonical JSON: {exc}") from exc
    return line, digest


def receipt_digest(fields: dict[str, Any]) -> str:
    """``sha256(JCS(fields))`` of a receipt without its ``hash``: what its
    ``hash`` must be. A line hostcall wrote takes :func:`seal`'s own path
    (about a quarter of the general one's time, when a file is verified).

    Raises:
        ValueError: ``fields`` is not I-JSON (a lone surrogate, say).
    """
    pairs = _call_pairs(fields)
    if pairs is None:
        return sha256_hex(jcs(fields))
    try:
        return sha256_hex(("{" + ",".join(_CALL_SORTED(pairs)) + "}").encode())
    except UnicodeEncodeError as exc:
        raise ValueError(f"not canonical JSON: {exc}") from exc


def _call_pairs(fields: dict[str, Any]) -> list[str] | None:
    """``"name":value`` of each field of a call's receipt (make_receipt's
    fields in its order, text or null values), or None for any other."""
    values = fields.values()
    if tuple(fields) != _CALL_FIELDS or not _TEXT_OR_NULL.issuperset(map(type, values)):
        return None
    quoted = [_quote(v) if v is not None else "null" for v in values]
    return list(map(operator.add, _CALL_NAMES, quoted))


def _quoted(fields: Mapping[str, Any]) -> dict[str, str] | None:
    """``"name":value`` of each field as JCS (and json.dumps) write it, or
    None unless every name is ASCII text and every value text or null.

    ASCII names sort the same by code point and by UTF-16 unit, and json's
    string escaping is JCS's (see :func:`supervisor.canonical.jcs`).
    """
    if "hash" in fields:  # sealed already: json.dumps's line keeps the field's place
        return None
    quoted = {}
    for name, value in fields.items():
        key = _QUOTED_NAMES.get(name)
        if key is None:
            if type(name) is not str or not name.isascii():
                return None
            key = _quote(name) + ":"
        if value is None:
            quoted[name] = key + "null"
        elif type(value) is str:
            quoted[name] = key + _quote(value)
        else:
            return None
    return quoted


class ReceiptOutcome(enum.StrEnum):
    """What a receipt says happened to its call (its ``outcome``)."""

    EXECUTED = "executed"
    REPLAYED = "replayed"
    REFUSED = "refused"
    FAILED = "failed"
    UNKNOWN = "unknown"
    RESULT_INVALID = "result_invalid"


class Receipts(Protocol):
    """Where one invocation's receipts go: its store's writer of its file
    (``EffectStore.receipts``)."""

    path: Path

    async def record(self, receipt: dict[str, Any]) -> None:
        """Chain ``receipt`` (from :func:`make_receipt`) and make it durable."""
        ...

    async def commit(
        self,
        invocation_id: str,
        call_id: str,
        response: Mapping[str, Any],
        now: float,
        receipt: dict[str, Any],
    ) -> None:
        """Commit a dispatched call's record in the store, and record its receipt
        (in the same transaction where the store journals receipts).

        Raises:
            StoreUnavailable: the record was not committed (and the receipt
                not recorded): the caller records an ``unknown`` one instead.
        """
        ...


@dataclass(frozen=True, slots=True)
class ChainError:
    """Where and why a receipt chain is broken (line numbers from 1)."""

    line: int
    problem: str


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as f:
        yield from enumerate(f, start=1)


def read_receipts(path: Path) -> Generator[tuple[int, dict[str, Any] | ChainError], None, None]:
    """Every receipt of a file with its line number (from 1), checking the
    chain as it reads.

    At the first break a :class:`ChainError` is yielded for that line, then
    the line itself if it is a receipt (a changed line still is one). Lines
    after the break are yielded if they are receipts, but no longer
    chain-checked: nothing ties them to the verified part.
    """
    check = ChainCheck()
    for number, raw in _lines(path):
        yield from check.line(number, raw)


@dataclass(slots=True)
class ChainCheck:
    """:func:`read_receipts`' check, a line at a time: what it keeps between
    lines is the hash the next one must name, so it can go on later."""

    #: The last line's ``hash``; ``None`` once the chain is broken.
    prev: str | None = GENESIS_HASH

    def line(self, number: int, raw: bytes) -> Iterator[tuple[int, dict[str, Any] | ChainError]]:
        """What line ``number`` yields (see :func:`read_receipts`)."""
        receipt: dict[str, Any] | None = None
        problem: str | None = None
        try:
            value = json.loads(raw)
        except ValueError:
            problem = "not valid JSON"
        else:
            if isinstance(value, dict) and set(value) == RECEIPT_FIELDS:
                receipt = value
                if self.prev is not None:
                    problem = _chain_problem(receipt, self.prev)
            else:
                problem = "not a receipt (fields differ)"
        if self.prev is not None:
            if problem is not None:
                yield number, ChainError(number, problem)
                self.prev = None
            else:
                assert receipt is not None
                self.prev = receipt["hash"]
        if receipt is not None:
            yield number, receipt


def _chain_problem(receipt: Mapping[str, Any], prev: str) -> str | None:
    if receipt["prev_hash"] != prev:
        return "prev_hash does not match the previous line (removed or reordered)"
    try:
        digest = receipt_digest({k: v for k, v in receipt.items() if k != "hash"})
    except ValueError:  # not I-JSON: no hostcall sealed it
        digest = None
    if digest != receipt["hash"]:
        return "hash does not match the content (changed)"
    return None


def verify_chain(path: Path) -> tuple[int, ChainError | None]:
    """Check a receipt file; returns the number of good lines and the first break."""
    count = 0
    with contextlib.closing(read_receipts(path)) as items:
        for _, item in items:
            if isinstance(item, ChainError):
                return count, item
            count += 1
    return count, None
