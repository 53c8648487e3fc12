"""WebAssembly guests for the tests: built once per session from C with the
``ziglang`` wheel (supervisor/wasm_build.py), as a user would build theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.wasm_build import build_c, build_python

GUESTS = Path(__file__).parents[2] / "examples" / "guests" / "wasm"


@pytest.fixture(scope="session")
def agent_wasm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``examples/guests/wasm/agent.c`` as a WASI command."""
    return build_c(GUESTS / "agent.c", tmp_path_factory.mktemp("wasm"))


@pytest.fixture(scope="session")
def agent_component(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``examples/guests/wasm/python/app.py`` as a component: CPython for WASI."""
    return build_python(GUESTS / "python", tmp_path_factory.mktemp("component"))
