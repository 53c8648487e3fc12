"""WebAssembly guests: real modules (C, built with the ziglang wheel) run by
wasmtime, their calls through the ``hostcall`` imports to the same broker a
native guest's socket calls reach (docs/wasm.md)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest

from channel.imports import Imports
from supervisor import Plan, Supervisor, tool
from supervisor import supervisor as supervisor_module
from supervisor.admin_client import AdminError, AsyncAdminClient
from supervisor.errors import WasmBusy, WasmError
from supervisor.executions import Execution
from supervisor.limits import Limits
from supervisor.outcomes import ExecutionOutcome
from supervisor.sandbox.policy import SandboxPolicy
from tests.harness import STEP_TIMEOUT_S, Ledger, hostcall_cli, wait_until

STEPS_GUEST = Path(__file__).parents[1] / "guests" / "steps.py"
RECEIPT_TRANSPORT_FIELDS = {
    "receipt_id",
    "invocation_id",
    "execution_id",
    "approval_id",
    "started_at",
    "finished_at",
    "prev_hash",
    "hash",
}
RECORD_TRANSPORT_FIELDS = {"invocation_id", "execution_id", "created_at", "updated_at"}


def scenario_plan(ledger: Ledger, **options: Any) -> Plan:
    """Tools whose results depend only on their arguments, so two runs compare."""

    @tool(reversibility="irreversible", target_args=["account"], cost=1)
    def charge(account: str, cents: int) -> dict[str, Any]:
        ledger.record("charge", account=account, cents=cents)
        return {"charge_id": f"ch_{account}_{cents}", "cents": cents}

    @tool(reversibility="irreversible")
    def send(to: str) -> str:
        ledger.record("send", to=to)
        raise ConnectionResetError("the mail server hung up")

    @tool(reversibility="irreversible", approval="always", target_args=["account"])
    def refund(account: str, cents: int) -> dict[str, Any]:
        ledger.record("refund", account=account, cents=cents)
        return {"refund_id": f"rf_{account}", "cents": cents}

    @tool(reversibility="irreversible")
    def slow(account: str) -> str:
        ledger.record("slow", account=account)
        ledger.started.set()
        if not ledger.release.wait(STEP_TIMEOUT_S):
            raise RuntimeError("the test never released slow")
        return f"slow_{account}"

    @tool(reversibility="reversible")
    def echo(n: int) -> int:
        return n

    return Plan([charge, send, refund, slow, echo], name="wasm-test", **options)


SCENARIO = [
    'call:c1:charge:{"account":"acct_a","cents":500}',  # executed
    'call:c1:charge:{"account":"acct_a","cents":500}',  # retried: replayed
    "call:d1:delete_everything:{}",  # refused: not in the plan
    'call:c2:charge:{"account":"acct_a","cents":"many"}',  # refused: invalid arguments
    'call:c1:charge:{"account":"acct_a","cents":9}',  # refused: call_id reused
    'call:m1:send:{"to":"bob"}',  # ambiguous: the handler's outcome is unknown
    'call:m1:send:{"to":"bob"}',  # retried: ambiguous, never run again
    'call:r1:refund:{"account":"acct_a","cents":100}',  # waits for approval, then runs
    "status:c1",  # replayed
    "status:r1:1000",  # replayed (long-poll of a committed call answers at once)
    "status:nope",  # not found
    "plan",  # the plan, and the budget left
]


def replies(sup: Supervisor, outcome: ExecutionOutcome, invocation_id: str) -> list[Any]:
    """What the guest printed: ``(http status, reply)`` per step, ``receipt_id`` aside."""
    log = sup.state.logs_dir / invocation_id / f"{outcome.execution_id}.stdout.log"
    seen = []
    for line in log.read_text().splitlines():
        status, _, body = line.partition(" ")
        reply = json.loads(body)
        reply.pop("receipt_id", None)
        seen.append((int(status), reply))
    return seen


def receipts(sup: Supervisor, invocation_id: str) -> list[dict[str, Any]]:
    path = sup.state.receipts_dir / f"{invocation_id}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def without(fields: set[str], item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in fields}


async def test_a_wasm_guest_whose_on_start_hangs_is_stopped_at_its_timeout(
    tmp_path: Path, agent_wasm: Path
) -> None:
    """As for a native guest: the timeout counts from the start, not from
    when the caller's ``on_start`` returned, and a hung one is cancelled."""
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def on_start(execution: Execution) -> None:
        await never

    async with Supervisor(tmp_path / "state") as sup:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            outcome = await sup.run(
                scenario_plan(Ledger()),
                ["spin"],
                wasm=agent_wasm,
                limits=Limits(timeout_s=0.5),
                on_start=on_start,
            )
    assert (outcome.last.reason, outcome.exit_status) == ("timeout", 124)
    assert never.cancelled()


@pytest.mark.parametrize("guest", ["c-module", "python-component"])
async def test_one_scenario_through_both_transports_leaves_the_same_records_and_receipts(
    tmp_path: Path, guest: str, request: pytest.FixtureRequest
) -> None:
    """The socket (a native Python guest) against the imports: a C module's
    i32 ABI, or a Python component's (CPython built for WASI)."""
    module: Path = request.getfixturevalue(
        "agent_wasm" if guest == "c-module" else "agent_component"
    )
    ledger = Ledger()
    plan = scenario_plan(ledger, max_calls=20)
    async with Supervisor(tmp_path / "state", approver=lambda proposal: True) as sup:
        native = await sup.run(
            plan, [sys.executable, str(STEPS_GUEST), "steps", *SCENARIO], invocation_id="inv_n"
        )
        wasm = await sup.run(plan, ["steps", *SCENARIO], invocation_id="inv_w", wasm=module)
        assert native.exit_status == 0 and wasm.exit_status == 0
        seen_native = replies(sup, native.last, "inv_n")
        seen_wasm = replies(sup, wasm.last, "inv_w")
        records_native = await sup.store.calls("inv_n")
        records_wasm = await sup.store.calls("inv_w")
        receipts_native = receipts(sup, "inv_n")
        receipts_wasm = receipts(sup, "inv_w")

    # What each guest was told, step by step: the same statuses and bodies.
    assert len(seen_wasm) == len(SCENARIO)
    assert seen_wasm == seen_native
    statuses = [status for status, _ in seen_wasm]
    assert statuses == [200, 200, 403, 422, 422, 409, 409, 200, 200, 200, 404, 200]
    effects = [reply.get("effect") for _, reply in seen_wasm[:8]]
    assert effects == [
        "executed",
        "replayed",
        "none",
        "none",
        "none",
        "unknown",
        "unknown",
        "executed",
    ]
    assert seen_wasm[3][1]["error"]["code"] == "invalid_arguments"
    assert seen_wasm[4][1]["error"]["code"] == "call_id_reused"
    assert seen_wasm[6][1]["reason"] == "unknown"
    # The plan's reply (over 2 KB) is larger than the guest's 256-byte buffer:
    # it came through the `reply` import whole.
    assert seen_wasm[-1][1]["name"] == "wasm-test"
    assert seen_wasm[-1][1]["budget"]["calls_left"] == 20 - 3

    # The effect records and receipts, field by field, transport fields aside.
    assert [without(RECORD_TRANSPORT_FIELDS, vars_of(r)) for r in records_wasm] == [
        without(RECORD_TRANSPORT_FIELDS, vars_of(r)) for r in records_native
    ]
    assert {r.execution_id for r in records_wasm} == {wasm.execution_id}
    assert [without(RECEIPT_TRANSPORT_FIELDS, r) for r in receipts_wasm] == [
        without(RECEIPT_TRANSPORT_FIELDS, r) for r in receipts_native
    ]
    assert len(receipts_wasm) == 8  # one per call that reached the broker (not per status)
    assert {r["execution_id"] for r in receipts_wasm} == {wasm.execution_id}
    # Each transport ran each handler once: the retries ran nothing.
    assert ledger.runs == {"charge": 2, "send": 2, "refund": 2}
    # How each guest ended is reported alike, and says what confined it.
    assert wasm.last.calls == native.last.calls
    assert wasm.last.sandbox["runtime"] == "wasmtime"
    assert wasm.last.sandbox["kind"] == ("module" if guest == "c-module" else "component")


def vars_of(record: Any) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__dataclass_fields__}


@pytest.mark.parametrize("guest", ["c-module", "python-component"])
async def test_a_wasm_guest_sees_its_argv_and_only_the_hostcall_names(
    tmp_path: Path, guest: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent_wasm: Path = request.getfixturevalue(
        "agent_wasm" if guest == "c-module" else "agent_component"
    )
    monkeypatch.setenv("DATABASE_PASSWORD", "hunter2")  # the host's: never the guest's
    plan = scenario_plan(Ledger())
    async with Supervisor(tmp_path / "state") as sup:
        outcome = await sup.run(plan, ["env"], wasm=agent_wasm, invocation_id="inv_env")
        log = sup.state.logs_dir / "inv_env" / f"{outcome.execution_id}.stdout.log"
        lines = log.read_text().splitlines()
        given = await sup.run(
            plan, ["env"], wasm=agent_wasm, env={"LANG": "C", "HOSTCALL_SOCKET": "/x"}
        )
        log = sup.state.logs_dir / given.invocation_id / f"{given.execution_id}.stdout.log"
        given_lines = log.read_text().splitlines()
    assert outcome.exit_status == 0
    assert [line for line in lines if line.startswith("argv ")] == [
        f"argv {agent_wasm.name}",
        "argv env",
    ]
    env = dict(line[4:].split("=", 1) for line in lines if line.startswith("env "))
    assert env == {
        "HOSTCALL_INVOCATION": "inv_env",
        "HOSTCALL_EXECUTION": outcome.execution_id,
        "HOSTCALL_PLAN": plan.plan_hash,
        "HOSTCALL_APPROVAL_LEASES": json.dumps({"refund": 300.0}, separators=(",", ":")),
    }
    given_env = dict(line[4:].split("=", 1) for line in given_lines if line.startswith("env "))
    assert given_env["LANG"] == "C"
    assert "HOSTCALL_SOCKET" not in given_env  # it has no socket; nobody may name one


async def test_a_wasm_guest_touches_files_only_in_the_plans_workdir(
    tmp_path: Path, agent_wasm: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    ledger = Ledger()
    async with Supervisor(tmp_path / "state") as sup:
        confined = await sup.run(
            scenario_plan(ledger), ["write", "note.txt", "hello"], wasm=agent_wasm
        )
        escaping = await sup.run(
            scenario_plan(ledger, sandbox=SandboxPolicy(workdir=work)),
            ["write", "../outside.txt", "escaped"],
            wasm=agent_wasm,
        )
        allowed = await sup.run(
            scenario_plan(ledger, sandbox=SandboxPolicy(workdir=work)),
            ["write", "note.txt", "hello"],
            wasm=agent_wasm,
        )
    assert confined.exit_status == 5  # no folder at all without a workdir
    assert escaping.exit_status == 5  # and none above it
    assert not (tmp_path / "outside.txt").exists()
    assert allowed.exit_status == 0
    assert (work / "note.txt").read_text() == "hello"


@pytest.mark.parametrize(
    ("args", "limits", "reason", "status"),
    [
        (["spin"], Limits(timeout_s=0.5), "timeout", 124),
        (["spin"], Limits(cpu_s=0.3), "cpu_limit", 125),
        (["grow", "64"], Limits(memory_bytes=32 * 2**20), "memory_limit", 125),
        (["grow", "4"], Limits(memory_bytes=32 * 2**20), "exited", 0),
    ],
    ids=["timeout", "cpu", "memory", "memory-enough"],
)
async def test_limits_stop_a_wasm_guest_and_are_reported_like_a_native_guests(
    tmp_path: Path,
    agent_wasm: Path,
    args: list[str],
    limits: Limits,
    reason: str,
    status: int,
) -> None:
    async with Supervisor(tmp_path / "state") as sup:
        outcome = (
            await sup.run(scenario_plan(Ledger()), args, wasm=agent_wasm, limits=limits)
        ).last
    assert (outcome.reason, outcome.exit_status) == (reason, status)
    if limits.memory_bytes is not None:
        assert outcome.peak_rss_bytes is not None
        assert outcome.peak_rss_bytes <= limits.memory_bytes  # the cap held
        assert outcome.sandbox["limits"]["memory_bytes"] == limits.memory_bytes
    if reason == "cpu_limit":
        assert outcome.cpu_s >= 0.3


@pytest.mark.parametrize("guest", ["c-module", "python-component"])
async def test_a_cancel_interrupts_a_running_wasm_guest(
    tmp_path: Path, guest: str, request: pytest.FixtureRequest
) -> None:
    agent_wasm: Path = request.getfixturevalue(
        "agent_wasm" if guest == "c-module" else "agent_component"
    )
    async with Supervisor(tmp_path / "state") as sup:
        started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
        run = asyncio.create_task(
            sup.run(scenario_plan(Ledger()), ["spin"], wasm=agent_wasm, on_start=started.set_result)
        )
        execution = await asyncio.wait_for(started, STEP_TIMEOUT_S)
        assert execution.describe()["state"] == "running"
        assert sup.cancel(execution.execution_id)
        outcome = await asyncio.wait_for(run, STEP_TIMEOUT_S)
    assert outcome.last.reason == "cancelled"
    assert outcome.exit_status == 143


async def test_a_fenced_wasm_guest_stops_and_its_dispatched_call_still_commits_once(
    tmp_path: Path, agent_wasm: Path
) -> None:
    ledger = Ledger()
    plan = scenario_plan(ledger)
    async with Supervisor(tmp_path / "state") as sup:
        first = asyncio.create_task(
            sup.run(
                plan,
                ["steps", 'call:s1:slow:{"account":"a"}'],
                invocation_id="inv_f",
                wasm=agent_wasm,
            )
        )
        assert await asyncio.to_thread(ledger.started.wait, STEP_TIMEOUT_S)
        # A newer execution of the invocation takes over: the first is fenced
        # while its call is inside the handler.
        second = asyncio.create_task(
            sup.run(
                plan,
                [
                    "steps",
                    f"status:s1:{int(STEP_TIMEOUT_S * 1000)}",
                    'call:s1:slow:{"account":"a"}',
                ],
                invocation_id="inv_f",
                wasm=agent_wasm,
            )
        )
        fenced = await asyncio.wait_for(first, STEP_TIMEOUT_S)
        assert fenced.last.reason == "fenced"
        old = sup.execution(fenced.execution_id)
        assert old is not None and not old.live
        # Its instance's imports now refuse, whatever it asks.
        imports = Imports(1024)
        for answer in (
            await imports.call(old, b'{"call_id":"x","tool":"echo","args":{"n":1}}'),
            await imports.status(old, "s1", 0),
            await imports.plan(old),
            imports.oversized(old),
        ):
            status, body = answer
            assert status == 403
            assert json.loads(body)["error"]["code"] == "execution_fenced"
        ledger.release.set()
        resumed = await asyncio.wait_for(second, STEP_TIMEOUT_S)
        log = sup.state.logs_dir / "inv_f" / f"{resumed.execution_id}.stdout.log"
        lines = [json.loads(line.partition(" ")[2]) for line in log.read_text().splitlines()]
    assert resumed.exit_status == 0
    assert [line["effect"] for line in lines] == ["replayed", "replayed"]
    assert lines[0]["result"] == "slow_a"
    assert ledger.runs["slow"] == 1


WAT_BAD_POINTER = """
(module
  (import "hostcall" "plan" (func $plan (param i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    ;; reply_len far outside its one page of memory
    (drop (call $plan (i32.const 0) (i32.const 16) (i32.const 0x7ffffff0)))))
"""
CHARGE = '{"call_id":"x","tool":"charge","args":{"account":"acct_a","cents":1}}'
WAT_CALL_WITHOUT_ROOM = """
(module
  (import "hostcall" "call" (func $call (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "{data}")
  (func (export "_start")
    ;; a good request, but a reply buffer that runs off the end of memory
    (drop (call $call (i32.const 0) (i32.const {size})
      (i32.const 65000) (i32.const 4096) (i32.const 128)))))
""".format(data=CHARGE.replace('"', '\\"'), size=len(CHARGE))
WAT_HUGE_REQUEST = """
(module
  (import "hostcall" "call" (func $call (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    ;; a 4 GiB request: refused for its size, never read
    (call $exit (i32.ne (i32.const 413)
      (call $call (i32.const 0) (i32.const -1) (i32.const 64) (i32.const 1024) (i32.const 8))))))
"""
WAT_STATUS_OUTSIDE = """
(module
  (import "hostcall" "status" (func $status (param i32 i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    ;; a 4 GiB call id in one page: outside its memory, as for `call`
    (drop (call $status (i32.const 0) (i32.const -1) (i32.const 0)
      (i32.const 64) (i32.const 1024) (i32.const 8)))))
"""
#: A table grown far past what --memory would hold: refused (it holds -1).
WAT_BIG_TABLE = """
(module
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (table $t 0 externref)
  (func (export "_start")
    (call $exit (i32.eq (i32.const -1)
      (table.grow $t (ref.null extern) (i32.const 50000000))))))
"""
WAT_SHARED_MEMORY = '(module (memory (export "memory") 1 1 shared) (func (export "_start")))'
#: A second memory: each would have had the whole --memory (F29).
WAT_TWO_MEMORIES = '(module (memory (export "memory") 1) (memory 1) (func (export "_start")))'
WAT_NO_START = '(module (memory (export "memory") 1))'
#: ``_start`` a global: it got past the checks and failed an assert on the
#: guest's thread, and its execution stayed ``stopping`` for ever.
WAT_START_GLOBAL = (
    '(module (memory (export "memory") 1) (global (export "_start") i32 (i32.const 0)))'
)
WAT_START_TAKES_ARGS = '(module (memory (export "memory") 1) (func (export "_start") (param i32)))'
WAT_OTHER_IMPORT = '(module (import "env" "system" (func)) (func (export "_start")))'
WAT_UNKNOWN_HOSTCALL = '(module (import "hostcall" "exec" (func)) (func (export "_start")))'


@pytest.mark.parametrize("stop", ["timeout", "cancel"])
async def test_a_wasm_module_asleep_in_wasi_is_stopped_at_once_and_its_thread_ends(
    tmp_path: Path, agent_wasm: Path, stop: str
) -> None:
    """wasmtime's own poll_oneoff sleeps through the epoch: the agent's
    ``nanosleep`` of an hour held its thread past the grace (reported
    ``cancelled``). hostcall's poll_oneoff looks at the stop every 0.1 s."""
    before = set(threading.enumerate())
    async with Supervisor(tmp_path / "state", stop_grace_s=STEP_TIMEOUT_S) as sup:
        started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
        run = asyncio.create_task(
            sup.run(
                scenario_plan(Ledger()),
                ["sleep", "3600"],
                wasm=agent_wasm,
                limits=Limits(timeout_s=0.5 if stop == "timeout" else None),
                on_start=started.set_result,
            )
        )
        execution = await asyncio.wait_for(started, STEP_TIMEOUT_S)
        if stop == "cancel":
            assert sup.cancel(execution.execution_id)
        outcome = await asyncio.wait_for(run, STEP_TIMEOUT_S * 2)
    expected = ("timeout", 124) if stop == "timeout" else ("cancelled", 143)
    assert (outcome.last.reason, outcome.exit_status) == expected
    if stop == "timeout":  # asleep by then; a cancel may find it before its sleep
        assert outcome.last.peak_rss_bytes, "the guest's own end, not 'did not stop'"
    left = [t for t in threading.enumerate() if t.name == "hostcall-wasm" and t not in before]
    assert not [t for t in left if t.is_alive()]


async def test_a_wasm_module_sleeps_as_long_as_it_asked_across_the_slices(
    tmp_path: Path, agent_wasm: Path
) -> None:
    """A sleep longer than a slice (0.1 s) neither ends early nor restarts."""
    async with Supervisor(tmp_path / "state") as sup:
        outcome = await sup.run(scenario_plan(Ledger()), ["sleep", "0.35"], wasm=agent_wasm)
        log = sup.state.logs_dir / outcome.invocation_id / f"{outcome.execution_id}.stdout.log"
        said = log.read_text().split()
    assert outcome.exit_status == 0
    assert said[0] == "slept" and float(said[1]) >= 0.35


async def test_a_guest_handing_the_imports_bad_memory_traps_alone(tmp_path: Path) -> None:
    (tmp_path / "bad.wat").write_text(WAT_BAD_POINTER)
    (tmp_path / "huge.wat").write_text(WAT_HUGE_REQUEST)
    (tmp_path / "room.wat").write_text(WAT_CALL_WITHOUT_ROOM)
    (tmp_path / "status.wat").write_text(WAT_STATUS_OUTSIDE)
    (tmp_path / "table.wat").write_text(WAT_BIG_TABLE)
    ledger = Ledger()
    async with Supervisor(tmp_path / "state") as sup:
        bad = await sup.run(scenario_plan(Ledger()), [], wasm=tmp_path / "bad.wat")
        status = await sup.run(scenario_plan(Ledger()), [], wasm=tmp_path / "status.wat")
        table = await sup.run(
            scenario_plan(Ledger()),
            [],
            wasm=tmp_path / "table.wat",
            limits=Limits(memory_bytes=16 << 20),
        )
        roomless = await sup.run(scenario_plan(ledger), [], wasm=tmp_path / "room.wat")
        roomless_calls = await sup.store.calls(roomless.invocation_id)
        huge = await sup.run(scenario_plan(Ledger()), [], wasm=tmp_path / "huge.wat")
        host_log = sup.state.logs_dir / bad.invocation_id / f"{bad.execution_id}.host.log"
        trapped = host_log.read_text()
        # The supervisor serves on.
        again = await sup.run(scenario_plan(Ledger()), ["steps", "plan"], wasm=huge_agent(tmp_path))
    assert bad.last.reason == "signalled" and bad.exit_status == 1
    assert "outside the guest's memory" in trapped
    assert status.last.reason == "signalled"  # a call id outside memory traps, as in `call`
    assert table.exit_status == 1  # its 50 million entries were refused (F29)
    # A call whose answer could not be taken never ran: checked before admission.
    assert roomless.last.reason == "signalled"
    assert ledger.runs["charge"] == 0 and roomless_calls == []
    assert huge.exit_status == 0  # the guest saw 413: payload_too_large
    assert again.exit_status == 0


def huge_agent(tmp_path: Path) -> Path:
    path = tmp_path / "plan.wat"
    path.write_text(
        """(module
  (import "hostcall" "plan" (func $plan (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (call $exit (i32.ne (i32.const 200)
      (call $plan (i32.const 64) (i32.const 16) (i32.const 0))))))"""
    )
    return path


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("not a module", "is not a WebAssembly module"),
        (WAT_SHARED_MEMORY, "is not a WebAssembly module"),
        (WAT_TWO_MEMORIES, "is not a WebAssembly module"),
        (WAT_NO_START, "exports no _start"),
        (WAT_START_GLOBAL, "exports no _start function"),
        (WAT_START_TAKES_ARGS, "exports no _start function"),
        (WAT_OTHER_IMPORT, "imports from 'env'"),
        (WAT_UNKNOWN_HOSTCALL, "imports hostcall.exec"),
    ],
    ids=[
        "garbage",
        "threads",
        "two-memories",
        "no-start",
        "start-a-global",
        "start-takes-arguments",
        "other-import",
        "unknown-hostcall-import",
    ],
)
async def test_a_module_hostcall_cannot_run_is_refused_before_an_invocation_exists(
    tmp_path: Path, source: str, says: str
) -> None:
    (tmp_path / "m.wat").write_text(source)
    async with Supervisor(tmp_path / "state") as sup:
        with pytest.raises(WasmError, match=says):
            await sup.run(
                scenario_plan(Ledger()), [], wasm=tmp_path / "m.wat", invocation_id="inv_x"
            )
        assert await sup.store.get_invocation("inv_x") is None


#: Passes the checks before an invocation exists; linking fails (fd_write's type).
CANNOT_LINK = """
(module
  (import "wasi_snapshot_preview1" "fd_write" (func (param i32)))
  (memory (export "memory") 1)
  (func (export "_start")))
"""


async def test_a_wasm_attempt_that_cannot_be_linked_leaves_the_live_attempt_running(
    tmp_path: Path,
) -> None:
    """A WebAssembly guest starts when its instance is made, on its thread.
    A module whose imports cannot be linked never started, but the fence
    came before: the invocation's running attempt was stopped for it."""
    (tmp_path / "bad.wat").write_text(CANNOT_LINK)
    plan = scenario_plan(Ledger())
    async with Supervisor(tmp_path / "state", sandbox=False) as sup:
        live = asyncio.ensure_future(sup.run(plan, ["/bin/sleep", "30"], invocation_id="inv_l"))
        try:
            await wait_until(
                lambda: [e.launched.is_set() for e in sup.executions("inv_l")] == [True],
                "the live attempt started",
            )
            [running] = sup.executions("inv_l")
            async with asyncio.timeout(STEP_TIMEOUT_S):
                bad = await sup.run(plan, [], invocation_id="inv_l", wasm=tmp_path / "bad.wat")
            state = running.state
            sup.cancel(running.execution_id)
            async with asyncio.timeout(STEP_TIMEOUT_S):
                outcome = await live
        finally:
            live.cancel()
    assert bad.last.reason == "signalled"
    assert state == "running"
    assert outcome.last.reason == "cancelled"


async def test_the_admin_api_launches_a_wasm_guest(tmp_path: Path, agent_wasm: Path) -> None:
    plan = scenario_plan(Ledger())
    async with Supervisor(tmp_path / "state", plan=plan) as sup:
        admin = AsyncAdminClient(sup.state.path)
        described = await admin.request(
            "POST",
            "/v1/invocations",
            {"wasm": str(agent_wasm), "argv": ["steps", "plan"], "invocation": "inv_api"},
        )
        assert described["sandbox"]["runtime"] == "wasmtime"
        assert described["argv"] == [str(agent_wasm), "steps", "plan"]
        assert described["guest_pid"] is None
        assert await sup.wait_stopped(described["execution_id"])
        shown = await admin.request("GET", "/v1/invocations/inv_api")
        with pytest.raises(AdminError) as refused:
            await admin.request("POST", "/v1/invocations", {"wasm": str(tmp_path / "none.wasm")})
        (tmp_path / "junk.wasm").write_bytes(b"\0asm junk")
        with pytest.raises(AdminError) as junk:
            await admin.request("POST", "/v1/invocations", {"wasm": str(tmp_path / "junk.wasm")})
    execution = next(
        e for e in shown["executions"] if e["execution_id"] == described["execution_id"]
    )
    assert execution["outcome"]["exit_status"] == 0
    assert execution["state"] == "ended"
    assert (refused.value.status, refused.value.code) == (400, "bad_request")
    assert (junk.value.status, junk.value.code) == (400, "bad_request")
    assert "not a WebAssembly module" in junk.value.message


async def test_hostcall_run_wasm_runs_a_module_and_reports_its_outcome(
    tmp_path: Path, agent_wasm: Path
) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\nname = 'cli-wasm'\n")
    state = str(tmp_path / "state")
    code, out, err = await hostcall_cli(
        "run", "--state-dir", state, "--plan", str(plan), "--wasm", str(agent_wasm),
        "--json", "--", "steps", "plan", "call:c:nope:{}",
    )  # fmt: skip
    assert code == 0, err
    assert out.splitlines()[0].startswith('200 {"plan_hash"')
    assert out.splitlines()[1].startswith("403 ")
    assert "WebAssembly guest" in err
    outcome = json.loads(err.splitlines()[-1])
    assert outcome["executions"][0]["sandbox"]["runtime"] == "wasmtime"
    assert outcome["executions"][0]["calls"] == {"refused": 1}
    missing = await hostcall_cli(
        "run", "--state-dir", state, "--plan", str(plan), "--wasm", str(tmp_path / "no.wasm")
    )
    assert missing[0] == 127
    assert "cannot start" in missing[2]


async def test_hostcall_run_wasm_exits_124_on_its_timeout_never_aborting(
    tmp_path: Path, agent_wasm: Path
) -> None:
    """A stopped guest's store used to be freed by the collector as the
    interpreter exited; wasmtime then dropped its output streams on a thread
    of its own, calling back into a dying Python: about one run in two
    aborted (exit 134) instead of exiting 124. Four runs, side by side."""
    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\nname = 'cli-wasm-timeout'\n")

    def run(n: int, *argv: str) -> Awaitable[tuple[int, str, str]]:
        return hostcall_cli(
            "run", "--state-dir", str(tmp_path / f"state{n}"), "--plan", str(plan),
            "--timeout", "1", "--wasm", str(agent_wasm), "--", *argv,
        )  # fmt: skip

    ran = await asyncio.gather(
        run(1, "spin"), run(2, "spin"), run(3, "spin"), run(4, "sleep", "3600")
    )
    for code, _, err in ran:
        assert "panicked" not in err
        assert code == 124, err


def test_wasm_guest_threads_never_hold_the_supervisor_after_it_closes(
    tmp_path: Path, agent_wasm: Path
) -> None:
    """A guest still spinning when the supervisor closes is stopped with it."""

    async def main() -> None:
        async with Supervisor(tmp_path / "state") as sup:
            started: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
            run = asyncio.create_task(
                sup.run(
                    scenario_plan(Ledger()), ["spin"], wasm=agent_wasm, on_start=started.set_result
                )
            )
            await asyncio.wait_for(started, STEP_TIMEOUT_S)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run

    before = set(threading.enumerate())
    asyncio.run(main())
    left = [t for t in threading.enumerate() if t.name == "hostcall-wasm" and t not in before]
    for thread in left:
        thread.join(STEP_TIMEOUT_S)
    assert not [t for t in left if t.is_alive()]


async def test_a_python_component_is_stopped_by_the_timeout_and_its_cpu_limit(
    tmp_path: Path, agent_component: Path
) -> None:
    async with Supervisor(tmp_path / "state") as sup:
        timed = await sup.run(
            scenario_plan(Ledger()), ["spin"], wasm=agent_component, limits=Limits(timeout_s=1)
        )
        spent = await sup.run(
            scenario_plan(Ledger()), ["spin"], wasm=agent_component, limits=Limits(cpu_s=0.5)
        )
        cached = sorted((sup.state.path / "wasm-cache").iterdir())
    assert (timed.last.reason, timed.exit_status) == ("timeout", 124)
    assert (spent.last.reason, spent.exit_status) == ("cpu_limit", 125)
    assert spent.last.cpu_s >= 0.5
    # Compiled once (~8 s), kept in the state dir for the next supervisor (0600).
    assert len(cached) == 1 and cached[0].stat().st_mode & 0o777 == 0o600


async def test_a_component_asleep_in_wasi_ends_for_what_stopped_it(
    tmp_path: Path, agent_component: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A component's WASI sleep is wasmtime's own, which no stop interrupts
    (docs/wasm.md, Limits): after the grace the execution ends for the
    timeout, not as ``cancelled``; its thread sleeps on to the end (3 s here).
    While too many sleep on, no new WebAssembly guest starts."""
    monkeypatch.setattr(supervisor_module, "MAX_ASLEEP_WASM", 1)
    monkeypatch.setattr(supervisor_module, "STOPPED_SLACK_S", 0.3)  # given up on at ~1 s
    plan = scenario_plan(Ledger())
    async with Supervisor(tmp_path / "state", plan=plan, stop_grace_s=0.2) as sup:
        asleep = await sup.run(
            plan, ["sleep", "3"], wasm=agent_component, limits=Limits(timeout_s=0.5)
        )
        with pytest.raises(WasmBusy, match="asleep in WASI"):
            await sup.run(plan, ["env"], wasm=agent_component)
        with pytest.raises(AdminError) as busy:
            await AsyncAdminClient(sup.state.path).request(
                "POST", "/v1/invocations", {"wasm": str(agent_component), "argv": ["env"]}
            )
        await wait_until(lambda: not sup._asleep, "the sleeper woke and ended")
        woken = await sup.run(plan, ["env"], wasm=agent_component)
    assert (asleep.last.reason, asleep.exit_status) == ("timeout", 124)
    assert (busy.value.status, busy.value.code) == (503, "wasm_busy")
    assert woken.exit_status == 0


WAT_COMPONENT_OTHER_IMPORT = """
(component
  (import "evil:net/raw" (instance))
  (core module $m (func (export "run") (result i32) (i32.const 0)))
  (core instance $i (instantiate $m))
  (func (export "run") (result s32) (canon lift (core func $i "run"))))
"""


async def test_a_component_importing_more_than_wasi_and_host_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.wat").write_text(WAT_COMPONENT_OTHER_IMPORT)
    async with Supervisor(tmp_path / "state") as sup:
        with pytest.raises(WasmError, match="imports evil:net/raw"):
            await sup.run(scenario_plan(Ledger()), [], wasm=tmp_path / "c.wat")


#: Charges from its start section, inside the instantiation, before ``_start``.
WAT_CHARGES_IN_START = """
(module
  (import "hostcall" "call" (func $call (param i32 i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 0) "{data}")
  (func $early
    (drop (call $call (i32.const 0) (i32.const {size})
      (i32.const 1024) (i32.const 4096) (i32.const 512))))
  (start $early)
  (func (export "_start")))
""".format(data=CHARGE.replace('"', '\\"'), size=len(CHARGE))


async def test_a_modules_start_section_is_served_only_once_the_older_attempt_is_fenced(
    tmp_path: Path,
) -> None:
    """A core module's start section runs inside the instantiation, before
    the instance exists, and may call the imports. Its first call fences
    the older attempt before it is served: the handler never runs while
    two attempts of the invocation are live."""
    (tmp_path / "early.wat").write_text(WAT_CHARGES_IN_START)
    seen: list[list[str]] = []
    async with Supervisor(tmp_path / "state", sandbox=False) as sup:

        @tool(reversibility="irreversible", target_args=["account"], cost=1)
        def charge(account: str, cents: int) -> str:
            seen.append([e.state for e in sup.executions("inv_s")])
            return "charged"

        plan = Plan([charge], name="wasm-test")
        live = asyncio.ensure_future(sup.run(plan, ["/bin/sleep", "30"], invocation_id="inv_s"))
        try:
            await wait_until(
                lambda: [e.launched.is_set() for e in sup.executions("inv_s")] == [True],
                "the live attempt started",
            )
            async with asyncio.timeout(STEP_TIMEOUT_S):
                early = await sup.run(plan, [], invocation_id="inv_s", wasm=tmp_path / "early.wat")
                older = await live
        finally:
            live.cancel()
    assert early.last.reason == "exited" and early.exit_status == 0
    assert older.last.reason == "fenced"
    assert seen == [["fenced", "running"]]
