from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from supervisor import Supervisor
from tests.harness import Ledger


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
async def sup(tmp_path: Path) -> AsyncIterator[Supervisor]:
    """A running supervisor on the default store (SQLite in a fresh state dir)."""
    async with Supervisor(state_dir=tmp_path / "state") as supervisor:
        yield supervisor
