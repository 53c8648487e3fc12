"""A WebAssembly module guest's memory as its imports see it: every pointer read
as unsigned and every range checked before a byte is read or written.

Shared by the ``hostcall`` imports (:mod:`supervisor.wasm`) and the
interruptible ``poll_oneoff`` (:mod:`supervisor.wasm_poll`).
"""

from __future__ import annotations

from typing import Final

import wasmtime

__all__ = ["U32", "GuestFault", "Stopped", "guest_memory", "read", "write"]

#: Pointers and lengths cross the ABI as ``i32``: read them as unsigned.
U32: Final = 0xFFFF_FFFF


class Stopped(Exception):
    """Raised in an import when the guest was stopped while it waited."""


class GuestFault(Exception):
    """An import was handed a pointer outside the guest's memory (or misaligned)."""


def guest_memory(caller: wasmtime.Caller) -> wasmtime.Memory:
    """The calling module's exported ``memory``."""
    memory = caller.get("memory")
    if not isinstance(memory, wasmtime.Memory):
        raise GuestFault("the module exports no memory named 'memory' for its imports")
    return memory


def read(caller: wasmtime.Caller, pointer: int, size: int) -> bytes:
    """``size`` bytes of the guest's memory at ``pointer``."""
    memory = guest_memory(caller)
    start = pointer & U32
    if start + size > memory.data_len(caller):
        raise GuestFault(f"an import read {size} bytes at {start}: outside the guest's memory")
    return bytes(memory.read(caller, start, start + size))


def write(caller: wasmtime.Caller, pointer: int, data: bytes) -> None:
    """``data`` into the guest's memory at ``pointer``."""
    memory = guest_memory(caller)
    start = pointer & U32
    if start + len(data) > memory.data_len(caller):
        raise GuestFault(
            f"an import wrote {len(data)} bytes at {start}: outside the guest's memory"
        )
    memory.write(caller, data, start)
