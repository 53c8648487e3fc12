"""Machinery for the file system and network attacks of SPEC §13 (S1, S2, S7, S8).

- a **stage** (:func:`stage_folder`): a folder outside ``/tmp`` that the guest
  can see. The host's ``/tmp`` is private inside the sandbox, so attacks on
  the account's own folder (under ``/tmp``) would prove nothing;
- :func:`write_plan`: the attack plan (sandbox_support's tools) in any folder;
- :data:`GUEST_LIB`, prepended to every hostile guest: its configuration
  (hex-encoded JSON in ``argv[1]``, so that no argument names a host path —
  an argument naming a path is exposed to the guest, and would name the
  state dir in its argv), attempts recorded by errno name, and raw channel
  calls (no ``guest_client``: it retries, and it may not be importable);
- :func:`hostcall_run`: ``hostcall run --json`` from any launch folder, with
  any state dir and plan; :class:`LiveRun` the same while the test and the
  guest exchange lines (the guest's stdin and stdout are ``hostcall run``'s);
- what the test observes on the host: :func:`fingerprint`, :func:`inodes`,
  :func:`sandbox_processes`, :class:`Listeners`, :class:`UnixListeners`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.hardening.sandbox_support import NOBODY, REPO, TOOLS, Account, _own, _reachable_by
from tests.harness import STEP_TIMEOUT_S

__all__ = [
    "GUEST_LIB",
    "Listeners",
    "LiveRun",
    "UnixListeners",
    "encode",
    "fingerprint",
    "guest_report",
    "host_addresses",
    "hostcall_run",
    "in_new_network_namespace",
    "inodes",
    "own",
    "sandbox_processes",
    "stage_folder",
    "summary_of",
    "write_plan",
]

#: Where a stage may be made: outside the sandbox's private folders (/tmp,
#: /var/tmp, /run, /dev/shm), searchable by every uid.
_STAGE_PARENTS = ("/srv", "/var/lib", "/opt", str(REPO))


def _searchable_by_all(folder: Path) -> bool:
    return all(os.stat(p).st_mode & 0o1 for p in [folder, *folder.parents])


@contextlib.contextmanager
def stage_folder(account: Account, prefix: str = "hostcall-attack-") -> Iterator[Path]:
    """A folder outside ``/tmp`` owned by ``account`` that every uid may search
    (the guest sees it, read-only); removed afterwards. Skips the test when
    the host offers none."""
    for parent in map(Path, _STAGE_PARENTS):
        if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK) and _searchable_by_all(parent):
            break
    else:
        pytest.skip("no folder outside /tmp that the tests may write and every uid may search")
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        folder.chmod(0o755)
        if account.uid != os.geteuid():
            os.chown(folder, account.uid, account.uid)
        assert _reachable_by(folder, NOBODY)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def own(path: Path, account: Account) -> Path:
    """Give ``path`` (and its folders up to one the account owns) to the account."""
    _own(path, account.uid)
    return path


def write_plan(account: Account, folder: Path, sandbox: str = "", plan: str = "") -> Path:
    """``folder/plan.toml`` and its tools module, owned by ``account``:
    sandbox_support's two tools, ``plan`` added to ``[plan]``."""
    folder.mkdir(parents=True, exist_ok=True)
    own(folder, account)
    (folder / "attack_tools.py").write_text(TOOLS)
    body = (
        f'[plan]\nname = "attack"\n{plan}\n[tools.echo]\nhandler = "attack_tools:echo"\n'
        'reversibility = "reversible"\n\n[tools.charge]\nhandler = "attack_tools:charge"\n'
    )
    if sandbox:
        body += "\n[sandbox]\n" + sandbox
    (folder / "plan.toml").write_text(body)
    for name in ("attack_tools.py", "plan.toml"):
        (folder / name).chmod(0o644)
        own(folder / name, account)
    return folder / "plan.toml"


#: Prepended to every guest (see the module docstring).
GUEST_LIB = r"""
import errno, json, os, socket, stat, sys
CONFIG = json.loads(bytes.fromhex(sys.argv[1]).decode())
def outcome(action, *args):
    '''"ok", or the name of the errno the attempt failed with.'''
    try:
        action(*args)
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, type(exc).__name__)
    return "ok"
def peek(path):
    '''Read a byte of a file, or list a folder: an empty folder (a mask) counts as absent.'''
    if os.path.isdir(path):
        if not os.listdir(path):
            raise FileNotFoundError(errno.ENOENT, "an empty folder")
        return
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        os.read(fd, 1)
    finally:
        os.close(fd)
def absent(path):
    '''"absent" when the path is missing or masked (an empty folder, or the
    /dev/null that covers a file), else what reading it came to.'''
    try:
        st = os.stat(path)
    except OSError as exc:
        return "absent" if exc.errno == errno.ENOENT else errno.errorcode.get(exc.errno or 0, "?")
    if os.path.isdir(path):
        return outcome(peek, path).replace("ENOENT", "absent")
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat("/dev/null").st_rdev:
        return "absent"
    return outcome(peek, path)
def report(**fields):
    print(json.dumps(fields), flush=True)
_CRED = []
def call(tool, args, call_id):
    '''POST /v1/calls on the channel: (HTTP status, JSON body).'''
    if not _CRED:
        fd, data = int(os.environ["HOSTCALL_CREDENTIAL_FD"]), b""
        while chunk := os.read(fd, 4096):
            data += chunk
        _CRED.append(data.decode())
    body = json.dumps({"call_id": call_id, "tool": tool, "args": args}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": "hostcall", "Connection": "close", "Content-Type": "application/json",
        "Content-Length": len(body), "Authorization": "Bearer " + _CRED[0],
        "Hostcall-Execution": os.environ["HOSTCALL_EXECUTION"],
        "Hostcall-Invocation": os.environ["HOSTCALL_INVOCATION"],
        "Hostcall-Plan": os.environ["HOSTCALL_PLAN"],
    }.items())
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(os.environ["HOSTCALL_SOCKET"])
        s.sendall(f"POST /v1/calls HTTP/1.1\r\n{head}\r\n".encode() + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, rest = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(rest)
"""


def encode(config: Any) -> str:
    """The guest's ``argv[1]``: JSON, hex-encoded (names no path as such)."""
    return json.dumps(config).encode().hex()


def summary_of(stderr: str) -> dict[str, Any]:
    """The ``--json`` summary: the last line of ``hostcall run``'s stderr."""
    lines = stderr.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _run_argv(
    account: Account,
    body: str,
    config: Any,
    *,
    plan: Path,
    state_dir: Path | None,
    extra: Sequence[str],
) -> list[str]:
    state = ["--state-dir", str(state_dir)] if state_dir is not None else []
    code = GUEST_LIB + body
    return account.command(
        "run", *state, "--plan", str(plan), "--json", *extra, "--", account.python, "-c", code,
        encode(config),
    )  # fmt: skip


def hostcall_run(
    account: Account,
    body: str,
    config: Any = None,
    *,
    cwd: Path,
    plan: Path,
    state_dir: Path | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    timeout: float = STEP_TIMEOUT_S * 2,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``hostcall run --json -- python -c GUEST_LIB+BODY CONFIG`` as ``account``
    from ``cwd`` (``state_dir`` None: the default ``./.hostcall``), handing it
    ``pass_fds`` as its launcher might; the finished process and its summary."""
    done = subprocess.run(
        _run_argv(account, body, config, plan=plan, state_dir=state_dir, extra=extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=cwd,
        env=env or account.env(),
        stdin=subprocess.DEVNULL,
        pass_fds=tuple(pass_fds),
    )
    return done, summary_of(done.stderr)


def guest_report(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The guest's last line of output (JSON), failing with what hostcall said."""
    lines = done.stdout.strip().splitlines()
    assert lines, f"the guest reported nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    found: dict[str, Any] = json.loads(lines[-1])
    return found


class LiveRun:
    """``hostcall run`` whose guest exchanges lines with the test while it runs.

    ``hostcall run`` hands a stdin that is not a terminal straight to its guest,
    and passes the guest's stdout through: :meth:`send` and :meth:`read_json`
    talk to the guest. Every read is bounded; leaving the ``with`` block ends
    whatever still runs.
    """

    def __init__(
        self,
        account: Account,
        body: str,
        config: Any = None,
        *,
        cwd: Path,
        plan: Path,
        state_dir: Path | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.process = subprocess.Popen(
            _run_argv(account, body, config, plan=plan, state_dir=state_dir, extra=extra),
            cwd=cwd,
            env=account.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._pending = b""
        self._stderr = b""
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self._stderr = self.process.stderr.read()

    def read_json(self, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """The guest's next line of output, as JSON."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise TimeoutError(f"no line from the guest within {timeout:g} s")
                chunk = os.read(fd, 65536)
                if not chunk:
                    self.process.wait(STEP_TIMEOUT_S)
                    self._reader.join(STEP_TIMEOUT_S)
                    raise AssertionError(f"the guest ended early: {self.stderr()[-3000:]}")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        found: dict[str, Any] = json.loads(line)
        return found

    def send(self, line: str = "go") -> None:
        """One line to the guest."""
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def finish(self, timeout: float = STEP_TIMEOUT_S * 2) -> tuple[int, dict[str, Any]]:
        """Close the guest's stdin and wait for ``hostcall run``: its exit status
        and summary."""
        assert self.process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        code = self.process.wait(timeout)
        self._reader.join(timeout)
        return code, summary_of(self.stderr())

    def stderr(self) -> str:
        return self._stderr.decode(errors="replace")

    def __enter__(self) -> LiveRun:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(STEP_TIMEOUT_S)
        self._reader.join(STEP_TIMEOUT_S)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def fingerprint(folder: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``folder`` (itself included): inode, mode, owner and
    the sha256 of a file's bytes."""
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        st = os.lstat(path)
        digest = ""
        if path.is_file() and not path.is_symlink():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        found[str(path.relative_to(folder))] = (st.st_ino, st.st_mode, st.st_uid, digest)
    return found


def inodes(folder: Path) -> dict[tuple[int, int], str]:
    """(device, inode) of everything under ``folder``, itself included."""
    found = {}
    for path in [folder, *folder.rglob("*")]:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            found[(st.st_dev, st.st_ino)] = str(path)
    return found


def sandbox_processes(pidns: int) -> dict[int, dict[str, str]]:
    """The ``/proc/PID/status`` fields of every host process in pid namespace ``pidns``."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}/ns/pid").st_ino != pidns:
                continue
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
            found[int(entry)] = fields
    return found


def _bindable(family: int, address: str) -> bool:
    with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.bind((address, 0))
        return True
    return False


def host_addresses() -> list[tuple[int, str]]:
    """This machine's loopback addresses (IPv4, and IPv6 where it works) and
    its other addresses but link-local ones: (family, address)."""
    found = [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
        for line in out.splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[2] in ("inet", "inet6"):
                address = fields[3].split("/")[0]
                family = socket.AF_INET if fields[2] == "inet" else socket.AF_INET6
                if not address.startswith(("127.", "fe80")) and address != "::1":
                    found.append((family, address))
    return [(family, address) for family, address in found if _bindable(family, address)]


class Listeners:
    """TCP and UDP listeners of the test, and what reached them."""

    def __init__(self, addresses: Sequence[tuple[int, str]]) -> None:
        self.sockets: list[tuple[str, socket.socket]] = []
        try:
            for family, host in addresses:
                for kind, name in ((socket.SOCK_STREAM, "tcp"), (socket.SOCK_DGRAM, "udp")):
                    sock = socket.socket(family, kind)
                    self.sockets.append((name, sock))
                    sock.bind((host, 0))
                    if kind == socket.SOCK_STREAM:
                        sock.listen(8)
                    sock.setblocking(False)
        except BaseException:
            self.close()
            raise

    def targets(self) -> list[list[Any]]:
        """``[kind, family, host, port]`` of each listener, for the guest."""
        return [[name, int(s.family), *s.getsockname()[:2]] for name, s in self.sockets]

    def arrived(self) -> list[str]:
        """What reached a listener so far: connections and datagrams (with their bytes)."""
        found = []
        for name, sock in self.sockets:
            host, port = sock.getsockname()[:2]
            with contextlib.suppress(BlockingIOError):
                while True:
                    if name == "tcp":
                        conn, _ = sock.accept()
                        with conn:
                            conn.settimeout(STEP_TIMEOUT_S)
                            found.append(f"tcp {host}:{port} {conn.recv(64)!r}")
                    else:
                        found.append(f"udp {host}:{port} {sock.recv(64)!r}")
        return found

    def close(self) -> None:
        for _, sock in self.sockets:
            sock.close()

    def __enter__(self) -> Listeners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UnixListeners:
    """Unix sockets of the test (stream, datagram, abstract) and what reached them."""

    def __init__(self) -> None:
        self.sockets: dict[str, socket.socket] = {}

    def add(self, name: str, sock: socket.socket) -> socket.socket:
        self.sockets[name] = sock
        sock.setblocking(False)
        return sock

    def bind(self, name: str, address: str | bytes, kind: int = socket.SOCK_STREAM) -> str:
        """A socket bound at ``address`` (a path, made connectable by anyone, or an
        abstract name); its name for :meth:`arrived`."""
        sock = self.add(name, socket.socket(socket.AF_UNIX, kind))
        sock.bind(address)
        if isinstance(address, str):
            os.chmod(address, 0o777)
        if kind == socket.SOCK_STREAM:
            sock.listen(8)
        return name

    def arrived(self) -> list[str]:
        """Connections and datagrams that reached any of them so far."""
        found = []
        for name, sock in self.sockets.items():
            with contextlib.suppress(BlockingIOError):
                while True:
                    if sock.type == socket.SOCK_STREAM:
                        conn, _ = sock.accept()
                        with conn:
                            conn.settimeout(STEP_TIMEOUT_S)
                            found.append(f"{name}: connection {conn.recv(64)!r}")
                    else:
                        found.append(f"{name}: datagram {sock.recv(64)!r}")
        return found

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()

    def __enter__(self) -> UnixListeners:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def in_new_network_namespace(make: Any) -> Any:
    """``make()`` run in a thread of its own moved to a new network namespace
    (needs root): a socket made there stays bound in that namespace."""
    import ctypes

    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET, this thread only
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            result.append(make())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(STEP_TIMEOUT_S)
    if errors:
        raise errors[0]
    return result[0]
