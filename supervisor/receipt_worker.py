"""Receipt files verified in a process of their own.

Verifying a receipt file recomputes the hash of every line: CPU-bound
Python, some 60 µs a receipt. Run in a thread of the supervisor, it holds
the GIL, and the event loop, which gives the GIL up at every system call,
waits up to the switch interval (5 ms) to get it back at every wake: one
verification of a 15 MB file (25,000 receipts, which refused or replayed
calls write at no cost to a guest's budget) cut another guest's calls
forty-fold while it ran (docs/security.md, F44). So the admin API hands
verification to :class:`ReceiptWorker`: one child process, started when
first needed, at a lower CPU priority (nice 10), so that what the operator
asks for only ever uses what the guests leave.

The worker reads one JSON request a line on its stdin and writes one JSON
answer a line on its stdout; it ends at the end of its stdin, so it never
outlives the supervisor by more than the verification it is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Final

from supervisor.errors import HostcallError

__all__ = ["ReceiptWorker", "ReceiptWorkerBusy", "ReceiptWorkerFailed"]

logger = logging.getLogger(__name__)

#: The worker's CPU priority, relative to the supervisor's.
NICENESS: Final = 10
#: How long a request waits for its report. Past it the answer is "still
#: verifying" (503), and the worker goes on: its cache then answers the next
#: request for that file from where it got to (supervisor.audit.AuditCache).
ANSWER_WAIT_S: Final = 20.0
#: The longest the worker may take over one file before it is deemed stuck,
#: killed (its cache with it) and started again for the next request.
STUCK_S: Final = 600.0
#: How long a closing worker may take to end before it is killed.
STOP_TIMEOUT_S: Final = 2.0
#: The longest answer read (a report of every line of a forged file).
MAX_ANSWER: Final = 256 * 2**20
#: Where ``supervisor`` is imported from, for the worker to import it too.
_ROOT: Final = str(Path(__file__).resolve().parent.parent)
#: The worker's program: ``argv[1]`` is :data:`_ROOT`, ``argv[2]`` the state dir.
_WORKER_MAIN: Final = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from supervisor.receipt_worker import main; sys.exit(main(sys.argv[2:]))"
)


class ReceiptWorkerFailed(HostcallError):
    """The worker could not verify a file (it failed, or was stuck)."""

    code = "internal_error"


class ReceiptWorkerBusy(HostcallError):
    """The file is still being verified (ask again: the worker goes on)."""

    code = "verifying"


class ReceiptWorker:
    """Verifies receipt files in a child process (see the module docstring).

    Files are verified one at a time, in the order asked; a file asked for
    again while it waits shares that verification (once it is being
    verified, the next one: the file may have grown since it started). A
    request waits :data:`ANSWER_WAIT_S` at most; the worker :data:`STUCK_S`
    per file.
    """

    def __init__(self, state_dir: Path) -> None:
        self._state_dir = state_dir
        self._process: asyncio.subprocess.Process | None = None
        #: Each file asked for and not yet answered, in the order asked.
        self._asked: dict[Path, asyncio.Future[dict[str, Any]]] = {}
        #: The file being verified, and its report to come.
        self._running: tuple[Path, asyncio.Future[dict[str, Any]]] | None = None
        self._serving: asyncio.Task[None] | None = None
        self._closed = False

    async def verify(self, path: Path) -> dict[str, Any]:
        """:func:`supervisor.views.verify_receipts` of ``path``, against the state dir.

        Raises:
            ReceiptWorkerBusy: not done within :data:`ANSWER_WAIT_S` (it goes on).
            ReceiptWorkerFailed: the worker failed, ended, or was stuck.
        """
        if self._closed:
            raise ReceiptWorkerFailed("the supervisor is closing")
        # The verification of this file under way, if one is: should the one
        # this request waits for not be done in time, that one's report is
        # the answer (it read the file as it was a little before).
        earlier = self._running[1] if self._running and self._running[0] == path else None
        report = self._asked.get(path)
        if report is None:
            report = self._asked[path] = asyncio.get_running_loop().create_future()
            report.add_done_callback(_retrieved)  # nobody may wait for it any more
            if self._serving is None or self._serving.done():
                self._serving = asyncio.create_task(self._serve())
        try:
            async with asyncio.timeout(ANSWER_WAIT_S):
                return await asyncio.shield(report)
        except TimeoutError:
            if earlier is not None and earlier.done() and earlier.exception() is None:
                return earlier.result()
            raise ReceiptWorkerBusy(
                f"{path.name} is still being verified; ask again (it goes on meanwhile)"
            ) from None

    async def close(self) -> None:
        """End the worker (bounded); no request is served after."""
        self._closed = True
        if self._serving is not None:
            self._serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serving
        for report in self._asked.values():
            if not report.done():
                report.set_exception(ReceiptWorkerFailed("the supervisor is closing"))
        self._asked.clear()
        await self._stop()

    async def _serve(self) -> None:
        """Verify what is asked, one file at a time, until nothing is (the
        next request starts this again)."""
        while self._asked:
            # Taken out as it starts: a request from now on waits for the
            # next verification, which reads what was written since.
            path = next(iter(self._asked))
            report = self._asked.pop(path)
            self._running = (path, report)
            try:
                answer = await self._ask({"op": "verify", "path": str(path)})
            except ReceiptWorkerFailed as exc:
                report.set_exception(exc)
            except asyncio.CancelledError:  # closing
                report.set_exception(ReceiptWorkerFailed("the supervisor is closing"))
                raise
            except Exception as exc:  # a bug: fail this file, serve the next
                logger.exception("the receipt worker failed on %s", path)
                report.set_exception(ReceiptWorkerFailed(f"the receipt worker failed: {exc!r}"))
            else:
                report.set_result(answer)
            finally:
                self._running = None

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        fresh = self._process is None or self._process.returncode is not None
        try:
            line = await self._exchange(request)
            if not line and not fresh:  # it ended since the last request: once more
                await self._stop()
                line = await self._exchange(request)
            answer = json.loads(line)
        except (TimeoutError, OSError, ValueError) as exc:  # ValueError: over the limit
            await self._stop()
            raise ReceiptWorkerFailed(f"the receipt worker failed: {exc!r}") from None
        except asyncio.CancelledError:
            self._kill()  # closing: its answer is not waited for
            raise
        if not isinstance(answer, dict) or ("ok" not in answer and "error" not in answer):
            raise ReceiptWorkerFailed("the receipt worker answered something else")
        if "error" in answer:
            raise ReceiptWorkerFailed(f"the receipts cannot be read: {answer['error']}")
        if not isinstance(answer["ok"], dict):
            raise ReceiptWorkerFailed("the receipt worker's answer is not a report")
        return answer["ok"]

    async def _exchange(self, request: dict[str, Any]) -> bytes:
        """The worker's answer line to ``request`` (empty: the worker has ended)."""
        process = await self._started()
        assert process.stdin is not None
        assert process.stdout is not None
        async with asyncio.timeout(STUCK_S):
            try:
                process.stdin.write(json.dumps(request).encode() + b"\n")
                await process.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                return b""
            return await process.stdout.readline()

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is not None:
            self._process = None
        if self._process is not None:
            return self._process
        # -I: no working directory, PYTHONPATH or user site on its path (a
        # guest may write the folder the supervisor was started in: a json.py
        # there would run as the supervisor); cwd "/" for the same reason.
        # The package is imported from where this supervisor imports it.
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            _WORKER_MAIN,
            _ROOT,
            str(self._state_dir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd="/",
            limit=MAX_ANSWER,
        )
        return self._process

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    async def _stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()  # the worker ends at the end of its input
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()  # SIGKILL: at once


def _retrieved(report: asyncio.Future[dict[str, Any]]) -> None:
    """Mark a report's failure as seen: the requests that waited for it may
    all have been answered "still verifying" and gone."""
    if not report.cancelled():
        report.exception()


def main(argv: list[str]) -> int:
    """The worker (:data:`_WORKER_MAIN`), given the state dir."""
    from supervisor.audit import AuditCache
    from supervisor.views import verify_receipts

    state_dir = Path(argv[0])
    cache = AuditCache()  # the console asks for the same files every few seconds
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            if request.get("op") != "verify":
                raise ValueError(f"no operation {request.get('op')!r}")
            report = verify_receipts(Path(request["path"]), state_dir, cache)
            answer: dict[str, Any] = {"ok": report}
        except OSError as exc:
            answer = {"error": exc.strerror or type(exc).__name__}
        except Exception as exc:  # boundary: one bad file must not end the worker
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
