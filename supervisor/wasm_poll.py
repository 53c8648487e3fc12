"""``poll_oneoff`` that a stop interrupts, for WASI preview 1 modules.

wasmtime's own ``poll_oneoff`` waits inside wasmtime and never looks at the
epoch, so a module that asked to sleep for an hour could not be stopped by
``--timeout``, a cancel or a fence (docs/wasm.md). A module's import of it is
given :class:`InterruptiblePoll` instead. That hands the very same
subscriptions to wasmtime's ``poll_oneoff``, a slice at a time: each slice adds
a clock of its own, :data:`SLICE_NS` long, and between slices it looks
whether the guest was stopped.

The guest gets what wasmtime's would have answered: the same events, in the
same order, with its own userdata, the same errno, and a trap for a pointer
outside its memory or misaligned. A relative timeout counts from the guest's
call, not from each slice.

wasmtime's ``poll_oneoff`` reads and writes the memory of the instance that
calls it, so it is called through a small helper instance of hostcall's own
(:data:`HELPER`), in the guest's store (the same WASI context: the same
descriptors), whose memory holds the copy.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Final

import wasmtime

from supervisor.wasm_memory import U32, GuestFault, Stopped, guest_memory

__all__ = ["MAX_SUBSCRIPTIONS", "SLICE_NS", "InterruptiblePoll"]

#: How long one slice may wait before the stop flag is looked at again.
SLICE_NS: Final = 100_000_000
#: Subscriptions one call may hand over; more is ``EINVAL``, as ``poll(2)``
#: answers more descriptors than it may have. (wasmtime's own has no limit.)
MAX_SUBSCRIPTIONS: Final = 4096

WASI_MODULE: Final = "wasi_snapshot_preview1"
#: The WASI preview 1 layout: a subscription, an event (both 8-aligned).
_SUBSCRIPTION: Final = 48
_EVENT: Final = 32
#: An event's fields: userdata, error and type; then nbytes and flags.
_EVENT_HEAD, _EVENT_RW, _EVENT_END = 11, 16, 26
#: A subscription's tag, and a clock subscription's fields at their offsets.
_TAG_CLOCK: Final = 0
_CLOCK_MONOTONIC: Final = 1
_ABSTIME: Final = 1
_U64: Final = struct.Struct("<Q")
_CLOCK: Final = struct.Struct("<QB7xIIQQH6x")  # userdata, tag, id, pad, timeout, precision, flags
_TIMEOUT_AT: Final = 24
_FLAGS_AT: Final = 40
_COUNT: Final = struct.Struct("<I")
_EINVAL: Final = 28
_PAGE: Final = 65536

#: A module that only passes a call through to WASI's ``poll_oneoff``, so
#: that it reads and writes the helper's memory.
HELPER: Final = f"""
(module
  (import "{WASI_MODULE}" "poll_oneoff" (func $poll (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "poll") (param i32 i32 i32 i32) (result i32)
    (call $poll (local.get 0) (local.get 1) (local.get 2) (local.get 3))))
"""


class InterruptiblePoll:
    """A guest's ``poll_oneoff(subscriptions, events, count, written) -> errno``.

    Made once per guest, in its store, before the guest is instantiated;
    ``stopped`` is the event :meth:`~supervisor.wasm.WasmGuest.stop` sets.
    """

    def __init__(
        self, engine: wasmtime.Engine, store: wasmtime.Store, stopped: threading.Event
    ) -> None:
        linker = wasmtime.Linker(engine)
        linker.define_wasi()  # wasmtime's own, unshadowed
        helper = linker.instantiate(store, wasmtime.Module(engine, HELPER))
        exports = helper.exports(store)
        memory, poll = exports["memory"], exports["poll"]
        assert isinstance(memory, wasmtime.Memory)
        assert isinstance(poll, wasmtime.Func)
        self._memory = memory
        self._size = memory.data_len(store)
        self._poll = poll
        self._stopped = stopped

    def define(self, linker: wasmtime.Linker) -> None:
        """Put this in place of WASI's ``poll_oneoff`` in ``linker`` (which
        already has WASI)."""
        i32 = wasmtime.ValType.i32()
        linker.allow_shadowing = True
        linker.define_func(
            WASI_MODULE,
            "poll_oneoff",
            wasmtime.FuncType([i32] * 4, [i32]),
            self,
            access_caller=True,
        )
        linker.allow_shadowing = False

    def __call__(
        self, caller: wasmtime.Caller, subscriptions: int, events: int, count: int, written: int
    ) -> int:
        subscriptions, events, count, written = (
            subscriptions & U32,
            events & U32,
            count & U32,
            written & U32,
        )
        if count == 0 or count > MAX_SUBSCRIPTIONS:
            return _EINVAL
        # Checked once: the guest waits in this call, and memory never shrinks.
        memory = guest_memory(caller)
        size = memory.data_len(caller)
        _check(size, subscriptions, count * _SUBSCRIPTION, 8, "subscriptions")
        _check(size, events, count * _EVENT, 8, "events")
        _check(size, written, _COUNT.size, 4, "event count")
        asked = bytearray(memory.read(caller, subscriptions, subscriptions + count * _SUBSCRIPTION))
        userdata, relative = _own_userdata(asked, count)
        entered = time.monotonic_ns()
        # The helper's memory: the subscriptions and the slice's clock, the
        # events, the count.
        at_events = (count + 1) * _SUBSCRIPTION
        at_count = at_events + (count + 1) * _EVENT
        self._room(caller, at_count + _COUNT.size)
        slice_clock = _CLOCK.pack(count, _TAG_CLOCK, _CLOCK_MONOTONIC, 0, SLICE_NS, 0, 0)
        while True:
            if self._stopped.is_set():
                raise Stopped
            elapsed = time.monotonic_ns() - entered
            for offset, timeout in relative:
                _U64.pack_into(asked, offset + _TIMEOUT_AT, max(0, timeout - elapsed))
            self._memory.write(caller, bytes(asked) + slice_clock, 0)
            try:
                errno = self._poll(caller, 0, at_events, count + 1, at_count)
            except wasmtime.Trap:
                if self._stopped.is_set():  # the epoch moved as the helper was entered
                    raise Stopped from None
                raise
            assert isinstance(errno, int)
            if errno != 0:
                return errno
            fired = self._fired(caller, at_events, at_count, userdata)
            if fired:
                # Field by field, as wasmtime's: the padding is left as it was.
                for i, event in enumerate(fired):
                    at = events + i * _EVENT
                    memory.write(caller, event[:_EVENT_HEAD], at)
                    memory.write(caller, event[_EVENT_RW:_EVENT_END], at + _EVENT_RW)
                memory.write(caller, _COUNT.pack(len(fired)), written)
                return 0

    def _fired(
        self, caller: wasmtime.Caller, at_events: int, at_count: int, userdata: list[int]
    ) -> list[bytes]:
        """The guest's events of this slice, with its userdata back (the
        slice's own clock left out)."""
        raw = self._memory.read(caller, at_events, at_count + _COUNT.size)
        (n,) = _COUNT.unpack_from(raw, at_count - at_events)
        fired = []
        for i in range(n):
            event = bytearray(raw[i * _EVENT : (i + 1) * _EVENT])
            (mine,) = _U64.unpack_from(event, 0)
            if mine < len(userdata):
                _U64.pack_into(event, 0, userdata[mine])
                fired.append(bytes(event))
        return fired

    def _room(self, caller: wasmtime.Caller, size: int) -> None:
        """Grow the helper's memory to ``size`` bytes (at most the memory of
        :data:`MAX_SUBSCRIPTIONS`: about 320 KiB)."""
        if size > self._size:
            self._memory.grow(caller, -(-(size - self._size) // _PAGE))
            self._size = self._memory.data_len(caller)


def _own_userdata(asked: bytearray, count: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Number the subscriptions 0…count-1 in their userdata, since the
    guest's own may be the slice's; returns the guest's userdata, and the
    relative clocks as (offset, timeout)."""
    userdata, relative = [], []
    for i in range(count):
        offset = i * _SUBSCRIPTION
        userdata.append(_U64.unpack_from(asked, offset)[0])
        _U64.pack_into(asked, offset, i)
        is_clock = asked[offset + 8] == _TAG_CLOCK
        if is_clock and not asked[offset + _FLAGS_AT] & _ABSTIME:
            relative.append((offset, _U64.unpack_from(asked, offset + _TIMEOUT_AT)[0]))
    return userdata, relative


def _check(size: int, start: int, length: int, align: int, what: str) -> None:
    """Trap, as wasmtime's ``poll_oneoff`` does, for a range outside the
    guest's memory (``size`` bytes) or a pointer not aligned to its type."""
    if start % align:
        raise GuestFault(f"poll_oneoff's {what} at {start} are not {align}-byte aligned")
    if start + length > size:
        raise GuestFault(
            f"poll_oneoff's {what} at {start} (+{length}) are outside the guest's memory"
        )
