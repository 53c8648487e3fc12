"""Auditing a receipt file: its hash chain, then what it claims (docs/approvals.md).

The hash chain shows a file was not edited by someone who did not recompute
it. A writer who recomputes every hash (a hostile guest once did) passes it,
so the audit also checks what the receipts claim, by rules that hold for
every honest run:

1. **Well-formed.** Every line is a receipt hostcall writes: string ids, a
   known ``outcome``. (The chain check of :func:`~supervisor.receipts.read_receipts`
   comes first; lines after a break are still checked, since a changed line
   usually breaks more than the chain.)
2. **No double execution.** At most one ``executed`` or ``result_invalid``
   receipt per ``(invocation_id, call_id)``. Both mean the handler ran *and
   its record was committed* (the receipt is written with or after the
   commit), and a committed record is final: no store changes one
   (``commit``, ``mark_unknown`` and ``release`` act on ``pending`` rows,
   ``begin`` reruns only ``unknown`` ones), so a committed call is replayed,
   never run again. A reversible call that runs again after ``unknown``
   (the replay table, docs/protocol.md) leaves ``unknown`` then *one* ``executed``: it
   passes. An ``unknown`` receipt *between* two ``executed`` ones excuses
   nothing: it cannot undo the first commit. ``failed`` and ``unknown``
   receipts are not counted: a ``failed`` run left no effect and released
   its record (the call may run again), an ``unknown`` one may be followed
   by a rerun, and neither's place in the file proves the order of the runs
   (the receipt of a run that released its record can land after the next
   run's commit). The one honest way to get two: an invocation resumed on
   the memory store, which keeps no records across processes.
3. **Receipts agree with the effect records** (only given a store). Every
   ``executed``, ``result_invalid`` or ``replayed`` receipt needs the call's
   record ``committed``, with the receipt's tool and idempotency key, and the
   stored response must be the one the receipt describes: for ``ok``,
   ``result_sha256 = sha256(JCS(response["result"]))``; for a
   ``result_invalid`` error, ``result_sha256`` null; an ``executed``
   receipt needs an ``ok`` response and a ``result_invalid`` one the error.
4. **Every commit has its receipt** (only given a store). A ``committed``
   record needs an ``executed`` or ``result_invalid`` receipt. How sure
   that is depends on the store (:attr:`EffectsView.receipts_share_commit`):
   SQLite journals a commit's receipt in the commit's own transaction and
   completes the file from that journal at the next start
   (docs/guarantees.md), so a missing line means it was removed — an error.
   PostgreSQL writes the receipt after the commit, so a crash in between, or
   another replica having run the call (its receipt is in that replica's
   file), explains it — a warning.

Not checked: ``refused``, ``failed`` and ``unknown`` receipts against the
records. A released record's ``call_id`` may be used again with other
arguments, and a crash right after a release leaves no receipt, so no rule
about them holds without exceptions. So removing such a line, or a
``replayed`` one, goes unseen; so does an irreversible call run again after
someone deleted its ``unknown`` record (receipts do not say which tools are
reversible).

**Reading a live store.** The file is read first, then the records in one
read transaction: every receipt read was written after its commit, so the
records agree with it (rule 3). A commit the file does not show yet has its
line in the store's receipt journal (journaled in the commit's transaction,
read in the same snapshot), or the line reached the file before the journal
row was trimmed — so for the calls rule 4 would report, the file is read
once more (rule 4).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final, Literal, Protocol

from supervisor.canonical import jcs, sha256_hex
from supervisor.errors import StoreUnavailable
from supervisor.receipts import ChainCheck, ChainError, ReceiptOutcome, read_receipts
from supervisor.stores.base import EffectRecord, EffectStatus

__all__ = [
    "AuditCache",
    "EffectsSnapshot",
    "EffectsView",
    "Finding",
    "ReceiptAudit",
    "SQLiteEffectsView",
    "audit_receipts",
    "effects_for",
]

Severity = Literal["error", "warning"]

#: Receipt outcomes docs/approvals.md, "Receipts" names.
_OUTCOMES: Final = frozenset(set(ReceiptOutcome))
#: Outcomes that mean the handler ran and its record was committed.
_RAN: Final = frozenset({ReceiptOutcome.EXECUTED, ReceiptOutcome.RESULT_INVALID})
#: Outcomes that need a committed record (rule 3).
_NEEDS_COMMIT: Final = _RAN | {ReceiptOutcome.REPLAYED}

_Call = tuple[str, str]  # (invocation_id, call_id)
#: Files an :class:`AuditCache` remembers (the most recently audited).
AUDITS_KEPT: Final = 64
#: How much of a file is read at once to hash what was read before.
_REREAD_CHUNK: Final = 2**20

_COMPROMISED: Final = (
    "the effect store is the record of what ran — treat this state dir as tampered with"
)
_TAMPERED: Final = "the receipt or the effect record was changed after the call; " + _COMPROMISED
_FORGED: Final = "this line was forged or damaged"


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing an audit found wrong, and what it means."""

    severity: Severity
    #: ``chain``, ``malformed``, ``double_execution``, ``record_mismatch``,
    #: ``unreceipted_commit`` or ``not_in_store``.
    rule: str
    message: str
    #: The receipt's line (from 1); ``None`` when no line holds it.
    line: int | None = None


@dataclass(frozen=True, slots=True)
class ReceiptAudit:
    """What :func:`audit_receipts` found in one receipt file."""

    path: Path
    #: Lines that are receipts (all of them when the chain is intact).
    receipts: int
    chain_intact: bool
    #: What the receipts were compared with, or ``None``.
    checked_against: str | None
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """Whether nothing worse than a warning was found (exit 0)."""
        return all(f.severity == "warning" for f in self.findings)

    def lines(self) -> list[str]:
        """One line per finding, ``PATH: line N: …``, in file order."""
        out = []
        for finding in self.findings:
            where = f"line {finding.line}: " if finding.line is not None else ""
            tag = "warning: " if finding.severity == "warning" else ""
            out.append(f"{self.path}: {where}{tag}{finding.message}")
        return out

    def summary(self) -> str:
        """One line saying what was checked and how it went."""
        text = f"{self.path}: {self.receipts} receipt(s), hash chain "
        text += "intact" if self.chain_intact else "broken"
        if self.checked_against is not None:
            agreed = "agree" if self.ok else "disagree"
            text += f"; they {agreed} with {self.checked_against}"
        problems = sum(f.severity == "error" for f in self.findings)
        warnings = len(self.findings) - problems
        if problems:
            text += f"; {problems} problem(s)"
        if warnings:
            text += f"; {warnings} warning(s)"
        return text


@dataclass(frozen=True, slots=True)
class EffectsSnapshot:
    """Effect records as of one moment, for some invocations."""

    #: Those of the asked invocations the store knows.
    invocations: frozenset[str]
    records: Mapping[_Call, EffectRecord]
    #: Receipts committed with their calls but perhaps not in their file yet
    #: (SQLite's receipt journal); empty for stores without one.
    journaled: tuple[Mapping[str, Any], ...] = ()


class EffectsView(Protocol):
    """Read-only access to an effect store, for audits. Implementations read
    without a supervisor's help (one may be running) and change no record."""

    @property
    def source(self) -> str:
        """What is read, for messages (``the effect records in …``)."""
        ...

    @property
    def receipts_share_commit(self) -> bool:
        """Whether a commit and its receipt are recorded atomically (rule 4)."""
        ...

    def snapshot(self, invocation_ids: Collection[str]) -> EffectsSnapshot:
        """The records of these invocations, read in one consistent snapshot.

        Raises:
            StoreUnavailable: the store cannot be read.
        """
        ...


class SQLiteEffectsView:
    """The SQLite store's file, opened read-only (``mode=ro``, as
    ``hostcall calls`` reads it): SQLite's WAL lets it be read while a
    supervisor writes it. On a closed store SQLite may leave empty ``-wal``
    and ``-shm`` files beside it (with the database's mode); the next
    supervisor opens it as usual."""

    receipts_share_commit = True  # the receipt journal (supervisor/stores/journal.py)

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def source(self) -> str:
        return f"the effect records in {self.path}"

    def snapshot(self, invocation_ids: Collection[str]) -> EffectsSnapshot:
        from supervisor.stores import read_snapshot  # the store's own statements

        known, records, lines = read_snapshot(self.path, invocation_ids, _parsed)
        journaled = [
            receipt
            for line in lines
            if (receipt := _parsed(line)) is not None and receipt.get("invocation_id") in known
        ]
        return EffectsSnapshot(
            known, {(r.invocation_id, r.call_id): r for r in records}, tuple(journaled)
        )


def _parsed(text: str | bytes | None) -> Mapping[str, Any] | None:
    """A stored JSON object; ``None`` when there is none or it is not one
    (rule 3 then reports the record's response as unreadable)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def effects_for(receipts_file: Path, state_dir: Path | None) -> SQLiteEffectsView | None:
    """The store to check ``receipts_file`` against: ``state_dir``'s when
    given, else the one beside the file (``<dir>/receipts/FILE`` next to
    ``<dir>/effects.db``), else ``None``.

    Raises:
        StoreUnavailable: ``state_dir`` was given but holds no SQLite store.
    """
    if state_dir is not None:
        db = state_dir / "effects.db"
        if not db.is_file():
            raise StoreUnavailable(
                f"no effect store to check against: {db} does not exist "
                "(only the default SQLite store can be read offline)"
            )
        return SQLiteEffectsView(db)
    folder = receipts_file.absolute().parent
    db = folder.parent / "effects.db"
    if folder.name == "receipts" and db.is_file():
        return SQLiteEffectsView(db)
    return None


@dataclass(frozen=True, slots=True)
class _Claim:
    """A receipt that says a record was committed (rule 3)."""

    line: int
    call: _Call
    outcome: str
    tool: str | None
    key: str | None
    result_sha256: str | None


@dataclass(slots=True)
class _Reading:
    """What the audit keeps of a receipt file, read once, and where it got to."""

    receipts: int = 0
    chain: ChainError | None = None
    invocations: set[str] = field(default_factory=set)
    claims: list[_Claim] = field(default_factory=list)
    #: Each call's first executed or result_invalid receipt: its line and outcome.
    ran: dict[_Call, tuple[int, str]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    #: The chain's state after the whole lines read, how many, their bytes
    #: and the sha256 of those bytes (:class:`AuditCache`).
    check: ChainCheck = field(default_factory=ChainCheck)
    lines: int = 0
    offset: int = 0
    digest: Any = field(default_factory=hashlib.sha256)

    def copy(self) -> _Reading:
        """A copy to go on from, sharing nothing that changes."""
        return _Reading(
            self.receipts,
            self.chain,
            set(self.invocations),
            list(self.claims),
            dict(self.ran),
            list(self.findings),
            ChainCheck(self.check.prev),
            self.lines,
            self.offset,
            self.digest.copy(),
        )

    def read(self, raw: bytes) -> None:
        """The next line, ``raw`` (with its newline, but for a last line
        still being written)."""
        for line, item in self.check.line(self.lines + 1, raw):
            if isinstance(item, ChainError):
                self.chain = item
                continue
            self.receipts += 1
            problem = _malformed(item)
            if problem is not None:
                self.findings.append(Finding("error", "malformed", problem, line))
                continue
            call_id = item["call_id"]
            self.invocations.add(item["invocation_id"])
            outcome = item["outcome"]
            if call_id is None or outcome not in _NEEDS_COMMIT:
                continue
            call = (item["invocation_id"], call_id)
            self.claims.append(
                _Claim(
                    line,
                    call,
                    outcome,
                    item["tool"],
                    item["idempotency_key"],
                    item["result_sha256"],
                )
            )
            if outcome in _RAN:
                first = self.ran.setdefault(call, (line, outcome))
                if first[0] != line:
                    self.findings.append(_double_execution(call, item["tool"], first, line))
        self.lines += 1
        self.offset += len(raw)
        self.digest.update(raw)


class AuditCache:
    """Where audits of receipt files got to, so that the next audit of a file
    that has only grown reads its new lines alone.

    The lines read before are read again and hashed (sha256, in C), and the
    audit goes on from where it stopped only if they are the very bytes it
    read: a line changed, removed or inserted since is seen as if the file
    were read afresh. The effect records are read afresh every time. For a
    process that audits the same files again and again (the admin API's
    receipt worker); not thread-safe.
    """

    def __init__(self, files: int = AUDITS_KEPT) -> None:
        self._files = files
        self._kept: collections.OrderedDict[Path, _Reading] = collections.OrderedDict()

    def resume(self, path: Path, f: BinaryIO) -> _Reading | None:
        """A copy of what was read of ``path``, with ``f`` just past it; or
        ``None``, with ``f`` at the start, when the file is not as it was."""
        kept = self._kept.get(path)
        if kept is None:
            return None
        digest, left = hashlib.sha256(), kept.offset
        while left and (chunk := f.read(min(left, _REREAD_CHUNK))):
            digest.update(chunk)
            left -= len(chunk)
        if left or digest.digest() != kept.digest.digest():
            del self._kept[path]
            f.seek(0)
            return None
        self._kept.move_to_end(path)
        return kept.copy()

    def keep(self, path: Path, reading: _Reading) -> None:
        """Remember ``reading`` (a copy) of ``path``."""
        self._kept[path] = reading.copy()
        self._kept.move_to_end(path)
        while len(self._kept) > self._files:
            self._kept.popitem(last=False)


def audit_receipts(
    path: Path, *, effects: EffectsView | None = None, cache: AuditCache | None = None
) -> ReceiptAudit:
    """Check a receipt file's chain and rules 1-2, and with ``effects`` rules 3-4
    (see the module docstring); with ``cache``, going on from where the last
    audit of the file stopped, if the file only grew since.

    Raises:
        OSError: the file cannot be read.
        StoreUnavailable: ``effects`` cannot be read.
    """
    reading = _read(path, cache)
    findings = reading.findings
    if effects is not None:
        stem = path.name.removesuffix(".jsonl") if path.name.endswith(".jsonl") else None
        asked = reading.invocations | ({stem} if stem else set())
        snapshot = effects.snapshot(asked)
        for invocation_id in sorted(reading.invocations - snapshot.invocations):
            findings.append(_not_in_store(invocation_id, effects))
        findings.extend(_against_records(reading.claims, snapshot, effects))
        findings.extend(_unreceipted(path, reading, snapshot, effects))
    if reading.chain is not None:
        chain = reading.chain
        problem = f"{chain.problem} ({chain.line - 1} receipt(s) before it verified)"
        findings.append(Finding("error", "chain", problem, chain.line))
    findings.sort(key=lambda f: (f.line is None, f.line or 0, f.rule != "chain"))
    return ReceiptAudit(
        path,
        reading.receipts,
        reading.chain is None,
        effects.source if effects is not None else None,
        tuple(findings),
    )


def _read(path: Path, cache: AuditCache | None) -> _Reading:
    with path.open("rb") as f:
        reading = cache.resume(path, f) if cache is not None else None
        if reading is None:
            reading = _Reading()
        tail = None
        for raw in f:
            if not raw.endswith(b"\n"):  # the last line, still being written
                tail = raw
                break
            reading.read(raw)
        if cache is not None:
            cache.keep(path, reading)  # whole lines only: the tail is read again
        if tail is not None:
            reading.read(tail)
    return reading


def _malformed(receipt: Mapping[str, Any]) -> str | None:
    """Why a receipt is not one hostcall writes (rule 1), or ``None``."""
    if not isinstance(receipt["invocation_id"], str):
        return "not a receipt hostcall writes: invocation_id is not a string; " + _FORGED
    for name in ("call_id", "tool", "idempotency_key", "result_sha256"):
        if not isinstance(receipt[name], str | None):
            return f"not a receipt hostcall writes: {name} is not a string; " + _FORGED
    outcome = receipt["outcome"]
    if not isinstance(outcome, str) or outcome not in _OUTCOMES:
        return f"not a receipt hostcall writes: outcome {receipt['outcome']!r}; " + _FORGED
    return None


def _double_execution(call: _Call, tool: str | None, first: tuple[int, str], again: int) -> Finding:
    return Finding(
        "error",
        "double_execution",
        f"call {call[1]} ({tool}) of {call[0]} ran twice: line {first[0]} already recorded "
        f"it {first[1]}, and a committed call is only ever replayed — whatever receipts lie "
        "between. Either its handler really ran again (check your backend for its "
        "idempotency_key) or one of these lines was forged; only an invocation resumed on "
        "the memory store, which keeps no records across processes, does this honestly",
        again,
    )


def _not_in_store(invocation_id: str, effects: EffectsView) -> Finding:
    return Finding(
        "warning",
        "not_in_store",
        f"invocation {invocation_id} is not in {effects.source}, so its receipts were not "
        "cross-checked: it ran on another store (--store memory, sqlite:///…, postgresql://…) "
        "— or its records were deleted",
    )


def _against_records(
    claims: Iterable[_Claim], snapshot: EffectsSnapshot, effects: EffectsView
) -> Iterator[Finding]:
    """Rule 3: what executed, result_invalid and replayed receipts claim."""
    for claim in claims:
        if claim.call[0] not in snapshot.invocations:
            continue  # reported once, by _not_in_store
        problem = _disagreement(claim, snapshot.records.get(claim.call))
        if problem is not None:
            yield Finding(
                "error",
                "record_mismatch",
                f"{claim.outcome} receipt of call {claim.call[1]} ({claim.tool}): {problem} "
                f"in {effects.source}; {_TAMPERED}",
                claim.line,
            )


def _disagreement(claim: _Claim, record: EffectRecord | None) -> str | None:
    if record is None:
        return "there is no effect record"
    if record.status is not EffectStatus.COMMITTED:
        return f"the effect record is {record.status.value}, not committed"
    if (record.tool, record.idempotency_key) != (claim.tool, claim.key):
        return (
            f"the effect record is of {record.tool} with idempotency_key "
            f"{record.idempotency_key}, not {claim.key}"
        )
    stored = _stored_outcome(record.response)
    if stored is None:
        return "the stored response is unreadable"
    outcome, digest = stored
    if claim.outcome != "replayed" and claim.outcome != outcome:
        return f"the stored response is {outcome}"
    if claim.result_sha256 != digest:
        return f"result_sha256 {claim.result_sha256} is not the stored result's ({digest})"
    return None


def _stored_outcome(response: Mapping[str, Any] | None) -> tuple[str, str | None] | None:
    """What a committed response says ran: ``executed`` with the sha256 of its
    result's JCS, or ``result_invalid`` (the error is stored, no result).
    ``None``: not a response a commit stores."""
    if response is None:
        return None
    if response.get("status") == "ok":
        try:
            return "executed", sha256_hex(jcs(response.get("result")))
        except ValueError:
            return None
    error = response.get("error")
    if isinstance(error, Mapping) and error.get("code") == "result_invalid":
        return "result_invalid", None
    return None


def _unreceipted(
    path: Path, reading: _Reading, snapshot: EffectsSnapshot, effects: EffectsView
) -> Iterator[Finding]:
    """Rule 4: committed records with no executed or result_invalid receipt."""
    receipted = set(reading.ran) | _ran_in(snapshot.journaled)
    missing = [
        record
        for call, record in sorted(snapshot.records.items())
        if record.status is EffectStatus.COMMITTED and call not in receipted
    ]
    if missing:
        # Committed after the file was read, its line written and the journal
        # trimmed before the snapshot: the file has it now.
        with contextlib.closing(read_receipts(path)) as items:
            receipted |= _ran_in(r for _, r in items if not isinstance(r, ChainError))
    for record in missing:
        if (record.invocation_id, record.call_id) in receipted:
            continue
        what = f"call {record.call_id} ({record.tool}) is committed in {effects.source}"
        if effects.receipts_share_commit:
            yield Finding(
                "error",
                "unreceipted_commit",
                f"{what}, but no executed or result_invalid receipt records it. This store "
                "writes a commit and its receipt in one transaction and restores the line "
                "after a crash, so the line was removed or the file replaced (lines the "
                f"store could not append are kept in {path.name}.unchained); {_COMPROMISED}",
            )
        else:
            yield Finding(
                "warning",
                "unreceipted_commit",
                f"{what}, but no executed or result_invalid receipt in this file records "
                "it: with this store a crash between the commit and its receipt does this, "
                "as does another replica having run the call (look in its receipt file)",
            )


def _ran_in(receipts: Iterable[Mapping[str, Any]]) -> set[_Call]:
    calls: set[_Call] = set()
    for receipt in receipts:
        invocation_id, call_id = receipt.get("invocation_id"), receipt.get("call_id")
        ran = receipt.get("outcome") in _RAN
        if ran and isinstance(invocation_id, str) and isinstance(call_id, str):
            calls.add((invocation_id, call_id))
    return calls
