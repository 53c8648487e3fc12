"""What only the PostgreSQL store promises: leases and recovery across
replicas, a versioned schema, its DSN options, and clear errors when the
database cannot be reached.

The contract every store keeps runs against it in test_stores.py; two real
supervisor processes sharing one database are in test_replicas.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from supervisor import Supervisor
from supervisor.budget import BudgetLimits
from supervisor.errors import StoreUnavailable
from supervisor.receipts import verify_chain
from supervisor.stores import (
    EffectStatus,
    NotPending,
    PostgresEffectStore,
    StartCall,
    store_from_spec,
)
from supervisor.stores.postgres import SCHEMA_VERSION
from tests.harness import Ledger, billing_plan, driven_guest
from tests.postgres_support import Partition, with_options, without_options

#: Upper bound for any one step of a test; every await runs under it.
STEP_S = 10.0
INV = "inv_1"
KEY = "k" * 64


def start(call_id: str = "c1", *, execution: str = "exe_1", reversible: bool = False) -> StartCall:
    return StartCall(INV, call_id, "charge", KEY, execution, reversible)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll a condition the system under test makes true, bounded by STEP_S."""
    try:
        async with asyncio.timeout(STEP_S):
            while not await check():
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {STEP_S} s: {what}") from None


def crash(store: PostgresEffectStore) -> None:
    """What ``kill -9`` leaves of a replica: no heartbeat, its connections gone,
    its lease not handed back (it runs out on its own)."""
    assert store._heartbeat_task is not None and store._pool is not None
    store._heartbeat_task.cancel()
    store._pool.terminate()
    store._heartbeat_task = None
    store._pool = None


@pytest.fixture
def dsn(postgres_dsn: str, postgres_schema: str) -> str:
    """The test's server, in a schema of its own."""
    return with_options(postgres_dsn, schema=postgres_schema)


@pytest.fixture
async def partition(postgres_dsn: str) -> AsyncIterator[Partition]:
    """A proxy to the test's server that the test can cut; closed at the end."""
    made = Partition(postgres_dsn)
    await made.start()
    try:
        yield made
    finally:
        await made.cut()


@pytest.fixture
async def stores() -> AsyncIterator[list[PostgresEffectStore]]:
    """Stores a test opened; closed (bounded) when it ends."""
    opened: list[PostgresEffectStore] = []
    try:
        yield opened
    finally:
        async with asyncio.timeout(STEP_S):
            for store in opened:
                await store.close()


async def replica(
    stores: list[PostgresEffectStore], dsn: str, **options: Any
) -> PostgresEffectStore:
    store = PostgresEffectStore(dsn, **options)
    stores.append(store)
    await store.open()
    return store


async def admin(dsn: str) -> asyncpg.Connection[asyncpg.Record]:
    """A direct connection to the test's server (hostcall_* options removed)."""
    return await asyncpg.connect(without_options(dsn), timeout=STEP_S)


# -- the DSN and its options (no server needed) ----------------------------------------


def test_options_in_the_dsn_are_read_and_taken_out_of_what_the_driver_gets() -> None:
    store = PostgresEffectStore(
        "postgresql://app:s3cret@db:5433/prod?sslmode=require&hostcall_schema=billing"
        "&hostcall_lease_s=4&hostcall_renew_s=1&hostcall_pool_max=3"
    )

    assert (store.schema, store.lease_s, store.renew_s, store.pool_max_size) == (
        "billing",
        4.0,
        1.0,
        3,
    )
    assert store._dsn == "postgresql://app:s3cret@db:5433/prod?sslmode=require"
    assert store.where == "postgresql://app:***@db:5433/prod?sslmode=require"


def test_keyword_options_win_over_the_dsn_and_defaults_apply_without_either() -> None:
    given = PostgresEffectStore("postgres://db/x?hostcall_lease_s=4", lease_s=9, renew_s=2)
    default = PostgresEffectStore("postgresql://db/x")

    assert (given.lease_s, given.renew_s) == (9.0, 2.0)
    assert (default.schema, default.lease_s, default.renew_s) == ("hostcall", 10.0, 3.0)


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("mysql://db/x", "postgresql://"),
        ("postgresql://db/x?hostcall_lease=4", "unknown option"),
        ("postgresql://db/x?hostcall_lease_s=soon", "not a number"),
        ("postgresql://db/x?hostcall_lease_s=3&hostcall_renew_s=3", "outlast"),
        ("postgresql://db/x?hostcall_schema=Bad-Name", "schema"),
        ("postgresql://db/x?synchronous_commit=off", "synchronous_commit"),
        # PostgreSQL's other spellings of off, and its names in any case
        ("postgresql://db/x?synchronous_commit=OFF", "synchronous_commit"),
        ("postgresql://db/x?synchronous_commit=false", "synchronous_commit"),
        ("postgresql://db/x?synchronous_commit=%20No", "synchronous_commit"),
        ("postgresql://db/x?synchronous_commit=0", "synchronous_commit"),
        ("postgresql://db/x?Synchronous_Commit=off", "synchronous_commit"),
    ],
)
def test_a_bad_dsn_or_option_is_refused_when_the_store_is_made(dsn: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PostgresEffectStore(dsn)


def test_sessions_ask_for_synchronous_commit_unless_the_dsn_names_a_level() -> None:
    # A startup setting overrides a role's or a database's default.
    default = PostgresEffectStore("postgresql://db/x")._server_settings()
    named = PostgresEffectStore("postgresql://db/x?synchronous_commit=remote_apply")

    assert default["synchronous_commit"] == "on"
    assert "synchronous_commit" not in named._server_settings()
    assert named._dsn.endswith("?synchronous_commit=remote_apply")  # asyncpg sends it


def test_store_from_spec_makes_a_postgres_store_that_keeps_its_id_in_the_state_dir(
    tmp_path: Path,
) -> None:
    for spec in ("postgresql://db/x", "postgres://db/x"):
        store = store_from_spec(spec, tmp_path)
        assert isinstance(store, PostgresEffectStore)
        assert store._identity_file == tmp_path / "replica-id"


# -- an unreachable database -------------------------------------------------------------


async def test_a_database_nobody_listens_for_is_store_unavailable_naming_no_password() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = PostgresEffectStore(f"postgresql://app:s3cret@127.0.0.1:{port}/x")
    async with asyncio.timeout(STEP_S):
        with pytest.raises(StoreUnavailable) as caught:
            await store.open()
        await store.close()

    assert isinstance(caught.value.__cause__, OSError)
    assert "s3cret" not in str(caught.value)
    assert f"127.0.0.1:{port}" in str(caught.value)


async def test_a_database_that_never_answers_is_store_unavailable_within_the_connect_timeout() -> (
    None
):
    with socket.socket() as silent:  # accepts connections, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        store = PostgresEffectStore(f"postgresql://app@127.0.0.1:{port}/x", connect_timeout_s=0.5)
        started = time.monotonic()
        async with asyncio.timeout(STEP_S):
            with pytest.raises(StoreUnavailable, match="timed out") as caught:
                await store.open()
        took = time.monotonic() - started

    assert isinstance(caught.value.__cause__, TimeoutError)
    assert took < 5.0


@pytest.mark.postgres
async def test_a_store_cut_off_from_its_database_is_store_unavailable_and_recovers_after(
    partition: Partition, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    store = await replica(stores, with_options(partition.dsn, schema=postgres_schema))
    async with asyncio.timeout(STEP_S):
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        await partition.cut()
        with pytest.raises(StoreUnavailable) as caught:
            await store.get(INV, "c1")
        await partition.start()
        begun = await store.begin(start(), 1.0)

    assert isinstance(caught.value.__cause__, (OSError, asyncpg.PostgresError))
    assert begun.won


@pytest.mark.postgres
async def test_a_call_whose_outcome_could_not_be_written_becomes_unknown_once_the_database_answers(
    partition: Partition, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    dsn = with_options(partition.dsn, schema=postgres_schema)
    store = await replica(stores, dsn, lease_s=30, renew_s=0.1)
    async with asyncio.timeout(STEP_S):
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await store.begin(start(), 1.0)).won
        await partition.cut()
        with pytest.raises(StoreUnavailable):
            await store.commit(INV, "c1", {"status": "ok"}, 2.0)
        await partition.start()

    async def unknown() -> bool:
        record = await store.get(INV, "c1")
        return record is not None and record.status is EffectStatus.UNKNOWN

    await eventually(unknown, "the heartbeat turns the stranded pending row unknown")


async def test_a_store_used_before_open_or_after_close_is_a_programming_error() -> None:
    store = PostgresEffectStore("postgresql://db/x")
    with pytest.raises(RuntimeError):
        await store.get(INV, "c1")
    with pytest.raises(RuntimeError, match="once the store is open"):
        _ = store.instance_id
    await store.close()  # idempotent, also before open


@pytest.mark.postgres
async def test_opening_a_store_twice_is_a_programming_error(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    store = await replica(stores, dsn)
    async with asyncio.timeout(STEP_S):
        with pytest.raises(RuntimeError, match="twice"):
            await store.open()
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await store.begin(start(), 1.0)).won


# -- the schema ---------------------------------------------------------------------------


@pytest.mark.postgres
async def test_replicas_opening_a_new_schema_together_create_it_once_at_the_current_version(
    dsn: str, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    async with asyncio.timeout(STEP_S):
        await asyncio.gather(*(replica(stores, dsn) for _ in range(5)))
        conn = await admin(dsn)
        try:
            version = await conn.fetchval(
                f"SELECT value FROM {postgres_schema}.meta WHERE key = 'schema_version'"
            )
            replicas = await conn.fetchval(f"SELECT count(*) FROM {postgres_schema}.replicas")
        finally:
            await conn.close()

    assert version == str(SCHEMA_VERSION)
    assert replicas == 5


@pytest.mark.postgres
async def test_a_schema_from_a_newer_hostcall_is_store_unavailable(
    dsn: str, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    async with asyncio.timeout(STEP_S):
        await replica(stores, dsn)
        conn = await admin(dsn)
        try:
            await conn.execute(f"UPDATE {postgres_schema}.meta SET value = '999'")
        finally:
            await conn.close()
        newer = PostgresEffectStore(dsn)
        for _ in range(2):  # a failed open() leaves nothing behind: it fails the same way
            with pytest.raises(StoreUnavailable, match="newer"):
                await newer.open()
        await newer.close()


@pytest.mark.postgres
async def test_stores_in_two_schemas_of_one_database_share_nothing(
    postgres_dsn: str, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    other = postgres_schema + "_b"
    try:
        async with asyncio.timeout(STEP_S):
            a = await replica(stores, postgres_dsn, schema=postgres_schema)
            b = await replica(stores, postgres_dsn, schema=other)
            await a.open_invocation(INV, "sha256:x", None, 0.0)
            await a.begin(start(), 1.0)

            assert await b.get_invocation(INV) is None
            assert await b.get(INV, "c1") is None
    finally:
        conn = await admin(postgres_dsn)
        try:
            await conn.execute(f"DROP SCHEMA IF EXISTS {other} CASCADE")
        finally:
            await conn.close()


@pytest.mark.postgres
async def test_its_sessions_commit_synchronously(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    store = await replica(stores, dsn)
    async with asyncio.timeout(STEP_S), store._conn() as conn:
        level = await conn.fetchval("SHOW synchronous_commit")

    assert level == "on"


@pytest.mark.postgres
async def test_a_session_the_server_runs_without_synchronous_commit_is_refused_at_open(
    dsn: str, stores: list[PostgresEffectStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the DSN's own check: what the server says it runs with. Here the
    session's default is taken away and the role's connection asks for off
    in a way the DSN check does not read (libpq's ``options``)."""
    monkeypatch.setattr(PostgresEffectStore, "_server_settings", lambda self: {})
    asks_off = "options=-c%20synchronous_commit%3Doff"
    store = PostgresEffectStore(f"{dsn}{'&' if '?' in dsn else '?'}{asks_off}")
    with pytest.raises(StoreUnavailable, match="synchronous_commit=off"):
        async with asyncio.timeout(STEP_S):
            await store.open()
    assert store._pool is None  # nothing left open


# -- leases and recovery ------------------------------------------------------------------


@pytest.mark.postgres
async def test_a_dead_replicas_pending_rows_become_unknown_after_its_lease_and_live_ones_stay(
    dsn: str, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    dying = await replica(stores, dsn, lease_s=3, renew_s=0.5)
    async with asyncio.timeout(STEP_S):
        await dying.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await dying.begin(start("a1"), 1.0)).won
        assert (await dying.begin(start("a2"), 1.0)).won
        await dying.commit(INV, "a2", {"status": "ok"}, 2.0)
        # A replica that opens while the owner is alive leaves its rows alone.
        live = await replica(stores, dsn, lease_s=3, renew_s=0.1)
        assert (await live.begin(start("b1", execution="exe_2"), 1.0)).won
        record = await live.get(INV, "a1")
        assert record is not None and record.status is EffectStatus.PENDING
        crash(dying)
        record = await live.get(INV, "a1")
        assert record is not None and record.status is EffectStatus.PENDING  # the lease runs

    async def recovered() -> bool:
        found = await live.get(INV, "a1")
        return found is not None and found.status is EffectStatus.UNKNOWN

    await eventually(recovered, "the live replica's heartbeat recovers a1 after the lease")
    async with asyncio.timeout(STEP_S):
        statuses = {r.call_id: r.status for r in await live.calls(INV)}
        conn = await admin(dsn)
        try:
            listed = await conn.fetch(f"SELECT instance_id FROM {postgres_schema}.replicas")
        finally:
            await conn.close()

    assert statuses == {
        "a1": EffectStatus.UNKNOWN,
        "a2": EffectStatus.COMMITTED,
        "b1": EffectStatus.PENDING,  # its owner is alive
    }
    assert [row[0] for row in listed] == [live.instance_id]  # the dead one is forgotten


@pytest.mark.postgres
async def test_a_dead_replicas_reservations_are_given_back_after_its_lease(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    """Calls waiting for approval on a replica that died never ran: once its
    lease has run out a live replica gives their budget back; its own stay."""
    limits = BudgetLimits(max_calls=3)
    dying = await replica(stores, dsn, lease_s=3, renew_s=0.5)
    async with asyncio.timeout(STEP_S):
        await dying.open_invocation(INV, "sha256:x", None, 0.0)
        assert await dying.reserve(INV, "charge", 0, limits) is not None
        live = await replica(stores, dsn, lease_s=3, renew_s=0.1)
        assert await live.reserve(INV, "charge", 0, limits) is not None
        crash(dying)

    async def given_back() -> bool:
        found = await live.get_invocation(INV)
        return found is not None and found.used.calls == 1

    await eventually(given_back, "the live replica's heartbeat gives the dead one's back")
    async with asyncio.timeout(STEP_S):
        assert await live.reserve(INV, "charge", 0, limits) is not None
        assert await live.reserve(INV, "charge", 0, limits) is not None
        assert await live.reserve(INV, "charge", 0, limits) is None  # the live one's stayed


@pytest.mark.postgres
async def test_a_replica_restarted_with_its_id_turns_its_own_pending_rows_unknown_at_once(
    dsn: str, tmp_path: Path, stores: list[PostgresEffectStore]
) -> None:
    identity = tmp_path / "replica-id"
    first = await replica(stores, dsn, identity_file=identity, lease_s=600, renew_s=100)
    async with asyncio.timeout(STEP_S):
        await first.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await first.begin(start("p1"), 1.0)).won
        crash(first)
        again = PostgresEffectStore(dsn, identity_file=identity, lease_s=600, renew_s=100)
        stores.append(again)
        recovered = await again.open()  # long before the 600 s lease could run out
        record = await again.get(INV, "p1")

    assert again.instance_id == first.instance_id == identity.read_text().strip()
    assert recovered == 1
    assert record is not None and record.status is EffectStatus.UNKNOWN


@pytest.mark.postgres
async def test_a_second_live_supervisor_with_the_same_replica_id_is_refused(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    """A copied state dir: the copy must not take the original's call in
    flight for its own earlier life's and turn it unknown."""
    original = await replica(stores, dsn, instance_id="r-copied", lease_s=2, renew_s=0.2)
    async with asyncio.timeout(STEP_S):
        await original.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await original.begin(start("p1"), 1.0)).won
        copy = PostgresEffectStore(dsn, instance_id="r-copied", lease_s=2, renew_s=0.2)
        stores.append(copy)
        with pytest.raises(StoreUnavailable, match="in use by a live supervisor"):
            await copy.open()
        record = await original.get(INV, "p1")
        assert record is not None and record.status is EffectStatus.PENDING
        await original.commit(INV, "p1", {"status": "ok"}, 2.0)
        await original.close()
        assert await copy.open() == 0  # handed back: the id is free, nothing to recover
        committed = await copy.get(INV, "p1")

    assert committed is not None and committed.status is EffectStatus.COMMITTED


@pytest.mark.postgres
async def test_two_copies_started_at_the_same_moment_open_one_store_not_two(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    """Each looks at the id's lease before either has taken it: both found
    it free, and each would take the other's calls in flight for its own."""
    copies = [
        PostgresEffectStore(dsn, instance_id="r-twin", lease_s=2, renew_s=0.2) for _ in range(2)
    ]
    stores.extend(copies)
    async with asyncio.timeout(STEP_S):
        opened = await asyncio.gather(*(c.open() for c in copies), return_exceptions=True)
    refused = [o for o in opened if isinstance(o, StoreUnavailable)]
    assert len(refused) == 1, opened
    assert "in use by a live supervisor" in str(refused[0])
    assert opened.count(0) == 1  # the other opened, with nothing to recover


@pytest.mark.postgres
async def test_a_replica_that_closes_hands_back_its_lease_so_others_recover_at_once(
    dsn: str, stores: list[PostgresEffectStore]
) -> None:
    leaving = await replica(stores, dsn, lease_s=600, renew_s=100)
    staying = await replica(stores, dsn, lease_s=600, renew_s=0.1)
    async with asyncio.timeout(STEP_S):
        await leaving.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await leaving.begin(start("p1"), 1.0)).won
        await leaving.close()

    async def recovered() -> bool:
        found = await staying.get(INV, "p1")
        return found is not None and found.status is EffectStatus.UNKNOWN

    await eventually(recovered, "p1 is recovered long before the 600 s lease")


@pytest.mark.postgres
async def test_a_replica_whose_lease_ran_out_begins_nothing_until_it_renews(
    dsn: str, postgres_schema: str, stores: list[PostgresEffectStore]
) -> None:
    store = await replica(stores, dsn, lease_s=600, renew_s=300)
    async with asyncio.timeout(STEP_S):
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await store.begin(start("before"), 1.0)).won
        conn = await admin(dsn)
        try:
            await conn.execute(
                f"UPDATE {postgres_schema}.replicas SET lease_expires_at = now() - interval '1 s'"
            )
        finally:
            await conn.close()
        with pytest.raises(StoreUnavailable, match="lease"):
            await store.begin(start("during"), 2.0)
        lost = await store.begin(start("before", execution="exe_2"), 2.0)  # still answered
        missing = await store.get(INV, "during")
        await store._renew()
        after = await store.begin(start("during"), 3.0)

    assert (lost.won, lost.record.execution_id) == (False, "exe_1")
    assert missing is None
    assert after.won


@pytest.mark.postgres
async def test_a_late_outcome_of_a_row_recovered_meanwhile_is_not_recorded_and_says_so(
    dsn: str,
    postgres_schema: str,
    stores: list[PostgresEffectStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = await replica(stores, dsn)
    async with asyncio.timeout(STEP_S):
        await store.open_invocation(INV, "sha256:x", None, 0.0)
        assert (await store.begin(start(), 1.0)).won
        conn = await admin(dsn)
        try:  # another replica decided this one was dead and recovered the row
            await conn.execute(f"UPDATE {postgres_schema}.effects SET status = 'unknown'")
        finally:
            await conn.close()
        with (
            caplog.at_level(logging.WARNING, logger="supervisor.stores.postgres"),
            pytest.raises(NotPending),  # the broker must not answer "executed"
        ):
            await store.commit(INV, "c1", {"status": "ok"}, 2.0)
        record = await store.get(INV, "c1")

    assert record is not None and record.status is EffectStatus.UNKNOWN
    assert "was not recorded" in caplog.text


# -- through a supervisor -----------------------------------------------------------------


@pytest.mark.postgres
async def test_a_call_whose_record_another_replica_recovered_while_it_ran_is_answered_unknown(
    dsn: str, postgres_schema: str, tmp_path: Path, ledger: Ledger
) -> None:
    """docs/guarantees.md: a result that could not be committed is answered
    ``ambiguous`` ``unknown``, never ``executed``. A replica whose lease ran
    out while its handler ran (frozen, cut off) was taken for dead: another
    replica turned its row ``unknown``. Its late commit writes nothing, so its
    reply must say what the record says, or the guest's retry would
    contradict it."""
    plan = billing_plan(ledger)
    args = {"account": "acct_1"}
    async with (
        Supervisor(state_dir=tmp_path / "state", store=dsn) as sup,
        driven_guest(sup, plan, invocation_id="inv_late") as guest,
    ):
        first = asyncio.create_task(guest.call("c1", "slow_charge", args))
        try:
            assert await asyncio.to_thread(ledger.started.wait, STEP_S)
            conn = await admin(dsn)
            try:  # what another replica's recovery of a dead one's rows does
                await conn.execute(
                    f"UPDATE {postgres_schema}.effects SET status = 'unknown'"
                    " WHERE call_id = 'c1' AND status = 'pending'"
                )
            finally:
                await conn.close()
        finally:
            ledger.release.set()
        late = await first
        retry = await guest.call("c1", "slow_charge", args)
        record = await sup.store.get("inv_late", "c1")
    receipts = (tmp_path / "state" / "receipts" / "inv_late.jsonl").read_text().splitlines()

    for reply in (late, retry):
        assert reply["status"] == 409
        assert (reply["body"]["status"], reply["body"]["reason"]) == ("ambiguous", "unknown")
        assert "result" not in reply["body"]
    assert record is not None and record.status is EffectStatus.UNKNOWN
    assert [json.loads(line)["outcome"] for line in receipts] == ["unknown", "unknown"]
    assert verify_chain(tmp_path / "state" / "receipts" / "inv_late.jsonl") == (2, None)
    assert ledger.runs["slow_charge"] == 1


@pytest.mark.postgres
async def test_with_the_database_cut_off_a_call_is_refused_and_its_handler_never_runs(
    partition: Partition, postgres_schema: str, tmp_path: Path, ledger: Ledger
) -> None:
    store = PostgresEffectStore(with_options(partition.dsn, schema=postgres_schema))
    plan = billing_plan(ledger)
    args = {"account": "acct_1", "cents": 5}
    async with (
        Supervisor(state_dir=tmp_path / "state", store=store) as sup,
        driven_guest(sup, plan) as guest,
    ):
        before = await guest.call("c1", "charge", args)
        await partition.cut()
        refused = await guest.call("c2", "charge", args)
        await partition.start()
        again = await guest.call("c2", "charge", args)

    assert before["body"]["effect"] == "executed"
    assert (refused["status"], refused["body"]["effect"]) == (503, "none")
    assert refused["body"]["error"]["code"] == "store_unavailable"
    assert again["body"]["effect"] == "executed"
    assert ledger.runs["charge"] == 2  # c1 once, c2 once: nothing ran unrecorded


@pytest.mark.postgres
async def test_approvals_and_receipts_work_on_the_shared_store_and_a_second_replica_replays(
    dsn: str, tmp_path: Path, ledger: Ledger
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    seen: list[str] = []

    def approve(proposal: Any) -> bool:
        seen.append(proposal.call_id)
        return True

    args = {"account": "acct_1", "cents": 5}
    async with (
        Supervisor(state_dir=tmp_path / "one", store=dsn, approver=approve) as one,
        driven_guest(one, plan, invocation_id="inv_shared") as guest,
    ):
        first = await guest.call("c1", "charge", args)
    async with (
        Supervisor(state_dir=tmp_path / "two", store=dsn, approver=approve) as two,
        driven_guest(two, plan, invocation_id="inv_shared") as guest,
    ):
        replayed = await guest.call("c1", "charge", args)

    assert first["body"]["effect"] == "executed"
    assert replayed["body"]["effect"] == "replayed"
    assert replayed["body"]["result"] == first["body"]["result"]
    assert seen == ["c1"]  # a replay needs no approval
    assert ledger.runs["charge"] == 1
    for state in ("one", "two"):  # each replica keeps its own receipt chain
        count, broken = verify_chain(tmp_path / state / "receipts" / "inv_shared.jsonl")
        assert (count, broken) == (1, None)
