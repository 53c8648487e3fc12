"""Errors of the host side, all under the one root :class:`HostcallError`."""

from __future__ import annotations

from channel.errors import HostcallError, Refusal

__all__ = [
    "EffectOutcomeUnknown",
    "HostcallError",
    "InvocationMismatch",
    "PlanError",
    "Refusal",
    "StateDirBusy",
    "StoreUnavailable",
    "SupervisorClosing",
    "UnsafeStateDir",
]


class EffectOutcomeUnknown(Exception):
    """Raised by a tool handler when it cannot tell whether its effect happened.

    The call is recorded ``unknown`` and the guest gets ``ambiguous``; it is
    never run again unless the tool is reversible.
    """


class PlanError(HostcallError):
    """A plan or tool definition is invalid (bad TOML, unknown handler, …)."""

    code = "plan_invalid"


class StoreUnavailable(HostcallError):
    """The effect store could not be read or written; nothing ran unrecorded."""

    code = "store_unavailable"


class SupervisorClosing(HostcallError):
    """The supervisor is closing: it launches no guest any more."""

    code = "supervisor_closing"


class StateDirBusy(HostcallError):
    """Another running supervisor holds the state dir's lock."""

    code = "state_dir_busy"


class UnsafeStateDir(HostcallError):
    """The state dir holds something hostcall will not follow (a symlink, another
    user's directory)."""

    code = "unsafe_state_dir"


class WasmError(HostcallError):
    """A module that cannot be run: not WebAssembly, not a WASI command, or
    importing what hostcall does not give (docs/wasm.md)."""

    code = "wasm_invalid"


class WasmBusy(HostcallError):
    """Too many WebAssembly components stopped while asleep in WASI have not
    woken yet: each holds a thread and its memory until it does (docs/wasm.md)."""

    code = "wasm_busy"


class InvocationMismatch(HostcallError):
    """An existing invocation was resumed with a different plan."""

    code = "invocation_mismatch"
