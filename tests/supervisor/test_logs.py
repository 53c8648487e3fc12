"""Guest output budgets (SPEC §13 S9) with real pipes, real child processes and real files."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.logs import (
    REDACTED,
    CappedStream,
    GuestLog,
    OutputBudget,
    Passthrough,
    Redactor,
    allow,
    pump,
)
from tests.harness import STEP_TIMEOUT_S

KiB = 1024
MiB = 1024 * KiB
SECRET = b"hc_SECRET_7f3a9c1d5e"
STREAMS = ("stdout", "stderr")

#: Writes each ``stream:text:count`` argument in order, ``text`` repeated
#: ``count`` times, in 64 KiB writes, each flushed.
WRITER = r"""
import sys
for spec in sys.argv[1:]:
    stream, text, count = spec.split(":")
    out = getattr(sys, stream).buffer
    data = text.encode() * int(count)
    for i in range(0, len(data), 65536):
        out.write(data[i : i + 65536])
        out.flush()
"""


def execution_marker(limit: str) -> bytes:
    return (
        f"\n[hostcall: output cut: this execution's output limit of {limit} was reached; "
        "the rest was discarded]\n"
    ).encode()


def invocation_marker(limit: str) -> bytes:
    return (
        f"\n[hostcall: output cut: this invocation's output limit of {limit} was reached; "
        "the rest was discarded]\n"
    ).encode()


@dataclass
class Run:
    returncode: int
    passed: dict[str, bytes]
    logs: dict[str, Path]

    def log(self, stream: str = "stdout") -> bytes:
        return self.logs[stream].read_bytes()


async def run_guest(
    folder: Path, execution_id: str, budgets: Sequence[OutputBudget], *specs: str
) -> Run:
    """Runs WRITER with ``specs``, pumping both of its streams as the supervisor does."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WRITER,
        *specs,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    passed = {name: bytearray() for name in STREAMS}
    logs = {name: folder / f"{execution_id}.{name}.log" for name in STREAMS}
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await asyncio.gather(
                *(
                    pump(
                        reader,
                        log=GuestLog(logs[name]),
                        passthrough=passed[name].extend,
                        redactor=Redactor(SECRET),
                        budgets=budgets,
                    )
                    for name, reader in zip(STREAMS, (process.stdout, process.stderr), strict=True)
                    if reader is not None
                )
            )
            returncode = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return Run(returncode, {name: bytes(data) for name, data in passed.items()}, logs)


# -- budget arithmetic -----------------------------------------------------------


def test_a_write_gets_what_both_budgets_allow_and_the_tighter_one_is_named() -> None:
    execution = OutputBudget("execution", 100)
    invocation = OutputBudget("invocation", 1000, used=960)

    assert allow(30, [execution, invocation]) == (30, None)
    assert allow(30, [execution, invocation]) == (10, invocation)
    assert (execution.used, invocation.used) == (40, 1000)
    assert allow(5, [execution, invocation]) == (0, invocation)


def test_equally_tight_budgets_name_the_first_one() -> None:
    execution, invocation = OutputBudget("execution", 10), OutputBudget("invocation", 10)

    assert allow(11, [execution, invocation]) == (10, execution)


def test_the_invocation_budget_counts_regular_files_in_its_folder_but_not_symlinks(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "inv"
    folder.mkdir()
    (folder / "a.stdout.log").write_bytes(b"x" * 300)
    (folder / "b.stderr.log").write_bytes(b"y" * 200)
    outside = tmp_path / "big"
    outside.write_bytes(b"z" * 10_000)
    (folder / "c.stdout.log").symlink_to(outside)

    assert OutputBudget.for_invocation(folder, 1000).left == 500
    assert OutputBudget.for_invocation(tmp_path / "absent", 1000).left == 1000


def test_a_credential_held_back_when_the_budget_runs_out_never_comes_out() -> None:
    budget = OutputBudget.for_execution(100)
    stream = CappedStream(Redactor(SECRET), [budget])

    first = stream.feed(b"x" * 97 + SECRET[:3])
    second = stream.feed(SECRET[3:] + b"tail")
    out = first + second + stream.finish()

    assert first == b"x" * 97
    assert out == b"x" * 97 + REDACTED[:3] + execution_marker("100 bytes")
    assert stream.cut_by is budget


def test_a_credential_start_pending_at_the_end_is_discarded_once_the_budget_is_spent() -> None:
    stream = CappedStream(Redactor(SECRET), [OutputBudget.for_execution(100)])

    out = stream.feed(b"x" * 100 + SECRET[:4]) + stream.finish()

    assert out == b"x" * 100 + execution_marker("100 bytes")


# -- real guests -----------------------------------------------------------------


async def test_output_past_the_execution_limit_is_cut_with_exactly_one_marker(
    tmp_path: Path,
) -> None:
    limit = 128 * KiB
    run = await run_guest(
        tmp_path, "e1", [OutputBudget.for_execution(limit)], f"stdout:x:{3 * limit}"
    )

    expected = b"x" * limit + execution_marker("128 KiB")
    assert run.returncode == 0
    assert run.log() == expected
    assert run.logs["stdout"].stat().st_size == limit + len(execution_marker("128 KiB"))
    assert run.passed["stdout"] == expected


async def test_output_that_exactly_fills_the_budget_is_kept_whole_without_a_marker(
    tmp_path: Path,
) -> None:
    limit = 100 * KiB
    run = await run_guest(tmp_path, "e1", [OutputBudget.for_execution(limit)], f"stdout:x:{limit}")

    assert run.log() == b"x" * limit
    assert run.passed["stdout"] == b"x" * limit


async def test_stdout_and_stderr_share_one_execution_budget(tmp_path: Path) -> None:
    limit, each = 150 * KiB, 100 * KiB
    run = await run_guest(
        tmp_path,
        "e1",
        [OutputBudget.for_execution(limit)],
        f"stdout:o:{each}",
        f"stderr:e:{each}",
    )

    marker = execution_marker("150 KiB")
    kept = {name: run.log(name).replace(marker, b"") for name in STREAMS}
    assert kept == {"stdout": b"o" * len(kept["stdout"]), "stderr": b"e" * len(kept["stderr"])}
    assert len(kept["stdout"]) + len(kept["stderr"]) == limit
    for name in STREAMS:
        # A stream that lost output says so once; one that kept it all does not.
        assert run.log(name).count(marker) == (len(kept[name]) < each)
        assert run.passed[name] == run.log(name)


async def test_a_later_execution_gets_only_what_is_left_of_the_invocation_budget(
    tmp_path: Path,
) -> None:
    invocation = OutputBudget.for_invocation(tmp_path, 256 * KiB)

    first = await run_guest(
        tmp_path, "e1", [OutputBudget.for_execution(200 * KiB), invocation], f"stdout:a:{200 * KiB}"
    )
    second = await run_guest(
        tmp_path, "e2", [OutputBudget.for_execution(200 * KiB), invocation], f"stdout:b:{200 * KiB}"
    )

    assert first.log() == b"a" * 200 * KiB
    assert second.log() == b"b" * 56 * KiB + invocation_marker("256 KiB")
    assert second.passed["stdout"] == second.log()


async def test_the_invocation_budget_counts_output_an_earlier_supervisor_left_on_disk(
    tmp_path: Path,
) -> None:
    earlier = OutputBudget.for_invocation(tmp_path, 256 * KiB)
    await run_guest(
        tmp_path, "e1", [OutputBudget.for_execution(), earlier], f"stdout:a:{100 * KiB}"
    )

    # A restarted supervisor knows only what is in the folder.
    restarted = OutputBudget.for_invocation(tmp_path, 256 * KiB)
    run = await run_guest(
        tmp_path, "e2", [OutputBudget.for_execution(), restarted], f"stderr:b:{200 * KiB}"
    )

    assert run.log("stderr") == b"b" * 156 * KiB + invocation_marker("256 KiB")


async def test_a_guest_writing_ten_times_the_limit_is_drained_and_exits(tmp_path: Path) -> None:
    limit = 1 * MiB
    run = await run_guest(
        tmp_path,
        "e1",
        [OutputBudget.for_execution(limit)],
        f"stdout:x:{5 * limit}",
        f"stderr:y:{5 * limit}",
    )

    assert run.returncode == 0  # not blocked on a full pipe, not killed by SIGPIPE
    total = sum(len(run.log(name)) for name in STREAMS)
    assert limit < total <= limit + 2 * len(execution_marker("1 MiB"))


async def test_a_symlink_planted_at_the_log_path_is_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    folder = tmp_path / "inv"
    folder.mkdir()
    (folder / "e1.stdout.log").symlink_to(victim)

    with caplog.at_level(logging.ERROR, logger="supervisor.logs"):
        run = await run_guest(folder, "e1", [OutputBudget.for_execution()], f"stdout:x:{300 * KiB}")

    assert run.returncode == 0
    assert victim.read_bytes() == b"keep me"
    assert (folder / "e1.stdout.log").is_symlink()
    assert run.passed["stdout"] == b"x" * 300 * KiB
    # Reported once, when it could not be opened, not once per chunk.
    assert len([r for r in caplog.records if "e1.stdout.log" in r.getMessage()]) == 1


@contextlib.contextmanager
def file_size_limit(size: int) -> Iterator[None]:
    """This process may write files up to ``size`` bytes: past it, writes fail (EFBIG)."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)


async def test_a_log_that_cannot_be_written_is_reported_once_and_output_still_passes_through(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="supervisor.logs"),
        file_size_limit(256 * KiB),
    ):
        run = await run_guest(tmp_path, "e1", [OutputBudget.for_execution()], f"stdout:x:{2 * MiB}")

    assert run.returncode == 0
    assert run.passed["stdout"] == b"x" * 2 * MiB
    assert run.logs["stdout"].stat().st_size == 256 * KiB
    reports = [r for r in caplog.records if "cannot write guest log" in r.getMessage()]
    assert len(reports) == 1


async def test_a_credential_split_across_the_cut_never_reaches_the_log_or_the_passthrough(
    tmp_path: Path,
) -> None:
    limit = 128 * KiB
    run = await run_guest(
        tmp_path,
        "e1",
        [OutputBudget.for_execution(limit)],
        f"stdout:x:{limit - 5}",
        f"stdout:{SECRET.decode()}:1",
        "stdout:y:1000",
    )

    expected = b"x" * (limit - 5) + REDACTED[:5] + execution_marker("128 KiB")
    assert run.log() == expected
    assert run.passed["stdout"] == expected
    assert SECRET[:4] not in run.log()


async def test_the_log_file_is_0600_in_a_0700_folder(tmp_path: Path) -> None:
    folder = tmp_path / "logs" / "inv"
    old = os.umask(0)  # the modes must not come from the umask
    try:
        run = await run_guest(folder, "e1", [OutputBudget.for_execution()], "stdout:x:10")
    finally:
        os.umask(old)

    assert run.logs["stdout"].stat().st_mode & 0o777 == 0o600
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "logs").stat().st_mode & 0o777 == 0o700


async def test_a_log_folder_and_file_left_with_looser_modes_are_made_private(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "inv"
    folder.mkdir(mode=0o755)
    (folder / "e1.stdout.log").write_bytes(b"earlier\n")
    os.chmod(folder, 0o755)
    os.chmod(folder / "e1.stdout.log", 0o644)

    run = await run_guest(folder, "e1", [OutputBudget.for_execution()], "stdout:x:10")

    assert run.log() == b"earlier\n" + b"x" * 10  # appended, not truncated
    assert run.logs["stdout"].stat().st_mode & 0o777 == 0o600
    assert folder.stat().st_mode & 0o777 == 0o700


def test_a_log_line_never_waits_for_a_reader_that_stopped_reading_and_is_not_lost() -> None:
    """Log lines are written from the event loop. While the pass-through is
    stuck writing guest output to a reader that stopped (a full pipe), a log
    line is queued behind that output rather than wait for the reader."""
    read_end, write_end = os.pipe()
    stream = os.fdopen(write_end, "w")
    got = bytearray()
    try:
        through = Passthrough.to(stream)
        assert through is not None
        through.write(b"g" * (1 * MiB))  # the pipe holds 64 KiB: its writer blocks

        def say_two() -> None:
            Passthrough.own_line(stream, "hostcall: WARNING x")
            Passthrough.own_line(stream, "hostcall: WARNING y")  # queued behind x

        said = threading.Thread(target=say_two)
        said.start()
        said.join(STEP_TIMEOUT_S)
        returned = not said.is_alive()  # before anyone read the pipe
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while not got.endswith(b"WARNING y\n") and time.monotonic() < deadline:
            got += os.read(read_end, 1 * MiB)
    finally:
        os.close(read_end)
        with contextlib.suppress(OSError):
            stream.close()
    assert returned
    # After the output, on a row of its own, in order.
    assert got == b"g" * MiB + b"\nhostcall: WARNING x\nhostcall: WARNING y\n"
