"""The supervisor protects itself, sandbox or not (SPEC §13, last paragraph).

Its files are its own, its memory is not readable by its uid, one failed
``/proc`` read or one ``EMFILE`` never stops its sampling, a guest cannot
flood its log, and a host without a sandbox makes ``hostcall run`` say so in
one line.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import Supervisor
from supervisor.limits import Limits
from supervisor.protection import RateLimit, is_dumpable
from supervisor.tracking import TreeTracker
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan

MEMORY_HOG = (
    "x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(60)"
)


async def test_the_state_dir_is_0700_and_every_file_in_it_0600_the_stores_wal_and_shm_too(
    tmp_path: Path, ledger: Ledger
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # made loose by someone else: tightened on start
    code = "from guest_client import connect; connect().call('lookup', {'account': 'a'})"
    async with Supervisor(state) as sup:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            outcome = await sup.run(billing_plan(ledger), [sys.executable, "-c", code])
        assert outcome.exit_status == 0
        files = [p for p in state.rglob("*") if p.is_file() and not p.is_symlink()]
        names = {p.name for p in files}
        assert {"effects.db", "effects.db-wal", "effects.db-shm", "lock"} <= names
        assert any(p.suffix == ".jsonl" for p in files)
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        for folder in [state, *(p for p in state.rglob("*") if p.is_dir())]:
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


async def test_a_process_is_not_dumpable_while_any_of_its_supervisors_runs(
    tmp_path: Path,
) -> None:
    """PR_SET_DUMPABLE 0: no process of its uid may ptrace it or read its
    memory. It stayed so after the supervisor closed, and as a user such a
    process cannot be told from a guest by another supervisor's admin API
    (its ``/proc`` files are root's): a host program that had run one was
    refused as an operator. The last supervisor to close puts it back."""
    set_dumpable(True)
    async with Supervisor(tmp_path / "a", sandbox=False):
        assert not is_dumpable()
        async with Supervisor(tmp_path / "b", sandbox=False):
            assert not is_dumpable()
        assert not is_dumpable()  # the first one still runs
    assert is_dumpable()
    set_dumpable(False)  # not dumpable before: left so
    async with Supervisor(tmp_path / "c", sandbox=False):
        pass
    assert not is_dumpable()
    set_dumpable(True)


def set_dumpable(dumpable: bool) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    assert libc.prctl(4, int(dumpable), 0, 0, 0) == 0  # PR_SET_DUMPABLE


async def test_the_sampler_outlives_emfile_and_still_ends_a_guest_at_its_limit(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unsandboxed (sampled) limits depend on the sampler: while every pass
    fails with EMFILE it must go on, and hold the limit once passes work."""
    import supervisor.tracking as tracking

    real = tracking.proc_snapshot
    failures = {"left": 5}

    def starved() -> dict[int, tracking.ProcStat]:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(24, "Too many open files")
        return real()

    monkeypatch.setattr(tracking, "proc_snapshot", starved)
    async with Supervisor(tmp_path / "state", sandbox=False) as sup:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            outcome = await sup.run(
                billing_plan(ledger),
                [sys.executable, "-c", MEMORY_HOG],
                limits=Limits(memory_bytes=100 * 2**20),
            )
    assert failures["left"] == 0  # it did fail, five times
    assert outcome.last.reason == "memory_limit"
    assert outcome.exit_status == 125


async def test_a_sample_that_raises_anything_does_not_end_the_sampler() -> None:
    tracker = TreeTracker(interval_s=0.01)
    passes = {"n": 0}

    def broken() -> None:
        passes["n"] += 1
        raise RuntimeError("a /proc entry that parses oddly")

    tracker.sample_all = broken  # type: ignore[method-assign]
    tracker._start()  # the loop under test
    tracker._trees["x"] = object()  # type: ignore[assignment]  # keeps it looping
    async with asyncio.timeout(STEP_TIMEOUT_S):
        while passes["n"] < 3:
            await asyncio.sleep(0.01)
    assert tracker._task is not None and not tracker._task.done()
    await tracker.close()


def test_a_flood_of_log_records_is_cut_to_a_burst_with_a_count_of_what_was_dropped() -> None:
    limit = RateLimit(burst=3, period_s=60.0)

    def record(at: float) -> logging.LogRecord:
        made = logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "bad frame", (), None
        )
        made.created = at
        return made

    passed = [limit.filter(record(100.0 + i / 100)) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    later = record(200.0)
    assert limit.filter(later)
    assert later.msg == "(7 similar messages dropped) bad frame"


def test_where_no_sandbox_can_be_made_hostcall_run_exits_2_with_one_line_naming_no_sandbox(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text('[plan]\nname = "p"\n')
    env = {**os.environ, "HOSTCALL_BWRAP": str(tmp_path / "no-bwrap-here")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "--state-dir",
            str(tmp_path / "state"),
            "--plan",
            str(tmp_path / "plan.toml"),
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
        env=env,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "--no-sandbox" in lines[0]
    assert not (tmp_path / "state").exists()  # refused before anything was made
    unsandboxed = subprocess.run(
        [
            sys.executable,
            "-m",
            "supervisor.cli",
            "run",
            "--state-dir",
            str(tmp_path / "state"),
            "--plan",
            str(tmp_path / "plan.toml"),
            "--no-sandbox",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S,
        check=False,
        env=env,
    )
    assert unsandboxed.returncode == 0, unsandboxed.stderr
    assert "sandbox off" in unsandboxed.stderr
