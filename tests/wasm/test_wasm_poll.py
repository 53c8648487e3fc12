"""hostcall's ``poll_oneoff`` (supervisor/wasm_poll.py) against wasmtime's own:
the same subscriptions, through a real module, give the same answer — and a
stop ends a wait wasmtime's would have slept through."""

from __future__ import annotations

import struct
import threading
import time
from typing import Any

import pytest
import wasmtime

from supervisor.wasm_memory import GuestFault, Stopped
from supervisor.wasm_poll import MAX_SUBSCRIPTIONS, InterruptiblePoll
from tests.harness import STEP_TIMEOUT_S

#: A guest that only passes its arguments to WASI's poll_oneoff.
GUEST = """
(module
  (import "wasi_snapshot_preview1" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "poll") (param i32 i32 i32 i32) (result i32)
    (call $poll (local.get 0) (local.get 1) (local.get 2) (local.get 3))))
"""
SUBSCRIPTIONS_AT, EVENTS_AT, COUNT_AT = 1024, 32768, 65532
REALTIME, MONOTONIC, PROCESS_CPUTIME = 0, 1, 2
FD_READ, FD_WRITE = 1, 2
ABSTIME = 1
MS = 1_000_000


def clock(userdata: int, timeout_ns: int, clock_id: int = MONOTONIC, flags: int = 0) -> bytes:
    return struct.pack("<QB7xIIQQH6x", userdata, 0, clock_id, 0, timeout_ns, 0, flags)


def fd(userdata: int, tag: int, descriptor: int) -> bytes:
    return struct.pack("<QB7xI28x", userdata, tag, descriptor)


class Guest:
    """The guest module in a store of its own, with WASI's poll_oneoff or hostcall's."""

    def __init__(self, *, interruptible: bool, stopped: threading.Event | None = None) -> None:
        config = wasmtime.Config()
        config.epoch_interruption = True
        self.engine = wasmtime.Engine(config)
        self.store = wasmtime.Store(self.engine)
        self.store.set_epoch_deadline(1)
        self.store.set_wasi(wasmtime.WasiConfig())
        linker = wasmtime.Linker(self.engine)
        linker.define_wasi()
        if interruptible:
            InterruptiblePoll(self.engine, self.store, stopped or threading.Event()).define(linker)
        exports = linker.instantiate(self.store, wasmtime.Module(self.engine, GUEST)).exports(
            self.store
        )
        self.memory: Any = exports["memory"]
        self.function: Any = exports["poll"]

    def poll(
        self,
        subscriptions: bytes,
        count: int | None = None,
        at: tuple[int, int, int] = (SUBSCRIPTIONS_AT, EVENTS_AT, COUNT_AT),
    ) -> tuple[int, bytes]:
        """(errno, the events written) for ``subscriptions``."""
        self.memory.write(self.store, b"\xee" * 65536, 0)  # nothing left from before
        self.memory.write(self.store, subscriptions, SUBSCRIPTIONS_AT)
        count = len(subscriptions) // 48 if count is None else count
        errno = self.function(self.store, at[0], at[1], count, at[2])
        if errno != 0:
            return errno, b""
        (n,) = struct.unpack("<I", self.memory.read(self.store, COUNT_AT, COUNT_AT + 4))
        return errno, bytes(self.memory.read(self.store, EVENTS_AT, EVENTS_AT + 32 * n))


CASES = {
    "a short monotonic clock": clock(7, MS),
    "a realtime clock": clock(7, MS, REALTIME),
    "a monotonic deadline passed": clock(7, 1, flags=ABSTIME),
    "stdin readable (empty)": fd(3, FD_READ, 0),
    "stdout writable": fd(4, FD_WRITE, 1),
    "stdout before a long clock": clock(1, 3600 * 10**9) + fd(2, FD_WRITE, 1),
    "the guest's userdata is the slice's": clock(1, 5 * MS) + clock(2**64 - 1, 3600 * 10**9),
    "two clocks, the first one due": clock(9, MS) + clock(9, 3600 * 10**9),
    "a bad descriptor": fd(5, FD_READ, 77),
    "an unknown clock": clock(5, MS, 9),
    "a CPU-time clock": clock(5, MS, PROCESS_CPUTIME),
    "an unknown tag": struct.pack("<QB7x32x", 8, 5),
    "no subscriptions": b"",
}


@pytest.mark.parametrize("subscriptions", CASES.values(), ids=CASES.keys())
def test_the_same_subscriptions_get_the_same_answer_as_wasmtimes_own(subscriptions: bytes) -> None:
    assert Guest(interruptible=True).poll(subscriptions) == Guest(interruptible=False).poll(
        subscriptions
    )


def test_a_relative_clock_over_several_slices_fires_once_and_not_early() -> None:
    guest = Guest(interruptible=True)
    started = time.monotonic()
    errno, events = guest.poll(clock(42, 350 * MS) + clock(43, 3600 * 10**9))
    took = time.monotonic() - started
    assert (errno, len(events)) == (0, 32)
    assert struct.unpack_from("<QHB", events) == (42, 0, 0)  # its userdata, no error, a clock
    assert took >= 0.35


@pytest.mark.parametrize(
    ("at", "what"),
    [
        ((65528, EVENTS_AT, COUNT_AT), "outside"),
        ((SUBSCRIPTIONS_AT + 4, EVENTS_AT, COUNT_AT), "aligned"),
        ((SUBSCRIPTIONS_AT, 65520, COUNT_AT), "outside"),
        ((SUBSCRIPTIONS_AT, EVENTS_AT, 65536), "outside"),
    ],
    ids=["subscriptions-outside", "misaligned", "events-outside", "count-outside"],
)
def test_a_bad_pointer_traps_as_wasmtimes_own_does(at: tuple[int, int, int], what: str) -> None:
    with pytest.raises(wasmtime.WasmtimeError):
        Guest(interruptible=False).poll(clock(1, MS), at=at)
    with pytest.raises(GuestFault, match=what):
        Guest(interruptible=True).poll(clock(1, MS), at=at)


def test_more_subscriptions_than_allowed_is_einval() -> None:
    assert Guest(interruptible=True).poll(clock(1, 0), count=MAX_SUBSCRIPTIONS + 1) == (28, b"")


def test_a_stop_ends_an_hours_sleep() -> None:
    """The guest's thread returns (Stopped) soon after the stop; with wasmtime's
    own it would sleep the hour."""
    stopped = threading.Event()
    guest = Guest(interruptible=True, stopped=stopped)
    asleep = threading.Event()
    ended: list[BaseException] = []

    def sleep() -> None:
        asleep.set()
        try:
            guest.poll(clock(1, 3600 * 10**9))
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=sleep, daemon=True)
    thread.start()
    assert asleep.wait(STEP_TIMEOUT_S)
    stopped.set()  # the flag alone: no epoch to trap on, only the slices' looks
    thread.join(STEP_TIMEOUT_S)
    assert not thread.is_alive()
    assert len(ended) == 1
    assert isinstance(ended[0], Stopped)
