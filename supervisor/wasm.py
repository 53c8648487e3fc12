"""WebAssembly guests run by wasmtime, their tool calls made through the
``hostcall`` imports (docs/wasm.md).

Two kinds: a WASI preview 1 *module* (a C, Zig, Rust… command) with the i32
imports of module ``hostcall``; and a WASI preview 2 *component* (a Python
agent built with componentize-py, …) of the world ``agent`` in
``channel/hostcall.wit``, whose ``host`` interface takes and returns strings.
Both call the same :class:`channel.imports.Imports`.

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
it returns or within :data:`IMPORT_POLL_S` — a module's ``poll_oneoff``
included, which is hostcall's own (:mod:`supervisor.wasm_poll`); a
component asleep in WASI is not interrupted (docs/wasm.md). WebAssembly
threads are off: a module that declares shared memory is refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib.metadata
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import wasmtime
from wasmtime import component

from channel.imports import Imports
from channel.routing import ExecutionPort
from supervisor.errors import WasmError
from supervisor.limits import EndReason, Limits
from supervisor.wasm_memory import U32, GuestFault, Stopped, guest_memory, read, write
from supervisor.wasm_poll import InterruptiblePoll

__all__ = [
    "DEFAULT_MEMORY_BYTES",
    "IMPORT_MODULE",
    "Compiled",
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
#: How long a finished guest's thread waits for wasmtime to drop its streams.
STREAM_RELEASE_S: Final = 1.0
#: Guest output handed to the event loop but not yet taken, before the guest waits.
OUTPUT_IN_FLIGHT: Final = 1024 * 1024
#: The import module a guest's calls go through, and its functions.
IMPORT_MODULE: Final = "hostcall"
IMPORTS: Final = {"call": 5, "status": 6, "plan": 3, "reply": 2}
WASI_MODULE: Final = "wasi_snapshot_preview1"
#: A component's import of the ``host`` interface, and its export (channel/hostcall.wit).
HOST_INTERFACE: Final = "hostcall:guest/host@0.1.0"
RUN_EXPORT: Final = "run"
#: The binary format's version words: a core module's, a component's.
_MODULE_VERSION: Final = b"\x01\x00\x00\x00"
_COMPONENT_VERSION: Final = b"\x0d\x00\x01\x00"
#: Compiled guests kept in memory, by content: compiling a C module takes
#: ~80 ms and a Python component ~8 s; loading either, < 150 ms.
MODULES_KEPT: Final = 16
_I32: Final = wasmtime.ValType.i32()

#: Table entries a guest may always have (compilers make one table of its
#: indirect calls), however small its memory limit.
MIN_TABLE_ELEMENTS: Final = 10_000

RUNTIME: Final = {"runtime": "wasmtime", "version": importlib.metadata.version("wasmtime")}


def _config() -> wasmtime.Config:
    config = wasmtime.Config()
    config.epoch_interruption = True
    config.wasm_threads = False
    config.shared_memory = False
    # One linear memory: the store caps each memory alone, so a module of
    # forty would have had forty times its --memory (docs/security.md, F29).
    config.wasm_multi_memory = False
    return config


@dataclass(frozen=True, slots=True)
class Compiled:
    """A guest ready to instantiate: its own engine and its code in it."""

    engine: wasmtime.Engine
    code: wasmtime.Module | component.Component

    @property
    def is_component(self) -> bool:
        return isinstance(self.code, component.Component)


class ModuleCache:
    """Guests compiled once per content, loaded into each execution's engine.

    An engine is per execution (its epoch is what stops that guest alone), and
    compiled code belongs to one engine; so the machine code is kept
    serialized — compiled by us, never read from anywhere else — in memory
    and, when ``folder`` is given (the state dir's, 0700, no guest sees it),
    on disk, and loaded into each new engine.
    """

    def __init__(self, folder: Path | None = None, kept: int = MODULES_KEPT) -> None:
        self._folder = folder
        self._kept = kept
        self._compiled: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, path: Path) -> Compiled:
        """A fresh engine and ``path``'s code in it (blocking: run it on a thread).

        Raises:
            WasmError: not a module or component hostcall runs.
            OSError: the file cannot be read.
        """
        data = path.read_bytes()
        is_component = _is_component(data)
        digest = hashlib.sha256(data).hexdigest()
        kind = component.Component if is_component else wasmtime.Module
        engine = wasmtime.Engine(_config())
        serialized = self._serialized(digest)
        if serialized is not None:
            with contextlib.suppress(wasmtime.WasmtimeError):  # another wasmtime's: compile
                return Compiled(engine, kind.deserialize(engine, serialized))
        try:
            # Text is handed over as text: wasmtime-py assembles it.
            code = kind(engine, data if data.startswith(b"\0asm") else data.decode())
        except (wasmtime.WasmtimeError, UnicodeDecodeError) as exc:
            what = "component" if is_component else "module (binary, or text)"
            if data.startswith(b"\0asm") and not is_component:
                what = "module"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
            raise WasmError(f"{path} is not a WebAssembly {what} hostcall runs: {first}") from None
        compiled = Compiled(engine, code)
        if isinstance(code, component.Component):
            _check_component(compiled, path)
        else:
            _check_imports(code, path)
        self._keep(digest, bytes(code.serialize()))
        return compiled

    def _serialized(self, digest: str) -> bytes | None:
        with self._lock:
            found = self._compiled.get(digest)
            if found is not None:
                self._compiled.move_to_end(digest)
                return found
        if self._folder is None:
            return None
        try:
            return (self._folder / f"{digest}.{RUNTIME['version']}.bin").read_bytes()
        except OSError:
            return None

    def _keep(self, digest: str, serialized: bytes) -> None:
        with self._lock:
            self._compiled[digest] = serialized
            while len(self._compiled) > self._kept:
                self._compiled.popitem(last=False)
        if self._folder is None:
            return
        with contextlib.suppress(OSError):  # a cache: without it we compile again
            self._folder.mkdir(mode=0o700, exist_ok=True)
            final = self._folder / f"{digest}.{RUNTIME['version']}.bin"
            partial = final.with_suffix(f".{threading.get_ident()}.partial")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(serialized)
            partial.replace(final)


def _is_component(data: bytes) -> bool:
    """A component's binary (its version word), or its text (``(component``)."""
    if data.startswith(b"\0asm"):
        return data[4:8] == _COMPONENT_VERSION
    text = re.sub(rb"\s+|;;[^\n]*", b"", data[:4096])
    return text.startswith(b"(component")


def _check_component(compiled: Compiled, path: Path) -> None:
    """A component must export ``run`` and import only WASI (preview 2, not
    ``wasi:http``) and the ``host`` interface."""
    code = compiled.code
    assert isinstance(code, component.Component)
    if code.get_export_index(RUN_EXPORT) is None:
        raise WasmError(
            f"{path} exports no run: it is not of the world agent (channel/hostcall.wit)"
        )
    for name in code.type.imports(compiled.engine):
        if name == HOST_INTERFACE:
            continue
        if not name.startswith("wasi:") or name.startswith("wasi:http/"):
            raise WasmError(f"{path} imports {name}: only WASI and {HOST_INTERFACE}")


def _check_imports(module: wasmtime.Module, path: Path) -> None:
    for item in module.imports:
        if item.module == IMPORT_MODULE:
            if item.name not in IMPORTS:
                raise WasmError(
                    f"{path} imports hostcall.{item.name}: the imports are " + ", ".join(IMPORTS)
                )
        elif item.module != WASI_MODULE:
            raise WasmError(f"{path} imports from {item.module!r}: only {WASI_MODULE} and hostcall")
    start = next((item.type for item in module.exports if item.name == "_start"), None)
    if not isinstance(start, wasmtime.FuncType) or start.params:
        raise WasmError(f"{path} exports no _start function: it is not a WASI command")


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


class _Ended(Exception):
    """A module's ``_start`` failed: the failure, and how to read its memory."""

    def __init__(self, failure: BaseException, peak: Callable[[], int]) -> None:
        super().__init__(str(failure))
        self.failure = failure
        self.peak = peak


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
        #: Set once wasmtime has dropped the callback :meth:`sink` made.
        self.released = threading.Event()

    def sink(self) -> Callable[[bytes], None]:
        """What wasmtime is handed as the stream: :meth:`write`, and
        :attr:`released` set when wasmtime lets go of it."""

        def sink(data: bytes) -> None:
            self.write(data)

        weakref.finalize(sink, self.released.set)
        return sink

    def write(self, data: bytes) -> None:
        """Called by wasmtime: on the guest's thread (a module), or on one of
        its own (a component's streams are asynchronous). Never raises."""
        chunk = bytes(data)
        with self._room:
            while self._in_flight > OUTPUT_IN_FLIGHT and not self._stopped.is_set():
                self._room.wait(IMPORT_POLL_S)
            self._in_flight += len(chunk)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody reads
            self._loop.call_soon_threadsafe(self._feed, chunk)

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self.reader.feed_eof)

    def _feed(self, chunk: bytes) -> None:
        if not self.reader.at_eof():
            self.reader.feed_data(chunk)
        with self._room:
            self._in_flight -= len(chunk)
            self._room.notify()


class WasmGuest:
    """One execution's WebAssembly guest: made on the loop, run on its thread.

    Args:
        compiled: Its own engine and its code (:meth:`ModuleCache.load`).
        argv: Its argv (``argv[0]`` its name; a component's ``run`` gets the rest).
        env: Its whole environment (the caller scrubs it).
        execution: What its imports reach: the execution's broker, its liveness.
        limits: ``memory_bytes`` caps its linear memory, ``cpu_s`` its CPU
            time; the caller enforces ``timeout_s`` (it calls :meth:`stop`).
        imports: What the imports call (the supervisor's one :class:`Imports`).
        workdir: A host folder preopened as the guest's ``.``, or None.
        on_instance: Called on the loop once, when the guest starts: its
            instance is made, or its first import call comes (a module's start
            section runs inside the instantiation), whichever is first. Queued
            before that call, so it runs before the call is served. A guest
            that cannot be linked and calls nothing never starts.
    """

    def __init__(
        self,
        compiled: Compiled,
        argv: Sequence[str],
        env: Mapping[str, str],
        execution: ExecutionPort,
        limits: Limits,
        *,
        imports: Imports,
        workdir: Path | None = None,
        on_instance: Callable[[], None] | None = None,
    ) -> None:
        self._engine = compiled.engine
        self._on_instance = on_instance
        self._code = compiled.code
        self._args = list(argv[1:])
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
        self._wasi.stdout_custom = self.stdout.sink()
        self._wasi.stderr_custom = self.stderr.sink()
        if workdir is not None:
            self._wasi.preopen_dir(str(workdir), ".")
        self._started = False  # on_instance queued
        #: The last reply, for ``reply`` (a guest's buffer was too small).
        self._reply = b""

    @property
    def sandbox(self) -> dict[str, Any]:
        """What the outcome and the admin API say about its confinement."""
        return {
            **RUNTIME,
            "kind": "component" if isinstance(self._code, component.Component) else "module",
            "limits": {"memory_bytes": self.memory_limit, "cpu": "epoch", "threads": False},
        }

    @property
    def stop_reason(self) -> EndReason | None:
        """Why :meth:`stop` was first called, or None."""
        return self._stop_reason

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
        # Closed here, on this thread, not whenever a traceback's cycle is
        # collected: WASI's output streams call back into Python when they are
        # dropped, and at interpreter exit that aborts the process.
        with wasmtime.Store(self._engine) as store:
            outcome = self._run_in(store)
        # wasmtime drops the streams on a thread of its own: wait (bounded)
        # until it has, so that none is dropped as the interpreter exits.
        for stream in (self.stdout, self.stderr):
            stream.released.wait(STREAM_RELEASE_S)
        return outcome

    def _run_in(self, store: wasmtime.Store) -> WasmOutcome:
        store.set_wasi(self._wasi)
        store.set_limits(
            memory_size=self.memory_limit,
            # A table's entries take host memory too, outside the linear
            # memory's cap: at most one per 8 bytes of the limit (F29).
            table_elements=max(self.memory_limit // 8, MIN_TABLE_ELEMENTS),
        )
        store.set_epoch_deadline(1)  # one increment — stop() — interrupts it
        cpu_started = time.thread_time()
        exit_code: int | None = 0
        reason: EndReason = "exited"
        trap: str | None = None
        peak: Callable[[], int] = lambda: 0  # noqa: E731 - until there is a memory
        try:
            if isinstance(self._code, component.Component):
                exit_code = self._run_component(store, self._code)
            else:
                peak = self._run_module(store, self._code)
        except wasmtime.ExitTrap as exit_trap:
            exit_code = exit_trap.code
        except Stopped:
            exit_code, reason = None, self._stop_reason or "cancelled"
        except _Ended as ended:
            peak = ended.peak
            exit_code, reason, trap = self._failed(ended.failure)
        except (wasmtime.Trap, wasmtime.WasmtimeError, GuestFault) as failure:
            exit_code, reason, trap = self._failed(failure)
        used = peak()
        if reason in ("exited", "signalled") and exit_code != 0 and self._at_cap(used):
            reason = "memory_limit"  # it needed more than the cap and gave up
        return WasmOutcome(exit_code, reason, time.thread_time() - cpu_started, used, trap)

    def _failed(self, failure: BaseException) -> tuple[int | None, EndReason, str | None]:
        """A trap or error that ended the guest: ours (a stop) or its own."""
        if isinstance(failure, wasmtime.ExitTrap):
            return failure.code, "exited", None
        if isinstance(failure, Stopped) or self._stopped.is_set():
            return None, self._stop_reason or "cancelled", None
        if isinstance(failure, wasmtime.Trap):
            return None, "signalled", failure.message
        # Instantiation failed (a memory over the cap, an import missing), or
        # an import was handed memory the guest does not have.
        return None, "signalled", str(failure)

    def _run_module(self, store: wasmtime.Store, module: wasmtime.Module) -> Callable[[], int]:
        """Run a module's ``_start``; returns how to read its memory's size."""
        linker = wasmtime.Linker(self._engine)
        linker.define_wasi()
        # wasmtime's poll_oneoff would sleep through a stop.
        InterruptiblePoll(self._engine, store, self._stopped).define(linker)
        self._define_imports(linker)
        instance = linker.instantiate(store, module)
        self._instantiated()
        memory = instance.exports(store).get("memory")

        def peak() -> int:
            return memory.data_len(store) if isinstance(memory, wasmtime.Memory) else 0

        start = instance.exports(store)["_start"]
        assert isinstance(start, wasmtime.Func)
        if self._stopped.is_set():
            raise Stopped
        try:
            start(store)
        except (wasmtime.Trap, wasmtime.WasmtimeError, GuestFault, Stopped) as failure:
            raise _Ended(failure, peak) from None
        return peak

    def _run_component(self, store: wasmtime.Store, code: component.Component) -> int:
        """Run a component's ``run(args)``; returns its result, the exit code.
        (Its memories are its own: no size is reported.)"""
        linker = component.Linker(self._engine)
        linker.add_wasip2()
        with linker.root() as root, root.add_instance(HOST_INTERFACE) as host:
            host.add_func("call", self._component_call)
            host.add_func("status", self._component_status)
            host.add_func("plan", self._component_plan)
        instance = linker.instantiate(store, code)
        self._instantiated()
        run = instance.get_func(store, RUN_EXPORT)
        if run is None:
            raise WasmError("the component exports no run")
        if self._stopped.is_set():
            raise Stopped
        result = run(store, self._args)
        return int(result) if isinstance(result, int) else 1

    # -- a component's imports: strings in, (status, string) out -----------------

    def _instantiated(self) -> None:
        """It started: queue ``on_instance`` once, on its thread (the loop
        runs what is queued in order, so before any call queued after)."""
        if self._started:
            return
        self._started = True
        if self._on_instance is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                self._loop.call_soon_threadsafe(self._on_instance)

    def _component_call(self, store: object, request: str) -> tuple[int, str]:
        data = request.encode()
        if len(data) > self._imports.max_body:
            status, body = self._imports.oversized(self._execution)
        else:
            status, body = self._await(self._imports.call(self._execution, data))
        return status, body.decode()

    def _component_status(self, store: object, call_id: str, wait_ms: int) -> tuple[int, str]:
        status, body = self._await(self._imports.status(self._execution, call_id, wait_ms))
        return status, body.decode()

    def _component_plan(self, store: object) -> tuple[int, str]:
        status, body = self._await(self._imports.plan(self._execution))
        return status, body.decode()

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
        self._instantiated()  # a start section's call: it started (SPEC §2)
        future = asyncio.run_coroutine_threadsafe(job, self._loop)
        while True:
            try:
                return future.result(IMPORT_POLL_S)
            except concurrent.futures.TimeoutError:
                if self._stopped.is_set():
                    # The call itself goes on (a dispatched handler is never
                    # cancelled: it is recorded); only the guest stops waiting.
                    raise Stopped from None

    def _answer(
        self, caller: wasmtime.Caller, reply: tuple[int, bytes], out: int, cap: int, length: int
    ) -> int:
        status, body = reply
        self._reply = body
        write(caller, length, len(body).to_bytes(4, "little"))
        if len(body) <= cap & U32:
            write(caller, out, body)
        return status

    def _import_call(
        self, caller: wasmtime.Caller, request: int, size: int, out: int, cap: int, length: int
    ) -> int:
        _check_reply_room(caller, out, cap, length)  # before anything runs
        size &= U32
        if size > self._imports.max_body:
            answer = self._imports.oversized(self._execution)  # unread
        else:
            request_bytes = read(caller, request, size)
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
        start, count = call_id & U32, size & U32
        if start + count > guest_memory(caller).data_len(caller):  # all of it, as `call` checks
            raise GuestFault(f"the call id at {start} (+{count}) is outside the guest's memory")
        raw = read(caller, call_id, min(count, 1024))
        job = self._imports.status(self._execution, raw.decode("utf-8", "replace"), wait_ms)
        return self._answer(caller, self._await(job), out, cap, length)

    def _import_plan(self, caller: wasmtime.Caller, out: int, cap: int, length: int) -> int:
        _check_reply_room(caller, out, cap, length)
        answer = self._await(self._imports.plan(self._execution))
        return self._answer(caller, answer, out, cap, length)

    def _import_reply(self, caller: wasmtime.Caller, out: int, cap: int) -> int:
        if len(self._reply) > cap & U32:
            return -len(self._reply)
        write(caller, out, self._reply)
        return len(self._reply)


def _check_reply_room(caller: wasmtime.Caller, out: int, cap: int, length: int) -> None:
    """The reply buffer and the length word must lie in the guest's memory
    before a call runs: a guest cannot make a call whose answer it cannot take.
    (Memory never shrinks, and the guest is blocked until the answer: they
    stay valid.)"""
    size = guest_memory(caller).data_len(caller)
    for start, count, what in (
        (out & U32, cap & U32, "reply buffer"),
        (length & U32, 4, "reply length"),
    ):
        if start + count > size:
            raise GuestFault(f"the {what} at {start} (+{count}) is outside the guest's memory")
