"""A stateful model of the replay table, the budget and the store, against the real broker.

Hypothesis drives a real :class:`~supervisor.broker.Broker` on a real effect
store (memory, and SQLite in a temp dir) with random sequences of calls,
transport retries, reused call_ids, racing duplicates, status polls, handler
outcomes (ok, an ambiguous ``ConnectionResetError``, a plain ``ValueError``,
an invalid result, slow) and restarts. After every step the system and a
small model written from SPEC §5-6 must agree: on every reply, on every
effect record, on the budget used and on how many times each handler ran.

A *restart* stands for a supervisor that dies: the old broker's store handle
is fenced (nothing it does afterwards reaches the store), its in-flight
handlers are abandoned, the store is closed and opened again (``open()``
turns ``pending`` rows ``unknown``) and a new broker serves a new execution
of the same invocation.

Every example runs on its own event loop; steps run one at a time on it, and
a slow handler is an ``async`` handler parked on an ``asyncio.Event`` between
steps, so the interleavings are those the steps choose, deterministically.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from channel.wire import CallReply
from supervisor import Plan, tool
from supervisor.approvals import ApprovalController
from supervisor.broker import Broker
from supervisor.errors import StoreUnavailable
from supervisor.ids import new_id
from supervisor.receipt_files import ReceiptLog
from supervisor.receipts import verify_chain
from supervisor.stores import EffectStore, MemoryEffectStore, SQLiteEffectStore
from tests.harness import STEP_TIMEOUT_S

T = TypeVar("T")

INV = "inv_model"
#: tool -> (reversibility, cost, sync handler?)
TOOLS: Mapping[str, tuple[str, float, bool]] = {
    "pay": ("irreversible", 2.0, False),
    "fetch": ("reversible", 1.0, False),
    "hold": ("costly", 1.0, True),
}
QUICK = ("ok", "ambiguous", "error", "invalid")
#: Hypothesis bounds: together the two machines stay well under 30 s in CI.
EXAMPLES = {"memory": 100, "sqlite": 60}
STEPS = 30

Shape = tuple[str, str, str | None, Any]  # status, effect, reason or error code, result


def shape(reply: CallReply) -> Shape:
    """What the model predicts about a reply (the rest is ids and messages)."""
    code = reply.reason if reply.reason is not None else (reply.error or {}).get("code")
    return (reply.status, reply.effect, code, reply.result)


def refused(code: str) -> Shape:
    return ("refused", "none", code, None)


IN_FLIGHT: Shape = ("ambiguous", "unknown", "in_flight", None)
UNKNOWN: Shape = ("ambiguous", "unknown", "unknown", None)


class DeadStore:
    """The store as one supervisor sees it; :meth:`die` cuts it off for good.

    A supervisor killed mid-handler never writes again: after ``die`` every
    operation of the old broker fails instead of reaching the store.
    """

    def __init__(self, inner: EffectStore) -> None:
        self._inner = inner
        self.dead = False

    def die(self) -> None:
        self.dead = True

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._inner, name)

        async def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.dead:
                raise StoreUnavailable("this supervisor is dead")
            return await method(*args, **kwargs)

        return guarded


@dataclass
class Record:
    """The model's effect record."""

    tool: str
    args: dict[str, Any]
    status: str  # pending | committed | unknown
    replay: Shape | None = None  # the stored response, as replayed


@dataclass
class Gate:
    """Holds a slow handler until the machine releases it."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    final: str = "ok"


@dataclass
class InFlight:
    """A slow call whose handler is running: its request and its execution number."""

    task: asyncio.Task[CallReply]
    seq: int


class Model:
    """The replay table (SPEC §5.5), the budget (§5.7) and the records (§6)."""

    def __init__(
        self, max_calls: int | None, max_cost: float | None, tool_max: dict[str, int]
    ) -> None:
        self.max_calls = max_calls
        self.max_cost = max_cost
        self.tool_max = tool_max
        self.records: dict[str, Record] = {}
        self.calls_used = 0
        self.cost_used = 0.0
        self.tool_used: Counter[str] = Counter()
        self.executions: Counter[str] = Counter()  # by call_id (= the handler's ref)
        self.seq = 0  # executions so far, all calls: the handler returns its number

    def admit(self, call_id: str, name: str, args: dict[str, Any]) -> Shape | None:
        """Steps 5-7: the reply of a call that does not run, or None if it runs."""
        record = self.records.get(call_id)
        if record is not None:
            if (record.tool, record.args) != (name, args):
                return refused("call_id_reused")
            if record.status == "committed":
                assert record.replay is not None
                return record.replay
            if record.status == "pending":
                return IN_FLIGHT
            if TOOLS[name][0] != "reversible":
                return UNKNOWN
        cost = TOOLS[name][1]
        if (
            (self.max_calls is not None and self.calls_used + 1 > self.max_calls)
            or (self.max_cost is not None and self.cost_used + cost > self.max_cost + 1e-9)
            or (name in self.tool_max and self.tool_used[name] + 1 > self.tool_max[name])
        ):
            return refused("budget_exhausted")
        self.calls_used += 1
        self.cost_used += cost
        self.tool_used[name] += 1
        self.executions[call_id] += 1
        self.seq += 1
        self.records[call_id] = Record(name, args, "pending")
        return None

    def settle(self, call_id: str, behaviour: str, seq: int) -> Shape:
        """Steps 10-11: the handler ran with ``behaviour``; its reply."""
        record = self.records[call_id]
        if behaviour == "ok":
            result = {"ref": call_id, "seq": seq}
            record.status, record.replay = "committed", ("ok", "replayed", None, result)
            return ("ok", "executed", None, result)
        if behaviour == "invalid":
            record.status = "committed"
            record.replay = ("error", "replayed", "result_invalid", None)
            return ("error", "executed", "result_invalid", None)
        if behaviour == "ambiguous":
            record.status = "unknown"
            return UNKNOWN
        del self.records[call_id]  # a plain error: released, nothing in doubt
        return ("error", "failed", "tool_error", None)

    def status(self, call_id: str) -> Shape:
        record = self.records.get(call_id)
        if record is None:
            return refused("not_found")
        if record.status == "committed":
            assert record.replay is not None
            return record.replay
        return IN_FLIGHT if record.status == "pending" else UNKNOWN

    def crash(self) -> int:
        """The supervisor died: every pending record becomes unknown on reopen."""
        pending = [r for r in self.records.values() if r.status == "pending"]
        for record in pending:
            record.status = "unknown"
        return len(pending)


class BrokerMachine(RuleBasedStateMachine):
    """The real broker and store, step by step, against :class:`Model`."""

    store_kind = "memory"

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.folder = Path(tempfile.mkdtemp(prefix="hcm-"))
        self.ledger: list[tuple[str, str, str]] = []  # (call_id, tool, "ran" | "failed")
        self.runs = 0  # handler executions so far; each returns its number
        self.last_call: dict[str, tuple[str, dict[str, Any]]] = {}  # call_id -> tool, args
        self.behaviour: dict[str, str] = {}
        self.gates: dict[str, Gate] = {}
        self.in_flight: dict[str, InFlight] = {}
        self.known: list[str] = []
        self.store: EffectStore | None = None
        self.handle: DeadStore | None = None
        self.broker: Broker | None = None
        self.model = Model(None, None, {})
        self.plan: Plan | None = None
        self.recovered = 0  # pending rows the last open() turned unknown

    # -- plumbing ---------------------------------------------------------------

    def run(self, work: Awaitable[T]) -> T:
        """Run one step's work on this example's loop, bounded."""
        return self.loop.run_until_complete(asyncio.wait_for(work, STEP_TIMEOUT_S))

    def make_plan(self, max_calls: int | None, max_cost: float | None, pay_max: int | None) -> Plan:
        machine = self

        async def outcome(ref: str, name: str) -> dict[str, Any]:
            behaviour = machine.behaviour.pop(ref, "ok")
            seq = machine.record_run(ref, name)
            if behaviour == "slow":
                gate = machine.gates[ref]
                gate.started.set()
                await gate.release.wait()
                behaviour = gate.final
            result: dict[str, Any] = machine.act(ref, name, behaviour, seq)
            return result

        @tool(reversibility="irreversible", cost=2.0, target_args=["ref"], max_calls=pay_max)
        async def pay(ref: str, n: int) -> dict[str, Any]:
            return await outcome(ref, "pay")

        @tool(reversibility="reversible", cost=1.0)
        async def fetch(ref: str, n: int) -> dict[str, Any]:
            return await outcome(ref, "fetch")

        @tool(reversibility="costly", cost=1.0)
        def hold(ref: str, n: int) -> dict[str, Any]:  # a sync handler: runs in a thread
            behaviour = machine.behaviour.pop(ref, "ok")
            seq = machine.record_run(ref, "hold")
            result: dict[str, Any] = machine.act(ref, "hold", behaviour, seq)
            return result

        return Plan([pay, fetch, hold], name="model", max_calls=max_calls, max_cost=max_cost)

    def record_run(self, ref: str, name: str) -> int:
        self.ledger.append((ref, name, "ran"))
        self.runs += 1
        return self.runs

    def act(self, ref: str, name: str, behaviour: str, seq: int) -> Any:
        if behaviour == "ambiguous":
            raise ConnectionResetError("the backend hung up")
        if behaviour == "error":
            self.ledger.append((ref, name, "failed"))
            raise ValueError("the backend said no")
        if behaviour == "invalid":
            return "not an object"  # fails the output schema: result_invalid
        return {"ref": ref, "seq": seq}

    async def open_store(self) -> EffectStore:
        if self.store_kind == "memory":
            store = self.store if self.store is not None else MemoryEffectStore()
        else:
            if self.store is not None:
                await self.store.close()
            store = SQLiteEffectStore(self.folder / "effects.db")
        self.recovered = await store.open()
        return store

    def new_broker(self) -> None:
        assert self.store is not None and self.plan is not None
        self.handle = DeadStore(self.store)
        self.broker = Broker(
            plan=self.plan,
            invocation_id=INV,
            execution_id=new_id("exe"),
            store=self.handle,  # type: ignore[arg-type]
            approvals=ApprovalController(),
            receipts=ReceiptLog(self.folder / "receipts.jsonl", commit=self.handle.commit),
            dispatch_blocker=lambda: None,
        )

    def request(self, call_id: str, name: str, args: dict[str, Any], behaviour: str) -> None:
        """One request, start to finish (or, if slow, until its handler runs)."""
        assert self.broker is not None
        if call_id not in self.known:
            self.known.append(call_id)
        self.last_call[call_id] = (name, args)
        self.behaviour[call_id] = behaviour
        expected = self.model.admit(call_id, name, args)
        if behaviour == "slow":
            self.gates[call_id] = gate = Gate()
            task = self.loop.create_task(self.broker.call(call_id, name, args))

            async def first_of() -> None:
                started = asyncio.ensure_future(gate.started.wait())
                await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
                started.cancel()

            self.run(first_of())
            if gate.started.is_set():
                assert expected is None, f"{call_id} ran; the model says {expected}"
                self.in_flight[call_id] = InFlight(task, self.model.seq)
                return
            del self.gates[call_id]
            reply = task.result()
        else:
            reply = self.run(self.broker.call(call_id, name, args))
        if expected is None:
            expected = self.model.settle(call_id, behaviour, self.model.seq)
        self.behaviour.pop(call_id, None)
        assert shape(reply) == expected, f"{call_id} {name} {behaviour}"

    # -- rules ------------------------------------------------------------------

    @initialize(
        max_calls=st.one_of(st.none(), st.integers(2, 30)),
        max_cost=st.one_of(st.none(), st.integers(4, 50)),
        pay_max=st.one_of(st.none(), st.integers(1, 8)),
    )
    def start(self, max_calls: int | None, max_cost: int | None, pay_max: int | None) -> None:
        cost = float(max_cost) if max_cost is not None else None
        self.plan = self.make_plan(max_calls, cost, pay_max)
        self.model = Model(max_calls, cost, {"pay": pay_max} if pay_max is not None else {})
        self.store = self.run(self.open_store())
        self.run(self.store.open_invocation(INV, self.plan.plan_hash, None, 0.0))
        self.new_broker()

    @rule(
        name=st.sampled_from(sorted(TOOLS)),
        n=st.integers(0, 3),
        behaviour=st.sampled_from((*QUICK, "slow")),
    )
    def a_new_call(self, name: str, n: int, behaviour: str) -> None:
        if TOOLS[name][2] and behaviour == "slow":
            behaviour = "ok"  # sync handlers are never parked (a thread would outlive a restart)
        call_id = f"c{len(self.known)}"
        self.request(call_id, name, {"ref": call_id, "n": n}, behaviour)

    @rule(name=st.sampled_from(sorted(n for n, (_, _, sync) in TOOLS.items() if not sync)))
    def a_new_call_whose_handler_is_slow(self, name: str) -> None:
        call_id = f"c{len(self.known)}"
        self.request(call_id, name, {"ref": call_id, "n": 0}, "slow")

    @precondition(lambda self: self.known)
    @rule(pick=st.integers(0, 99), behaviour=st.sampled_from((*QUICK, "slow")))
    def a_retry_with_the_same_call_id_and_args(self, pick: int, behaviour: str) -> None:
        call_id = self.known[pick % len(self.known)]
        name, args = self.call_of(call_id)
        if TOOLS[name][2] and behaviour == "slow":
            behaviour = "ok"
        if call_id in self.in_flight and behaviour == "slow":
            behaviour = "ok"  # its gate is in use; the model answers in_flight anyway
        self.request(call_id, name, args, behaviour)

    @precondition(lambda self: self.known)
    @rule(pick=st.integers(0, 99), other_tool=st.booleans())
    def a_call_id_reused_for_other_arguments(self, pick: int, other_tool: bool) -> None:
        call_id = self.known[pick % len(self.known)]
        name, args = self.call_of(call_id)
        if other_tool:
            name = "fetch" if name != "fetch" else "pay"
        else:
            args = {**args, "n": args["n"] + 10}
        self.request(call_id, name, args, "ok")

    @rule(name=st.sampled_from(sorted(TOOLS)), copies=st.integers(2, 4))
    def racing_duplicates_of_a_new_call(self, name: str, copies: int) -> None:
        assert self.broker is not None
        call_id = f"c{len(self.known)}"
        args = {"ref": call_id, "n": 0}
        self.known.append(call_id)
        self.last_call[call_id] = (name, args)
        self.behaviour[call_id] = "ok"
        expected = self.model.admit(call_id, name, args)
        broker = self.broker

        async def race() -> list[CallReply]:
            return list(
                await asyncio.gather(*(broker.call(call_id, name, args) for _ in range(copies)))
            )

        shapes = [shape(r) for r in self.run(race())]
        if expected is not None:  # refused by the budget: every copy shares the refusal
            assert shapes == [expected] * copies
            return
        executed = self.model.settle(call_id, "ok", self.model.seq)
        replayed = self.model.status(call_id)
        assert shapes.count(executed) == 1, shapes
        assert all(s in (executed, replayed, IN_FLIGHT) for s in shapes), shapes

    @precondition(lambda self: self.in_flight)
    @rule(pick=st.integers(0, 99), final=st.sampled_from(QUICK))
    def a_slow_handler_finishes(self, pick: int, final: str) -> None:
        call_id = sorted(self.in_flight)[pick % len(self.in_flight)]
        flight = self.in_flight.pop(call_id)
        gate = self.gates.pop(call_id)
        event("a slow handler finishes")
        gate.final = final
        gate.release.set()
        reply = self.run(flight.task)
        assert shape(reply) == self.model.settle(call_id, final, flight.seq), call_id

    @precondition(lambda self: self.known)
    @rule(pick=st.integers(0, 99))
    def a_status_poll(self, pick: int) -> None:
        assert self.broker is not None
        call_id = self.known[pick % len(self.known)]
        reply = self.run(self.broker.status(call_id, 0.0))
        assert shape(reply) == self.model.status(call_id), call_id

    @rule()
    def the_supervisor_dies_and_restarts(self) -> None:
        assert self.handle is not None
        if self.in_flight:
            event("a restart abandons a handler in flight")
        self.handle.die()
        self.abandon_tasks()
        self.in_flight.clear()
        self.gates.clear()
        self.store = self.run(self.open_store())
        assert self.recovered == self.model.crash()
        self.new_broker()

    # -- invariants -------------------------------------------------------------

    @invariant()
    def the_store_holds_what_the_model_holds(self) -> None:
        if self.store is None:
            return
        records = self.run(self.store.calls(INV))
        actual = {r.call_id: (r.tool, r.status.value) for r in records}
        assert actual == {c: (r.tool, r.status) for c, r in self.model.records.items()}
        invocation = self.run(self.store.get_invocation(INV))
        assert invocation is not None
        assert invocation.used.calls == self.model.calls_used
        assert abs(invocation.used.cost - self.model.cost_used) < 1e-9

    @invariant()
    def every_handler_ran_exactly_as_often_as_the_model_says(self) -> None:
        ran = Counter(ref for ref, _, what in self.ledger if what == "ran")
        assert ran == +self.model.executions

    @invariant()
    def no_call_of_a_tool_that_is_not_reversible_took_effect_twice(self) -> None:
        # Independent of the model: executions of one call_id's tool that did
        # not fail plainly (a plain failure is released and may run again).
        effective = Counter((ref, name) for ref, name, what in self.ledger if what == "ran")
        effective.subtract((ref, name) for ref, name, what in self.ledger if what == "failed")
        for (call_id, name), count in effective.items():
            if TOOLS[name][0] != "reversible":
                assert count <= 1, (call_id, name)

    # -- helpers ------------------------------------------------------------------

    def call_of(self, call_id: str) -> tuple[str, dict[str, Any]]:
        """The tool and args of a call_id: its record's, else its last request's."""
        record = self.model.records.get(call_id)
        if record is not None:
            return record.tool, record.args
        return self.last_call[call_id]

    def abandon_tasks(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def teardown(self) -> None:
        try:
            if self.handle is not None:
                self.handle.die()
            self.abandon_tasks()
            if self.store is not None:
                self.run(self.store.close())
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            receipts = self.folder / "receipts.jsonl"
            if receipts.exists():
                _, broken = verify_chain(receipts)
                assert broken is None, broken
        finally:
            self.loop.close()
            shutil.rmtree(self.folder, ignore_errors=True)


class SQLiteBrokerMachine(BrokerMachine):
    store_kind = "sqlite"


BOUNDS = settings(
    deadline=None,
    derandomize=True,  # the same examples on every run: deterministic in CI
    database=None,
    stateful_step_count=STEPS,
    suppress_health_check=[HealthCheck.too_slow],
)

TestTheBrokerOnTheMemoryStoreAgreesWithTheModel = BrokerMachine.TestCase
TestTheBrokerOnTheMemoryStoreAgreesWithTheModel.settings = settings(
    BOUNDS, max_examples=EXAMPLES["memory"]
)
TestTheBrokerOnTheSQLiteStoreAgreesWithTheModel = SQLiteBrokerMachine.TestCase
TestTheBrokerOnTheSQLiteStoreAgreesWithTheModel.settings = settings(
    BOUNDS, max_examples=EXAMPLES["sqlite"]
)
