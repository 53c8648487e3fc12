"""WebAssembly guests: a WASI (preview 1) command run by wasmtime, its tool
calls made through the ``hostcall`` imports (docs/wasm.md).

Each execution gets an engine, a store and a thread of its own. The imports
hand each request to the event loop, where the very broker a native guest's
calls reach answers it (:mod:`channel.imports`), and block the guest until it
has. What a WebAssembly guest can do is what it is given: WASI's clocks,
random numbers, its argv and environment, its standard streams (into the
execution's logs) and a preopened folder only if the plan names one — no
socket, no process, no other file.

Limits: linear memory is capped by the store (``--memory``, else
:data:`DEFAULT_MEMORY_BYTES`); the timeout, a cancel and ``--cpu`` (the
thread's own CPU clock, read every :data:`CPU_POLL_S`) interrupt a running
guest through epoch interruption, and a guest blocked in an import as soon as
it returns or within :data:`IMPORT_POLL_S`. WebAssembly threads are off: a
module that declares shared memory is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import wasmtime

from channel.imports import Imports
from channel.routing import ExecutionPort
from supervisor.errors import WasmError
from supervisor.limits import EndReason, Limits

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "IMPORT_MODULE",
    "ModuleCache",
    "WasmError",
    "WasmGuest",
    "WasmOutcome",
]

#: Linear memory a guest may grow to when ``--memory`` does not say.
DEFAULT_MEMORY_BYTES: Final = 256 * 2**20
#: How close to the memory cap a failed guest counts as stopped by it (or 1/16 of the cap).
NEAR_CAP_BYTES: Final = 4 * 2**20
#: How often the guest's CPU time is compared with ``--cpu``.
CPU_POLL_S: Final = 0.05
#: How often an import blocked on the broker looks whether the guest was stopped.
IMPORT_POLL_S: Final = 0.1
#: Guest output handed to the event loop but not yet taken, before the guest waits.
OUTPUT_IN_FLIGHT: Final = 1024 * 1024
#: The import module a guest's calls go through, and its functions.
IMPORT_MODULE: Final = "hostcall"
IMPORTS: Final = {"call": 5, "status": 6, "plan": 3, "reply": 2}
WASI_MODULE: Final = "wasi_snapshot_preview1"
#: Compiled modules kept, by content: compiling takes ~80 ms, loading ~0.5 ms.
MODULES_KEPT: Final = 16
_I32: Final = wasmtime.ValType.i32()
_U32: Final = 0xFFFF_FFFF

RUNTIME: Final = {"runtime": "wasmtime", "version": importlib.metadata.version("wasmtime")}


def _config() -> wasmtime.Config:
    config = wasmtime.Config()
    config.epoch_interruption = True
    config.wasm_threads = False
    config.shared_memory = False
    return config


class ModuleCache:
    """Modules compiled once per content, loaded into each execution's engine.

    An engine is per execution (its epoch is what stops that guest alone), and
    a module belongs to one engine; so the machine code is kept serialized —
    compiled by us, never read from disk — and loaded into each new engine.
    """

    def __init__(self, kept: int = MODULES_KEPT) -> None:
        self._kept = kept
        self._compiled: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, path: Path) -> tuple[wasmtime.Engine, wasmtime.Module]:
        """A fresh engine and ``path``'s module in it (blocking: run it on a thread).

        Raises:
            WasmError: not a module we can run.
            OSError: the file cannot be read.
        """
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            compiled = self._compiled.get(digest)
            if compiled is not None:
                self._compiled.move_to_end(digest)
        engine = wasmtime.Engine(_config())
        if compiled is not None:
            return engine, wasmtime.Module.deserialize(engine, compiled)
        try:
            module = wasmtime.Module(engine, data)
        except wasmtime.WasmtimeError as exc:
            what = "module" if data.startswith(b"\0asm") else "module (binary, or text)"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
            raise WasmError(f"{path} is not a WebAssembly {what} hostcall runs: {first}") from None
        _check_imports(module, path)
        with self._lock:
            self._compiled[digest] = bytes(module.serialize())
            while len(self._compiled) > self._kept:
                self._compiled.popitem(last=False)
        return engine, module


def _check_imports(module: wasmtime.Module, path: Path) -> None:
    for item in module.imports:
        if item.module == IMPORT_MODULE:
            if item.name not in IMPORTS:
                raise WasmError(
                    f"{path} imports hostcall.{item.name}: the imports are " + ", ".join(IMPORTS)
                )
        elif item.module != WASI_MODULE:
            raise WasmError(f"{path} imports from {item.module!r}: only {WASI_MODULE} and hostcall")
    if not any(item.name == "_start" for item in module.exports):
        raise WasmError(f"{path} exports no _start: it is not a WASI command")


@dataclass(frozen=True, slots=True)
class WasmOutcome:
    """How a WebAssembly guest ended."""

    exit_code: int | None
    #: ``exited``; ``timeout``, ``cancelled``, ``cpu_limit`` (interrupted);
    #: ``memory_limit``; ``signalled`` for any other trap.
    reason: EndReason
    cpu_s: float
    peak_memory_bytes: int
    #: What the trap said, when one ended it.
    trap: str | None = None


class _Stopped(Exception):
    """Raised in an import when the guest was stopped while it waited."""


class GuestStream:
    """One WASI output stream, handed from the guest's thread to an
    :class:`asyncio.StreamReader` on the loop — what a native guest's pipe
    feeds — with at most :data:`OUTPUT_IN_FLIGHT` bytes on the way."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stopped: threading.Event) -> None:
        self.reader = asyncio.StreamReader()
        self._loop = loop
        self._stopped = stopped
        self._in_flight = 0
        self._room = threading.Condition()

    def write(self, data: bytes) -> None:
        """Called by wasmtime on the guest's thread."""
        chunk = bytes(data)
        with self._room:
            while self._in_flight > OUTPUT_IN_FLIGHT and not self._stopped.is_set():
                self._room.wait(IMPORT_POLL_S)
            self._in_flight += len(chunk)
        self._loop.call_soon_threadsafe(self._feed, chunk)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self.reader.feed_eof)

    def _feed(self, chunk: bytes) -> None:
        self.reader.feed_data(chunk)
        with self._room:
            self._in_flight -= len(chunk)
            self._room.notify()


class WasmGuest:
    """One execution's WebAssembly guest: made on the loop, run on its thread.

    Args:
        engine: Its own engine (:meth:`ModuleCache.load`).
        module: The module, in ``engine``.
        argv: Its argv (``argv[0]`` its name).
        env: Its whole environment (the caller scrubs it).
        execution: What its imports reach: the execution's broker, its liveness.
        limits: ``memory_bytes`` caps its linear memory, ``cpu_s`` its CPU
            time; the caller enforces ``timeout_s`` (it calls :meth:`stop`).
        imports: What the imports call (the supervisor's one :class:`Imports`).
        workdir: A host folder preopened as the guest's ``.``, or None.
    """

    def __init__(
        self,
        engine: wasmtime.Engine,
        module: wasmtime.Module,
        argv: Sequence[str],
        env: Mapping[str, str],
        execution: ExecutionPort,
        limits: Limits,
        *,
        imports: Imports,
        workdir: Path | None = None,
    ) -> None:
        self._engine = engine
        self._module = module
        self._execution = execution
        self._imports = imports
        self._cpu_s = limits.cpu_s
        self.memory_limit = limits.memory_bytes or DEFAULT_MEMORY_BYTES
        self._stop_reason: EndReason | None = None
        self._stopped = threading.Event()
        self._loop = asyncio.get_running_loop()
        self.stdout = GuestStream(self._loop, self._stopped)
        self.stderr = GuestStream(self._loop, self._stopped)
        self._wasi = wasmtime.WasiConfig()
        self._wasi.argv = list(argv)
        self._wasi.env = sorted(env.items())
        self._wasi.stdout_custom = self.stdout.write
        self._wasi.stderr_custom = self.stderr.write
        if workdir is not None:
            self._wasi.preopen_dir(str(workdir), ".")
        #: The last reply, for ``reply`` (a guest's buffer was too small).
        self._reply = b""

    @property
    def sandbox(self) -> dict[str, Any]:
        """What the outcome and the admin API say about its confinement."""
        return {
            **RUNTIME,
            "limits": {"memory_bytes": self.memory_limit, "cpu": "epoch", "threads": False},
        }

    # -- the run ---------------------------------------------------------------

    async def run(self) -> WasmOutcome:
        """Run the guest to its end on a thread of its own."""
        done: asyncio.Future[WasmOutcome] = self._loop.create_future()

        def finish(outcome: WasmOutcome | BaseException) -> None:
            if done.done():
                return
            if isinstance(outcome, BaseException):
                done.set_exception(outcome)
            else:
                done.set_result(outcome)

        def body() -> None:
            try:
                outcome: WasmOutcome | BaseException = self._run()
            except BaseException as exc:  # boundary: a thread's failure reaches its awaiter
                outcome = exc
            finally:
                self.stdout.close()
                self.stderr.close()
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self._loop.call_soon_threadsafe(finish, outcome)

        thread = threading.Thread(target=body, name="hostcall-wasm", daemon=True)
        thread.start()
        watching = asyncio.ensure_future(self._watch_cpu(thread))
        try:
            return await asyncio.shield(done)
        finally:
            watching.cancel()

    def stop(self, reason: EndReason) -> None:
        """Interrupt the guest now (thread-safe): running code traps at once, a
        blocked import gives up within :data:`IMPORT_POLL_S`."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._stopped.set()
        self._engine.increment_epoch()

    async def _watch_cpu(self, thread: threading.Thread) -> None:
        if self._cpu_s is None or thread.ident is None:
            return
        try:
            clock = time.pthread_getcpuclockid(thread.ident)
            while thread.is_alive():
                if time.clock_gettime(clock) >= self._cpu_s:
                    self.stop("cpu_limit")
                    return
                await asyncio.sleep(CPU_POLL_S)
        except OSError:
            return  # the thread ended between the two looks

    def _run(self) -> WasmOutcome:
        store = wasmtime.Store(self._engine)
        store.set_wasi(self._wasi)
        store.set_limits(memory_size=self.memory_limit, instances=1, memories=1)
        store.set_epoch_deadline(1)  # one increment — stop() — interrupts it
        linker = wasmtime.Linker(self._engine)
        linker.define_wasi()
        self._define_imports(linker)
        cpu_started = time.thread_time()
        exit_code: int | None = 0
        reason: EndReason = "exited"
        trap: str | None = None
        memory: object = None
        try:
            instance = linker.instantiate(store, self._module)
            memory = instance.exports(store).get("memory")
            start = instance.exports(store)["_start"]
            if self._stopped.is_set():
                raise _Stopped
            assert isinstance(start, wasmtime.Func)
            start(store)
        except wasmtime.ExitTrap as exit_trap:
            exit_code = exit_trap.code
        except _Stopped:
            exit_code, reason = None, self._stop_reason or "cancelled"
        except wasmtime.Trap as failure:
            exit_code = None
            if failure.trap_code == wasmtime.TrapCode.INTERRUPT or self._stopped.is_set():
                reason = self._stop_reason or "cancelled"  # we stopped it
            else:
                reason, trap = "signalled", failure.message
        except (wasmtime.WasmtimeError, _GuestFault) as failure:
            # Instantiation failed (a memory over the cap), or an import was
            # handed memory the guest does not have.
            exit_code, reason, trap = None, "signalled", str(failure)
        peak = memory.data_len(store) if isinstance(memory, wasmtime.Memory) else 0
        if reason in ("exited", "signalled") and exit_code != 0 and self._at_cap(peak):
            reason = "memory_limit"  # it needed more than the cap and gave up
        return WasmOutcome(exit_code, reason, time.thread_time() - cpu_started, peak, trap)

    def _at_cap(self, peak: int) -> bool:
        """Whether its memory ended near the cap: within a sixteenth of it (at
        least :data:`NEAR_CAP_BYTES`). wasmtime does not report a refused
        grow, so a guest that failed this full is taken to have been stopped
        by the cap; one that asked for more than is left in one go and
        failed further off is not (docs/wasm.md)."""
        return peak + max(NEAR_CAP_BYTES, self.memory_limit // 16) > self.memory_limit

    # -- the imports -------------------------------------------------------------

    def _define_imports(self, linker: wasmtime.Linker) -> None:
        handlers: dict[str, Callable[..., int]] = {
            "call": self._import_call,
            "status": self._import_status,
            "plan": self._import_plan,
            "reply": self._import_reply,
        }
        for name, params in IMPORTS.items():
            linker.define_func(
                IMPORT_MODULE,
                name,
                wasmtime.FuncType([_I32] * params, [_I32]),
                handlers[name],
                access_caller=True,
            )

    def _await(self, job: Coroutine[Any, Any, tuple[int, bytes]]) -> tuple[int, bytes]:
        """Run ``job`` on the loop; block the guest's thread until it answers."""
        future = asyncio.run_coroutine_threadsafe(job, self._loop)
        while True:
            try:
                return future.result(IMPORT_POLL_S)
            except concurrent.futures.TimeoutError:
                if self._stopped.is_set():
                    # The call itself goes on (a dispatched handler is never
                    # cancelled: it is recorded); only the guest stops waiting.
                    raise _Stopped from None

    def _answer(
        self, caller: wasmtime.Caller, reply: tuple[int, bytes], out: int, cap: int, length: int
    ) -> int:
        status, body = reply
        self._reply = body
        _write(caller, length, len(body).to_bytes(4, "little"))
        if len(body) <= cap & _U32:
            _write(caller, out, body)
        return status

    def _import_call(
        self, caller: wasmtime.Caller, request: int, size: int, out: int, cap: int, length: int
    ) -> int:
        _check_reply_room(caller, out, cap, length)  # before anything runs
        size &= _U32
        if size > self._imports.max_body:
            answer = self._imports.oversized(self._execution)  # unread
        else:
            request_bytes = _read(caller, request, size)
            answer = self._await(self._imports.call(self._execution, request_bytes))
        return self._answer(caller, answer, out, cap, length)

    def _import_status(
        self,
        caller: wasmtime.Caller,
        call_id: int,
        size: int,
        wait_ms: int,
        out: int,
        cap: int,
        length: int,
    ) -> int:
        _check_reply_room(caller, out, cap, length)
        raw = _read(caller, call_id, min(size & _U32, 1024))
        job = self._imports.status(self._execution, raw.decode("utf-8", "replace"), wait_ms)
        return self._answer(caller, self._await(job), out, cap, length)

    def _import_plan(self, caller: wasmtime.Caller, out: int, cap: int, length: int) -> int:
        _check_reply_room(caller, out, cap, length)
        answer = self._await(self._imports.plan(self._execution))
        return self._answer(caller, answer, out, cap, length)

    def _import_reply(self, caller: wasmtime.Caller, out: int, cap: int) -> int:
        if len(self._reply) > cap & _U32:
            return -len(self._reply)
        _write(caller, out, self._reply)
        return len(self._reply)


class _GuestFault(Exception):
    """An import was handed a pointer outside the guest's memory."""


def _memory(caller: wasmtime.Caller) -> wasmtime.Memory:
    memory = caller.get("memory")
    if not isinstance(memory, wasmtime.Memory):
        raise _GuestFault("the module exports no memory named 'memory' for the hostcall imports")
    return memory


def _check_reply_room(caller: wasmtime.Caller, out: int, cap: int, length: int) -> None:
    """The reply buffer and the length word must lie in the guest's memory
    before a call runs: a guest cannot make a call whose answer it cannot take.
    (Memory never shrinks, and the guest is blocked until the answer: they
    stay valid.)"""
    size = _memory(caller).data_len(caller)
    for start, count, what in (
        (out & _U32, cap & _U32, "reply buffer"),
        (length & _U32, 4, "reply length"),
    ):
        if start + count > size:
            raise _GuestFault(f"the {what} at {start} (+{count}) is outside the guest's memory")


def _read(caller: wasmtime.Caller, pointer: int, size: int) -> bytes:
    memory = _memory(caller)
    start = pointer & _U32
    if start + size > memory.data_len(caller):
        raise _GuestFault(f"a hostcall import read {size} bytes at {start}: outside its memory")
    return bytes(memory.read(caller, start, start + size))


def _write(caller: wasmtime.Caller, pointer: int, data: bytes) -> None:
    memory = _memory(caller)
    start = pointer & _U32
    if start + len(data) > memory.data_len(caller):
        raise _GuestFault(
            f"a hostcall import wrote {len(data)} bytes at {start}: outside its memory"
        )
    memory.write(caller, data, start)
