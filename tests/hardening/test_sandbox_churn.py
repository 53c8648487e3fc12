"""Sandboxed launches while another program binds and unlinks Unix sockets
where the guest can see them (docs/sandbox.md: every Unix socket bound on the
host at launch is masked).

The masks come from ``/proc/net/unix`` as the sandbox is built, and a socket
may be gone by the time bubblewrap mounts over it. bubblewrap then failed
before the guest's program ran ("Can't create file at …: Read-only file
system"), and that failure was the guest's own exit status 1. Real processes
only: the supervisor in this process, the churn in a child of its own (no
GIL shared with the supervisor), a real bubblewrap per launch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import Supervisor
from supervisor.process import wait_exited
from supervisor.sandbox import SandboxError, SandboxPolicy
from supervisor.sandbox import start as sandbox_start
from supervisor.sandbox.bwrap import SandboxHost
from supervisor.sandbox.start import launch_sandboxed
from tests.hardening.attack_support import stage_folder
from tests.hardening.sandbox_support import Account
from tests.harness import STEP_TIMEOUT_S, Ledger, billing_plan, read_line

#: Sandboxed launches in a row, each while the churn goes on.
LAUNCHES = 30
#: The guest's own exit status: neither 0 nor bubblewrap's 1.
GUEST_EXIT = 7

#: Binds a socket under a new name, unlinks the oldest of the four it keeps
#: bound, and so on, until its stdin closes; then prints how many it bound.
#: Says "ready" once the first is bound.
CHURN = r"""
import os, socket, sys, threading
folder = sys.argv[1]
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
kept = []
bound = 0
while not done.is_set():
    path = os.path.join(folder, f"churn-{bound}.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    kept.append((s, path))
    bound += 1
    if bound == 1:
        print("ready", flush=True)
    if len(kept) > 4:
        old, old_path = kept.pop(0)
        os.unlink(old_path)
        old.close()
print(bound, flush=True)
"""

#: The guest: tries the socket the host keeps bound beside the churn (it
#: must be masked), and exits with GUEST_EXIT if it could not connect.
GUEST = r"""
import os, socket, sys
with socket.socket(socket.AF_UNIX) as s:
    sys.exit(int(os.environ["GUEST_EXIT"]) if s.connect_ex(os.environ["STABLE"]) else 0)
"""


@pytest.fixture
def churn_folder() -> Iterator[Path]:
    """A folder outside /tmp the guest sees (read-only), of the tests' own uid."""
    me = Account("self", os.geteuid(), sys.executable, Path.home())
    with stage_folder(me, prefix="hostcall-churn-") as folder:
        yield folder


async def _launch(sup: Supervisor, ledger: Ledger, env: dict[str, str]) -> tuple[str, int | None]:
    """One sandboxed run of :data:`GUEST`: how it ended, and its exit status;
    a launch that failed is counted, not raised (the tally is the point)."""
    try:
        outcome = await sup.run(
            billing_plan(ledger),
            [sys.executable, "-c", GUEST],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except SandboxError as exc:
        return f"launch failed: {exc}", None
    return outcome.last.reason, outcome.last.exit_code


async def test_sockets_unlinked_while_sandboxes_are_built_fail_no_launch(
    tmp_path: Path, churn_folder: Path
) -> None:
    """Each of 30 launches, while another process binds and unlinks sockets
    in a folder the guest can see, runs its guest and reports the guest's
    own exit status; a socket kept bound there stays masked."""
    ledger = Ledger()
    env = {"STABLE": str(churn_folder / "stable.sock"), "GUEST_EXIT": str(GUEST_EXIT)}
    exits: list[tuple[str, int | None]] = []
    with socket.socket(socket.AF_UNIX) as stable:
        stable.bind(env["STABLE"])
        os.chmod(env["STABLE"], 0o777)  # a mask, not its mode, keeps the guest out
        stable.listen(LAUNCHES)
        with subprocess.Popen(
            [sys.executable, "-c", CHURN, str(churn_folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        ) as churn:
            assert churn.stdin is not None
            try:
                assert read_line(churn.stdout) == "ready\n"
                async with asyncio.timeout(STEP_TIMEOUT_S * 4):
                    async with Supervisor(tmp_path / "state", stop_grace_s=0.5) as sup:
                        for _ in range(LAUNCHES):
                            exits.append(await _launch(sup, ledger, env))
            finally:
                churn.stdin.close()  # it ends, and says how many it bound
                try:
                    bound_line = read_line(churn.stdout)
                finally:
                    churn.kill()  # if it did not end by itself
    bound = int(bound_line)

    tally = Counter(f"{reason[:60]} {code}" for reason, code in exits)
    assert exits == [("exited", GUEST_EXIT)] * LAUNCHES, dict(tally)
    assert bound > LAUNCHES  # the churn went on all along


async def test_a_sandbox_bubblewrap_cannot_build_is_a_launch_error_and_a_guests_exit_1_is_not(
    tmp_path: Path, churn_folder: Path
) -> None:
    """bubblewrap exits 1 when a mount fails, as a guest may: the start tells
    them apart by the gate's byte, never by that status. A mask over a path
    gone since (nothing may be made under the guest's read-only ``/``) is a
    :class:`SandboxError` with bubblewrap's reason; ``exit 1`` is the guest's."""
    host = SandboxHost.probe()
    with socket.socket(socket.AF_UNIX) as channel:
        channel.bind(str(tmp_path / "channel.sock"))
        endings: list[str | int] = []
        for mask_gone, argv in ((True, ["/bin/true"]), (False, ["/bin/sh", "-c", "exit 1"])):
            launch = host.build(
                SandboxPolicy(),
                argv=argv,
                env={"PATH": os.defpath},
                cwd=Path("/"),
                state_dir=tmp_path / "state",
                socket=tmp_path / "channel.sock",
            )
            if mask_gone:
                gone = ("--ro-bind", "/dev/null", str(churn_folder / "gone.sock"))
                launch = dataclasses.replace(launch, options=(*launch.options, *gone))
            async with asyncio.timeout(STEP_TIMEOUT_S):
                try:
                    process, sandboxed = await launch_sandboxed(
                        launch, credential="x" * 43, stderr=subprocess.PIPE
                    )
                except SandboxError as exc:
                    endings.append(str(exc))
                    continue
                endings.append(await wait_exited(process))
                sandboxed.close()
                process.close_pipes()

    assert endings[1:] == [1]
    assert "the sandbox did not start" in str(endings[0])
    assert f"Can't create file at {churn_folder}/gone.sock: Read-only file system" in str(
        endings[0]
    )


async def test_a_folder_masked_whole_after_churn_still_shows_what_the_plan_needs_inside(
    tmp_path: Path, churn_folder: Path
) -> None:
    """After a socket vanished, its folder is masked whole on the next build:
    a socket bound there stays out of reach, and so does the rest of the
    folder, but for a plan path inside it (else the plan's data would be
    hidden under the mask). ``/bin/sh``'s prefix — ``/`` where ``/bin`` leads
    to ``/usr/bin`` — keeps nothing from being masked."""
    (churn_folder / "data").mkdir()
    (churn_folder / "data" / "file").write_text("hello\n")
    (churn_folder / "other").write_text("x\n")
    for path in (churn_folder / "data", churn_folder / "data" / "file", churn_folder / "other"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    script = (
        f"cat {churn_folder}/data/file; test -e {churn_folder}/other && echo other-seen;"
        f" test -S {churn_folder}/one.sock && echo socket-seen; exit 0"
    )
    host = SandboxHost.probe()
    shown: list[tuple[bool, str]] = []
    with socket.socket(socket.AF_UNIX) as channel, socket.socket(socket.AF_UNIX) as one:
        channel.bind(str(tmp_path / "channel.sock"))
        one.bind(str(churn_folder / "one.sock"))
        for policy in (SandboxPolicy(), SandboxPolicy(read_only=(churn_folder / "data",))):
            launch = host.build(
                policy,
                argv=["/bin/sh", "-c", script],
                env={"PATH": os.defpath},
                cwd=Path("/"),
                state_dir=tmp_path / "state",
                socket=tmp_path / "channel.sock",
                mask_whole={churn_folder},
            )
            async with asyncio.timeout(STEP_TIMEOUT_S):
                process, sandboxed = await launch_sandboxed(
                    launch, credential="x" * 43, stdout=subprocess.PIPE
                )
                assert process.stdout is not None
                out = await process.stdout.read()
                assert await wait_exited(process) == 0
                sandboxed.close()
                process.close_pipes()
            shown.append((churn_folder in launch.masked, out.decode()))

    assert shown[0] == (True, "")  # the folder masked whole: nothing of it
    assert shown[1] == (False, "hello\nother-seen\n")  # one by one: the socket alone


def test_a_masked_socket_bound_again_at_its_path_counts_as_vanished(
    tmp_path: Path, churn_folder: Path
) -> None:
    """A program that restarts unlinks its socket and binds it again: by the
    time the launch looks, the path is there, but bubblewrap may have met it
    gone. It is told by its inode."""
    host = SandboxHost.probe()
    with socket.socket(socket.AF_UNIX) as channel:
        channel.bind(str(tmp_path / "channel.sock"))
        restarting = socket.socket(socket.AF_UNIX)
        restarting.bind(str(churn_folder / "daemon.sock"))
        launch = host.build(
            SandboxPolicy(),
            argv=["/bin/true"],
            env={"PATH": os.defpath},
            cwd=Path("/"),
            state_dir=tmp_path / "state",
            socket=tmp_path / "channel.sock",
        )
        restarting.close()
        os.unlink(churn_folder / "daemon.sock")  # the program restarts …
        error = ""
        try:
            asyncio.run(launch_sandboxed(launch, credential="x" * 43, stderr=subprocess.PIPE))
        except SandboxError as exc:
            error = str(exc)
        launch.close_fds()
        with socket.socket(socket.AF_UNIX) as again:  # … and is back when the launch looks
            again.bind(str(churn_folder / "daemon.sock"))
            found = (launch.vanished_socket_folders(), launch.vanished_socket_folders(error))
    assert f"Can't create file at {churn_folder}/daemon.sock" in error  # bubblewrap met it gone
    assert found == (frozenset(), frozenset({churn_folder}))  # the path is back: told by the error


async def test_a_cgroup_join_that_never_ends_fails_the_start_and_runs_nothing(
    tmp_path: Path, churn_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start's one deadline bounds joining the cgroup too (a thread)."""
    monkeypatch.setattr(sandbox_start, "SANDBOX_START_TIMEOUT_S", 1.0)
    marker = churn_folder / "ran"
    os.chmod(churn_folder, 0o777)
    released = threading.Event()
    host = SandboxHost.probe()
    with socket.socket(socket.AF_UNIX) as channel:
        channel.bind(str(tmp_path / "channel.sock"))
        launch = host.build(
            SandboxPolicy(read_write=(churn_folder,)),
            argv=["/bin/sh", "-c", f"echo ran > {marker}"],
            env={"PATH": os.defpath},
            cwd=Path("/"),
            state_dir=tmp_path / "state",
            socket=tmp_path / "channel.sock",
        )
        try:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                with pytest.raises(SandboxError) as failed:
                    await launch_sandboxed(
                        launch,
                        credential="x" * 43,
                        stderr=subprocess.PIPE,
                        join=lambda pid: released.wait(STEP_TIMEOUT_S) and None,
                    )
        finally:
            released.set()
            launch.close_fds()
    assert "its cgroup was not joined within 1 s" in str(failed.value)
    assert not marker.exists()
