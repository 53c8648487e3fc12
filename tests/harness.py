"""Shared test machinery: a ledger of real handler executions and a driven guest.

Handlers in these tests run in the test process (the supervisor runs there
too), so the ledger counts real executions of real handlers; calls reach them
only through a real guest process and the real Unix socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.machinery
import importlib.util
import itertools
import json
import os
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from supervisor import Plan, Supervisor, tool
from supervisor.executions import Execution

DRIVER = Path(__file__).parent / "guests" / "driver.py"
#: Upper bound for any single step a test waits on.
STEP_TIMEOUT_S = 30.0


@dataclass
class Ledger:
    """Counts real handler executions, thread-safely, and can hold them."""

    runs: Counter[str] = field(default_factory=Counter)
    args: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, **kwargs: Any) -> int:
        with self._lock:
            self.runs[name] += 1
            self.args.append((name, kwargs))
            return self.runs[name]


def billing_plan(ledger: Ledger, **plan_options: Any) -> Plan:
    """A plan whose handlers count themselves in ``ledger``.

    - ``charge`` (irreversible, target ``account``, cost 10): returns a charge id.
    - ``lookup`` (reversible): returns the account.
    - ``slow_charge`` (irreversible): blocks until ``ledger.release`` is set.
    - ``flaky_send`` (irreversible): raises ``ConnectionResetError`` (ambiguous).
    - ``flaky_read`` (reversible): raises ``TimeoutError`` the first time only.
    - ``broken`` (reversible): raises ``ValueError`` (a plain tool error).
    - ``bad_result`` (irreversible): returns a string where an int is promised.
    """

    @tool(reversibility="irreversible", target_args=["account"], cost=10)
    def charge(account: str, cents: int) -> dict[str, Any]:
        n = ledger.record("charge", account=account, cents=cents)
        return {"charge_id": f"ch_{n}", "account": account, "cents": cents}

    @tool(reversibility="reversible")
    def lookup(account: str) -> dict[str, str]:
        ledger.record("lookup", account=account)
        return {"account": account}

    @tool(reversibility="irreversible")
    def slow_charge(account: str) -> str:
        ledger.record("slow_charge", account=account)
        ledger.started.set()
        if not ledger.release.wait(STEP_TIMEOUT_S):
            raise RuntimeError("the test never released slow_charge")
        return f"slow_{account}"

    @tool(reversibility="irreversible")
    def flaky_send(to: str) -> str:
        ledger.record("flaky_send", to=to)
        raise ConnectionResetError("the mail server hung up")

    @tool(reversibility="reversible")
    def flaky_read(key: str) -> str:
        if ledger.record("flaky_read", key=key) == 1:
            raise TimeoutError("backend timed out")
        return f"value_{key}"

    @tool(reversibility="reversible")
    def broken(x: int) -> int:
        ledger.record("broken", x=x)
        raise ValueError("no such thing")

    @tool(reversibility="irreversible")
    def bad_result() -> int:
        ledger.record("bad_result")
        return "not an int"  # type: ignore[return-value]

    tools: list[Callable[..., Any]] = [
        charge,
        lookup,
        slow_charge,
        flaky_send,
        flaky_read,
        broken,
        bad_result,
    ]
    return Plan(tools, name="billing-test", **plan_options)


class Driver:
    """Talks to a driven guest (tests/guests/driver.py) over its stdin/stdout."""

    def __init__(self, execution: Execution) -> None:
        assert execution.process is not None
        self.execution = execution
        self._process = execution.process
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        stdout = self._process.stdout
        assert stdout is not None
        try:
            while line := await stdout.readline():
                answer = json.loads(line)
                waiter = self._waiting.pop(answer.pop("id", None), None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(answer)
        finally:
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(EOFError("the guest closed its stdout"))

    async def send(self, command: dict[str, Any]) -> dict[str, Any]:
        """Send one command and wait (bounded) for its answer."""
        stdin = self._process.stdin
        assert stdin is not None
        command_id = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[command_id] = answer
        if self._reader.done():
            raise EOFError("the guest closed its stdout")
        stdin.write(json.dumps({**command, "id": command_id}).encode() + b"\n")
        await stdin.drain()
        async with asyncio.timeout(STEP_TIMEOUT_S * 4):
            return await answer

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def request(self, **spec: Any) -> dict[str, Any]:
        return await self.send({"op": "request", **spec})

    async def call(self, call_id: str, tool_name: str, args: dict[str, Any]) -> dict[str, Any]:
        body = {"call_id": call_id, "tool": tool_name, "args": args}
        return await self.request(method="POST", path="/v1/calls", body=body)

    async def credential(self) -> str:
        return str((await self.send({"op": "credential"}))["credential"])


@contextlib.asynccontextmanager
async def driven_guest(
    sup: Supervisor, plan: Plan, *, invocation_id: str | None = None, exit_code: int = 0
) -> AsyncIterator[Driver]:
    """Run tests/guests/driver.py as a guest of ``sup`` and yield its driver."""
    started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
    run = asyncio.create_task(
        sup.run(
            plan,
            [sys.executable, str(DRIVER)],
            invocation_id=invocation_id,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            on_start=started.set_result,
        )
    )
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            done, _ = await asyncio.wait([started, run], return_when=asyncio.FIRST_COMPLETED)
        if run in done:
            run.result()  # raises what went wrong
        driver = Driver(started.result())
        yield driver
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
            await driver.send({"op": "exit", "code": exit_code})
        await driver.close()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await run
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await run


def raw_request(
    socket_path: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None = None,
) -> tuple[int, Any]:
    """One HTTP request from *this* process (not a guest) to a Unix socket."""
    import http.client
    import socket

    class _Conn(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(STEP_TIMEOUT_S)
            self.sock.connect(socket_path)

    conn = _Conn("localhost", timeout=STEP_TIMEOUT_S)
    try:
        conn.request(method, path, body, headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    return response.status, json.loads(data)


def identity_headers(execution: Execution, credential: str) -> dict[str, str]:
    """The four identity headers of SPEC §4.1 for ``execution``."""
    return {
        "Authorization": f"Bearer {credential}",
        "Hostcall-Invocation": execution.invocation_id,
        "Hostcall-Execution": execution.execution_id,
        "Hostcall-Plan": execution.plan_hash,
    }


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for a condition the system under test makes true."""
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while not predicate():
            await asyncio.sleep(0.005)
    assert predicate(), what


async def hostcall_cli(*args: str) -> tuple[int, str, str]:
    """Run the real ``hostcall`` CLI in a subprocess without blocking the loop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "supervisor.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S * 2):
            out, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples of a ``/metrics`` text by name and sorted labels, but the
    ``_created`` timestamps (hostcall writes none)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def without_hostcall_env() -> dict[str, str]:
    """This process's environment without ``HOSTCALL_*``: a child ``hostcall``
    then picks its state dir and store as a user's fresh shell would."""
    return {k: v for k, v in os.environ.items() if not k.startswith("HOSTCALL_")}


def load_script(path: Path, name: str) -> ModuleType:
    """Import a script without a ``.py`` ending (``scripts/faults``) as ``name``."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


def pid_namespace_of(pid: int) -> int | None:
    """The inode of a process's pid namespace (the same number inside and out)."""
    try:
        link = os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return int(link.removeprefix("pid:[").removesuffix("]"))


def processes_in_pid_namespace(inode: int) -> list[int]:
    """Every live process (not a zombie) whose pid namespace is ``inode``: a
    sandbox's processes, which cannot leave it."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X") and pid_namespace_of(int(name)) == inode:
            found.append(int(name))
    return found


class TreeWatch:
    """Holds on to a running guest's processes so that a later check cannot be
    fooled by a recycled pid or a recycled pid-namespace number.

    Give it what the guest printed about itself (its pids and ``pidns``) while
    it still runs. A sandboxed guest's namespace is pinned by a descriptor (a
    namespace's inode number is reused as soon as it is freed); an
    unsandboxed guest's processes are remembered with their start times.
    """

    def __init__(self, tree: dict[str, int], *, sandboxed: bool) -> None:
        import psutil

        tree = dict(tree)
        self.pidns = tree.pop("pidns")
        self.sandboxed = sandboxed
        self._nsfd: int | None = None
        self._processes: list[psutil.Process] = []
        if sandboxed:
            for pid in processes_in_pid_namespace(self.pidns):
                with contextlib.suppress(OSError):
                    self._nsfd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
                    break
            assert self._nsfd is not None, "the sandbox ended before it could be watched"
        else:
            for pid in tree.values():
                with contextlib.suppress(psutil.Error):
                    self._processes.append(psutil.Process(pid))

    def alive(self) -> list[int]:
        """The watched processes still alive (zombies are not)."""
        import psutil

        if self.sandboxed:
            return processes_in_pid_namespace(self.pidns)
        found = []
        for process in self._processes:
            with contextlib.suppress(psutil.Error):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process.pid)
        return found

    def close(self) -> None:
        if self._nsfd is not None:
            os.close(self._nsfd)
            self._nsfd = None


def read_line(stream: Any, timeout: float = STEP_TIMEOUT_S) -> Any:
    """``stream.readline()``, bounded: a reader thread, joined with a timeout (a
    pipe's buffered reader may hold lines a ``select`` would not see)."""
    box: list[Any] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        raise TimeoutError(f"no line within {timeout} s")
    return box[0]
