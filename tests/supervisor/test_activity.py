"""The console's sources in the supervisor: change notices and the call journal."""

from __future__ import annotations

import asyncio

from supervisor.activity import CallEntry, CallJournal, EventHub, Topic


def entry(call_id: str, args: object, size: int) -> CallEntry:
    return CallEntry(
        "exe_1", call_id, "tool", args, size, "ok", "executed", "executed",
        None, "k", "rcpt", None, 1.0, 2.0,
    )  # fmt: skip


async def test_notices_are_coalesced_per_subscriber_until_read() -> None:
    hub = EventHub()
    hub.publish(Topic.CALLS, "inv_0")  # nobody listens: nothing is kept
    with hub.subscribe() as one, hub.subscribe() as two:
        for _ in range(1000):
            hub.publish(Topic.CALLS, "inv_1")
        hub.publish(Topic.APPROVALS)
        first = await one.next(1.0)
        hub.publish(Topic.CALLS, "inv_2")
        second = await one.next(1.0)
        other = await two.next(1.0)
        nothing = await one.next(0.01)
    assert first == [(Topic.CALLS, "inv_1"), (Topic.APPROVALS, None)]
    assert second == [(Topic.CALLS, "inv_2")]
    assert other == [(Topic.CALLS, "inv_1"), (Topic.APPROVALS, None), (Topic.CALLS, "inv_2")]
    assert nothing == []
    hub.publish(Topic.CALLS, "inv_3")  # closed subscriptions get nothing
    assert not one._pending and not two._pending


async def test_too_many_distinct_notices_collapse_into_one_resync() -> None:
    hub = EventHub()
    with hub.subscribe() as subscription:
        for n in range(5000):
            hub.publish(Topic.CALLS, f"inv_{n}")
        notices = await subscription.next(1.0)
    assert len(notices) < 300
    assert (Topic.RESYNC, None) in notices


async def test_a_waiting_subscriber_wakes_when_a_notice_comes() -> None:
    hub = EventHub()
    with hub.subscribe() as subscription:
        waiting = asyncio.ensure_future(subscription.next(10.0))
        await asyncio.sleep(0)  # let it start waiting
        hub.publish(Topic.LOGS, "inv_1")
        async with asyncio.timeout(5):
            assert await waiting == [(Topic.LOGS, "inv_1")]


async def test_a_subscription_to_some_topics_is_not_woken_by_the_others() -> None:
    """``hostcall run``'s watcher reads approvals and executions: a call, at
    every call, must not wake it."""
    hub = EventHub()
    with hub.subscribe(frozenset({Topic.APPROVALS})) as some, hub.subscribe() as every:
        for _ in range(10):
            hub.publish(Topic.CALLS, "inv_1")
        assert await some.next(0.01) == []
        assert await every.next(1.0) == [(Topic.CALLS, "inv_1")]
        hub.publish(Topic.CALLS, "inv_2")
        hub.publish(Topic.APPROVALS)
        assert await some.next(1.0) == [(Topic.APPROVALS, None)]


def test_the_journal_keeps_the_newest_calls_per_invocation() -> None:
    journal = CallJournal(per_invocation=3)
    for n in range(5):
        journal.add("inv_1", entry(f"c{n}", {"n": n}, 10))
    kept = journal.calls("inv_1")
    assert kept is not None and [e.call_id for e in kept] == ["c2", "c3", "c4"]
    assert journal.calls("inv_2") is None


def test_the_journal_drops_the_oldest_arguments_past_its_byte_budget() -> None:
    journal = CallJournal(per_invocation=100, args_budget_bytes=1000, max_args_bytes=400)
    for n in range(10):
        journal.add("inv_1", entry(f"c{n}", {"n": n}, 300))
    journal.add("inv_1", entry("big", {"x": "y" * 500}, 501))
    kept = journal.calls("inv_1")
    assert kept is not None
    with_args = [e.call_id for e in kept if e.args is not None]
    assert with_args == ["c7", "c8", "c9"]  # 900 bytes of the 1000
    assert len(kept) == 11  # the calls stay, without their arguments
    assert kept[-1].args is None and kept[-1].to_json()["args_kept"] is False


def test_the_journal_keeps_a_bounded_number_of_invocations() -> None:
    journal = CallJournal(invocations=2, args_budget_bytes=10_000)
    journal.add("inv_1", entry("c", {"a": 1}, 100))
    journal.add("inv_2", entry("c", {"a": 1}, 100))
    journal.add("inv_1", entry("d", {"a": 1}, 100))  # inv_1 is now the most recent
    journal.add("inv_3", entry("c", {"a": 1}, 100))
    assert journal.calls("inv_2") is None
    assert journal.calls("inv_1") is not None and journal.calls("inv_3") is not None
    # Arguments of a dropped invocation no longer count against the budget.
    assert journal._held_bytes == 300


def test_the_journal_does_not_grow_with_calls_whose_arguments_it_dropped() -> None:
    journal = CallJournal(per_invocation=10, args_budget_bytes=10**9)
    for n in range(10_000):
        journal.add("inv_1", entry(f"c{n}", {"n": n}, 10))
    assert len(journal._holding) <= 2 * 10 + 64


def test_the_journal_keeps_a_bounded_number_of_calls_across_invocations() -> None:
    journal = CallJournal(per_invocation=10, invocations=100, calls=25, args_budget_bytes=10**9)
    for inv in range(4):
        for n in range(10):
            journal.add(f"inv_{inv}", entry(f"c{n}", {"n": n}, 10))
    # 40 calls made, at most 25 kept: the least recently active went first, whole.
    assert journal.calls("inv_0") is None and journal.calls("inv_1") is None
    assert [len(journal.calls(f"inv_{inv}") or []) for inv in (2, 3)] == [10, 10]
    journal.add("inv_2", entry("late", {"n": 0}, 10))  # inv_2 is now the most recent
    for n in range(10):
        journal.add("inv_4", entry(f"c{n}", {"n": n}, 10))
    assert journal.calls("inv_3") is None
    assert journal.calls("inv_2") is not None and journal.calls("inv_4") is not None


def test_the_journal_of_many_busy_invocations_stays_within_its_memory_bound() -> None:
    """What a long-running `hostcall serve` holds: guests coming and going,
    each making hundreds of calls. Measured, not counted: tracemalloc."""
    import tracemalloc

    journal = CallJournal()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for inv in range(120):  # 60,000 calls: three times CALLS_KEPT
            for n in range(500):
                args = {"account": f"acct_{inv}_{n}", "cents": n}
                journal.add(f"inv_{inv:024x}", entry(f"call_{inv}_{n}", args, 40))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 24 * 2**20, f"{held / 2**20:.1f} MiB"
