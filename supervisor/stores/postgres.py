"""The effect store that replicas on several hosts share: PostgreSQL (docs/operations.md).

At-most-once across hosts rests on PostgreSQL alone: ``begin`` is one
``INSERT … ON CONFLICT DO NOTHING RETURNING`` (or, for a reversible tool, one
compare-and-set ``UPDATE`` of an ``unknown`` row); budgets are taken under a
row lock on the invocation. Every statement commits before it returns, with
``synchronous_commit = on`` (unless the DSN names another level; ``off`` is
refused): a ``pending`` row is durable before its handler is called.

Ownership. Each store instance is a *replica* with an id and a lease in the
``replicas`` table, renewed by a background task and timed by the database's
clock (never a host's). ``begin`` records the owner and only writes while the
owner's lease is live. A ``pending`` row whose owner's lease has run out
becomes ``unknown`` (on :meth:`PostgresEffectStore.open` and at every
renewal, by whichever replica gets there first); a live replica's rows are
never touched. A replica that restarts with the same id (the id is kept in
the state dir) turns its own leftover ``pending`` rows ``unknown`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import time
import urllib.parse
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypeAlias

import asyncpg
import psutil
from asyncpg.pool import PoolConnectionProxy

from supervisor.budget import BudgetLimits
from supervisor.canonical import compact_json
from supervisor.errors import StoreUnavailable
from supervisor.ids import is_valid_id, new_id
from supervisor.receipt_files import ReceiptLog
from supervisor.receipts import Receipts
from supervisor.stores.base import (
    Begun,
    BudgetUse,
    Charge,
    EffectRecord,
    InvocationRecord,
    NotPending,
    StartCall,
    charge_refusal,
)
from supervisor.stores.postgres_sql import (
    BEGIN_INSERT,
    BEGIN_RERUN,
    CALLS,
    COMMIT,
    DEAD_REPLICAS,
    FORGET_CALLS,
    FORGET_REPLICAS,
    GET_EFFECT,
    GET_INVOCATION,
    HAND_BACK_LEASE,
    LEASE_HOLDER,
    LEASE_IS_LIVE,
    LEASE_LAPSED_FOR_UPDATE,
    LEASE_ROW,
    LIST_INVOCATIONS,
    LOCK_BUDGET,
    MARK_UNKNOWN,
    OPEN_INVOCATION,
    RECOVER,
    RECOVER_RESERVATIONS,
    REJECT,
    REJECTION,
    RELEASE,
    RENEW_LEASE,
    RESERVE,
    REVOKE,
    REVOKED,
    SCHEMA_VERSION,
    SETTLE_WHERE,
    STRANDED_UNKNOWN,
    TAKE_RESERVATION,
    TOOL_USED,
    USE,
    effect_from_row,
    invocation_from_row,
    migrate,
)

__all__ = [
    "ACQUIRE_TIMEOUT_S",
    "COMMAND_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
    "DEFAULT_SCHEMA",
    "LEASE_S",
    "POOL_MAX_SIZE",
    "RENEW_S",
    "SCHEMA_VERSION",
    "PostgresEffectStore",
    "redact_dsn",
]

logger = logging.getLogger(__name__)

#: How long a replica's lease lasts past its last renewal.
LEASE_S: Final = 10.0
#: How often the heartbeat renews the lease and recovers dead replicas' rows.
RENEW_S: Final = 3.0
#: Bound on opening one connection (TCP, TLS, authentication).
CONNECT_TIMEOUT_S: Final = 5.0
#: Bound on one statement; past it the call is refused ``store_unavailable``.
COMMAND_TIMEOUT_S: Final = 10.0
#: Bound on waiting for a free pooled connection (all busy: a burst of calls).
ACQUIRE_TIMEOUT_S: Final = 10.0
#: Connections one replica keeps at most.
POOL_MAX_SIZE: Final = 10
#: Bound on :meth:`PostgresEffectStore.close` handing back its lease.
CLOSE_TIMEOUT_S: Final = 5.0
#: Where the tables live unless ``schema=`` / ``?hostcall_schema=`` says otherwise.
DEFAULT_SCHEMA: Final = "hostcall"
#: How often ``begin`` retries when a record vanishes between its statements.
_BEGIN_ROUNDS: Final = 8

_DSN_OPTIONS: Final = frozenset(
    {"hostcall_schema", "hostcall_lease_s", "hostcall_renew_s", "hostcall_pool_max"}
)
_SCHEMA_NAME: Final = re.compile(r"[a-z_][a-z0-9_]{0,62}")
#: What the driver raises when the database cannot be reached or refuses.
_DRIVER_ERRORS: Final = (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError)

_Conn: TypeAlias = "asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]"
_Key: TypeAlias = tuple[str, str]


class PostgresEffectStore:
    """:class:`~supervisor.stores.base.EffectStore` in PostgreSQL, shared by replicas.

    Args:
        dsn: ``postgresql://user[:password]@host[:port]/database[?…]``, as
            asyncpg takes it. The query may also carry this store's options
            (``hostcall_schema``, ``hostcall_lease_s``, ``hostcall_renew_s``,
            ``hostcall_pool_max``); keyword arguments take precedence over them.
        schema: the PostgreSQL schema that holds the tables (created if
            missing). Replicas that share records use the same schema.
        instance_id: this replica's id. Default: read from ``identity_file``
            (created there on first use), else a fresh random id.
        identity_file: where a replica id outlives restarts (the state dir).
        lease_s: how long the lease lasts past each renewal.
        renew_s: how often it is renewed (default: ``min(RENEW_S, lease_s / 3)``).
        pool_max_size: connections kept at most.
        connect_timeout_s: bound on opening one connection.
        command_timeout_s: bound on one statement.

    Raises:
        ValueError: a DSN that is not ``postgresql://`` or ``postgres://``, an
            unknown ``hostcall_*`` option or a value out of range.
    """

    #: The stores open in this process: a replica id is in use here if one of
    #: them holds it (see :meth:`_claim_identity`).
    _open_here: ClassVar[weakref.WeakSet[PostgresEffectStore]] = weakref.WeakSet()

    #: Records survive the process; receipts go to the file (fsync'd) of the
    #: replica that answered, not through the shared database.
    durable = True

    def __init__(
        self,
        dsn: str,
        *,
        schema: str | None = None,
        instance_id: str | None = None,
        identity_file: str | os.PathLike[str] | None = None,
        lease_s: float | None = None,
        renew_s: float | None = None,
        pool_max_size: int | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        command_timeout_s: float = COMMAND_TIMEOUT_S,
    ) -> None:
        self._dsn, options, self._session = _split_dsn(dsn)
        level = self._setting("synchronous_commit")
        if level is not None and level.strip().lower() in _NOT_SYNCHRONOUS:
            raise ValueError(f"synchronous_commit={level} could lose a pending row: leave it out")
        #: The DSN with any password masked: safe for logs and error messages.
        self.where = redact_dsn(self._dsn)
        self.schema = schema or options.get("hostcall_schema", DEFAULT_SCHEMA)
        if not _SCHEMA_NAME.fullmatch(self.schema):
            raise ValueError(f"schema {self.schema!r}: use 1-63 of [a-z0-9_], not a digit first")
        self.lease_s = _number(lease_s, options, "hostcall_lease_s", LEASE_S)
        default_renew = min(RENEW_S, self.lease_s / 3)
        self.renew_s = _number(renew_s, options, "hostcall_renew_s", default_renew)
        if not 0 < self.renew_s < self.lease_s:
            raise ValueError("the lease must outlast its renewal: 0 < renew_s < lease_s")
        self.pool_max_size = int(
            _number(pool_max_size, options, "hostcall_pool_max", POOL_MAX_SIZE)
        )
        if self.pool_max_size < 1:
            raise ValueError("pool_max_size must be at least 1")
        if instance_id is not None and not is_valid_id(instance_id):
            raise ValueError("replica ids are 1-128 characters of [A-Za-z0-9._:-]")
        self._instance_id = instance_id
        self._identity_file = Path(identity_file) if identity_file is not None else None
        self._connect_timeout_s = connect_timeout_s
        self._command_timeout_s = command_timeout_s
        self._s = f'"{self.schema}"'
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        # Attempts this replica won and has not settled; attempts whose outcome
        # could not be written (turned unknown once the database answers).
        self._won: dict[_Key, str] = {}
        self._stranded: dict[_Key, str] = {}

    @property
    def instance_id(self) -> str:
        """This replica's id (known once :meth:`open` has run, or when given)."""
        if self._instance_id is None:
            raise RuntimeError("the replica id is known once the store is open")
        return self._instance_id

    # -- connections --------------------------------------------------------

    def _q(self, sql: str) -> str:
        return sql.replace("{s}", self._s)

    def _unavailable(self, exc: BaseException, doing: str = "") -> StoreUnavailable:
        what = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        return StoreUnavailable(f"PostgreSQL effect store {self.where}{doing}: {what}")

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[_Conn]:
        """A pooled connection; driver errors leave as ``StoreUnavailable``."""
        pool = self._pool
        if pool is None:
            raise RuntimeError("PostgresEffectStore used before open() or after close()")
        try:
            async with pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                yield conn
        except _DRIVER_ERRORS as exc:
            raise self._unavailable(exc) from exc

    @staticmethod
    async def _keep_session(conn: asyncpg.Connection[asyncpg.Record]) -> None:
        """Released connections skip asyncpg's ``RESET ALL`` round trip: this
        store leaves no session state behind (no SET, LISTEN, cursors or
        session advisory locks), and an open transaction is still rolled back."""

    # -- lifecycle ------------------------------------------------------------

    def receipts(self, path: Path, executor: Executor | None) -> Receipts:
        # Written after the commit: a crash in between, or another replica
        # that ran the call, leaves no line here (docs/replicas.md).
        return ReceiptLog(path, executor, fsync=True, commit=self.commit)

    def set_load_hint(self, active_requests: Callable[[], int]) -> None:
        return None  # the server batches; nothing to learn

    async def open(self) -> int:
        """Connect, create or migrate the schema, register this replica's lease
        and turn the pending rows of dead replicas (and its own earlier life's)
        unknown; then keep the lease renewed until :meth:`close`.

        Returns:
            How many pending rows became unknown.

        Raises:
            StoreUnavailable: the database cannot be reached, refuses us, or
                holds a schema from a newer hostcall.
        """
        if self._pool is not None:
            raise RuntimeError("PostgresEffectStore.open() called twice")
        self._instance_id = self._instance_id or self._identity()
        try:
            pool = await asyncpg.create_pool(
                self._dsn,
                min_size=1,
                max_size=self.pool_max_size,
                timeout=self._connect_timeout_s,
                command_timeout=self._command_timeout_s,
                reset=self._keep_session,
                server_settings=self._server_settings(),
            )
        except (*_DRIVER_ERRORS, ValueError) as exc:  # ValueError: a DSN asyncpg cannot parse
            raise self._unavailable(exc, " cannot be opened") from exc
        self._pool = pool
        try:
            await self._check_durable()
            await self._migrate()
            await self._claim_identity()
            await self._renew()
            recovered = await self._recover(time.time(), own=True)
        except BaseException:
            self._pool = None
            pool.terminate()
            raise
        self._heartbeat_task = asyncio.create_task(
            self._heartbeat(), name=f"hostcall-lease-{self._instance_id}"
        )
        return recovered

    def _setting(self, name: str) -> str | None:
        """A setting the DSN names for the session (PostgreSQL's names are
        case-insensitive), or None."""
        found = [value for key, value in self._session.items() if key.lower() == name]
        return found[-1] if found else None

    async def _check_durable(self) -> None:
        """Refuse a session that commits without waiting for the disk, however
        it came to (the DSN is checked when the store is made; this is what
        the server says)."""
        async with self._conn() as conn:
            level = await conn.fetchval("SHOW synchronous_commit")
        if level == "off":
            raise StoreUnavailable(
                f"effect store {self.where} runs with synchronous_commit=off, which could "
                "lose a pending row: leave it on"
            )

    def _server_settings(self) -> dict[str, str]:
        settings: dict[str, str] = {}
        if "application_name" not in self._session:
            settings["application_name"] = f"hostcall {self._instance_id}"[:63]
        if self._setting("synchronous_commit") is None:
            # A pending row must be durable when begin returns, whatever the
            # role's or the database's default says.
            settings["synchronous_commit"] = "on"
        return settings

    def _identity(self) -> str:
        """The replica id kept in ``identity_file`` (made on first use), or a new one."""
        if self._identity_file is None:
            return new_id("rep")
        path = self._identity_file
        try:
            found = path.read_text().strip() if path.exists() else ""
            if is_valid_id(found):
                return found
            if found:
                logger.warning("%s does not hold a replica id: replacing it", path)
            # Written whole or not at all (the state dir's lock keeps other
            # supervisors out): a crash here leaves no half-written id.
            minted = new_id("rep")
            partial = path.with_name(path.name + ".tmp")
            with open(partial, "w") as out:
                out.write(minted + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(partial, path)
            return minted
        except OSError as exc:
            raise StoreUnavailable(f"cannot keep the replica id in {path}: {exc}") from exc

    async def _migrate(self) -> None:
        async with self._conn() as conn, conn.transaction():
            found = await migrate(conn, self.schema)
        if found > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"PostgreSQL effect store {self.where}: schema {self.schema} is at version"
                f" {found}, newer than this hostcall ({SCHEMA_VERSION})"
            )

    async def close(self) -> None:
        """Stop the heartbeat and hand back the lease: from then on any replica
        may turn this one's leftover pending rows unknown. Idempotent."""
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        pool, self._pool = self._pool, None
        self._won.clear()
        self._stranded.clear()
        if pool is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                async with pool.acquire() as conn:
                    await conn.execute(
                        self._q(HAND_BACK_LEASE),
                        self._instance_id,
                    )
                await pool.close()
        except _DRIVER_ERRORS as exc:
            logger.warning(
                "replica %s could not hand back its lease (%s); it runs out within %g s",
                self._instance_id,
                self._unavailable(exc).message,
                self.lease_s,
            )
            pool.terminate()

    # -- the lease ------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                await self._renew()
                await self._recover(time.time(), own=False)
                await self._settle_stranded(time.time())
            except StoreUnavailable as exc:
                # Bounded by the statement timeouts; the next round tries again.
                logger.warning("replica %s: heartbeat failed: %s", self._instance_id, exc)
            except Exception:  # boundary: the lease must outlive any one bad round
                logger.exception("replica %s: heartbeat failed", self._instance_id)

    async def _claim_identity(self) -> None:
        """Open only as a replica id nobody else holds: a supervisor started on
        a copy of another's state dir (a cloned image, a restored backup, a
        shared volume) would otherwise take the other's calls in flight for
        its own earlier life's and turn them unknown.

        The id's lease is free when it has run out or was handed back; when
        its holder is a process of this host that no longer exists, or a store
        of this process that is no longer open (an earlier life: recovered
        at once). Otherwise the lease is watched: renewed, it has a live
        holder and the store is refused; run out, it is taken.

        Raises:
            StoreUnavailable: another live supervisor holds the id.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease_s + self.renew_s + LEASE_WATCH_SLACK_S
        seen = None
        while True:
            # The look and the take in one transaction, the row locked: of
            # two copies started at the same moment, the second sees the first.
            async with self._conn() as conn, conn.transaction():
                await conn.execute(self._q(LEASE_ROW), self._instance_id)
                holder = await conn.fetchrow(self._q(LEASE_HOLDER), self._instance_id)
                if holder is None:  # forgotten in between by another replica: again
                    continue
                if not holder["live"] or self._earlier_life(holder):
                    await self._take_lease(conn)
                    return
            if seen is not None and holder["lease_expires_at"] != seen:
                raise StoreUnavailable(
                    f"replica id {self._instance_id} is in use by a live supervisor "
                    f"(host {holder['hostname']}, pid {holder['pid']}) on {self.where}: "
                    "was its state dir copied? give each supervisor a state dir of its own"
                )
            seen = holder["lease_expires_at"]
            if loop.time() > deadline:  # a lease longer than ours: its holder is not us
                raise StoreUnavailable(
                    f"replica id {self._instance_id}: its lease held by host "
                    f"{holder['hostname']}, pid {holder['pid']}, has not run out"
                )
            await asyncio.sleep(min(LEASE_WATCH_S, self.renew_s / 2))

    async def _take_lease(self, conn: _Conn) -> None:
        await conn.execute(
            self._q(RENEW_LEASE),
            self._instance_id,
            socket.gethostname(),
            os.getpid(),
            self.lease_s,
        )
        # Open from now on, for _earlier_life: a store of this process
        # opening at the same moment must not take this one for a past life.
        self._open_here.add(self)

    def _earlier_life(self, holder: asyncpg.Record) -> bool:
        """Whether the lease's holder is this replica's own earlier life."""
        if holder["hostname"] != socket.gethostname():
            return False
        if holder["pid"] == os.getpid():
            return not any(
                other is not self
                and other._pool is not None
                and (other.where, other.schema, other._instance_id)
                == (self.where, self.schema, self._instance_id)
                for other in self._open_here
            )
        return not psutil.pid_exists(holder["pid"])

    async def _renew(self) -> None:
        """Extend (or first take) this replica's lease, by the database's clock."""
        async with self._conn() as conn, conn.transaction():
            lapsed = await conn.fetchval(
                self._q(LEASE_LAPSED_FOR_UPDATE),
                self._instance_id,
            )
            await self._take_lease(conn)
        if lapsed is not False and self._heartbeat_task is not None:
            logger.warning(
                "replica %s: its lease had run out before this renewal; calls it had in"
                " flight may have been turned unknown by other replicas",
                self._instance_id,
            )

    async def _recover(self, now: float, *, own: bool) -> int:
        """Turn unknown every pending row whose owner's lease has run out (and,
        when ``own``, this replica's earlier life's); a live owner's rows stay."""
        async with self._conn() as conn, conn.transaction():
            dead = [
                row[0]
                for row in await conn.fetch(
                    self._q(DEAD_REPLICAS),
                    self._instance_id,
                )
            ]
            owners = [*dead, self._instance_id] if own else dead

            rows = await conn.fetch(
                self._q(RECOVER),
                now,
                owners,
            )
            # Their calls waiting for approval never ran: the budget goes back.
            returned = await conn.fetch(self._q(RECOVER_RESERVATIONS), owners)
            for invocation_id, tool, cost in sorted(tuple(row) for row in returned):
                await conn.execute(self._q(USE), invocation_id, tool, -1, -float(cost))
            if dead:
                await conn.execute(self._q(FORGET_REPLICAS), dead)
        if returned:
            logger.warning(
                "%d call(s) were waiting for approval on a replica that stopped without"
                " giving their budget back: given back now",
                len(returned),
            )
        if rows and not own:
            logger.warning(
                "%d call(s) were in flight on replica(s) %s when their lease ran out: now unknown",
                len(rows),
                ", ".join(sorted({row[0] for row in rows})),
            )
        return len(rows)

    async def _settle_stranded(self, now: float) -> None:
        """Turn unknown the pending rows whose outcome this replica could not write."""
        for key, attempt in list(self._stranded.items()):
            async with self._conn() as conn:
                await conn.execute(
                    self._q(STRANDED_UNKNOWN),
                    *key,
                    attempt,
                    now,
                )
            if self._stranded.get(key) == attempt:
                del self._stranded[key]

    # -- invocations and budget -------------------------------------------------

    async def open_invocation(
        self, invocation_id: str, plan_hash: str, deadline_at: float | None, now: float
    ) -> tuple[InvocationRecord, bool]:
        async with self._conn() as conn:
            created = await conn.fetchval(
                self._q(OPEN_INVOCATION),
                invocation_id,
                plan_hash,
                float(now),
                None if deadline_at is None else float(deadline_at),
            )
            record = await self._invocation(conn, invocation_id)
        assert record is not None
        return record, created is True

    async def _invocation(self, conn: _Conn, invocation_id: str) -> InvocationRecord | None:
        row = await conn.fetchrow(self._q(GET_INVOCATION), invocation_id)
        return None if row is None else invocation_from_row(row)

    async def get_invocation(self, invocation_id: str) -> InvocationRecord | None:
        async with self._conn() as conn:
            return await self._invocation(conn, invocation_id)

    async def list_invocations(self) -> list[InvocationRecord]:
        async with self._conn() as conn:
            rows = await conn.fetch(self._q(LIST_INVOCATIONS))
        return [invocation_from_row(row) for row in rows]

    async def reserve(
        self, invocation_id: str, tool: str, cost: float, limits: BudgetLimits
    ) -> str | None:
        reservation = new_id("rsv")
        async with self._conn() as conn, conn.transaction():
            refused = await self._charge(conn, invocation_id, Charge(tool, cost, limits, None), 0.0)
            if refused is not None:
                return None
            await conn.execute(
                self._q(RESERVE), reservation, invocation_id, tool, float(cost), self._instance_id
            )
        return reservation

    async def _charge(
        self, conn: _Conn, invocation_id: str, charge: Charge, now: float
    ) -> Literal["limits", "deadline"] | None:
        """Take ``charge`` from the budget inside the caller's transaction, or
        say why it does not fit. The invocation's row lock serializes charges
        across replicas; the statements after it see every charge before it."""
        used = await conn.fetchrow(
            self._q(LOCK_BUDGET),
            invocation_id,
        )
        so_far: BudgetUse | None = None
        if used is not None:
            tool_used = await conn.fetchval(
                self._q(TOOL_USED),
                invocation_id,
                charge.tool,
            )
            so_far = BudgetUse(used[0], used[1], {charge.tool: tool_used or 0})
        refused = charge_refusal(charge, so_far, now)
        if refused is None:
            await conn.execute(self._q(USE), invocation_id, charge.tool, 1, float(charge.cost))
        return refused

    async def refund(self, reservation_id: str) -> None:
        async with self._conn() as conn, conn.transaction():
            taken = await conn.fetchrow(self._q(TAKE_RESERVATION), reservation_id)
            if taken is not None:
                await conn.execute(self._q(USE), taken[0], taken[1], -1, -float(taken[2]))

    # -- effect records -----------------------------------------------------------

    async def get(self, invocation_id: str, call_id: str) -> EffectRecord | None:
        async with self._conn() as conn:
            row = await conn.fetchrow(
                self._q(GET_EFFECT),
                invocation_id,
                call_id,
            )
        return None if row is None else effect_from_row(row)

    async def begin(
        self,
        start: StartCall,
        now: float,
        charge: Charge | None = None,
        reservation: str | None = None,
    ) -> Begun:
        key = (start.invocation_id, start.call_id)
        attempt = uuid.uuid4().hex
        try:
            async with self._conn() as conn:
                for _ in range(_BEGIN_ROUNDS):
                    begun = await self._try_begin(conn, start, now, charge, attempt, reservation)
                    if begun is not None:
                        if begun.won:
                            self._won[key] = attempt
                        return begun
                    # Nothing written and no record to answer from: our lease
                    # lapsed, or the record changed between our statements.
                    live = await conn.fetchval(
                        self._q(LEASE_IS_LIVE),
                        self._instance_id,
                    )
                    if not live:
                        raise StoreUnavailable(
                            f"replica {self._instance_id}'s lease has run out; it begins no"
                            " call until the lease is renewed"
                        )
        except BaseException:
            # The insert may have landed without our hearing of it: if so, the
            # heartbeat turns that row unknown (this attempt never dispatches).
            self._stranded[key] = attempt
            raise
        raise StoreUnavailable(f"the record of {start.call_id} kept changing; nothing ran")

    async def _try_begin(
        self,
        conn: _Conn,
        start: StartCall,
        now: float,
        charge: Charge | None,
        attempt: str,
        reservation: str | None,
    ) -> Begun | None:
        """One round of :meth:`begin`; ``None`` when it neither won nor found a
        record to answer from."""
        args = (
            start.invocation_id,
            start.call_id,
            start.tool,
            start.idempotency_key,
            start.execution_id,
            float(now),
            self._instance_id,
            attempt,
        )
        refused: Literal["limits", "deadline"] | None = None
        try:
            async with conn.transaction():
                # The insert (or compare-and-set) comes first: a concurrent
                # begin of the same call waits on it, then finds the record and
                # loses without touching the budget.
                row = await conn.fetchrow(self._q(BEGIN_INSERT), *args)
                if row is None and start.reversible:
                    row = await conn.fetchrow(self._q(BEGIN_RERUN), *args)
                if row is not None:
                    if reservation is not None and await conn.fetchrow(
                        self._q(TAKE_RESERVATION), reservation
                    ):
                        charge = None  # paid for by its reservation
                    if charge is not None:
                        refused = await self._charge(conn, start.invocation_id, charge, now)
                        if refused is not None:
                            raise _Refused  # rolls the insert back
                    return Begun(True, effect_from_row(row))
        except _Refused:
            pass
        existing = await conn.fetchrow(
            self._q(GET_EFFECT),
            start.invocation_id,
            start.call_id,
        )
        record = None if existing is None else effect_from_row(existing)
        if refused is not None:
            return Begun(False, record, refused)
        if record is None or start.reruns(record):
            return None
        return Begun(False, record)

    async def _settle(self, sql: str, key: _Key, *args: Any) -> bool:
        """Write the outcome of a pending record (only the attempt this replica
        won, if it won one); if the write fails, the heartbeat makes it unknown.
        Whether a record was written."""
        attempt = self._won.pop(key, None)
        try:
            async with self._conn() as conn:
                status = await conn.execute(
                    self._q(sql + SETTLE_WHERE),
                    *key,
                    attempt,
                    *args,
                )
        except BaseException:
            if attempt is not None:
                self._stranded[key] = attempt
            raise
        written = not status.endswith(" 0")
        if attempt is not None and not written:
            logger.warning(
                "call %s of %s: its record was no longer this replica's pending attempt"
                " (its lease ran out?); the outcome was not recorded",
                key[1],
                key[0],
            )
        return written

    async def commit(
        self, invocation_id: str, call_id: str, response: Mapping[str, Any], now: float
    ) -> None:
        text = compact_json(response)
        if not await self._settle(COMMIT, (invocation_id, call_id), text, float(now)):
            raise NotPending(f"the record of {call_id} is no longer this replica's pending one")

    async def mark_unknown(self, invocation_id: str, call_id: str, now: float) -> None:
        await self._settle(
            MARK_UNKNOWN,
            (invocation_id, call_id),
            float(now),
        )

    async def release(self, invocation_id: str, call_id: str) -> None:
        await self._settle(RELEASE, (invocation_id, call_id))

    async def revoke(self, invocation_id: str, tool: str, now: float) -> None:
        async with self._conn() as conn:
            await conn.execute(
                self._q(REVOKE),
                invocation_id,
                tool,
                float(now),
            )

    async def revoked(self, invocation_id: str) -> frozenset[str]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                self._q(REVOKED),
                invocation_id,
            )
        return frozenset(row[0] for row in rows)

    async def reject(
        self, invocation_id: str, call_id: str, idempotency_key: str, approval_id: str, now: float
    ) -> None:
        async with self._conn() as conn:
            await conn.execute(
                self._q(REJECT), invocation_id, call_id, idempotency_key, approval_id, float(now)
            )

    async def rejection(self, invocation_id: str, call_id: str) -> tuple[str, str] | None:
        async with self._conn() as conn:
            row = await conn.fetchrow(self._q(REJECTION), invocation_id, call_id)
        return None if row is None else (row[0], row[1])

    async def forget_calls(self, invocation_id: str) -> int:
        async with self._conn() as conn:
            status = await conn.execute(self._q(FORGET_CALLS), invocation_id)
        return int(status.split()[-1])  # "DELETE n"

    async def calls(self, invocation_id: str) -> list[EffectRecord]:
        async with self._conn() as conn:
            rows = await conn.fetch(
                self._q(CALLS),
                invocation_id,
            )
        return [effect_from_row(row) for row in rows]


class _Refused(Exception):
    """Raised inside begin's transaction to roll it back: the charge did not fit."""


#: How often a replica id's lease is looked at while another may hold it.
LEASE_WATCH_S: Final = 0.5
#: Beyond a lease and a renewal: how long the watch waits at most.
LEASE_WATCH_SLACK_S: Final = 2.0
#: What PostgreSQL takes for ``synchronous_commit = off`` (any case).
_NOT_SYNCHRONOUS: Final = frozenset({"off", "false", "no", "0"})


def _split_dsn(dsn: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """The DSN for asyncpg; this store's ``hostcall_*`` options taken out of its
    query (asyncpg would send them to the server as settings); the rest of the
    query, by name."""
    parts = urllib.parse.urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("a PostgreSQL store is named by a postgresql:// or postgres:// DSN")
    kept: list[str] = []
    options: dict[str, str] = {}
    session: dict[str, str] = {}
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = item.partition("=")
        name = urllib.parse.unquote_plus(name)
        if not name.startswith("hostcall_"):
            kept.append(item)
            session[name] = urllib.parse.unquote_plus(value)
        elif name in _DSN_OPTIONS:
            options[name] = urllib.parse.unquote_plus(value)
        else:
            raise ValueError(f"unknown option {name!r}: use one of {sorted(_DSN_OPTIONS)}")
    return urllib.parse.urlunsplit(parts._replace(query="&".join(kept))), options, session


def _number(given: float | None, options: Mapping[str, str], name: str, default: float) -> float:
    if given is not None:
        value = float(given)
    elif name in options:
        try:
            value = float(options[name])
        except ValueError:
            raise ValueError(f"{name}={options[name]!r} is not a number") from None
    else:
        value = float(default)
    if not value > 0:
        raise ValueError(f"{name.removeprefix('hostcall_')} must be greater than 0")
    return value


def redact_dsn(dsn: str) -> str:
    """The DSN with any password (in the authority or the query) masked."""
    parts = urllib.parse.urlsplit(dsn)
    netloc = re.sub(r"^([^:@/]*):[^@]*@", r"\1:***@", parts.netloc)
    query = re.sub(r"(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query))
