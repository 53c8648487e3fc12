"""WebAssembly guests for the tests: built once per session from C with the
``ziglang`` wheel (supervisor/zigcc.py), as a user would build theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.zigcc import build_wasm

AGENT_C = Path(__file__).parents[2] / "examples" / "guests" / "wasm" / "agent.c"


@pytest.fixture(scope="session")
def agent_wasm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``examples/guests/wasm/agent.c`` as a WASI command."""
    return build_wasm(AGENT_C, tmp_path_factory.mktemp("wasm"))
