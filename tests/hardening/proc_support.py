"""Machinery for the process attacks of SPEC §13 (S3-S6, S9): a real ``hostcall
serve`` driven through its admin socket as the supervisor's own account, FIFOs
through which sandboxed guests talk to the test and to each other, the Python
API run as that account, and the kernel facts the tests assert on (what is
left in a pid namespace, which cgroups exist).

Guests are hostile Python programs given with ``-c``; :data:`GUEST_LIB` is
prepended to each: raw channel requests (no ``guest_client``, which would
retry what the test wants to see refused), the credential, and FIFO reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.hardening.sandbox_support import IS_ROOT, NOBODY, Account, plan_file
from tests.harness import STEP_TIMEOUT_S, pid_namespace_of, processes_in_pid_namespace

#: The uid every sandboxed guest has, seen from outside: 65534 when the tests
#: run as root (guests drop to it; the unprivileged supervisor is it), else
#: the tests' own uid (the supervisor's, and so its guests').
GUEST_UID = NOBODY if IS_ROOT else os.geteuid()

#: Prepended to every guest: a raw HTTP client of the channel and FIFO reports.
GUEST_LIB = r"""
import json, os, select, socket, sys, time
_CRED = []
def credential():
    if not _CRED:
        fd = int(os.environ["HOSTCALL_CREDENTIAL_FD"])
        data = b""
        while chunk := os.read(fd, 4096):
            data += chunk
        _CRED.append(data.decode())
    return _CRED[0]
def identity(cred=None):
    return {
        "Authorization": "Bearer " + (cred or credential()),
        "Hostcall-Invocation": os.environ["HOSTCALL_INVOCATION"],
        "Hostcall-Execution": os.environ["HOSTCALL_EXECUTION"],
        "Hostcall-Plan": os.environ["HOSTCALL_PLAN"],
    }
def connect_channel(timeout=30):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(os.environ["HOSTCALL_SOCKET"])
    return s
def read_response(s):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return None, None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    status = int(head.split()[1])
    return status, json.loads(body) if body else None
def hc(method, path, body=None, headers=None, sock=None):
    # One request (on a fresh connection unless sock is given): (status, json).
    own = sock is None
    s = connect_channel() if own else sock
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1", "Host: hostcall",
                 f"Content-Length: {len(payload)}", "Content-Type: application/json"]
        lines += [f"{k}: {v}" for k, v in (headers or identity()).items()]
        s.sendall("\r\n".join(lines).encode() + b"\r\n\r\n" + payload)
        return read_response(s)
    finally:
        if own:
            s.close()
def echo(text, call_id, headers=None):
    return hc("POST", "/v1/calls", {"call_id": call_id, "tool": "echo",
              "args": {"text": text}}, headers)
def report(fifo, **fields):
    with open(fifo, "w") as f:
        f.write(json.dumps(fields) + "\n")
def inbox(fifo):
    # Open a FIFO the test will write to; before telling the test we are ready.
    return os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
def receive(fd, timeout=60):
    data = b""
    deadline = time.monotonic() + timeout
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError("nothing from the test")
        data += os.read(fd, 4096)
    return json.loads(data)
def pidns():
    return int(os.readlink("/proc/self/ns/pid")[5:-1])
"""


def guest(code: str) -> str:
    """A guest program: :data:`GUEST_LIB`, then ``code``."""
    return GUEST_LIB + "\n" + code


def as_account(account: Account, argv: Sequence[str]) -> list[str]:
    """``argv`` run as ``account`` (``setpriv`` when it is not us)."""
    if account.uid == os.geteuid():
        return list(argv)
    ids = [f"--reuid={account.uid}", f"--regid={account.uid}", "--clear-groups"]
    return ["setpriv", *ids, "--", *argv]


def guest_folder(account: Account, name: str) -> Path:
    """A folder the guests of ``account`` may write (a ``read_write`` path)."""
    folder = account.folder(name, 0o755)
    if IS_ROOT:
        os.chown(folder, GUEST_UID, GUEST_UID)
    return folder


# -- FIFOs: guests talk to the test -----------------------------------------------


class Fifo:
    """A named pipe a guest writes JSON lines to (``report``), or with
    ``to_guest`` one it reads from (``inbox`` then ``receive``). The test holds
    the read end of the first kind open from the start, so a guest's ``open``
    for writing never waits for the test."""

    def __init__(self, path: Path, *, to_guest: bool = False) -> None:
        self.path = path
        os.mkfifo(path, 0o666)
        os.chmod(path, 0o666)
        if IS_ROOT:
            os.chown(path, GUEST_UID, GUEST_UID)
        # A FIFO to a guest is read by the guest alone.
        self._fd = -1 if to_guest else os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self._buffer = b""

    def read(self, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """The next JSON line a guest wrote (bounded)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                raise TimeoutError(f"nothing from {self.path} within {timeout} s")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                # Every writer closed (EOF): wait for the next one without spinning.
                select.select([], [], [], 0.01)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, **fields: Any) -> None:
        """Write one JSON line to a guest that has this FIFO open (``inbox``)
        and has said so."""
        fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, json.dumps(fields).encode() + b"\n")
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- hostcall serve -------------------------------------------------------------

#: Run as the supervisor's account: one admin request, printed as JSON.
_ADMIN_REQUEST = r"""
import http.client, json, socket, sys
path, method, url, body = sys.argv[1:5]
class Conn(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(60)
        self.sock.connect(path)
conn = Conn("hostcall-admin", timeout=60)
conn.request(method, url, body.encode() or None,
             {"Content-Type": "application/json"} if body else {})
response = conn.getresponse()
data = response.read().decode()
try:
    data = json.loads(data)
except ValueError:
    pass
print(json.dumps({"status": response.status, "body": data}))
"""


def admin_request(
    account: Account,
    state: Path,
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    *,
    uid: int | None = None,
    timeout: float = STEP_TIMEOUT_S * 2,
) -> tuple[int, Any]:
    """One request on ``state``'s admin socket from a process of ``account``
    (or of ``uid``): its status and decoded body.

    Raises:
        subprocess.TimeoutExpired: no answer within ``timeout``.
    """
    who = account if uid is None else Account("other", uid, account.python, account.home)
    done = subprocess.run(
        as_account(
            who,
            [
                account.python,
                "-c",
                _ADMIN_REQUEST,
                str(state / "admin.sock"),
                method,
                url,
                json.dumps(body) if body is not None else "",
            ],
        ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=account.env(),
    )
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    return answer["status"], answer["body"]


@dataclass
class Served:
    """A running ``hostcall serve`` of ``account``."""

    account: Account
    process: subprocess.Popen[str]
    state: Path
    stdout: Path
    stderr_lines: list[str] = field(default_factory=list)
    drainer: threading.Thread | None = None

    @property
    def console_url(self) -> str:
        """The console's URL, token included, as serve printed it."""
        prefix = "hostcall: console at "
        return next(line for line in self.stderr_lines if line.startswith(prefix))[
            len(prefix) :
        ].strip()

    def admin(
        self,
        method: str,
        url: str,
        body: dict[str, Any] | None = None,
        timeout: float = STEP_TIMEOUT_S * 2,
    ) -> tuple[int, Any]:
        return admin_request(self.account, self.state, method, url, body, timeout=timeout)

    def launch(
        self,
        code: str,
        *args: str,
        invocation: str | None = None,
        timeout: float = STEP_TIMEOUT_S * 2,
    ) -> dict[str, Any]:
        """``POST /v1/invocations`` of ``python -c code args``; the new execution."""
        body: dict[str, Any] = {"argv": [self.account.python, "-c", code, *args]}
        if invocation is not None:
            body["invocation"] = invocation
        status, answer = self.admin("POST", "/v1/invocations", body, timeout=timeout)
        assert status == 201, answer
        return dict(answer)

    def executions(self) -> dict[str, dict[str, Any]]:
        """Every execution the admin API lists, by id."""
        status, answer = self.admin("GET", "/v1/invocations")
        assert status == 200, answer
        return {e["execution_id"]: e for inv in answer for e in inv["executions"]}

    def wait_ended(self, execution_id: str, timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """Poll the admin API (bounded) until the execution has its outcome."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.executions().get(execution_id)
            if found is not None and found["outcome"] is not None:
                return found
            assert time.monotonic() < deadline, f"{execution_id} did not end: {found}"
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM, bounded wait; its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STEP_TIMEOUT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(timeout=STEP_TIMEOUT_S)
            if self.drainer is not None:
                self.drainer.join(STEP_TIMEOUT_S)
            if self.process.stderr is not None:
                self.process.stderr.close()


@contextlib.contextmanager
def serving(account: Account, *, sandbox: str = "", console: bool = False) -> Iterator[Served]:
    """``hostcall serve`` as ``account``; stopped (SIGTERM) at the end.

    Guests' output goes to a file (``Served.stdout``); serve's own stderr is
    drained by a thread so that its log never blocks it. With ``console``,
    it serves the operator console too (``Served.console_url``).
    """
    plan = plan_file(account, sandbox)
    state = account.home / "state"
    out = account.home / "serve.out"
    with open(out, "w") as stdout:
        process = account.popen(
            "serve",
            "--state-dir",
            str(state),
            "--plan",
            str(plan),
            *(("--console", "127.0.0.1:0") if console else ()),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
        )
    served = Served(account, process, state, out)
    ready = threading.Event()

    def drain() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            served.stderr_lines.append(line)
            if line.startswith("  launch guests"):
                ready.set()
        ready.set()

    served.drainer = threading.Thread(target=drain, daemon=True)
    served.drainer.start()
    try:
        assert ready.wait(STEP_TIMEOUT_S), "hostcall serve did not start"
        assert process.poll() is None, "".join(served.stderr_lines)
        yield served
    finally:
        served.stop()


# -- the Python API as the account ----------------------------------------------------

_API_RUN = r"""
import asyncio, json, sys
from supervisor import Plan, Supervisor
from supervisor.limits import Limits
state, plan, options, limits, *argv = sys.argv[1:]
async def main():
    async with Supervisor(state, **json.loads(options)) as sup:
        outcome = await sup.run(Plan.load(plan), argv, limits=Limits(**json.loads(limits)))
    print(json.dumps(outcome.to_json()), file=sys.stderr)
asyncio.run(main())
"""


def api_run(
    account: Account,
    code: str,
    *args: str,
    options: dict[str, Any],
    limits: dict[str, Any] | None = None,
    sandbox: str = "",
    timeout: float = STEP_TIMEOUT_S * 2,
) -> tuple[subprocess.CompletedProcess[bytes], dict[str, Any]]:
    """``Supervisor(**options).run(plan, python -c code args)`` in a process of
    ``account`` (for knobs the CLI does not have); the finished process (its
    stdout is the guest's, as bytes) and the outcome (the last line of stderr)."""
    plan = plan_file(account, sandbox)
    done = subprocess.run(
        as_account(
            account,
            [
                account.python,
                "-c",
                _API_RUN,
                str(account.home / "state"),
                str(plan),
                json.dumps(options),
                json.dumps(limits or {}),
                account.python,
                "-c",
                code,
                *args,
            ],
        ),
        capture_output=True,
        timeout=timeout,
        check=False,
        cwd=account.home,
        env=account.env(),
    )
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    try:
        outcome = json.loads(lines[-1]) if lines else {}
    except ValueError:
        outcome = {}
    return done, outcome


# -- kernel facts ----------------------------------------------------------------------


def sandbox_pidns(monitor_pid: int, timeout: float = STEP_TIMEOUT_S) -> int:
    """The pid namespace of the sandbox whose bubblewrap monitor is ``monitor_pid``
    (its child is the sandbox's pid 1)."""
    deadline = time.monotonic() + timeout
    while True:
        children = f"/proc/{monitor_pid}/task/{monitor_pid}/children"
        with contextlib.suppress(OSError, ValueError), open(children) as f:
            for child in f.read().split():
                inode = pid_namespace_of(int(child))
                if inode is not None and inode != pid_namespace_of(os.getpid()):
                    return inode
        assert time.monotonic() < deadline, f"no sandbox under {monitor_pid}"
        time.sleep(0.01)


@contextlib.contextmanager
def pinned(inode: int) -> Iterator[int]:
    """Hold pid namespace ``inode`` (a descriptor of it) so that its inode number
    cannot be given to a new namespace while the test looks for what is left
    in it: the kernel reuses a freed number at once, and other sandboxes start
    all the time. The namespace must have a process when this is entered."""
    fd = -1
    for pid in processes_in_pid_namespace(inode):
        with contextlib.suppress(OSError):
            fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            if os.fstat(fd).st_ino == inode:
                break
            os.close(fd)
            fd = -1
    assert fd >= 0, f"no process in pid namespace {inode} to pin it by"
    try:
        yield inode
    finally:
        os.close(fd)


def wait_namespace_empty(inode: int, timeout: float) -> list[int]:
    """Poll (bounded) until no live process is left in pid namespace ``inode``;
    returns what is left at the deadline (empty when it emptied)."""
    deadline = time.monotonic() + timeout
    while (left := processes_in_pid_namespace(inode)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def kill_namespace(inode: int) -> None:
    """SIGKILL whatever is left in pid namespace ``inode`` (test cleanup)."""
    for pid in processes_in_pid_namespace(inode):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    wait_namespace_empty(inode, STEP_TIMEOUT_S)


def cgroup_roots() -> dict[str, Path]:
    """This process's own cgroup in each v1 hierarchy (controller -> folder)."""
    found: dict[str, Path] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(","):
                folder = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                if controller and folder.is_dir():
                    found[controller] = folder
    return found


def cgroups_of(supervisor_pid: int) -> list[Path]:
    """The cgroup folders a supervisor of that pid made (``hostcall-<pid>-<n>``)."""
    found: list[Path] = []
    for root in cgroup_roots().values():
        found.extend(root.glob(f"hostcall-{supervisor_pid}-*"))
    return found


def tasks_in(base: Path) -> list[int]:
    """Every task in a cgroup folder and the folders below it."""
    found: list[int] = []
    for tasks in [base / "tasks", *base.glob("*/tasks")]:
        with contextlib.suppress(OSError):
            found.extend(int(t) for t in tasks.read_text().split())
    return found


def remove_cgroups_of(supervisor_pid: int) -> None:
    """Remove the (empty) cgroups a killed supervisor left (test cleanup)."""
    for base in cgroups_of(supervisor_pid):
        for leaf in base.iterdir():
            if leaf.is_dir():
                with contextlib.suppress(OSError):
                    leaf.rmdir()
        with contextlib.suppress(OSError):
            base.rmdir()
