"""The PostgreSQL store's SQL: its schema and migrations, the statements it runs
and how rows become records.

Every statement names its tables as ``{s}.<table>``; the store puts its
(quoted) schema in place of ``{s}``.
"""

from __future__ import annotations

import json
from typing import Final

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from supervisor.stores.base import BudgetUse, EffectRecord, EffectStatus, InvocationRecord

__all__ = [
    "BEGIN_INSERT",
    "BEGIN_RERUN",
    "CALLS",
    "COMMIT",
    "DEAD_REPLICAS",
    "EFFECT_COLUMNS",
    "FORGET_REPLICAS",
    "GET_EFFECT",
    "GET_INVOCATION",
    "HAND_BACK_LEASE",
    "INVOCATION_QUERY",
    "LEASE_HOLDER",
    "LEASE_IS_LIVE",
    "LEASE_LAPSED_FOR_UPDATE",
    "LEASE_LIVE",
    "LEASE_ROW",
    "LIST_INVOCATIONS",
    "LOCK_BUDGET",
    "MARK_UNKNOWN",
    "MIGRATIONS",
    "OPEN_INVOCATION",
    "RECOVER",
    "RECOVER_RESERVATIONS",
    "REJECT",
    "REJECTION",
    "RELEASE",
    "RENEW_LEASE",
    "RESERVE",
    "REVOKE",
    "REVOKED",
    "SCHEMA_VERSION",
    "SETTLE_WHERE",
    "STRANDED_UNKNOWN",
    "TAKE_RESERVATION",
    "TOOL_USED",
    "USE",
    "effect_from_row",
    "invocation_from_row",
    "migrate",
]

#: Migrations, in order: the schema's version is how many have run. Append,
#: never edit: a database at version N runs only ``MIGRATIONS[N:]``.
MIGRATIONS: Final = (
    """
    CREATE TABLE {s}.meta (key text PRIMARY KEY, value text NOT NULL);
    CREATE TABLE {s}.replicas (
        instance_id text PRIMARY KEY,
        hostname text NOT NULL,
        pid integer NOT NULL,
        started_at timestamptz NOT NULL,
        lease_expires_at timestamptz NOT NULL
    );
    CREATE TABLE {s}.invocations (
        invocation_id text PRIMARY KEY,
        plan_hash text NOT NULL,
        created_at double precision NOT NULL,
        deadline_at double precision,
        calls_used bigint NOT NULL DEFAULT 0,
        cost_used double precision NOT NULL DEFAULT 0
    );
    CREATE TABLE {s}.tool_usage (
        invocation_id text NOT NULL,
        tool text NOT NULL,
        calls_used bigint NOT NULL DEFAULT 0,
        PRIMARY KEY (invocation_id, tool)
    );
    CREATE TABLE {s}.effects (
        invocation_id text NOT NULL,
        call_id text NOT NULL,
        tool text NOT NULL,
        idempotency_key text NOT NULL,
        status text NOT NULL CHECK (status IN ('pending', 'committed', 'unknown')),
        execution_id text NOT NULL,
        response text,
        created_at double precision NOT NULL,
        updated_at double precision NOT NULL,
        owner_instance text NOT NULL,
        attempt_id text NOT NULL,
        PRIMARY KEY (invocation_id, call_id)
    );
    CREATE INDEX effects_pending_by_owner ON {s}.effects (owner_instance)
        WHERE status = 'pending';
    CREATE TABLE {s}.revocations (
        invocation_id text NOT NULL,
        tool text NOT NULL,
        revoked_at double precision NOT NULL,
        PRIMARY KEY (invocation_id, tool)
    );
    """,
    # 2: reservations of calls waiting for approval, given back by recovery
    # when their replica dies (an older hostcall must not open this schema).
    """
    CREATE TABLE {s}.reservations (
        reservation_id text PRIMARY KEY,
        invocation_id text NOT NULL,
        tool text NOT NULL,
        cost double precision NOT NULL,
        owner_instance text NOT NULL
    );
    CREATE INDEX reservations_by_owner ON {s}.reservations (owner_instance);
    """,
    # 3: calls an operator rejected, refused on their retries without asking
    # again, on any replica and after a restart.
    """
    CREATE TABLE {s}.rejections (
        invocation_id text NOT NULL,
        call_id text NOT NULL,
        idempotency_key text NOT NULL,
        approval_id text NOT NULL,
        rejected_at double precision NOT NULL,
        PRIMARY KEY (invocation_id, call_id)
    );
    """,
)
SCHEMA_VERSION: Final = len(MIGRATIONS)

EFFECT_COLUMNS: Final = (
    "invocation_id, call_id, tool, idempotency_key, status, execution_id, response,"
    " created_at, updated_at"
)
LEASE_LIVE: Final = (
    "EXISTS (SELECT 1 FROM {s}.replicas"
    " WHERE instance_id = $7 AND lease_expires_at > clock_timestamp())"
)
INVOCATION_QUERY: Final = (
    "SELECT i.invocation_id, i.plan_hash, i.created_at, i.deadline_at, i.calls_used,"
    " i.cost_used,"
    " ARRAY(SELECT t.tool FROM {s}.tool_usage t"
    "       WHERE t.invocation_id = i.invocation_id ORDER BY t.tool) AS tools,"
    " ARRAY(SELECT t.calls_used FROM {s}.tool_usage t"
    "       WHERE t.invocation_id = i.invocation_id ORDER BY t.tool) AS tool_calls"
    " FROM {s}.invocations i"
)
GET_INVOCATION: Final = INVOCATION_QUERY + " WHERE i.invocation_id = $1"
LIST_INVOCATIONS: Final = INVOCATION_QUERY + " ORDER BY i.created_at, i.invocation_id"
#: Add to (or, negative, give back) an invocation's budget use; nothing for an
#: invocation that does not exist. The UPDATE holds the invocation's row lock,
#: which every writer of ``tool_usage`` takes first.
USE: Final = (
    "WITH inv AS (UPDATE {s}.invocations SET calls_used = calls_used + $3,"
    " cost_used = cost_used + $4 WHERE invocation_id = $1 RETURNING invocation_id)"
    " INSERT INTO {s}.tool_usage AS t (invocation_id, tool, calls_used)"
    " SELECT invocation_id, $2, $3 FROM inv"
    " ON CONFLICT (invocation_id, tool)"
    " DO UPDATE SET calls_used = t.calls_used + excluded.calls_used"
)

#: begin's insert; the owner ($7) writes only while its lease is live.
BEGIN_INSERT: Final = (
    "INSERT INTO {s}.effects (invocation_id, call_id, tool, idempotency_key, status,"
    " execution_id, created_at, updated_at, owner_instance, attempt_id)"
    " SELECT $1::text, $2::text, $3::text, $4::text, 'pending',"
    " $5::text, $6::float8, $6::float8, $7::text, $8::text"
    f" WHERE {LEASE_LIVE} ON CONFLICT DO NOTHING RETURNING {EFFECT_COLUMNS}"
)
#: begin's compare-and-set for a reversible tool: of concurrent retries of an
#: unknown call, one finds it unknown.
BEGIN_RERUN: Final = (
    "UPDATE {s}.effects SET status = 'pending', execution_id = $5, updated_at = $6,"
    " owner_instance = $7, attempt_id = $8"
    " WHERE invocation_id = $1 AND call_id = $2 AND status = 'unknown'"
    f" AND tool = $3 AND idempotency_key = $4 AND {LEASE_LIVE} RETURNING {EFFECT_COLUMNS}"
)

#: A row for replica $1 to lock, if it has none: a lease nobody holds.
LEASE_ROW: Final = (
    "INSERT INTO {s}.replicas (instance_id, hostname, pid, started_at, lease_expires_at)"
    " VALUES ($1, '', 0, clock_timestamp(), '-infinity') ON CONFLICT DO NOTHING"
)
#: Who holds replica $1's lease, until when, and whether that is still ahead;
#: row locked: whoever decides to take the lease takes it before another looks.
LEASE_HOLDER: Final = (
    "SELECT hostname, pid, lease_expires_at, lease_expires_at > clock_timestamp() AS live"
    " FROM {s}.replicas WHERE instance_id = $1 FOR UPDATE"
)
#: Whether a replica's lease had run out (``None``: it has no row), row locked.
LEASE_LAPSED_FOR_UPDATE: Final = (
    "SELECT lease_expires_at < clock_timestamp() FROM {s}.replicas"
    " WHERE instance_id = $1 FOR UPDATE"
)
#: Take or extend a replica's lease ($4 seconds from now, by the database's clock).
RENEW_LEASE: Final = (
    "INSERT INTO {s}.replicas AS r (instance_id, hostname, pid, started_at, lease_expires_at)"
    " VALUES ($1, $2, $3, clock_timestamp(), clock_timestamp() + make_interval(secs => $4))"
    " ON CONFLICT (instance_id) DO UPDATE SET lease_expires_at = excluded.lease_expires_at,"
    " hostname = excluded.hostname, pid = excluded.pid"
)
#: A replica that closes: its lease ends now.
HAND_BACK_LEASE: Final = (
    "UPDATE {s}.replicas SET lease_expires_at = '-infinity' WHERE instance_id = $1"
)
#: Replicas (other than $1) whose lease has run out, row locked; SKIP LOCKED:
#: a replica renewing its lease right now is not dead.
DEAD_REPLICAS: Final = (
    "SELECT instance_id FROM {s}.replicas"
    " WHERE lease_expires_at < clock_timestamp() AND instance_id <> $1"
    " FOR UPDATE SKIP LOCKED"
)
#: Turn unknown the pending rows owned by $2 or by no registered replica. Rows
#: locked right now (being committed, or recovered by another replica) are
#: skipped: no waits, so no deadlocks between recoverers.
RECOVER: Final = (
    "WITH doomed AS (SELECT invocation_id, call_id FROM {s}.effects e"
    "  WHERE status = 'pending' AND (owner_instance = ANY($2::text[])"
    "   OR NOT EXISTS (SELECT 1 FROM {s}.replicas r WHERE r.instance_id = e.owner_instance))"
    "  ORDER BY invocation_id, call_id FOR UPDATE SKIP LOCKED)"
    " UPDATE {s}.effects e SET status = 'unknown', updated_at = $1 FROM doomed d"
    " WHERE e.invocation_id = d.invocation_id AND e.call_id = d.call_id"
    " RETURNING e.owner_instance"
)
FORGET_REPLICAS: Final = "DELETE FROM {s}.replicas WHERE instance_id = ANY($1::text[])"
RESERVE: Final = (
    "INSERT INTO {s}.reservations (reservation_id, invocation_id, tool, cost, owner_instance)"
    " VALUES ($1, $2, $3, $4, $5)"
)
#: Take one reservation (by begin, or to give it back): what it held, if it was there.
TAKE_RESERVATION: Final = (
    "DELETE FROM {s}.reservations WHERE reservation_id = $1 RETURNING invocation_id, tool, cost"
)
#: Take the reservations of $1's replicas or of no registered replica, as
#: RECOVER does their pending rows; skipped if locked (being taken right now).
RECOVER_RESERVATIONS: Final = (
    "DELETE FROM {s}.reservations r WHERE r.reservation_id IN ("
    "  SELECT reservation_id FROM {s}.reservations x WHERE x.owner_instance = ANY($1::text[])"
    "   OR NOT EXISTS (SELECT 1 FROM {s}.replicas p WHERE p.instance_id = x.owner_instance)"
    "  ORDER BY reservation_id FOR UPDATE SKIP LOCKED)"
    " RETURNING r.invocation_id, r.tool, r.cost"
)
#: Turn unknown the pending row of one attempt whose outcome went unwritten.
STRANDED_UNKNOWN: Final = (
    "UPDATE {s}.effects SET status = 'unknown', updated_at = $4"
    " WHERE invocation_id = $1 AND call_id = $2 AND attempt_id = $3 AND status = 'pending'"
)
OPEN_INVOCATION: Final = (
    "INSERT INTO {s}.invocations (invocation_id, plan_hash, created_at, deadline_at)"
    " VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING true"
)
#: An invocation's use, row locked: charges of one invocation take turns.
LOCK_BUDGET: Final = (
    "SELECT calls_used, cost_used FROM {s}.invocations WHERE invocation_id = $1 FOR UPDATE"
)
TOOL_USED: Final = "SELECT calls_used FROM {s}.tool_usage WHERE invocation_id = $1 AND tool = $2"
GET_EFFECT: Final = (
    f"SELECT {EFFECT_COLUMNS} FROM {{s}}.effects WHERE invocation_id = $1 AND call_id = $2"
)
LEASE_IS_LIVE: Final = (
    "SELECT lease_expires_at > clock_timestamp() FROM {s}.replicas WHERE instance_id = $1"
)
REVOKE: Final = (
    "INSERT INTO {s}.revocations (invocation_id, tool, revoked_at) VALUES ($1, $2, $3)"
    " ON CONFLICT DO NOTHING"
)
REVOKED: Final = "SELECT tool FROM {s}.revocations WHERE invocation_id = $1"
REJECT: Final = (
    "INSERT INTO {s}.rejections (invocation_id, call_id, idempotency_key, approval_id,"
    " rejected_at) VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING"
)
REJECTION: Final = (
    "SELECT idempotency_key, approval_id FROM {s}.rejections"
    " WHERE invocation_id = $1 AND call_id = $2"
)
CALLS: Final = (
    f"SELECT {EFFECT_COLUMNS} FROM {{s}}.effects WHERE invocation_id = $1"
    " ORDER BY created_at, call_id"
)
#: Which row commit, mark_unknown and release act on: a pending one, and (when
#: $3 is given) only the attempt this replica won.
SETTLE_WHERE: Final = (
    " WHERE invocation_id = $1 AND call_id = $2 AND status = 'pending'"
    " AND ($3::text IS NULL OR attempt_id = $3)"
)
COMMIT: Final = "UPDATE {s}.effects SET status = 'committed', response = $4, updated_at = $5"
MARK_UNKNOWN: Final = "UPDATE {s}.effects SET status = 'unknown', updated_at = $4"
RELEASE: Final = "DELETE FROM {s}.effects"
FORGET_CALLS: Final = "DELETE FROM {s}.effects WHERE invocation_id = $1 AND status <> 'pending'"


async def migrate(
    conn: asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record], schema: str
) -> int:
    """Create ``schema`` and run the migrations it lacks, inside the caller's
    transaction; returns the version found (a newer one is left untouched).

    Replicas opening a new database together take turns on an advisory lock.
    """
    quoted = f'"{schema}"'
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", f"hostcall.migrate:{schema}")
    if await conn.fetchval("SELECT to_regnamespace($1)", schema) is None:
        # Not CREATE SCHEMA IF NOT EXISTS: that needs the CREATE privilege even
        # when an administrator made the schema beforehand.
        await conn.execute(f"CREATE SCHEMA {quoted}")
    version = 0
    if await conn.fetchval("SELECT to_regclass($1)", f"{quoted}.meta") is not None:
        found = await conn.fetchval(f"SELECT value FROM {quoted}.meta WHERE key = 'schema_version'")
        version = int(found) if found is not None else 0
    if version >= SCHEMA_VERSION:
        return version
    for migration in MIGRATIONS[version:]:
        await conn.execute(migration.replace("{s}", quoted))
    await conn.execute(
        f"INSERT INTO {quoted}.meta (key, value) VALUES ('schema_version', $1)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        str(SCHEMA_VERSION),
    )
    return version


def effect_from_row(row: asyncpg.Record) -> EffectRecord:
    """The record of a row selected or returned with ``EFFECT_COLUMNS``."""
    response = row["response"]
    return EffectRecord(
        row["invocation_id"],
        row["call_id"],
        row["tool"],
        row["idempotency_key"],
        EffectStatus(row["status"]),
        row["execution_id"],
        json.loads(response) if response is not None else None,
        row["created_at"],
        row["updated_at"],
    )


def invocation_from_row(row: asyncpg.Record) -> InvocationRecord:
    """The record of a row selected with ``INVOCATION_QUERY``."""
    tool_calls = dict(zip(row["tools"], row["tool_calls"], strict=True))
    return InvocationRecord(
        row["invocation_id"],
        row["plan_hash"],
        row["created_at"],
        row["deadline_at"],
        BudgetUse(row["calls_used"], row["cost_used"], tool_calls),
    )
