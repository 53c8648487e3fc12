"""Fixtures for the guest client's tests: a scripted host on a real Unix
socket, a guest environment pointing at it, and clients of both kinds.

`make_client` and `client` are parametrized over the sync `HostClient` and
the asyncio `AsyncHostClient` (driven on a private event loop behind a
blocking facade), so every test that uses them shows that both clients
behave the same on the wire."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from client_fakehost import (
    CREDENTIAL,
    EXECUTION,
    FAST_RETRY,
    INVOCATION,
    PLAN_HASH,
    MakeClient,
    RunningHost,
    ScriptedHost,
)

from guest_client import GuestEnvironment, HostClient, RetryPolicy, connect
from guest_client import aio as guest_aio
from guest_client import env as guest_env_module

T = TypeVar("T")


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


class BlockingAsyncClient:
    """An `AsyncHostClient` on a private event loop, with `HostClient`'s
    blocking methods, so that one test body drives either kind of client."""

    def __init__(self, client: guest_aio.AsyncHostClient, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = client
        self._loop = loop

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self._loop.run_until_complete(coroutine)

    @property
    def environment(self) -> GuestEnvironment:
        return self.inner.environment

    @property
    def retry(self) -> RetryPolicy:
        return self.inner.retry

    def call(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self.inner.call(*args, **kwargs))

    def status(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.inner.status(*args, **kwargs))

    def plan(self, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.inner.plan(**kwargs))

    def tools(self, **kwargs: Any) -> list[dict[str, Any]]:
        return self._run(self.inner.tools(**kwargs))

    def tools_for(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return self._run(self.inner.tools_for(*args, **kwargs))

    def call_openai(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.inner.call_openai(*args, **kwargs))

    def call_anthropic(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.inner.call_anthropic(*args, **kwargs))

    def close(self) -> None:
        self._run(self.inner.aclose())

    def __enter__(self) -> BlockingAsyncClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self.inner)


@pytest.fixture(params=["sync", "async"])
def make_client(request: pytest.FixtureRequest, guest_env: dict[str, str]) -> Iterator[MakeClient]:
    """Makes clients of the scripted host from the environment, as `connect()`
    does: `make_client(retry=FAST_RETRY, sleeps=None)`; with a `sleeps` list,
    every backoff sleep is recorded there (and still taken)."""
    loop = asyncio.new_event_loop() if request.param == "async" else None
    made: list[Any] = []

    def make(retry: RetryPolicy = FAST_RETRY, *, sleeps: list[float] | None = None) -> Any:
        client: Any
        if loop is None:
            if sleeps is None:
                client = connect(retry=retry)
            else:

                def sleep(seconds: float) -> None:
                    sleeps.append(seconds)
                    time.sleep(seconds)

                client = HostClient(GuestEnvironment.from_environ(), retry=retry, sleep=sleep)
        elif sleeps is None:
            client = BlockingAsyncClient(guest_aio.connect(retry=retry), loop)
        else:

            async def async_sleep(seconds: float) -> None:
                sleeps.append(seconds)
                await asyncio.sleep(seconds)

            inner = guest_aio.AsyncHostClient(
                GuestEnvironment.from_environ(), retry=retry, sleep=async_sleep
            )
            client = BlockingAsyncClient(inner, loop)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
    if loop is not None:
        loop.close()


@pytest.fixture
def client(make_client: MakeClient) -> Iterator[HostClient]:
    """A client of the scripted host (sync or async), as `connect()` makes it."""
    with make_client() as made:
        yield made
