"""The sampler's one-read-per-process view of ``/proc`` against psutil's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from supervisor.limits import Limits
from supervisor.tracking import TreeTracker, proc_snapshot, rss_bytes
from tests.harness import STEP_TIMEOUT_S, wait_until


async def test_a_snapshot_reads_what_psutil_reads_also_for_an_odd_command_name(
    tmp_path: Path,
) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    odd = tmp_path / "a) b (c"  # the command name is in parentheses in /proc/<pid>/stat
    shutil.copy(sleep, odd)
    child = subprocess.Popen([str(odd), "60"])
    try:
        process = psutil.Process(child.pid)
        stat = proc_snapshot()[child.pid]
        assert process.name() == "a) b (c"
        assert stat.ppid == os.getpid()
        assert not stat.zombie
        created = psutil.boot_time() + stat.start / os.sysconf("SC_CLK_TCK")
        assert abs(created - process.create_time()) < 0.05
        # Both read the same kernel counter; the child may still be starting up.
        await wait_until(
            lambda: rss_bytes(child.pid) == process.memory_info().rss,
            "the same RSS as psutil",
        )

        def same_cpu() -> bool:
            times = process.cpu_times()
            total = times.user + times.system + times.children_user + times.children_system
            return abs(proc_snapshot()[child.pid].cpu_s - total) < 1e-9

        await wait_until(same_cpu, "the same CPU time as psutil")
        child.send_signal(signal.SIGKILL)
        await wait_until(lambda: proc_snapshot()[child.pid].zombie, "the child to be a zombie")
    finally:
        child.kill()
        child.wait(timeout=STEP_TIMEOUT_S)
    assert child.pid not in proc_snapshot()


async def test_a_sample_counts_the_tree_and_remembers_each_process_once(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = (
        "import subprocess, time; child = subprocess.Popen(['sleep', '60']);"
        f" open({str(pidfile)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    guest = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    tracker = TreeTracker(interval_s=3600)  # sampled by hand below
    try:
        await wait_until(lambda: pidfile.exists() and pidfile.read_text() != "", "the grandchild")
        grandchild = int(pidfile.read_text())
        tree = tracker.track("exe_t", guest.pid, Limits(max_open_files=10_000), lambda _: None)
        for _ in range(3):
            tracker.sample_all()
        assert tree.peak_processes == 2
        assert {pid for pid, _ in tree.seen} == {guest.pid, grandchild}
        assert tree.peak_rss_bytes >= psutil.Process(guest.pid).memory_info().rss
        assert tree.peak_open_files >= 3  # stdin, stdout, stderr at least
    finally:
        await tracker.close()
        os.killpg(guest.pid, signal.SIGKILL)
        guest.wait(timeout=STEP_TIMEOUT_S)
