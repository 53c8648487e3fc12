from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from supervisor import Supervisor
from tests.harness import Ledger
from tests.postgres_support import drop_schema, new_schema_name, postgres_server


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[Supervisor]:
    """A running supervisor on the default store (SQLite in a fresh state dir)."""
    async with Supervisor(state_dir=tmp_path / "state") as supervisor:
        yield supervisor


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A PostgreSQL server for the session (see tests/postgres_support.py):
    skips when there is none, but fails under CI=true or when
    $HOSTCALL_TEST_POSTGRES_DSN names one that does not answer."""
    with postgres_server() as dsn:
        yield dsn


@pytest.fixture
def postgres_schema(postgres_dsn: str) -> Iterator[str]:
    """A schema name of this test's own in ``postgres_dsn``; dropped afterwards."""
    schema = new_schema_name()
    try:
        yield schema
    finally:
        drop_schema(postgres_dsn, schema)
