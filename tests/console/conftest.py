"""A supervisor with its console, both in this process, on real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from supervisor import Supervisor
from supervisor.console import ConsoleServer, Listen


@dataclass
class Served:
    """A running supervisor, its console, and an HTTP client for the console."""

    sup: Supervisor
    console: ConsoleServer
    http: aiohttp.ClientSession

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.console.port}"

    def headers(self, **extra: str) -> dict[str, str]:
        return {"X-Hostcall-Token": self.console.token, **extra}


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with (
        Supervisor(tmp_path / "state") as sup,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http,
    ):
        console = ConsoleServer(sup.state.path, Listen("127.0.0.1", 0))
        await console.start()
        try:
            yield Served(sup, console, http)
        finally:
            await console.close()
