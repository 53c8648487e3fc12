"""Fixtures for the guest client's tests: a scripted host on a real Unix
socket, and a guest environment pointing at it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import pytest
from client_fakehost import (
    CREDENTIAL,
    EXECUTION,
    FAST_RETRY,
    INVOCATION,
    PLAN_HASH,
    RunningHost,
    ScriptedHost,
)

from guest_client import HostClient, connect
from guest_client import env as guest_env_module


@pytest.fixture(autouse=True)
def forget_credentials() -> Iterator[None]:
    """Each test starts as a fresh process would: no credential read yet."""
    guest_env_module._credentials.clear()
    yield
    guest_env_module._credentials.clear()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    """A short directory for sockets: `sun_path` holds only 108 bytes."""
    path = tempfile.mkdtemp(prefix="hc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def host(socket_dir: str) -> Iterator[ScriptedHost]:
    """A scripted host, serving until the test ends; fails the test if a
    request arrived that the script did not expect."""
    scripted = ScriptedHost(socket_path=f"{socket_dir}/channel.sock")
    running = RunningHost(scripted)
    running.start()
    yield scripted
    running.stop()
    assert not scripted.unexpected, f"unscripted requests: {scripted.unexpected}"


@pytest.fixture
def guest_env(monkeypatch: pytest.MonkeyPatch, host: ScriptedHost) -> dict[str, str]:
    """The variables a supervisor sets, with the credential in the env."""
    variables = {
        "HOSTCALL_SOCKET": host.socket_path,
        "HOSTCALL_INVOCATION": INVOCATION,
        "HOSTCALL_EXECUTION": EXECUTION,
        "HOSTCALL_PLAN": PLAN_HASH,
        "HOSTCALL_CREDENTIAL": CREDENTIAL,
    }
    monkeypatch.delenv("HOSTCALL_CREDENTIAL_FD", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return variables


@pytest.fixture
def client(guest_env: dict[str, str]) -> Iterator[HostClient]:
    """A client of the scripted host, made by `connect()`."""
    with connect(retry=FAST_RETRY) as made:
        yield made
