"""Where the PostgreSQL tests get a server, and how each test gets its own schema.

The server, in this order:

1. ``$HOSTCALL_TEST_POSTGRES_DSN`` — CI sets it (``.ci/run``). If it is set
   and the server does not answer within ``CI_WAIT_S``, the tests **fail**.
2. The local default, ``postgresql://postgres@127.0.0.1:5432/test``, if it
   answers within ``PROBE_TIMEOUT_S``.
3. A throwaway cluster made with ``initdb`` / ``pg_ctl`` (found on ``PATH`` or
   under ``/usr/lib/postgresql/*/bin``) in a private temporary directory,
   reachable only through a Unix socket there, stopped when the session ends.
   ``initdb`` refuses to run as root: as root, the cluster is made and run as
   the ``postgres`` user (``runuser``) when that user exists.
4. Otherwise the PostgreSQL tests are skipped, saying why — except under
   ``CI=true``, where they fail: CI never skips them.

Each test gets a fresh schema (``hostcall_t_<random>``) in that server, which
the store creates and the fixture drops afterwards: tests never share tables
and never assume an empty database.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TypeVar

import asyncpg
import pytest

T = TypeVar("T")

ENV_DSN: Final = "HOSTCALL_TEST_POSTGRES_DSN"
LOCAL_DSN: Final = "postgresql://postgres@127.0.0.1:5432/test"
#: How long the local default gets to answer before we look further.
PROBE_TIMEOUT_S: Final = 3.0
#: How long a server named by ``$HOSTCALL_TEST_POSTGRES_DSN`` gets to come up.
CI_WAIT_S: Final = 30.0
#: Bound on ``initdb``, ``pg_ctl start`` and ``pg_ctl stop`` each.
CLUSTER_STEP_S: Final = 60.0
#: Bound on any one statement the fixtures run.
STATEMENT_S: Final = 10.0
#: The throwaway cluster's port: it names the socket file only (no TCP), in a
#: private directory, so it cannot collide with another server.
CLUSTER_PORT: Final = 5432


def run_async(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on a private loop in a worker thread, so
    that sync fixtures work whether or not a test's event loop is running."""

    async def bounded() -> T:
        async with asyncio.timeout(CI_WAIT_S + STATEMENT_S):
            return await make()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, bounded()).result()


async def _probe(dsn: str, timeout_s: float) -> None:
    conn = await asyncpg.connect(dsn, timeout=timeout_s)
    try:
        await conn.fetchval("SELECT 1", timeout=timeout_s)
    finally:
        await conn.close(timeout=timeout_s)


def answers(dsn: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """``None`` if the server answers, else why not."""
    try:
        run_async(lambda: _probe(dsn, timeout_s))
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def wait_for(dsn: str, within_s: float) -> str | None:
    """Like :func:`answers`, retried until ``within_s`` has passed."""

    async def until_up() -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            try:
                await _probe(dsn, PROBE_TIMEOUT_S)
                return None
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                if loop.time() >= deadline:
                    return f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)  # a server starting up: poll, bounded by the deadline

    return run_async(until_up)


def find_server_binaries() -> Path | None:
    """A folder with ``initdb``, ``pg_ctl`` and ``postgres``: PATH first, then
    the newest ``/usr/lib/postgresql/*/bin``."""
    folders: list[Path] = []
    on_path = shutil.which("initdb")
    if on_path:
        folders.append(Path(on_path).resolve().parent)

    def version(folder: str) -> int:
        name = Path(folder).parent.name
        return int(name) if name.isdigit() else 0

    folders += [Path(f) for f in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version)[::-1]]
    for folder in folders:
        if all(os.access(folder / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


@dataclass
class ThrowawayCluster:
    """A PostgreSQL cluster in a temporary directory, on a Unix socket only."""

    binaries: Path
    root: Path
    run_as: str | None  # a user to run the server as (needed when we are root)

    @property
    def dsn(self) -> str:
        host = urllib.parse.quote(str(self.root), safe="")
        return f"postgresql://postgres@/postgres?host={host}&port={CLUSTER_PORT}"

    def _run(self, *argv: str) -> None:
        command = [str(self.binaries / argv[0]), *argv[1:]]
        if self.run_as is not None:
            command = ["runuser", "-u", self.run_as, "--", *command]
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=CLUSTER_STEP_S, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed: {done.stderr.strip()[-2000:]}")

    def start(self) -> None:
        data = self.root / "data"
        self._run(
            "initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
            "--locale=C", "--no-sync", "--no-instructions",
        )  # fmt: skip
        settings = (
            f"-c listen_addresses='' -c unix_socket_directories='{self.root}' -p {CLUSTER_PORT}"
            " -c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        log = self.root / "server.log"
        self._run("pg_ctl", "-D", str(data), "-l", str(log), "-o", settings, "-w",
                  "-t", str(int(CLUSTER_STEP_S)), "start")  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w",
                      "-t", str(int(CLUSTER_STEP_S)), "stop")  # fmt: skip
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def throwaway_cluster(binaries: Path) -> Iterator[str]:
    """Start a throwaway cluster and yield its DSN; stop and remove it after.

    Raises:
        RuntimeError: it cannot be made (as root, with no ``postgres`` user).
    """
    run_as: str | None = None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise RuntimeError(
                "initdb refuses to run as root, and there is no 'postgres' user to run it as"
            ) from None
        if shutil.which("runuser") is None:
            raise RuntimeError("running as root, and there is no runuser to drop privileges")
        run_as = user.pw_name
    # A short path: the socket's full path must fit sun_path (108 bytes).
    root = Path(tempfile.mkdtemp(prefix="hcpg-", dir="/tmp"))
    if run_as is not None:
        user = pwd.getpwnam(run_as)
        os.chown(root, user.pw_uid, user.pw_gid)
    cluster = ThrowawayCluster(binaries, root, run_as)
    try:
        cluster.start()
        yield cluster.dsn
    finally:
        cluster.stop()


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """The DSN of a server for this session (see the module docstring)."""
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    configured = os.environ.get(ENV_DSN)
    if configured:
        problem = wait_for(configured, CI_WAIT_S)
        if problem is not None:
            pytest.fail(f"${ENV_DSN} is set but its server does not answer: {problem}")
        yield configured
        return
    if answers(LOCAL_DSN) is None:
        yield LOCAL_DSN
        return
    binaries = find_server_binaries()
    why = "no PostgreSQL server answers at the local default and no initdb/pg_ctl was found"
    if binaries is not None:
        cluster = contextlib.ExitStack()
        try:
            dsn = cluster.enter_context(throwaway_cluster(binaries))
        except RuntimeError as exc:
            why = f"a throwaway cluster could not be started: {exc}"
        else:
            with cluster:
                yield dsn
            return
    message = (
        f"PostgreSQL tests need a server: {why}. Set ${ENV_DSN}, run one at {LOCAL_DSN}, "
        "or install the server binaries (initdb, pg_ctl)"
    )
    if in_ci:
        pytest.fail(message + " — CI never skips them")
    pytest.skip(message)


def with_options(dsn: str, **options: object) -> str:
    """``dsn`` with ``hostcall_<name>=<value>`` added to its query."""
    extra = urllib.parse.urlencode({f"hostcall_{k}": str(v) for k, v in options.items()})
    return f"{dsn}{'&' if '?' in dsn else '?'}{extra}"


def without_options(dsn: str) -> str:
    """``dsn`` without its ``hostcall_*`` options: what a plain driver connection takes."""
    parts = urllib.parse.urlsplit(dsn)
    kept = [item for item in parts.query.split("&") if item and not item.startswith("hostcall_")]
    return urllib.parse.urlunsplit(parts._replace(query="&".join(kept)))


def new_schema_name() -> str:
    """A schema name no other test uses."""
    return f"hostcall_t_{secrets.token_hex(6)}"


def drop_schema(dsn: str, schema: str) -> None:
    """Drop a test's schema and everything in it."""

    async def drop() -> None:
        conn = await asyncpg.connect(dsn, timeout=STATEMENT_S)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE', timeout=STATEMENT_S)
        finally:
            await conn.close(timeout=STATEMENT_S)

    run_async(drop)


class Partition:
    """A TCP proxy in front of the server that a test can cut and restore:
    what a store sees when the network to its database fails."""

    def __init__(self, dsn: str) -> None:
        self._upstream = _address(dsn)
        self._base = dsn
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def dsn(self) -> str:
        """The server's DSN, through this proxy."""
        parts = urllib.parse.urlsplit(self._base)
        user = parts.netloc.rpartition("@")[0]
        query = [
            item
            for item in parts.query.split("&")
            if item and item.partition("=")[0] not in ("host", "port")
        ]
        netloc = f"{user}@127.0.0.1:{self.port}" if user else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query="&".join(query)))

    async def start(self) -> None:
        """Listen (again, on the same port once it has one)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Stop listening and break every connection through the proxy."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._upstream[0] == "unix":
                up_reader, up_writer = await asyncio.open_unix_connection(self._upstream[1])
            else:
                host, port = self._upstream[1], int(self._upstream[2])
                up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.transport.abort()


def _address(dsn: str) -> tuple[str, ...]:
    """Where a DSN's server listens: ``("unix", path)`` or ``("tcp", host, port)``."""
    parts = urllib.parse.urlsplit(dsn)
    query = dict(urllib.parse.parse_qsl(parts.query))
    port = int(query.get("port") or parts.port or 5432)
    host = query.get("host") or parts.hostname or "/var/run/postgresql"
    if host.startswith("/"):
        return ("unix", f"{host}/.s.PGSQL.{port}")
    return ("tcp", host, str(port))
