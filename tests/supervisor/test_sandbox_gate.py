"""The gate a sandboxed guest's program runs behind (supervisor/sandbox/gate.py).

Each shell this host has runs the gate line for real, on a real pipe: what
it runs the guest with, and what it passes on. The gate inside a real
sandbox, a supervisor killed before its go-ahead among them, is tested in
tests/supervisor/test_lifecycle.py and tests/hardening/test_sandbox_procs.py.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supervisor.sandbox.gate import (
    GATE_GO_AHEAD,
    GATE_REACHED,
    GATE_SHUT_EXIT,
    GO_AHEAD,
    Gate,
    Gates,
)
from tests.harness import STEP_TIMEOUT_S

#: Names dash drops from the environment and bash keeps.
ODD_NAMES = {
    "spring.profiles.active": "test",
    "BASH_FUNC_module%%": "() {  echo module\n}",
    "x-y": "1",
}


def _shells() -> Iterator[tuple[str, ...]]:
    yield ("/bin/sh",)
    for name, options in (("dash", ()), ("bash", ("--posix",)), ("busybox", ("sh",))):
        path = shutil.which(name, path=os.defpath)
        if path is not None:
            yield (path, *options)


SHELLS = list(_shells())


def _gate(shell: Sequence[str]) -> Gate:
    gate = Gate.probe(*shell)
    assert gate is not None, f"{shell} cannot run a program"
    return gate


def _through(
    gate: Gate, argv: Sequence[str], *, go_ahead: bool, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` behind ``gate`` with the go-ahead written to its pipe, or
    the pipe ended without it (the supervisor gone: then the test's own end
    of the reached pipe is closed too, as the supervisor's would be)."""
    read, write = os.pipe()
    reached_r, reached_w = os.pipe()
    try:
        if go_ahead:
            os.write(write, GO_AHEAD)
        os.close(write)
        with subprocess.Popen(
            [*gate.command(read, reached_w), *argv],
            env={"PATH": os.defpath} if env is None else env,
            pass_fds=(read, reached_r, reached_w),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as gated:
            if not go_ahead:
                os.close(reached_r)
                reached_r = -1
            stdout, stderr = gated.communicate(timeout=STEP_TIMEOUT_S)
        if reached_r != -1:
            os.set_blocking(reached_r, False)
            assert os.read(reached_r, 16) == GATE_REACHED  # said once, before it ran
        return subprocess.CompletedProcess(gated.args, gated.returncode, stdout, stderr)
    finally:
        for fd in (read, reached_r, reached_w):
            if fd != -1:
                os.close(fd)


@pytest.mark.parametrize("shell", SHELLS, ids=" ".join)
def test_each_shell_runs_the_guest_only_after_the_go_ahead(shell: tuple[str, ...]) -> None:
    gate = _gate(shell)
    env = shutil.which("env", path=os.defpath)
    assert env is not None

    shut = _through(gate, [env], go_ahead=False)
    ran = _through(gate, [env], go_ahead=True, env={"PATH": os.defpath, "SECRETLESS": "1"})

    assert (shut.returncode, shut.stdout) == (GATE_SHUT_EXIT, b"")
    assert ran.returncode == 0
    assert b"SECRETLESS=1" in ran.stdout.splitlines()


@pytest.mark.parametrize("shell", SHELLS, ids=" ".join)
def test_each_shell_says_it_reached_the_gate_before_it_waits_for_its_line(
    shell: tuple[str, ...],
) -> None:
    """The start reads the gate's byte before it writes the gate's line:
    bubblewrap has built the whole sandbox by then, and no code of the guest
    has run yet."""
    gate = _gate(shell)
    read, write = os.pipe()
    reached_r, reached_w = os.pipe()
    try:
        with subprocess.Popen(
            [*gate.command(read, reached_w), "/bin/echo", "ran"],
            env={"PATH": os.defpath},
            pass_fds=(read, reached_w),
            stdout=subprocess.PIPE,
        ) as gated:
            os.close(reached_w)
            reached_w = -1
            readable, _, _ = select.select([reached_r], [], [], STEP_TIMEOUT_S)
            assert readable, "the gate never said it was reached"
            assert os.read(reached_r, 16) == GATE_REACHED
            assert gated.poll() is None  # waiting for its line, the guest not run
            os.write(write, GATE_GO_AHEAD)
            stdout, _ = gated.communicate(timeout=STEP_TIMEOUT_S)
        assert (gated.returncode, stdout) == (0, b"ran\n")
    finally:
        for fd in (read, write, reached_r, reached_w):
            if fd != -1:
                os.close(fd)


@pytest.mark.parametrize("shell", SHELLS, ids=" ".join)
def test_a_program_named_like_an_option_runs_behind_every_shell(
    shell: tuple[str, ...], tmp_path: Path
) -> None:
    """bash and busybox took ``exec -x`` for an option of ``exec``; the gate
    gives them ``--`` (dash takes none, nor any option)."""
    (tmp_path / "-x").write_text('#!/bin/sh\necho ran as "$0" with "$1"\n')
    (tmp_path / "-x").chmod(0o755)

    done = _through(
        _gate(shell), ["-x", "-y"], go_ahead=True, env={"PATH": f"{tmp_path}:{os.defpath}"}
    )

    assert (done.returncode, done.stdout) == (0, f"ran as {tmp_path}/-x with -y\n".encode())


def test_the_probe_knows_which_shells_keep_names_that_are_not_shell_names() -> None:
    env = shutil.which("env", path=os.defpath)
    assert env is not None
    for shell in SHELLS:
        gate = _gate(shell)
        seen = _through(gate, [env], go_ahead=True, env={"PATH": os.defpath, **ODD_NAMES})
        names = {line.split(b"=", 1)[0] for line in seen.stdout.splitlines()}
        assert gate.keeps_any_name == ({n.encode() for n in ODD_NAMES} <= names), shell


def test_this_hosts_gates_pass_on_every_name_given_where_bash_is_installed() -> None:
    """dash (Debian's /bin/sh) drops ``spring.profiles.active`` and exported
    bash functions; a guest given one gets bash's gate, which keeps them."""
    gates = Gates.probe()
    assert gates is not None
    if not gates.usual.keeps_any_name and shutil.which("bash", path=os.defpath) is None:
        pytest.skip("/bin/sh drops names and there is no bash: the log says so (test below)")

    plain = gates.for_env({"PATH": os.defpath})
    odd = gates.for_env({"PATH": os.defpath, **ODD_NAMES})

    assert plain == gates.usual
    assert odd.keeps_any_name


def test_a_host_with_no_gate_that_keeps_a_name_logs_the_names_lost_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dropping = Gate(("/bin/sh",), 'exec "$@"', keeps_any_name=False)
    gates = Gates(dropping, any_name=None)
    env = {"PATH": os.defpath, "TOKEN.value": "s3cret-value", "x-y": "1"}

    with caplog.at_level(logging.WARNING, logger="supervisor.sandbox.gate"):
        assert gates.for_env(env) is dropping
        assert gates.for_env(dict(env)) is dropping

    lost = [r.getMessage() for r in caplog.records if "loses" in r.getMessage()]
    assert len(lost) == 1
    assert "TOKEN.value, x-y" in lost[0]
    assert "s3cret-value" not in caplog.text


async def test_a_sandboxed_guest_gets_every_name_of_its_environment(tmp_path: Path) -> None:
    """Before, the gate (dash, as Debian's /bin/sh) dropped these names
    between the supervisor and the guest."""
    import asyncio

    from supervisor.process import wait_exited
    from supervisor.sandbox.bwrap import SandboxHost
    from supervisor.sandbox.policy import SandboxPolicy
    from supervisor.sandbox.start import launch_sandboxed

    host = SandboxHost.probe()
    if not host.gates.usual.keeps_any_name and host.gates.any_name is None:
        pytest.skip("/bin/sh drops names and there is no bash: the log says so")
    env_program = shutil.which("env", path=os.defpath)
    assert env_program is not None
    seen = tmp_path / "seen"
    with socket.socket(socket.AF_UNIX) as listening, seen.open("wb") as output:
        listening.bind(str(tmp_path / "channel.sock"))
        launch = host.build(
            SandboxPolicy(),
            argv=[env_program],
            env={"PATH": os.defpath, **ODD_NAMES},
            cwd=Path("/"),
            state_dir=tmp_path,
            socket=tmp_path / "channel.sock",
        )
        process, sandboxed = await launch_sandboxed(launch, credential="x" * 43, stdout=output)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await wait_exited(process) == 0
        sandboxed.close()

    got = dict(line.split("=", 1) for line in seen.read_text().split("\n") if "=" in line)
    assert got["spring.profiles.active"] == "test"
    assert got["x-y"] == "1"
    assert "BASH_FUNC_module%%" in got
