"""Two real ``hostcall run`` processes (replicas) sharing one PostgreSQL store.

Each replica has its own state dir and runs the same invocation under the
same plan. Handlers write every real execution to a ledger file (fsync'd) that
outlives any process; the tests count executions there. Handlers talk to the
test through a Unix socket: ``gate`` blocks until the test lets every replica
go at once (so their guests race), ``hang`` says it is mid-handler and never
returns. The store's state is read straight from the database.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.harness import STEP_TIMEOUT_S, read_line
from tests.postgres_support import run_async, with_options

pytestmark = pytest.mark.postgres

GUEST = Path(__file__).parents[1] / "guests" / "scripted.py"
INVOCATION = "inv_same"
TOOLS = """
import os, socket, threading
from supervisor import tool

def _ledger(line):
    fd = os.open(os.environ["LEDGER"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)

def _tell(message):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(os.environ["SIGNAL_SOCKET"])
        s.sendall(message.encode())
        return s.recv(16)   # the test answers "go", or closes

@tool(reversibility="reversible")
def gate(who: str) -> str:
    _tell("gate " + who)    # blocks until the test lets every replica go
    return "open"

@tool(reversibility="irreversible", target_args=["account"], cost=1)
def charge(account: str, cents: int) -> dict:
    _ledger(f"charge {account} {cents} on {os.environ['REPLICA']}")
    return {"charge_id": "ch_" + account, "cents": cents}

@tool(reversibility="irreversible", target_args=["account"])
def hang(account: str) -> str:
    _ledger(f"hang {account} on {os.environ['REPLICA']}")
    _tell("hang")           # the test now knows we are mid-handler
    threading.Event().wait(120)
    return "finished"
"""
PLAN = """
[plan]
name = "replicas"
max_calls = {max_calls}

[tools.gate]
handler = "replica_tools:gate"

[tools.charge]
handler = "replica_tools:charge"

[tools.hang]
handler = "replica_tools:hang"
"""


def write_plan(folder: Path, max_calls: int = 100) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / "replica_tools.py").write_text(TOOLS)
    (folder / "plan.toml").write_text(PLAN.format(max_calls=max_calls))
    return folder / "plan.toml"


class Cluster:
    """The replicas of one test: their store, plan, ledger and signal socket."""

    def __init__(self, tmp_path: Path, dsn: str, schema: str, listener: socket.socket) -> None:
        self.tmp_path = tmp_path
        self.dsn = dsn
        self.schema = schema
        self.listener = listener
        self.ledger = tmp_path / "ledger.txt"
        self.plan = write_plan(tmp_path / "plan")
        self.signal_path = Path(listener.getsockname())

    def store(self, **options: object) -> str:
        return with_options(self.dsn, schema=self.schema, **options)

    def start(
        self,
        name: str,
        calls: list[list[Any]],
        *,
        store: str | None = None,
        plan: Path | None = None,
    ) -> subprocess.Popen[str]:
        """Launch ``hostcall run`` as replica ``name`` (state dir ``st_<name>``)."""
        argv = [
            sys.executable, "-m", "supervisor.cli", "run",
            "--state-dir", str(self.state(name)), "--store", store or self.store(),
            "--plan", str(plan or self.plan), "--invocation", INVOCATION,
            "--", sys.executable, str(GUEST), "calls", json.dumps(calls),
        ]  # fmt: skip
        env = {
            **os.environ,
            "LEDGER": str(self.ledger),
            "SIGNAL_SOCKET": str(self.signal_path),
            "REPLICA": name,
        }
        return subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def state(self, name: str) -> Path:
        return self.tmp_path / f"st_{name}"

    def accept(self) -> tuple[socket.socket, str]:
        """The next handler that talks to the test, and what it said."""
        connection, _ = self.listener.accept()
        connection.settimeout(STEP_TIMEOUT_S)
        return connection, connection.recv(64).decode()

    def ledger_lines(self) -> list[str]:
        return self.ledger.read_text().splitlines() if self.ledger.exists() else []

    def receipts(self, name: str) -> list[dict[str, Any]]:
        path = self.state(name) / "receipts" / f"{INVOCATION}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def query(self, sql: str, *args: object) -> list[asyncpg.Record]:
        """Rows of one statement on the shared database (``{s}``: the schema)."""

        async def fetch() -> list[asyncpg.Record]:
            conn = await asyncpg.connect(self.dsn, timeout=STEP_TIMEOUT_S)
            try:
                return await conn.fetch(sql.replace("{s}", f'"{self.schema}"'), *args)
            finally:
                await conn.close()

        return run_async(fetch)

    def wait_for(self, what: str, check: Any) -> None:
        """Poll ``check()`` (the database, a file) until it holds, bounded."""
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {STEP_TIMEOUT_S} s: {what}")
            time.sleep(0.05)


@pytest.fixture
def cluster(tmp_path: Path, postgres_dsn: str, postgres_schema: str) -> Iterator[Cluster]:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "signal.sock"))
        listener.listen(8)
        listener.settimeout(STEP_TIMEOUT_S)
        yield Cluster(tmp_path, postgres_dsn, postgres_schema, listener)


@contextmanager
def running(*processes: subprocess.Popen[str]) -> Iterator[None]:
    """Kill (the process groups of) replicas still running when the block ends."""
    with ExitStack() as stack:
        for process in processes:
            stack.enter_context(process)
            stack.callback(_kill_group, process)
        yield


def _kill_group(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=STEP_TIMEOUT_S)


def finish(process: subprocess.Popen[str]) -> tuple[int, list[dict[str, Any]], str]:
    """Wait (bounded) for a replica: its exit status, its guest's lines, its stderr."""
    out, err = process.communicate(timeout=STEP_TIMEOUT_S * 2)
    lines = [json.loads(line) for line in out.splitlines()]
    return process.returncode, lines[1:], err  # lines[0] is the guest's pid


def release_gates(cluster: Cluster, count: int) -> None:
    """Wait until ``count`` replicas sit in ``gate``, then let them all go at once."""
    waiting = [cluster.accept() for _ in range(count)]
    assert sorted(said for _, said in waiting) == sorted(f"gate {n}" for n in "ab"[:count])
    for connection, _ in waiting:
        connection.sendall(b"go")
        connection.close()


def test_two_replicas_racing_the_same_calls_run_each_once_and_both_guests_get_its_result(
    cluster: Cluster,
) -> None:
    charges = [[f"c{i}", "charge", {"account": f"acct_{i}", "cents": 100 + i}] for i in range(20)]
    a = cluster.start("a", [["gate_a", "gate", {"who": "a"}], *charges])
    b = cluster.start("b", [["gate_b", "gate", {"who": "b"}], *charges])
    with running(a, b):
        release_gates(cluster, 2)
        status_a, lines_a, err_a = finish(a)
        status_b, lines_b, err_b = finish(b)

    assert (status_a, status_b) == (0, 0), err_a + err_b
    expected = [
        {"call_id": f"c{i}", "result": {"charge_id": f"ch_acct_{i}", "cents": 100 + i}}
        for i in range(20)
    ]
    assert lines_a[1:] == expected  # the loser got the winner's committed result
    assert lines_b[1:] == expected
    ran = Counter(line.rsplit(" on ", 1)[0] for line in cluster.ledger_lines())
    assert ran == Counter(f"charge acct_{i} {100 + i}" for i in range(20))  # each exactly once
    executed = Counter(
        r["call_id"]
        for name in "ab"
        for r in cluster.receipts(name)
        if r["outcome"] == "executed" and r["tool"] == "charge"
    )
    assert executed == Counter(f"c{i}" for i in range(20))
    [row] = cluster.query("SELECT count(*) AS n, min(status) AS s FROM {s}.effects")
    assert (row["n"], row["s"]) == (22, "committed")


def test_kill_9_of_a_replica_mid_call_leaves_the_call_unknown_after_its_lease_for_the_other(
    cluster: Cluster,
) -> None:
    store = cluster.store(lease_s=4, renew_s=0.25)
    hang = ["h1", "hang", {"account": "bob"}]
    a = cluster.start("a", [hang], store=store)
    with running(a):
        assert a.stdout is not None
        assert "pid" in json.loads(read_line(a.stdout))  # a's guest runs
        connection, said = cluster.accept()  # a's handler is running now
        assert said == "hang"
        owner = (cluster.state("a") / "replica-id").read_text().strip()
        [row] = cluster.query("SELECT status, owner_instance FROM {s}.effects")
        assert (row["status"], row["owner_instance"]) == ("pending", owner)

        b = cluster.start(
            "b", [hang, ["c1", "charge", {"account": "carol", "cents": 7}]], store=store
        )
        with running(b):
            # b's guest asked for h1 and was told it is in flight; a is alive,
            # so b (which opened meanwhile) left a's row alone.
            cluster.wait_for(
                "b answers h1 in_flight",
                lambda: any(r["error_code"] == "in_flight" for r in cluster.receipts("b")),
            )
            [row] = cluster.query("SELECT status FROM {s}.effects WHERE call_id = 'h1'")
            assert row["status"] == "pending"

            os.kill(a.pid, signal.SIGKILL)
            a.wait(timeout=STEP_TIMEOUT_S)  # its sandboxed guest dies with it (S5)
            connection.close()
            cluster.wait_for(
                "h1 becomes unknown once a's lease has run out",
                lambda: (
                    cluster.query("SELECT status FROM {s}.effects WHERE call_id = 'h1'")[0][
                        "status"
                    ]
                    == "unknown"
                ),
            )
            status_b, lines_b, err_b = finish(b)

    assert status_b == 0, err_b
    assert lines_b[0]["call_id"] == "h1"
    assert lines_b[0]["code"] == "ambiguous"
    assert len(lines_b[0]["unknown"]) == 64  # with the idempotency key to reconcile
    assert lines_b[1] == {"call_id": "c1", "result": {"charge_id": "ch_carol", "cents": 7}}
    assert cluster.ledger_lines() == ["hang bob on a", "charge carol 7 on b"]  # h1 ran once
    replicas = cluster.query("SELECT instance_id FROM {s}.replicas")
    assert owner not in [r["instance_id"] for r in replicas]  # the dead replica is forgotten


def test_a_replica_restarted_on_its_state_dir_answers_unknown_at_once_without_its_lease(
    cluster: Cluster,
) -> None:
    store = cluster.store(lease_s=600, renew_s=1)
    hang = ["h1", "hang", {"account": "bob"}]
    a = cluster.start("a", [hang], store=store)
    with running(a):
        assert a.stdout is not None
        assert "pid" in json.loads(read_line(a.stdout))  # a's guest runs
        connection, _ = cluster.accept()
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=STEP_TIMEOUT_S)  # its sandboxed guest dies with it (S5)
        connection.close()
    again = cluster.start("a", [hang], store=store)  # same state dir: same replica id
    with running(again):
        status, lines, err = finish(again)  # bounded far below the 600 s lease

    assert status == 0, err
    assert (lines[0]["call_id"], lines[0]["code"]) == ("h1", "ambiguous")
    assert cluster.ledger_lines() == ["hang bob on a"]
    assert "now unknown" in err  # the supervisor says what it recovered


def test_two_replicas_together_cannot_spend_more_than_the_invocations_budget(
    cluster: Cluster,
) -> None:
    plan = write_plan(cluster.tmp_path / "plan_12", max_calls=12)  # 2 gates + 10 charges
    spend = {
        name: [[f"{name}{i}", "charge", {"account": f"{name}_{i}", "cents": 1}] for i in range(10)]
        for name in "ab"
    }
    a = cluster.start("a", [["gate_a", "gate", {"who": "a"}], *spend["a"]], plan=plan)
    b = cluster.start("b", [["gate_b", "gate", {"who": "b"}], *spend["b"]], plan=plan)
    with running(a, b):
        release_gates(cluster, 2)
        status_a, lines_a, err_a = finish(a)
        status_b, lines_b, err_b = finish(b)

    assert (status_a, status_b) == (0, 0), err_a + err_b
    answers = lines_a[1:] + lines_b[1:]
    assert sum("result" in line for line in answers) == 10
    assert [line["error"] for line in answers if "error" in line] == ["budget_exhausted"] * 10
    assert len(cluster.ledger_lines()) == 10
    [row] = cluster.query("SELECT calls_used FROM {s}.invocations")
    assert row["calls_used"] == 12


def test_a_replica_resuming_the_invocation_with_another_plan_is_refused(
    cluster: Cluster,
) -> None:
    first = cluster.start("a", [["c1", "charge", {"account": "x", "cents": 1}]])
    with running(first):
        status, _, err = finish(first)
    assert status == 0, err
    other = write_plan(cluster.tmp_path / "plan_other", max_calls=5)
    second = cluster.start("b", [["c1", "charge", {"account": "x", "cents": 1}]], plan=other)
    with running(second):
        status, _lines, err = finish(second)

    assert status == 2
    assert "resume it with the plan it started with" in err
    assert cluster.ledger_lines() == ["charge x 1 on a"]
