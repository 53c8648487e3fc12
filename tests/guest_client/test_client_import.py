"""The guest client imports in any guest environment: standard library only,
and light until it is used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import guest_client

ROOT = str(Path(__file__).resolve().parents[2])

# Loaded on first use, not on import: they are most of the import time.
DEFERRED = ["http.client", "socket", "ssl", "email", "json", "random", "uuid", "select"]
HEAVY = ["typing", "dataclasses", "inspect", "asyncio", "threading"]

# Loaded on first use of what needs them: the async client and the adapters.
LAZY_PARTS = ["guest_client.aio", "guest_client.aio_transport", "guest_client.adapters"]

PROBE = """
import json, sys
sys.path.insert(0, {root!r})
before = set(sys.modules)
import {module}
loaded = sorted(set(sys.modules) - before)
print(json.dumps({{"loaded": loaded, "stdlib": sorted(sys.stdlib_module_names)}}))
"""


def _probe(module: str = "guest_client") -> tuple[list[str], set[str]]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    completed = subprocess.run(
        [sys.executable, "-I", "-S", "-c", PROBE.format(root=ROOT, module=module)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(completed.stdout)
    return report["loaded"], set(report["stdlib"])


@pytest.mark.parametrize("module", ["guest_client", *LAZY_PARTS])
def test_guest_client_imports_with_only_the_standard_library(module: str) -> None:
    loaded, stdlib = _probe(module)

    foreign = [
        name
        for name in loaded
        if name.partition(".")[0] not in stdlib and name.partition(".")[0] != "guest_client"
    ]
    assert "guest_client" in loaded
    assert foreign == []


def test_importing_guest_client_defers_sockets_json_and_typing_to_first_use() -> None:
    loaded, _ = _probe()

    unwanted = set(DEFERRED + HEAVY)
    early = [name for name in loaded if name in unwanted or name.partition(".")[0] in unwanted]
    assert early == []
    assert "guest_client.transport" not in loaded
    assert [name for name in LAZY_PARTS if name in loaded] == []


def test_the_package_exports_exactly_its_public_api() -> None:
    assert sorted(guest_client.__all__) == [
        "ConfigurationError",
        "EffectUnknown",
        "GuestEnvironment",
        "HostClient",
        "HostcallError",
        "ProtocolError",
        "Refused",
        "ResultInvalid",
        "RetryPolicy",
        "ToolError",
        "TransportError",
        "connect",
    ]
    for name in guest_client.__all__:
        exported = getattr(guest_client, name)
        assert exported.__doc__, f"{name} has no docstring"


def test_every_error_is_a_hostcall_error_and_misuse_is_not() -> None:
    for name in guest_client.__all__:
        exported = getattr(guest_client, name)
        if isinstance(exported, type) and issubclass(exported, Exception):
            assert issubclass(exported, guest_client.HostcallError)
    assert not issubclass(guest_client.ResultInvalid, guest_client.ToolError)
