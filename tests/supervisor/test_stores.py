"""The EffectStore contract (SPEC §6), run against every implementation.

One conformance suite, in the manner of Trio's ``check_two_way_stream``: each
backend below is a small adapter that knows how to make a store, how to make
a second instance on the same storage (PostgreSQL's replicas; SQLite refuses
one) and how to "restart" it; every contract
test runs once per backend through the parametrized ``backend`` fixture. The
PostgreSQL backend runs against a real server, in a schema of each test's own
(tests/postgres_support.py says where the server comes from); what only it
promises (leases, replicas, migrations) is in test_postgres_store.py.

The tests after the contract section check what only the SQLite store
promises: durability across a real reopen, one ``open()`` per instance,
group commit that isolates a failing operation, and driver errors as
``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar

import pytest

from supervisor.budget import BudgetLimits
from supervisor.errors import StoreUnavailable
from supervisor.stores import (
    Charge,
    EffectRecord,
    EffectStatus,
    EffectStore,
    InvocationRecord,
    MemoryEffectStore,
    NotPending,
    PostgresEffectStore,
    SQLiteEffectStore,
    StartCall,
)
from tests.harness import wait_until
from tests.postgres_support import with_options

#: Upper bound for any one step of a test; every await runs under it.
STEP_S = 10.0
INV = "inv_1"
KEY = "k" * 64


# -- backends -------------------------------------------------------------------


class Backend:
    """How the suite makes, shares and restarts one kind of store."""

    name: ClassVar[str]
    #: Whether two instances see the same records (several processes or hosts).
    shared: ClassVar[bool]

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self._opened: list[EffectStore] = []

    @classmethod
    def for_test(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
        """This backend for one test (fixtures it needs come from ``request``)."""
        return cls(tmp_path)

    def make(self) -> EffectStore:
        """A new, unopened instance on this backend's storage."""
        raise NotImplementedError

    async def open_new(self) -> EffectStore:
        """A new instance, opened; closed when the test ends."""
        store = self.make()
        self._opened.append(store)
        await store.open()
        return store

    async def restart(self, store: EffectStore) -> tuple[EffectStore, int]:
        """What a supervisor restart does: close, open again; the ``open()`` count too."""
        await store.close()
        fresh = self.make()
        self._opened.append(fresh)
        return fresh, await fresh.open()

    async def close_all(self) -> None:
        for store in self._opened:
            await store.close()


class MemoryBackend(Backend):
    name = "memory"
    shared = False

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self._store = MemoryEffectStore()

    def make(self) -> EffectStore:
        # Its storage is the instance itself: "another instance" is the same one.
        return self._store

    async def restart(self, store: EffectStore) -> tuple[EffectStore, int]:
        # Nothing outlives the process; what a restart can show is open()'s recovery.
        return store, await store.open()


class SQLiteBackend(Backend):
    name = "sqlite"
    shared = True

    def make(self) -> EffectStore:
        return SQLiteEffectStore(self.tmp_path / "effects.db")


class SQLiteMixedBackend(SQLiteBackend):
    """SQLite with every other operation run inline, on the caller's thread
    (what the supervisor does when one request is all it serves), the rest
    by the writer thread: the two paths interleave on one connection."""

    name = "sqlite-mixed"

    def make(self) -> EffectStore:
        store = SQLiteEffectStore(self.tmp_path / "effects.db")
        turns = itertools.cycle((True, False))
        store.set_load_hint(lambda: 1 if next(turns) else 2)
        return store


class PostgresBackend(Backend):
    name = "postgres"
    shared = True

    def __init__(self, tmp_path: Path, dsn: str) -> None:
        super().__init__(tmp_path)
        self.dsn = dsn

    @classmethod
    def for_test(cls, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
        dsn: str = request.getfixturevalue("postgres_dsn")
        schema: str = request.getfixturevalue("postgres_schema")
        return cls(tmp_path, with_options(dsn, schema=schema))

    def make(self) -> EffectStore:
        # Each instance is a replica of its own: a restart is a new replica,
        # and close() hands back the lease, so open() recovers the old rows.
        return PostgresEffectStore(self.dsn)


_POSTGRES = pytest.param(PostgresBackend, marks=pytest.mark.postgres, id="postgres")
BACKENDS: list[Any] = [MemoryBackend, SQLiteBackend, SQLiteMixedBackend, _POSTGRES]


@pytest.fixture(params=BACKENDS, ids=lambda kind: kind.name)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    made: Backend = request.param.for_test(request, tmp_path)
    try:
        yield made
    finally:
        async with asyncio.timeout(STEP_S):
            await made.close_all()


# Backends whose instances share their records (several processes or hosts).
# Not SQLite: one supervisor per database, a second store on it is refused
# (test_sqlite_a_second_store_on_one_database_is_refused_until_the_first_closes).
SHARED_BACKENDS: list[Any] = [_POSTGRES]


@pytest.fixture(params=SHARED_BACKENDS, ids=lambda kind: kind.name)
async def shared_backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    made: Backend = request.param.for_test(request, tmp_path)
    assert made.shared
    try:
        yield made
    finally:
        async with asyncio.timeout(STEP_S):
            await made.close_all()


@pytest.fixture
async def store(backend: Backend) -> EffectStore:
    async with asyncio.timeout(STEP_S):
        opened = await backend.open_new()
        await opened.open_invocation(INV, "sha256:" + "0" * 64, None, 0.0)
        return opened


def start(
    call_id: str = "c1",
    *,
    tool: str = "charge",
    key: str = KEY,
    execution: str = "exe_1",
    reversible: bool = False,
    invocation: str = INV,
) -> StartCall:
    return StartCall(invocation, call_id, tool, key, execution, reversible)


async def unknown_record(store: EffectStore, call_id: str = "c1", **kwargs: Any) -> EffectRecord:
    """A record whose outcome is in doubt, made the way the broker makes one."""
    assert (await store.begin(start(call_id, **kwargs), 1.0)).won
    await store.mark_unknown(INV, call_id, 2.0)
    record = await store.get(INV, call_id)
    assert record is not None
    assert record.status is EffectStatus.UNKNOWN
    return record


RESPONSE = {"status": "ok", "call_id": "c1", "effect": "executed", "result": {"ids": [1, "x"]}}


# -- begin --------------------------------------------------------------------------


async def test_begin_inserts_a_pending_record_and_wins(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        begun = await store.begin(start(), 5.0)
        stored = await store.get(INV, "c1")

    assert begun.won is True
    assert begun.record == stored
    assert begun.record == EffectRecord(
        INV, "c1", "charge", KEY, EffectStatus.PENDING, "exe_1", None, 5.0, 5.0
    )


async def test_begin_on_an_existing_record_returns_it_unchanged_and_loses(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        first = await store.begin(start(), 1.0)
        again = await store.begin(start(execution="exe_2"), 2.0)
        reversible_again = await store.begin(start(execution="exe_3", reversible=True), 3.0)

    assert first.won is True
    assert again.won is False
    assert again.record == first.record  # still exe_1's, still created at 1.0
    assert reversible_again.won is False  # pending is running now, even for a reversible tool
    assert reversible_again.record == first.record


async def test_begin_on_a_committed_record_returns_it_with_its_response(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        await store.begin(start(), 1.0)
        await store.commit(INV, "c1", RESPONSE, 2.0)
        before = await store.get(INV, "c1")
        for reversible in (False, True):
            again = await store.begin(start(execution="exe_2", reversible=reversible), 3.0)
            assert again.won is False
            assert again.record == before
        assert await store.get(INV, "c1") == before


async def test_begin_turns_unknown_back_into_pending_for_a_reversible_tool(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        await unknown_record(store)
        begun = await store.begin(start(execution="exe_2", reversible=True), 9.0)
        stored = await store.get(INV, "c1")

    assert begun.won is True
    assert begun.record == stored
    assert begun.record.status is EffectStatus.PENDING
    assert begun.record.execution_id == "exe_2"
    assert (begun.record.created_at, begun.record.updated_at) == (1.0, 9.0)


async def test_begin_leaves_unknown_alone_for_a_tool_that_is_not_reversible(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        before = await unknown_record(store)
        begun = await store.begin(start(execution="exe_2", reversible=False), 9.0)

        assert begun.won is False
        assert begun.record == before
        assert await store.get(INV, "c1") == before


@pytest.mark.parametrize(
    "other", [{"tool": "refund"}, {"key": "z" * 64}], ids=["other-tool", "other-key"]
)
async def test_begin_leaves_unknown_alone_when_tool_or_key_differ(
    store: EffectStore, other: dict[str, str]
) -> None:
    async with asyncio.timeout(STEP_S):
        before = await unknown_record(store)
        begun = await store.begin(start(execution="exe_2", reversible=True, **other), 9.0)

        assert begun.won is False
        assert begun.record == before
        assert await store.get(INV, "c1") == before


async def test_records_are_keyed_by_invocation_and_call_id(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        await store.open_invocation("inv_2", "sha256:" + "0" * 64, None, 0.0)
        a = await store.begin(start("c1"), 1.0)
        b = await store.begin(start("c1", invocation="inv_2"), 1.0)
        c = await store.begin(start("c2"), 1.0)

        assert (a.won, b.won, c.won) == (True, True, True)
        assert await store.get("inv_2", "c2") is None
        assert await store.get("inv_nope", "c1") is None


async def test_exactly_one_of_many_concurrent_begins_wins(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        results = await asyncio.gather(
            *(store.begin(start(execution=f"exe_{i}"), float(i)) for i in range(50))
        )

    winners = [r for r in results if r.won]
    assert len(winners) == 1
    assert {r.record for r in results} == {winners[0].record}


async def test_exactly_one_of_many_concurrent_reversible_retries_of_an_unknown_wins(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        await unknown_record(store)
        results = await asyncio.gather(
            *(
                store.begin(start(execution=f"exe_{i}", reversible=True), 10.0 + i)
                for i in range(50)
            )
        )
        stored = await store.get(INV, "c1")

    winners = [r for r in results if r.won]
    assert len(winners) == 1
    assert winners[0].record == stored
    assert all(r.record == stored for r in results)


async def test_exactly_one_begin_wins_across_two_instances_in_two_threads(
    shared_backend: Backend,
) -> None:
    backend = shared_backend
    calls = [f"c{i}" for i in range(20)]
    # Both stores are open before either begins: a later open() would turn the
    # other's pending rows unknown, as it must after a crash.
    both_open = threading.Barrier(2, timeout=STEP_S)

    async def race(execution: str) -> list[str]:
        instance = backend.make()
        await instance.open()
        try:
            await instance.open_invocation(INV, "sha256:" + "0" * 64, None, 0.0)
            await asyncio.to_thread(both_open.wait)
            results = await asyncio.gather(
                *(instance.begin(start(c, execution=execution), 1.0) for c in calls)
            )
            return [r.record.call_id for r in results if r.won]
        finally:
            await instance.close()

    def in_own_loop(execution: str) -> list[str]:
        async def bounded() -> list[str]:
            async with asyncio.timeout(STEP_S):
                return await race(execution)

        return asyncio.run(bounded())

    async with asyncio.timeout(STEP_S * 2):
        won_a, won_b = await asyncio.gather(
            asyncio.to_thread(in_own_loop, "exe_a"), asyncio.to_thread(in_own_loop, "exe_b")
        )
        check = await backend.open_new()
        records = {c: await check.get(INV, c) for c in calls}

    assert sorted(won_a + won_b) == sorted(calls)  # each call won once, by one of them
    for call_id, record in records.items():
        assert record is not None
        assert record.execution_id == ("exe_a" if call_id in won_a else "exe_b")


# -- begin with a charge: the budget taken in the same atomic step ----------------------


def charge(limits: BudgetLimits, cost: float = 2.0, deadline_at: float | None = None) -> Charge:
    return Charge("charge", cost, limits, deadline_at)


async def used(store: EffectStore) -> tuple[int, float, dict[str, int]]:
    record = await store.get_invocation(INV)
    assert record is not None
    return record.used.calls, record.used.cost, dict(record.used.tool_calls or {})


async def test_begin_with_a_charge_takes_it_in_the_same_step_as_the_insert(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        begun = await store.begin(start(), 1.0, charge(BudgetLimits(max_calls=5)))
        spent = await used(store)

    assert (begun.won, begun.exhausted) == (True, None)
    assert begun.record is not None and begun.record.status is EffectStatus.PENDING
    assert spent == (1, 2.0, {"charge": 1})


@pytest.mark.parametrize(
    ("limits", "deadline_at", "why"),
    [
        pytest.param(BudgetLimits(max_calls=1), None, "limits", id="max_calls"),
        pytest.param(BudgetLimits(max_cost=3), None, "limits", id="max_cost"),
        pytest.param(BudgetLimits(tool_max_calls={"charge": 1}), None, "limits", id="tool"),
        pytest.param(BudgetLimits(), 5.0, "deadline", id="deadline"),
    ],
)
async def test_begin_with_a_charge_that_does_not_fit_inserts_nothing_and_says_why(
    store: EffectStore, limits: BudgetLimits, deadline_at: float | None, why: str
) -> None:
    async with asyncio.timeout(STEP_S):
        first = await store.begin(start("c1"), 1.0, charge(limits, deadline_at=deadline_at))
        before = await used(store)
        refused = await store.begin(start("c2"), 5.0, charge(limits, deadline_at=deadline_at))
        after = await used(store)
        missing = await store.get(INV, "c2")

    assert first.won
    assert (refused.won, refused.record, refused.exhausted) == (False, None, why)
    assert missing is None
    assert after == before


@pytest.mark.parametrize(
    "limits", [BudgetLimits(), BudgetLimits(max_calls=5)], ids=["no limits", "limits"]
)
async def test_begin_with_a_charge_for_an_invocation_never_opened_inserts_nothing(
    store: EffectStore, limits: BudgetLimits
) -> None:
    stranger = StartCall("inv_never", "c1", "charge", KEY, "exe_1", reversible=False)
    async with asyncio.timeout(STEP_S):
        refused = await store.begin(stranger, 1.0, charge(limits))
        missing = await store.get("inv_never", "c1")
        invocation = await store.get_invocation("inv_never")

    assert (refused.won, refused.record, refused.exhausted) == (False, None, "limits")
    assert missing is None
    assert invocation is None


async def test_begin_with_a_charge_for_a_call_that_has_a_record_takes_nothing(
    store: EffectStore,
) -> None:
    limits = BudgetLimits(max_calls=5)
    async with asyncio.timeout(STEP_S):
        first = await store.begin(start(), 1.0, charge(limits))
        again = await store.begin(start(execution="exe_2"), 2.0, charge(limits))
        spent = await used(store)

    assert (again.won, again.record, again.exhausted) == (False, first.record, None)
    assert spent == (1, 2.0, {"charge": 1})


async def test_a_reversible_rerun_of_an_unknown_call_is_charged_again_or_left_unknown(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        unknown = await unknown_record(store, reversible=True)  # begun without a charge
        tight = await store.begin(
            start(execution="exe_2", reversible=True), 3.0, charge(BudgetLimits(max_calls=0))
        )
        rerun = await store.begin(
            start(execution="exe_3", reversible=True), 4.0, charge(BudgetLimits(max_calls=1))
        )
        spent = await used(store)

    assert (tight.won, tight.record, tight.exhausted) == (False, unknown, "limits")
    assert rerun.won
    assert rerun.record is not None and rerun.record.execution_id == "exe_3"
    assert spent == (1, 2.0, {"charge": 1})


async def test_concurrent_begins_with_charges_cannot_overspend_and_losers_take_nothing(
    store: EffectStore,
) -> None:
    limits = BudgetLimits(max_calls=10)
    async with asyncio.timeout(STEP_S):
        distinct = await asyncio.gather(
            *(store.begin(start(f"c{i}"), 1.0, charge(limits, cost=0)) for i in range(30))
        )
        same = await asyncio.gather(
            *(store.begin(start("same"), 1.0, charge(BudgetLimits(), cost=0)) for _ in range(30))
        )
        spent = await used(store)

    assert sum(b.won for b in distinct) == 10
    assert {b.exhausted for b in distinct if not b.won} == {"limits"}
    assert sum(b.won for b in same) == 1
    assert spent[0] == 11


async def test_begins_with_charges_from_two_instances_in_two_threads_cannot_overspend(
    shared_backend: Backend,
) -> None:
    backend = shared_backend
    calls = [f"c{i}" for i in range(20)]
    limits = BudgetLimits(max_calls=15)
    both_open = threading.Barrier(2, timeout=STEP_S)

    async def race(execution: str) -> list[str]:
        instance = backend.make()
        await instance.open()
        try:
            await asyncio.to_thread(both_open.wait)
            results = await asyncio.gather(
                *(instance.begin(start(c, execution=execution), 1.0, charge(limits)) for c in calls)
            )
            return [c for c, r in zip(calls, results, strict=True) if r.won]
        finally:
            await instance.close()

    def in_own_loop(execution: str) -> list[str]:
        async def bounded() -> list[str]:
            async with asyncio.timeout(STEP_S):
                return await race(execution)

        return asyncio.run(bounded())

    async with asyncio.timeout(STEP_S * 2):
        check = await backend.open_new()  # storage exists before the two instances open
        await check.open_invocation(INV, "sha256:" + "0" * 64, None, 0.0)
        won_a, won_b = await asyncio.gather(
            asyncio.to_thread(in_own_loop, "exe_a"), asyncio.to_thread(in_own_loop, "exe_b")
        )
        spent = await used(check)

    assert len(won_a) + len(won_b) == 15
    assert not set(won_a) & set(won_b)  # no call won twice
    assert spent == (15, 30.0, {"charge": 15})


# -- commit, mark_unknown, release -----------------------------------------------------


async def test_commit_stores_the_response_of_a_pending_record(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        await store.begin(start(), 1.0)
        await store.commit(INV, "c1", RESPONSE, 2.0)
        record = await store.get(INV, "c1")

    assert record is not None
    assert record.status is EffectStatus.COMMITTED
    assert record.response == RESPONSE
    assert (record.created_at, record.updated_at) == (1.0, 2.0)


async def test_mark_unknown_records_doubt_about_a_pending_record(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        await store.begin(start(), 1.0)
        await store.mark_unknown(INV, "c1", 2.0)
        record = await store.get(INV, "c1")

    assert record is not None
    assert (record.status, record.response, record.updated_at) == (EffectStatus.UNKNOWN, None, 2.0)


async def test_release_deletes_a_pending_record_so_the_call_may_begin_again(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        await store.begin(start(), 1.0)
        await store.release(INV, "c1")
        gone = await store.get(INV, "c1")
        again = await store.begin(start(execution="exe_2"), 3.0)

    assert gone is None
    assert again.won is True
    assert (again.record.execution_id, again.record.created_at) == ("exe_2", 3.0)


def _commit(store: EffectStore) -> Coroutine[Any, Any, None]:
    return store.commit(INV, "c1", {"status": "late"}, 50.0)


def _mark_unknown(store: EffectStore) -> Coroutine[Any, Any, None]:
    return store.mark_unknown(INV, "c1", 50.0)


def _release(store: EffectStore) -> Coroutine[Any, Any, None]:
    return store.release(INV, "c1")


async def _to_committed(store: EffectStore) -> None:
    await store.begin(start(), 1.0)
    await store.commit(INV, "c1", RESPONSE, 2.0)


async def _to_unknown(store: EffectStore) -> None:
    await unknown_record(store)


async def _settle(
    store: EffectStore, settle: Callable[[EffectStore], Coroutine[Any, Any, None]]
) -> None:
    """``settle`` a call whose record is not pending: a commit says so (the
    broker must not answer ``executed``), the others leave it be."""
    if settle is _commit:
        with pytest.raises(NotPending):
            await settle(store)
    else:
        await settle(store)


@pytest.mark.parametrize("settle", [_commit, _mark_unknown, _release])
@pytest.mark.parametrize("prepare", [_to_committed, _to_unknown], ids=["committed", "unknown"])
async def test_commit_mark_unknown_and_release_act_only_on_pending_records(
    store: EffectStore,
    prepare: Callable[[EffectStore], Coroutine[Any, Any, None]],
    settle: Callable[[EffectStore], Coroutine[Any, Any, None]],
) -> None:
    async with asyncio.timeout(STEP_S):
        await prepare(store)
        before = await store.get(INV, "c1")
        await _settle(store, settle)
        after = await store.get(INV, "c1")

    assert before is not None
    assert after == before


@pytest.mark.parametrize("settle", [_commit, _mark_unknown, _release])
async def test_settling_a_call_that_has_no_record_creates_none(
    store: EffectStore, settle: Callable[[EffectStore], Coroutine[Any, Any, None]]
) -> None:
    async with asyncio.timeout(STEP_S):
        await _settle(store, settle)
        assert await store.get(INV, "c1") is None
        assert await store.calls(INV) == []


async def test_calls_lists_an_invocations_records_oldest_first(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        await store.open_invocation("inv_2", "sha256:" + "0" * 64, None, 0.0)
        for now, call_id in [(3.0, "a"), (1.0, "z"), (2.0, "m"), (4.0, "gone")]:
            await store.begin(start(call_id), now)
        await store.begin(start("other", invocation="inv_2"), 0.5)
        await store.commit(INV, "m", RESPONSE, 5.0)
        await store.mark_unknown(INV, "a", 5.0)
        await store.release(INV, "gone")
        listed = await store.calls(INV)

    assert [(r.call_id, r.status) for r in listed] == [
        ("z", EffectStatus.PENDING),
        ("m", EffectStatus.COMMITTED),
        ("a", EffectStatus.UNKNOWN),
    ]
    assert listed[1].response == RESPONSE


async def test_calls_of_an_invocation_without_records_is_empty(store: EffectStore) -> None:
    async with asyncio.timeout(STEP_S):
        assert await store.calls(INV) == []
        assert await store.calls("inv_never") == []


# -- invocations ------------------------------------------------------------------------


async def test_open_invocation_creates_once_then_returns_the_existing_one(
    backend: Backend,
) -> None:
    async with asyncio.timeout(STEP_S):
        store = await backend.open_new()
        created, was_created = await store.open_invocation("inv_a", "sha256:aa", 100.0, 1.0)
        again, created_again = await store.open_invocation("inv_a", "sha256:bb", None, 2.0)
        fetched = await store.get_invocation("inv_a")
        missing = await store.get_invocation("inv_missing")

    assert (was_created, created_again) == (True, False)
    assert (created.invocation_id, created.plan_hash) == ("inv_a", "sha256:aa")
    assert (created.created_at, created.deadline_at) == (1.0, 100.0)
    assert (created.used.calls, created.used.cost, dict(created.used.tool_calls or {})) == (
        0,
        0.0,
        {},
    )
    assert again == created  # the first plan and deadline stand
    assert fetched == created
    assert missing is None


async def test_list_invocations_returns_them_oldest_first(backend: Backend) -> None:
    async with asyncio.timeout(STEP_S):
        store = await backend.open_new()
        for now, invocation in [(2.0, "inv_b"), (1.0, "inv_c"), (3.0, "inv_a")]:
            await store.open_invocation(invocation, "sha256:x", None, now)
        listed = await store.list_invocations()

    assert [i.invocation_id for i in listed] == ["inv_c", "inv_b", "inv_a"]


# -- budgets ------------------------------------------------------------------------------


async def test_reserve_takes_calls_until_max_calls_then_refuses(store: EffectStore) -> None:
    limits = BudgetLimits(max_calls=3)
    async with asyncio.timeout(STEP_S):
        taken = [await store.reserve(INV, "charge", 1.0, limits) is not None for _ in range(5)]
        record = await store.get_invocation(INV)

    assert taken == [True, True, True, False, False]
    assert record is not None
    assert (record.used.calls, record.used.cost) == (3, 3.0)
    assert dict(record.used.tool_calls or {}) == {"charge": 3}


async def test_reserve_respects_max_cost(store: EffectStore) -> None:
    limits = BudgetLimits(max_cost=25)
    async with asyncio.timeout(STEP_S):
        taken = [await store.reserve(INV, "charge", 10, limits) is not None for _ in range(3)]
        free = await store.reserve(INV, "lookup", 0, limits) is not None
        cheap = await store.reserve(INV, "lookup", 5, limits) is not None
        over = await store.reserve(INV, "lookup", 0.5, limits) is not None

    assert taken == [True, True, False]
    assert (free, cheap, over) == (True, True, False)


async def test_reserve_respects_a_per_tool_max_calls(store: EffectStore) -> None:
    limits = BudgetLimits(max_calls=10, tool_max_calls={"charge": 2})
    async with asyncio.timeout(STEP_S):
        charges = [await store.reserve(INV, "charge", 0, limits) is not None for _ in range(3)]
        lookups = [await store.reserve(INV, "lookup", 0, limits) is not None for _ in range(3)]
        record = await store.get_invocation(INV)

    assert charges == [True, True, False]
    assert lookups == [True, True, True]
    assert record is not None
    assert dict(record.used.tool_calls or {}) == {"charge": 2, "lookup": 3}


async def test_budgets_belong_to_each_invocation(store: EffectStore) -> None:
    limits = BudgetLimits(max_calls=1)
    async with asyncio.timeout(STEP_S):
        await store.open_invocation("inv_2", "sha256:x", None, 0.0)
        first = await store.reserve(INV, "charge", 0, limits)
        other = await store.reserve("inv_2", "charge", 0, limits)
        second = await store.reserve(INV, "charge", 0, limits)

    assert (first is not None, other is not None, second) == (True, True, None)


async def test_reserve_for_an_invocation_that_was_never_opened_says_no(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        assert await store.reserve("inv_never", "charge", 0, BudgetLimits()) is None
        assert await store.get_invocation("inv_never") is None


async def test_refund_of_a_reservation_that_is_not_there_changes_nothing(
    store: EffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        await store.refund("rsv_never_made")
        record = await store.get_invocation(INV)

    assert record is not None
    assert (record.used.calls, record.used.cost, dict(record.used.tool_calls or {})) == (0, 0.0, {})


async def test_refund_gives_a_reservation_back_once(store: EffectStore) -> None:
    limits = BudgetLimits(max_calls=2, max_cost=20, tool_max_calls={"charge": 2})
    async with asyncio.timeout(STEP_S):
        first = await store.reserve(INV, "charge", 10, limits)
        assert first is not None
        assert await store.reserve(INV, "charge", 10, limits)
        assert not await store.reserve(INV, "charge", 10, limits)
        await store.refund(first)
        await store.refund(first)  # given back already: nothing more
        record = await store.get_invocation(INV)
        assert await store.reserve(INV, "charge", 10, limits)
        assert not await store.reserve(INV, "charge", 10, limits)

    assert record is not None
    assert (record.used.calls, record.used.cost) == (1, 10.0)
    assert dict(record.used.tool_calls or {}) == {"charge": 1}


async def test_begin_with_a_reservation_takes_it_in_place_of_the_charge(
    store: EffectStore,
) -> None:
    """The approval path: the budget reserved before the wait is what the
    call's begin takes; a refund after that gives nothing back."""
    limits = BudgetLimits(max_calls=1, max_cost=10)
    async with asyncio.timeout(STEP_S):
        reservation = await store.reserve(INV, "charge", 2.0, limits)
        assert reservation is not None
        begun = await store.begin(start(), 1.0, charge(limits), reservation)
        await store.refund(reservation)
        record = await store.get_invocation(INV)

    assert begun.won
    assert record is not None
    assert (record.used.calls, record.used.cost) == (1, 2.0)


async def test_begin_whose_reservation_was_given_back_takes_the_charge_or_is_refused(
    store: EffectStore,
) -> None:
    """A reservation given back meanwhile (recovery took its owner for dead)
    is not free budget: the begin charges instead, or refuses if that no
    longer fits."""
    limits = BudgetLimits(max_calls=2)
    async with asyncio.timeout(STEP_S):
        first = await store.reserve(INV, "charge", 0, limits)
        second = await store.reserve(INV, "charge", 0, limits)
        assert first is not None and second is not None
        await store.refund(first)
        charged = await store.begin(start("c1"), 1.0, charge(limits, 0), first)
        await store.refund(second)
        await store.reserve(INV, "charge", 0, limits)  # someone else takes the last call
        refused = await store.begin(start("c2"), 1.0, charge(limits, 0), second)
        record = await store.get_invocation(INV)
        gone = await store.get(INV, "c2")

    assert charged.won
    assert (refused.won, refused.exhausted) == (False, "limits")
    assert gone is None
    assert record is not None
    assert record.used.calls == 2


async def test_a_begin_that_finds_a_record_leaves_its_reservation_to_be_refunded(
    store: EffectStore,
) -> None:
    limits = BudgetLimits(max_calls=5)
    async with asyncio.timeout(STEP_S):
        await store.begin(start(), 1.0)
        await store.commit(INV, "c1", RESPONSE, 2.0)
        reservation = await store.reserve(INV, "charge", 0, limits)
        assert reservation is not None
        again = await store.begin(start(), 3.0, charge(limits, 0), reservation)
        held = await store.get_invocation(INV)
        await store.refund(reservation)
        after = await store.get_invocation(INV)

    assert not again.won and again.record is not None
    assert again.record.status is EffectStatus.COMMITTED
    assert held is not None and held.used.calls == 1
    assert after is not None and after.used.calls == 0


@pytest.mark.parametrize(
    ("limits", "cost"),
    [
        pytest.param(BudgetLimits(max_calls=10), 0.0, id="max_calls"),
        pytest.param(BudgetLimits(max_cost=30), 3.0, id="max_cost"),
        pytest.param(BudgetLimits(tool_max_calls={"charge": 10}), 0.0, id="tool_max_calls"),
    ],
)
async def test_concurrent_reserves_cannot_overspend(
    store: EffectStore, limits: BudgetLimits, cost: float
) -> None:
    async with asyncio.timeout(STEP_S):
        taken = await asyncio.gather(
            *(store.reserve(INV, "charge", cost, limits) for _ in range(50))
        )
        record = await store.get_invocation(INV)

    assert sum(t is not None for t in taken) == 10
    assert record is not None
    assert record.used.calls == 10
    assert record.used.cost == pytest.approx(10 * cost)


async def test_concurrent_reserves_from_two_instances_in_two_threads_cannot_overspend(
    shared_backend: Backend,
) -> None:
    backend = shared_backend
    limits = BudgetLimits(max_calls=15, max_cost=40, tool_max_calls={"charge": 12})
    # Both open before either reserves, and both read before either closes: a
    # closed replica's reservations are given back (its calls never ran).
    both_open, both_spent, both_read = (threading.Barrier(2, timeout=STEP_S) for _ in range(3))

    async def spend() -> tuple[list[tuple[str, bool]], InvocationRecord | None]:
        instance = backend.make()
        await instance.open()
        try:
            await instance.open_invocation(INV, "sha256:" + "0" * 64, None, 0.0)
            await asyncio.to_thread(both_open.wait)
            tools = ["charge", "lookup"] * 15
            taken = await asyncio.gather(
                *(instance.reserve(INV, tool, 2.0, limits) for tool in tools)
            )
            await asyncio.to_thread(both_spent.wait)
            record = await instance.get_invocation(INV)
            await asyncio.to_thread(both_read.wait)
            return [(tool, t is not None) for tool, t in zip(tools, taken, strict=True)], record
        finally:
            await instance.close()

    def in_own_loop() -> tuple[list[tuple[str, bool]], InvocationRecord | None]:
        async def bounded() -> tuple[list[tuple[str, bool]], InvocationRecord | None]:
            async with asyncio.timeout(STEP_S):
                return await spend()

        return asyncio.run(bounded())

    async with asyncio.timeout(STEP_S * 2):
        # Made first, so the two instances open storage that exists already.
        await backend.open_new()
        (a, record), (b, _) = await asyncio.gather(
            asyncio.to_thread(in_own_loop), asyncio.to_thread(in_own_loop)
        )

    taken = [tool for tool, ok in a + b if ok]
    assert len(taken) == 15  # max_calls binds first: 15 calls of cost 2 fit max_cost 40
    assert taken.count("charge") <= 12
    assert record is not None
    assert record.used.calls == 15
    assert record.used.cost == pytest.approx(30.0)
    assert dict(record.used.tool_calls or {}) == {
        "charge": taken.count("charge"),
        "lookup": taken.count("lookup"),
    }


# -- open(): recovery after a crash ---------------------------------------------------------


async def test_open_turns_pending_records_unknown_and_counts_them(backend: Backend) -> None:
    async with asyncio.timeout(STEP_S):
        store = await backend.open_new()
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        for call_id in ("p1", "p2", "done", "doubt"):
            await store.begin(start(call_id), 1.0)
        await store.commit(INV, "done", RESPONSE, 2.0)
        await store.mark_unknown(INV, "doubt", 2.0)

        store, recovered = await backend.restart(store)
        statuses = {r.call_id: r.status for r in await store.calls(INV)}
        done = await store.get(INV, "done")
        _, recovered_again = await backend.restart(store)

    assert recovered == 2
    assert statuses == {
        "p1": EffectStatus.UNKNOWN,
        "p2": EffectStatus.UNKNOWN,
        "done": EffectStatus.COMMITTED,
        "doubt": EffectStatus.UNKNOWN,
    }
    assert done is not None
    assert done.response == RESPONSE
    assert recovered_again == 0


async def test_open_gives_back_the_reservations_a_crash_left(backend: Backend) -> None:
    """A call that waited for approval when its supervisor stopped never ran:
    the next open gives its reservation back. One a begin took stays taken."""
    limits = BudgetLimits(max_calls=2, max_cost=10)
    async with asyncio.timeout(STEP_S):
        store = await backend.open_new()
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        waiting = await store.reserve(INV, "charge", 3.0, limits)
        taken = await store.reserve(INV, "charge", 4.0, limits)
        assert waiting is not None and taken is not None
        assert (await store.begin(start(), 1.0, charge(limits, 4.0), taken)).won
        store, _ = await backend.restart(store)
        record = await store.get_invocation(INV)
        await store.refund(waiting)  # the broker's own refund, late: nothing more
        again = await store.get_invocation(INV)

    assert record is not None
    assert (record.used.calls, record.used.cost) == (1, 4.0)
    assert again == record


async def test_a_call_recovered_as_unknown_runs_again_only_if_reversible(
    backend: Backend,
) -> None:
    async with asyncio.timeout(STEP_S):
        store = await backend.open_new()
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        await store.begin(start("irr"), 1.0)
        await store.begin(start("rev", reversible=True), 1.0)
        store, _ = await backend.restart(store)
        irreversible = await store.begin(start("irr", execution="exe_2"), 2.0)
        reversible = await store.begin(start("rev", execution="exe_2", reversible=True), 2.0)

    assert (irreversible.won, irreversible.record.status) == (False, EffectStatus.UNKNOWN)
    assert (reversible.won, reversible.record.status) == (True, EffectStatus.PENDING)


# -- SQLite only ------------------------------------------------------------------------------


@pytest.fixture
async def sqlite_store(tmp_path: Path) -> AsyncIterator[SQLiteEffectStore]:
    store = SQLiteEffectStore(tmp_path / "effects.db")
    async with asyncio.timeout(STEP_S):
        await store.open()
        await store.open_invocation(INV, "sha256:x", None, 0.0)
    try:
        yield store
    finally:
        async with asyncio.timeout(STEP_S):
            await store.close()


async def test_sqlite_records_budgets_and_responses_survive_close_and_reopen(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state" / "effects.db"
    async with asyncio.timeout(STEP_S):
        first = SQLiteEffectStore(path)
        assert await first.open() == 0
        await first.open_invocation(INV, "sha256:x", 99.0, 0.0)
        await first.begin(start("done"), 1.0, charge(BudgetLimits(), 10))
        await first.commit(INV, "done", RESPONSE, 2.0)
        await first.begin(start("left_pending"), 3.0)
        await first.close()

        second = SQLiteEffectStore(path)
        try:
            recovered = await second.open()
            done = await second.get(INV, "done")
            left = await second.get(INV, "left_pending")
            invocation = await second.get_invocation(INV)
        finally:
            await second.close()

    assert recovered == 1
    assert done == EffectRecord(
        INV, "done", "charge", KEY, EffectStatus.COMMITTED, "exe_1", RESPONSE, 1.0, 2.0
    )
    assert left is not None
    assert left.status is EffectStatus.UNKNOWN
    assert invocation is not None
    assert (invocation.deadline_at, invocation.used.calls, invocation.used.cost) == (99.0, 1, 10.0)


async def test_sqlite_pending_row_is_visible_to_another_connection_when_begin_returns(
    sqlite_store: SQLiteEffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        await sqlite_store.begin(start(), 1.0)
        reader = sqlite3.connect(sqlite_store.path)
        try:
            row = reader.execute("SELECT status FROM effects WHERE call_id = 'c1'").fetchone()
        finally:
            reader.close()

    assert row == ("pending",)


async def test_sqlite_a_second_store_on_one_database_is_refused_until_the_first_closes(
    tmp_path: Path,
) -> None:
    """One supervisor per database, whatever path names it: a second store's
    open() would turn the first one's live ``pending`` rows ``unknown`` (its
    guest told ``executed``, the record saying otherwise) and a reversible
    call could run twice."""
    real = tmp_path / "real" / "effects.db"
    link = tmp_path / "link.db"
    first, second, third = SQLiteEffectStore(real), SQLiteEffectStore(link), SQLiteEffectStore(real)
    async with asyncio.timeout(STEP_S):
        await first.open()
        link.symlink_to(real)
        try:
            await first.open_invocation(INV, "sha256:x", None, 0.0)
            assert (await first.begin(start(), 1.0)).won
            for other in (second, third):
                with pytest.raises(
                    StoreUnavailable, match=rf"in use by another supervisor \(pid {os.getpid()}\)"
                ):
                    await other.open()
            still = await first.get(INV, "c1")
            await first.commit(INV, "c1", RESPONSE, 2.0)
        finally:
            await first.close()
        assert await second.open() == 0  # once the first has closed
        try:
            done = await second.get(INV, "c1")
        finally:
            await second.close()

    assert still is not None
    assert still.status is EffectStatus.PENDING
    assert done is not None
    assert done.status is EffectStatus.COMMITTED


async def test_sqlite_an_open_cancelled_midway_leaves_the_database_free(tmp_path: Path) -> None:
    """A supervisor whose start is cancelled (a host program's timeout) must
    not keep its database locked for the rest of its process's life."""
    path = tmp_path / "effects.db"
    first = SQLiteEffectStore(path)
    async with asyncio.timeout(STEP_S):
        opening = asyncio.create_task(first.open())
        await asyncio.sleep(0)  # let it start: cancelled inside open(), not before
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    lock = os.path.realpath(f"{path}-lock")

    def lock_held() -> bool:  # a descriptor of ours on the lock file, still open
        for fd in os.listdir("/proc/self/fd"):
            # One closes as we look (the listing's own, a worker's): not ours.
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == lock:
                    return True
        return False

    # Once no work of the cancelled open() is left, no descriptor holds the lock.
    with contextlib.suppress(AssertionError, TimeoutError):  # then said below
        await wait_until(lambda: not lock_held(), "the lock let go")
    assert not lock_held()
    async with asyncio.timeout(STEP_S):
        second = SQLiteEffectStore(path)
        try:
            assert await second.open() == 0
        finally:
            await second.close()


async def test_sqlite_open_twice_on_one_instance_is_a_programming_error(
    sqlite_store: SQLiteEffectStore,
) -> None:
    async with asyncio.timeout(STEP_S):
        with pytest.raises(RuntimeError, match="twice"):
            await sqlite_store.open()
        # The store still works after the refused second open.
        assert (await sqlite_store.begin(start(), 1.0)).won


async def test_sqlite_store_used_before_open_or_after_close_is_a_programming_error(
    tmp_path: Path,
) -> None:
    store = SQLiteEffectStore(tmp_path / "effects.db")
    async with asyncio.timeout(STEP_S):
        with pytest.raises(RuntimeError):
            await store.get(INV, "c1")
        await store.open()
        await store.close()
        await store.close()  # idempotent
        with pytest.raises(RuntimeError):
            await store.get(INV, "c1")


async def test_sqlite_a_failing_operation_in_a_batch_does_not_undo_its_neighbours(
    sqlite_store: SQLiteEffectStore,
) -> None:
    # Operations queued in one turn of the event loop share one transaction
    # (group commit); the trace shows the statements of that transaction.
    statements: list[str] = []

    def write_then_fail(conn: sqlite3.Connection) -> None:
        conn.execute(
            "INSERT INTO effects (invocation_id, call_id, tool, idempotency_key, status,"
            " execution_id, created_at, updated_at)"
            " VALUES (?, 'doomed', 'charge', ?, 'pending', 'exe_1', 1, 1)",
            (INV, KEY),
        )
        raise ValueError("this operation fails after writing")

    def violate_a_constraint(conn: sqlite3.Connection) -> None:
        conn.execute("UPDATE effects SET status = 'bogus' WHERE call_id = 'c0'")

    async with asyncio.timeout(STEP_S):
        await sqlite_store._run(lambda conn: conn.set_trace_callback(statements.append))
        before = [asyncio.ensure_future(sqlite_store.begin(start(f"c{i}"), 1.0)) for i in range(5)]
        failing = asyncio.ensure_future(sqlite_store._run(write_then_fail))
        constraint = asyncio.ensure_future(sqlite_store._run(violate_a_constraint))
        after = [asyncio.ensure_future(sqlite_store.begin(start(f"d{i}"), 1.0)) for i in range(5)]
        begun = await asyncio.gather(*before, *after)
        with pytest.raises(ValueError, match="fails after writing"):
            await failing
        with pytest.raises(StoreUnavailable) as caught:
            await constraint
        await sqlite_store._run(lambda conn: conn.set_trace_callback(None))
        doomed = await sqlite_store.get(INV, "doomed")
        c0 = await sqlite_store.get(INV, "c0")
        listed = await sqlite_store.calls(INV)

    assert all(b.won for b in begun)
    assert isinstance(caught.value.__cause__, sqlite3.IntegrityError)
    assert doomed is None  # its own write was rolled back …
    assert c0 is not None
    assert c0.status is EffectStatus.PENDING  # … and so was the constraint violation
    assert sorted(r.call_id for r in listed) == [f"{p}{i}" for p in "cd" for i in range(5)]
    # They really shared one transaction: the batch ran without savepoints
    # first, was rolled back when an op failed, then ran again with one
    # savepoint per op — one BEGIN and one COMMIT for all twelve.
    first = statements.index("BEGIN IMMEDIATE")  # the batch after the one that set the trace
    commit = statements.index("COMMIT", first)
    assert "ROLLBACK" in statements[first:commit]
    assert statements[first:commit].count("SAVEPOINT op") == 12
    last = max(i for i in range(first, commit) if statements[i] == "BEGIN IMMEDIATE")
    assert statements[last:commit].count("SAVEPOINT op") == 12


async def test_sqlite_a_batch_whose_ops_all_succeed_takes_no_savepoint(
    sqlite_store: SQLiteEffectStore,
) -> None:
    statements: list[str] = []
    async with asyncio.timeout(STEP_S):
        await sqlite_store._run(lambda conn: conn.set_trace_callback(statements.append))
        begun = await asyncio.gather(*(sqlite_store.begin(start(f"c{i}"), 1.0) for i in range(8)))
        await sqlite_store._run(lambda conn: conn.set_trace_callback(None))
        listed = await sqlite_store.calls(INV)
    assert all(b.won for b in begun)
    assert sorted(r.call_id for r in listed) == [f"c{i}" for i in range(8)]
    first = statements.index("BEGIN IMMEDIATE")
    batch = statements[first : statements.index("COMMIT", first) + 1]
    assert batch.count("BEGIN IMMEDIATE") == 1
    assert "SAVEPOINT op" not in batch
    assert sum(s.startswith("INSERT INTO effects") for s in batch) == 8


async def test_sqlite_a_directory_in_place_of_the_database_is_store_unavailable(
    tmp_path: Path,
) -> None:
    store = SQLiteEffectStore(tmp_path)
    async with asyncio.timeout(STEP_S):
        with pytest.raises(StoreUnavailable) as caught:
            await store.open()
        await store.close()

    assert isinstance(caught.value.__cause__, sqlite3.Error)


async def test_sqlite_a_file_in_place_of_the_state_dir_is_store_unavailable(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    store = SQLiteEffectStore(blocker / "effects.db")
    async with asyncio.timeout(STEP_S):
        with pytest.raises(StoreUnavailable):
            await store.open()
        await store.close()


async def test_sqlite_a_database_from_a_newer_hostcall_is_store_unavailable(
    tmp_path: Path,
) -> None:
    path = tmp_path / "effects.db"
    async with asyncio.timeout(STEP_S):
        store = SQLiteEffectStore(path)
        await store.open()
        await store._run(lambda conn: conn.execute("UPDATE meta SET value = '999'"))
        await store.close()
        newer = SQLiteEffectStore(path)
        try:
            with pytest.raises(StoreUnavailable, match="newer"):
                await newer.open()
            # A failed open() leaves nothing running: trying again fails the same way.
            with pytest.raises(StoreUnavailable, match="newer"):
                await newer.open()
        finally:
            await newer.close()


# -- forgetting (hostcall gc) -----------------------------------------------------


async def test_forget_calls_deletes_settled_records_and_keeps_in_flight_ones_and_the_budget(
    store: EffectStore,
) -> None:
    other = "inv_other"
    await store.open_invocation(other, "sha256:" + "0" * 64, None, 0.0)
    assert (await store.begin(start("c1"), 1.0)).won
    await store.commit(INV, "c1", RESPONSE, 2.0)
    await unknown_record(store, "c2")
    assert (await store.begin(start("c3"), 3.0)).won  # still pending: in flight
    assert (await store.begin(start("c1", invocation=other), 1.0)).won
    await store.commit(other, "c1", RESPONSE, 2.0)
    await store.revoke(INV, "charge", 4.0)
    used_before = (await store.get_invocation(INV)).used  # type: ignore[union-attr]

    forgotten = await store.forget_calls(INV)

    assert forgotten == 2
    assert [r.call_id for r in await store.calls(INV)] == ["c3"]
    assert [r.call_id for r in await store.calls(other)] == ["c1"]
    invocation = await store.get_invocation(INV)
    assert invocation is not None and invocation.used == used_before
    assert await store.revoked(INV) == frozenset({"charge"})


async def test_a_rejection_is_kept_across_a_restart_and_the_first_one_holds(
    backend: Backend, store: EffectStore
) -> None:
    assert await store.rejection(INV, "c1") is None
    await store.reject(INV, "c1", "key-1", "apr_1", 1.0)
    await store.reject(INV, "c1", "key-2", "apr_2", 2.0)  # a later one changes nothing
    await store.reject(INV, "c2", "key-3", "apr_3", 3.0)
    restarted, _ = await backend.restart(store)

    assert await restarted.rejection(INV, "c1") == ("key-1", "apr_1")
    assert await restarted.rejection(INV, "c2") == ("key-3", "apr_3")
    assert await restarted.rejection("inv_other", "c1") is None
