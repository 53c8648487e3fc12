"""SPEC §13 rows S3, S4, S5, S6 and S9, mounted by hostile guests against a real
supervisor (``hostcall run`` / ``hostcall serve``), as root and as an
unprivileged user (see tests/hardening/sandbox_support.py).

Each test runs a guest that tries the attack and asserts both that it failed
and that the defence the spec claims held. Guests talk to the test through
hostcall's own stdin/stdout or through FIFOs (tests/hardening/proc_support.py);
nothing is ordered by sleeping.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.hardening.proc_support import (
    GUEST_UID,
    Fifo,
    Served,
    api_run,
    as_account,
    cgroups_of,
    guest,
    guest_folder,
    kill_namespace,
    pinned,
    remove_cgroups_of,
    sandbox_pidns,
    serving,
    tasks_in,
    wait_namespace_empty,
)
from tests.hardening.sandbox_support import IS_ROOT, Account, account, plan_file, run_guest
from tests.harness import STEP_TIMEOUT_S, processes_in_pid_namespace

__all__ = ["account"]  # the fixture, parametrized root / unprivileged


def summary_of(stderr: str) -> dict[str, Any]:
    """The ``--json`` summary: the last line of hostcall's stderr."""
    lines = stderr.strip().splitlines()
    assert lines, "hostcall printed nothing"
    summary: dict[str, Any] = json.loads(lines[-1])
    return summary


@contextlib.contextmanager
def hostcall_run(
    account: Account, code: str, *args: str, extra: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen[str]]:
    """``hostcall run --json -- python -c CODE`` with its stdin and stdout piped
    to the test (the guest inherits them); killed at the end if still running."""
    plan = plan_file(account)
    process = account.popen(
        "run",
        "--state-dir",
        str(account.home / "state"),
        "--plan",
        str(plan),
        "--json",
        *extra,
        "--",
        account.python,
        "-c",
        code,
        *args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=STEP_TIMEOUT_S)


#: What :func:`read_line` read past the end of a line, per process.
_unread: weakref.WeakKeyDictionary[subprocess.Popen[str], bytes] = weakref.WeakKeyDictionary()


def read_line(process: subprocess.Popen[str], timeout: float = STEP_TIMEOUT_S) -> str:
    """One line of the guest's stdout (through hostcall's), bounded.

    It reads the pipe itself and keeps what follows the line for the next call:
    a buffered ``readline`` would take two lines that arrived together, and the
    ``select`` before the next one would wait for data already read."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    deadline = time.monotonic() + timeout
    data = _unread.pop(process, b"")
    while b"\n" not in data:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], "the guest said nothing"
        chunk = os.read(fd, 65536)
        if not chunk:
            break  # end of output: what there is, as readline gives it
        data += chunk
    line, newline, _unread[process] = data.partition(b"\n")
    return (line + newline).decode()


def children_of(pid: int) -> list[int]:
    """The children of process ``pid`` (of its main thread)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@contextlib.contextmanager
def victim(uid: int) -> Iterator[subprocess.Popen[bytes]]:
    """A process outside every sandbox with the guests' own uid."""
    process = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "600"]
        if os.geteuid() != uid
        else ["sleep", "600"]
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait(timeout=STEP_TIMEOUT_S)


# == S3: it cannot see or touch any process outside its own sandbox ====================

#: Reads the pids of outside processes on stdin, attacks each by every call that
#: takes a pid, then every call that takes a pidfd of the supervisor (which the
#: kernel hands out: SO_PEERPIDFD on the channel and on its stdout), then
#: kill(-1, SIGKILL).
S3_OUTSIDE = r"""
import ctypes, signal, struct, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.syscall.restype = ctypes.c_long
def err(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
def sys_err(nr, *a):
    # Every argument a full register wide: ctypes passes a bare int as 32 bits.
    a = [ctypes.c_long(x) if isinstance(x, int) else x for x in a]
    return 0 if libc.syscall(ctypes.c_long(nr), *a) >= 0 else ctypes.get_errno()
print("ready", flush=True)
outside = json.loads(sys.stdin.readline())["outside"]
found = {"proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "by_pid": {}}
buf = ctypes.create_string_buffer(64)
iov = struct.pack("PN", ctypes.addressof(buf), 64)
liov = ctypes.create_string_buffer(iov); riov = ctypes.create_string_buffer(iov)
for pid in outside:
    found["by_pid"][pid] = {
        "kill0": err(lambda: os.kill(pid, 0)),
        "kill": err(lambda: os.kill(pid, signal.SIGKILL)),
        "killpg": err(lambda: os.killpg(pid, signal.SIGKILL)),
        "pidfd_open": err(lambda: os.pidfd_open(pid)),
        "ptrace": 0 if libc.ptrace(16, pid, None, None) == 0 else ctypes.get_errno(),
        "vm_readv": sys_err(310, pid, liov, 1, riov, 1, 0),
        "vm_writev": sys_err(311, pid, liov, 1, riov, 1, 0),
        "proc": os.path.exists(f"/proc/{pid}"),
        "mem": err(lambda: open(f"/proc/{pid}/mem", "rb").close()),
    }
def pidfd_attacks(sock):
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, 77)  # SO_PEERPIDFD
    except OSError as e:
        return {"none": e.errno}
    attacks = {"signal": err(lambda: signal.pidfd_send_signal(pidfd, signal.SIGKILL)),
               "signal0": err(lambda: signal.pidfd_send_signal(pidfd, 0))}
    taken = [sys_err(438, pidfd, fd, 0) for fd in range(64)]  # pidfd_getfd
    attacks["getfd"] = sorted(set(taken))
    for nr in range(1, 11):  # PIDFD_GET_{CGROUP,IPC,MNT,NET,PID,...,USER,UTS}_NAMESPACE
        opened = libc.ioctl(pidfd, ctypes.c_ulong((0xFF << 8) | nr), ctypes.c_long(0))
        attacks[f"ns{nr}"] = 0 if opened >= 0 else ctypes.get_errno()
    attacks["setns"] = 0 if libc.setns(pidfd, 0x40000000) == 0 else ctypes.get_errno()
    attacks["madvise"] = sys_err(440, pidfd, riov, 1, 20, 0)  # process_madvise MADV_COLD
    return attacks
channel = connect_channel()
found["channel_peer"] = list(struct.unpack("3i", channel.getsockopt(
    socket.SOL_SOCKET, socket.SO_PEERCRED, 12)))
found["via_channel"] = pidfd_attacks(channel)
try:  # a pipe (no peer to ask about) unless the supervisor made it a socket pair
    found["via_stdout"] = pidfd_attacks(socket.socket(fileno=os.dup(1)))
except OSError as e:
    found["via_stdout"] = {"none": e.errno}
child = subprocess.Popen(["sleep", "600"])
found["kill_all"] = err(lambda: os.kill(-1, signal.SIGKILL))
found["child_killed"] = child.wait(30) == -9
print(json.dumps(found), flush=True)
"""


def test_a_guest_sees_only_its_sandbox_and_cannot_touch_the_supervisor_or_any_outside_process(
    account: Account,
) -> None:
    """S3: by pid (kill, pidfd_open, ptrace, process_vm_readv/writev, /proc), by a
    pidfd of the supervisor the kernel hands it (SO_PEERPIDFD on its channel
    connection and on its stdout), and by kill(-1): nothing outside is reached."""
    with victim(GUEST_UID) as other, hostcall_run(account, guest(S3_OUTSIDE)) as run:
        assert read_line(run) == "ready\n"
        supervisor = run.pid  # setpriv execs: the supervisor itself
        monitors = children_of(supervisor)  # bubblewrap's monitor, outside the sandbox
        outside = [supervisor, other.pid, os.getpid(), *monitors]
        assert run.stdin is not None
        run.stdin.write(json.dumps({"outside": outside}) + "\n")
        run.stdin.flush()
        found = json.loads(read_line(run))
        _, err = run.communicate(timeout=STEP_TIMEOUT_S)
        assert run.returncode == 0, err
        assert other.poll() is None, "kill(-1) or kill(pid) reached a process outside"
    assert summary_of(err)["executions"][0]["reason"] == "exited"
    # /proc shows the sandbox's pid 1 (bubblewrap), the guest and its children only.
    assert max(found["proc"]) < 100 and 1 in found["proc"], found["proc"]
    for pid, attacks in found["by_pid"].items():
        assert attacks["proc"] is False, pid
        assert attacks["mem"] == errno.ENOENT, (pid, attacks)
        for name in ("kill0", "kill", "killpg", "pidfd_open"):
            assert attacks[name] == errno.ESRCH, (pid, name, attacks)
        for name in ("ptrace", "vm_readv", "vm_writev"):
            # Not in its pid namespace; and refused outright by the seccomp filter.
            assert attacks[name] in (errno.ESRCH, errno.EPERM), (pid, name, attacks)
    # The supervisor is not in the guest's pid namespace: its pid reads as 0 …
    assert found["channel_peer"][0] == 0
    for route in ("via_channel", "via_stdout"):
        attacks = found[route]
        if "none" in attacks:  # no pidfd to abuse: a pipe, or a kernel before 6.5
            continue
        # … and a pidfd of it opens nothing: no signal crosses pid namespaces, and
        # it is not dumpable (PR_SET_DUMPABLE 0), so no descriptor, namespace or
        # memory advice either.
        assert attacks["signal"] == attacks["signal0"] == errno.EINVAL, (route, attacks)
        assert attacks["getfd"] == [errno.EPERM], (route, attacks)
        for nr in range(1, 11):
            assert attacks[f"ns{nr}"] in (errno.EPERM, errno.EACCES), (route, nr, attacks)
        assert attacks["setns"] in (errno.EPERM, errno.EINVAL), (route, attacks)
        assert attacks["madvise"] in (errno.EPERM, errno.EACCES), (route, attacks)
    assert found["kill_all"] == 0 and found["child_killed"]


#: Signals the sandbox's pid 1 (bubblewrap's init) and reads its /proc, then
#: reports whether it is still there, unstopped.
S3_PID1 = r"""
import signal
def err(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
found = {}
for sig in ("SIGTERM", "SIGINT", "SIGHUP", "SIGSTOP", "SIGKILL"):
    found[sig] = err(lambda: os.kill(1, getattr(signal, sig)))
state = open("/proc/1/stat").read().rsplit(")", 1)[1].split()[0]
found["state"] = state
found["environ"] = err(lambda: open("/proc/1/environ", "rb").read())
found["fds"] = err(lambda: os.listdir("/proc/1/fd"))
found["mem"] = err(lambda: open("/proc/1/mem", "rb").close())
found["uid"] = os.getuid()
print(json.dumps(found), flush=True)
"""


def test_the_sandboxs_pid_1_survives_every_signal_its_guest_sends_it(account: Account) -> None:
    """S3: pid 1 (bubblewrap's init) holds the sandbox together: as root it belongs
    to root and the guest's signals and /proc reads are refused; unprivileged
    the kernel drops every signal a namespace sends its own init (no handler)."""
    done, summary = run_guest(account, guest(S3_PID1))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert summary["executions"][0]["reason"] == "exited"
    assert found["state"] in ("S", "R"), found  # not stopped by SIGSTOP
    signals = [found[s] for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGSTOP", "SIGKILL")]
    if account.root:
        assert signals == [errno.EPERM] * 5, found
        assert found["environ"] == found["fds"] == found["mem"] == errno.EACCES, found
    else:
        # Same uid inside its user namespace: delivered, and ignored by the kernel.
        assert signals == [0] * 5, found


def test_the_guest_leads_its_own_session_and_process_group_in_the_sandbox(
    account: Account,
) -> None:
    """SPEC §3: the guest starts in its own process group (``start_new_session``).
    Inside the sandbox bubblewrap's pid 1 led both, the guest (pid 2) in them;
    util-linux's setsid now runs first. The exit status still comes through."""
    code = "print(json.dumps([os.getpid(), os.getpgid(0), os.getsid(0)])); sys.exit(7)"
    done, summary = run_guest(account, guest(code))
    pid, group, session = json.loads(done.stdout)
    assert group == session == pid != 1
    assert (done.returncode, summary["executions"][0]["exit_code"]) == (7, 7)


#: The victim: hands its whole identity, credential included, to the attacker
#: (as a compromised guest or a leaked log might), then makes a call.
S3_VICTIM = r"""
box = inbox(sys.argv[2])
report(sys.argv[1], headers=identity(), pidns=pidns())
receive(box)
status, body = echo("still me", "b1")
report(sys.argv[1], status=status, code=(body.get("error") or {}).get("code"))
"""

#: The attacker: with the victim's identity and outside pids, speaks as it and
#: reaches for its processes.
S3_ATTACKER = r"""
import signal
box = inbox(sys.argv[2])
report(sys.argv[1], ready=True)
target = receive(box)
def code(answer):
    status, body = answer
    return [status, (body.get("error") or {}).get("code")]
def err(f):
    try:
        f()
        return 0
    except OSError as e:
        return e.errno
stolen = target["headers"]
mixed = {**stolen, "Authorization": identity()["Authorization"]}
found = {
    "as_victim": code(echo("stolen", "a1", stolen)),
    "status_as_victim": code(hc("GET", "/v1/calls/b1", headers=stolen)),
    "victim_ids_own_credential": code(echo("mixed", "a2", mixed)),
    "own": code(echo("mine", "a3")),
    "kill": [err(lambda: os.kill(pid, signal.SIGKILL)) for pid in target["pids"]],
    "pidfd": [err(lambda: os.pidfd_open(pid)) for pid in target["pids"]],
    "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "pidns": pidns(),
}
report(sys.argv[1], **found)
"""


def test_a_guest_cannot_reach_another_guests_processes_or_speak_as_it_with_its_credential(
    account: Account,
) -> None:
    """S3 across guests of one ``hostcall serve``: even with the other guest's
    whole identity (its credential leaked), the attacker is refused 403
    origin_denied — its connection comes from another pid namespace — and it
    cannot find or signal the other's processes."""
    shared = guest_folder(account, "shared")
    fifos = {name: Fifo(shared / name) for name in ("victim", "attacker")}
    inboxes = {name: Fifo(shared / f"{name}-in", to_guest=True) for name in fifos}
    try:
        with serving(account, sandbox=f'read_write = ["{shared}"]\n') as served:
            victim_exe = served.launch(
                guest(S3_VICTIM), str(fifos["victim"].path), str(inboxes["victim"].path)
            )
            leaked = fifos["victim"].read()
            attacker_exe = served.launch(
                guest(S3_ATTACKER), str(fifos["attacker"].path), str(inboxes["attacker"].path)
            )
            assert fifos["attacker"].read() == {"ready": True}
            monitor = victim_exe["guest_pid"]
            pid1 = children_of(monitor)[0]
            victim_pids = [monitor, pid1, *children_of(pid1)]
            inboxes["attacker"].send(headers=leaked["headers"], pids=victim_pids)
            found = fifos["attacker"].read()
            inboxes["victim"].send(go=True)
            after = fifos["victim"].read()
            for execution in (victim_exe, attacker_exe):
                ended = served.wait_ended(execution["execution_id"])
                assert ended["outcome"]["exit_code"] == 0, ended
    finally:
        for fifo in [*fifos.values(), *inboxes.values()]:
            fifo.close()
    assert found["pidns"] != leaked["pidns"]
    assert found["as_victim"] == [403, "origin_denied"]
    assert found["status_as_victim"] == [403, "origin_denied"]
    assert found["victim_ids_own_credential"] == [401, "unauthenticated"]
    assert found["own"] == [200, None]
    assert found["kill"] == found["pidfd"] == [errno.ESRCH] * len(victim_pids)
    assert max(found["proc"]) < 100, found["proc"]
    # The victim was not harmed, and nothing ran in its name.
    assert after == {"status": 200, "code": None}


# == S4: the admin API is out of reach, and fails closed ===============================

#: Asks for approval of an irreversible call, then looks for the admin API by
#: every route it can think of, to approve its own proposal.
S4_REACH_ADMIN = r"""
import stat, threading
state = sys.argv[2]
answers = {}
def charge():
    body = {"call_id": "c1", "tool": "charge", "args": {"account": "a", "cents": 1}}
    answers["charge"] = hc("POST", "/v1/calls", body)
waiting = threading.Thread(target=charge)
waiting.start()
routes = {}
def unix(path):
    def connect():
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(path)
        return s
    return connect
def try_admin(name, connect):
    try:
        s = connect()
    except (OSError, ValueError) as e:
        routes[name] = ["connect", getattr(e, "errno", None)]
        return
    try:
        status, body = hc("GET", "/v1/approvals?state=waiting", headers={}, sock=s)
        routes[name] = ["answered", status]
        for proposal in body if status == 200 and isinstance(body, list) else []:
            routes[name].append(hc("POST", f"/v1/approvals/{proposal['id']}/approve", {},
                                   headers={}, sock=unix_again(name))[0])
    except OSError as e:
        routes[name] = ["request", e.errno]
    finally:
        s.close()
admin = state + "/admin.sock"
candidates = {
    "path": unix(admin),
    "proc_1_root": unix("/proc/1/root" + admin),
    "proc_self_root": unix("/proc/self/root" + admin),
    "proc_1_cwd": unix("/proc/1/cwd/admin.sock"),
    "abstract": unix("\0" + admin),
    "abstract_short": unix("\0hostcall"),
    "channel": connect_channel,
}
unix_again = lambda name: candidates[name]()
for name, connect in candidates.items():
    try_admin(name, connect)
def listing(path):
    try:
        return sorted(os.listdir(path))
    except OSError as e:
        return e.errno
routes["state_dir"] = listing(state)
routes["proc_1_fd"] = listing("/proc/1/fd")
# Every descriptor it holds: none may be a connection to the admin socket.
peers = []
for fd in range(1024):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            s = socket.socket(fileno=os.dup(fd))
            if s.family == socket.AF_UNIX:
                peers.append(s.getpeername())
            s.close()
    except OSError:
        pass
routes["socket_peers"] = peers
report(sys.argv[1], **routes)
waiting.join(120)
report(sys.argv[1], charge=answers["charge"][0],
       code=(answers["charge"][1].get("error") or {}).get("code"))
"""


def listed_once_proposed(account: Account, served: Served) -> list[dict[str, Any]]:
    """``hostcall approvals list --json``, asked again (bounded) until it
    lists a proposal."""
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while True:
        listed = account.hostcall("approvals", "list", "--json", "--state-dir", str(served.state))
        assert listed.returncode == 0, listed.stderr
        proposals: list[dict[str, Any]] = json.loads(listed.stdout)
        if proposals or time.monotonic() > deadline:
            return proposals
        time.sleep(0.1)


def test_a_sandboxed_guest_finds_no_route_to_the_admin_api_to_approve_its_own_call(
    account: Account,
) -> None:
    """S4: the admin socket by its path, through /proc/1/root and /proc/self/root,
    an abstract name, the channel socket, and any descriptor the guest holds;
    none answers, the proposal stays waiting, and the operator's CLI decides it."""
    shared = guest_folder(account, "shared")
    fifo = Fifo(shared / "out")
    try:
        with serving(account, sandbox=f'read_write = ["{shared}"]\n') as served:
            launched = served.launch(guest(S4_REACH_ADMIN), str(fifo.path), str(served.state))
            routes = fifo.read()
            # The guest sends its call from a thread and reports its routes
            # without waiting for it: the proposal may come a little later.
            proposals = listed_once_proposed(account, served)
            assert [(p["tool"], p["state"]) for p in proposals] == [("charge", "waiting")]
            rejected = account.hostcall(
                "approvals", "reject", proposals[0]["id"], "--state-dir", str(served.state)
            )
            assert rejected.returncode == 0, rejected.stderr
            final = fifo.read()
            served.wait_ended(launched["execution_id"])
    finally:
        fifo.close()
    for name in ("path", "proc_self_root"):
        # The state dir is an empty tmpfs inside (its socket is not there).
        assert routes[name] == ["connect", errno.ENOENT], (name, routes)
    # pid 1's view: the same (unprivileged), or none at all (root's pid 1).
    through_pid_1 = errno.EACCES if account.root else errno.ENOENT
    for name in ("proc_1_root", "proc_1_cwd"):
        assert routes[name] == ["connect", through_pid_1], (name, routes)
    # Abstract sockets are per network namespace, and the guest has its own.
    assert routes["abstract"] == routes["abstract_short"] == ["connect", errno.ECONNREFUSED]
    # The channel is no admin API: the request is refused (no identity).
    assert routes["channel"][0] == "answered" and routes["channel"][1] in (401, 404), routes
    assert routes["state_dir"] == []
    assert all("admin" not in str(peer) for peer in routes["socket_peers"]), routes
    if account.root:
        assert routes["proc_1_fd"] == errno.EACCES
    assert final == {"charge": 403, "code": "approval_rejected"}


#: Run as the supervisor's own uid: connects in a child that then exits and is
#: reaped, and sends the request on the connection it passed up (SO_PEERCRED
#: names the child, which is gone when the admin API looks).
CONNECT_AND_EXIT = r"""
import array, json, os, socket, sys
path = sys.argv[1]
parent, child = socket.socketpair()
pid = os.fork()
if pid == 0:
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    child.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [s.fileno()]))])
    os._exit(0)
os.waitpid(pid, 0)
msg, ancillary, _, _ = parent.recvmsg(1, socket.CMSG_SPACE(4))
fd = array.array("i", ancillary[0][2])[0]
s = socket.socket(fileno=fd)
s.settimeout(60)
s.sendall(b"GET /v1/approvals HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
head, _, body = data.partition(b"\r\n\r\n")
print(json.dumps({"status": int(head.split()[1]), "body": json.loads(body)}))
"""

#: One admin request, from wherever it is run (a sandbox of the test's own).
ADMIN_GET = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect(sys.argv[1])
s.sendall(b"GET /v1/approvals HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n")
data = b""
while chunk := s.recv(65536):
    data += chunk
head, _, body = data.partition(b"\r\n\r\n")
print(json.dumps({"status": int(head.split()[1]), "body": json.loads(body)}))
"""


def test_the_admin_api_refuses_every_peer_it_cannot_attribute_and_still_serves_the_operator(
    account: Account,
) -> None:
    """S4 fails closed: a peer whose process is gone when it is checked, one in
    another pid namespace (a bubblewrap sandbox of the test's own, with the
    admin socket bound in) and one of another uid are each refused 403
    origin_denied; the operator's ``hostcall approvals list`` still answers."""
    from supervisor.sandbox import bwrap_executable

    bwrap = str(bwrap_executable())
    with serving(account) as served:
        sock = str(served.state / "admin.sock")

        def run(argv: list[str]) -> dict[str, Any]:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False
            )
            assert done.returncode == 0, done.stderr
            answer: dict[str, Any] = json.loads(done.stdout)
            return answer

        gone = run(as_account(account, [account.python, "-c", CONNECT_AND_EXIT, sock]))
        namespaces = ["--unshare-pid"] if account.root else ["--unshare-user", "--unshare-pid"]
        in_a_sandbox = [
            bwrap, *namespaces, "--die-with-parent",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
            "--bind", sock, "/tmp/admin.sock",
            "--", account.python, "-c", ADMIN_GET, "/tmp/admin.sock",
        ]  # fmt: skip
        sandboxed = run(as_account(account, in_a_sandbox))
        # Another uid that can still connect: root, to the unprivileged
        # supervisor's socket; to root's, a uid with CAP_DAC_OVERRIDE only.
        other_uid = [
            "setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
            "--inh-caps=+dac_override", "--ambient-caps=+dac_override",
        ]  # fmt: skip
        # (Run as a user, the tests have no other uid to try.)
        foreign = None
        if IS_ROOT:
            prefix = other_uid if account.root else []
            foreign = run([*prefix, account.python, "-c", ADMIN_GET, sock])
        operator = account.hostcall("approvals", "list", "--state-dir", str(served.state))
    for refused in (gone, sandboxed, *([foreign] if foreign is not None else [])):
        assert refused["status"] == 403, refused
        assert refused["body"]["error"]["code"] == "origin_denied", refused
    assert operator.returncode == 0, operator.stderr
    assert operator.stdout.strip() == "no proposals"


def test_the_console_in_the_supervisors_own_process_reaches_its_admin_api(
    account: Account,
) -> None:
    """``--console`` serves the operator console from the supervisor's own
    process, a client of its admin API like the CLI. The admin check read
    the peer's ``/proc/<pid>/environ`` to tell it from a guest; the
    supervisor is not dumpable, so to any user but root its own ``/proc``
    files are root's: as a user, every page of the console answered 403
    origin_denied. The supervisor's own process is no guest's."""
    with serving(account, console=True) as served:
        url = urllib.parse.urlsplit(served.console_url)
        with urllib.request.urlopen(
            f"{url.scheme}://{url.netloc}/api/overview?{url.query}", timeout=STEP_TIMEOUT_S
        ) as response:
            status, overview = response.status, json.load(response)
    assert status == 200
    assert (overview["invocations"], overview["approvals"]) == ([], [])


# == S5: nothing of a guest outlives its execution =====================================

#: Leaves behind everything a guest can: a child in its group, a setsid'd one, a
#: double-forked daemon, and a fork-exit chain (a new pid every few µs), all
#: ignoring SIGTERM; prints its pid namespace (and reports it to the FIFO
#: argv[2] if given). Then, as argv[1] says: "exit" once stdin has a line (the
#: test has pinned the namespace), or "wait" (forever).
S5_TREE = r"""
import signal, subprocess
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by every child
stubborn = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen(stubborn, stdin=subprocess.DEVNULL)
subprocess.Popen(stubborn, stdin=subprocess.DEVNULL, start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, stubborn)
    os._exit(0)
if os.fork() == 0:
    os.setsid()
    while True:
        if os.fork():
            os._exit(0)
print(json.dumps({"pidns": pidns()}), flush=True)
if len(sys.argv) > 2:
    report(sys.argv[2], pidns=pidns())
if sys.argv[1] == "exit":
    sys.stdin.readline()
else:
    time.sleep(600)
"""


def finish(run: subprocess.Popen[str], stdin: str | None = None) -> tuple[str, dict[str, Any]]:
    """Wait (bounded) for ``hostcall run`` to end; the rest of the guest's
    stdout and the JSON summary."""
    out, err = run.communicate(stdin, timeout=STEP_TIMEOUT_S * 2)
    return out, summary_of(err)


def test_a_guest_that_exits_leaves_nothing_alive_when_hostcall_run_returns(
    account: Account,
) -> None:
    """S5 by exit: setsid'd children, a double-forked daemon and a fork-exit chain,
    all ignoring SIGTERM, are gone the moment ``hostcall run`` returns."""
    with hostcall_run(account, guest(S5_TREE), "exit") as run:
        pidns = json.loads(read_line(run))["pidns"]
        with pinned(pidns):
            _, summary = finish(run, "go\n")
            left = processes_in_pid_namespace(pidns)
    assert run.returncode == 0
    assert left == []
    assert summary["executions"][0]["reason"] == "exited"


def test_a_timeout_ends_a_tree_that_ignores_sigterm_before_hostcall_run_returns(
    account: Account,
) -> None:
    """S5 by ``--timeout``: TERM is ignored by all, the chain changes pids faster
    than any list of them; the KILL still leaves nothing, and exit is 124."""
    with hostcall_run(account, guest(S5_TREE), "wait", extra=("--timeout", "1")) as run:
        pidns = json.loads(read_line(run))["pidns"]
        with pinned(pidns):
            _, summary = finish(run)
            left = processes_in_pid_namespace(pidns)
    assert run.returncode == 124
    assert left == []
    assert summary["executions"][0]["reason"] == "timeout"


@contextlib.contextmanager
def fifos(account: Account, *names: str) -> Iterator[dict[str, Fifo]]:
    """FIFOs a guest reports to, in a folder the plan makes writable."""
    shared = guest_folder(account, "shared")
    made = {name: Fifo(shared / name) for name in names}
    try:
        yield made
    finally:
        for fifo in made.values():
            fifo.close()


def shared_plan(account: Account) -> str:
    return f'read_write = ["{account.home / "shared"}"]\n'


def test_a_cancel_through_the_admin_api_ends_the_whole_tree_before_it_is_reported_ended(
    account: Account,
) -> None:
    """S5 by ``POST /v1/executions/{id}/cancel`` under ``hostcall serve``: once the
    admin API says the execution is cancelled, nothing of it is alive."""
    with fifos(account, "tree") as made, serving(account, sandbox=shared_plan(account)) as served:
        launched = served.launch(guest(S5_TREE), "wait", str(made["tree"].path))
        pidns = made["tree"].read()["pidns"]
        url = f"/v1/executions/{launched['execution_id']}/cancel"
        with pinned(pidns):
            status, answer = served.admin("POST", url)
            left_at_answer = processes_in_pid_namespace(pidns)
            ended = served.wait_ended(launched["execution_id"])
            left_at_end = processes_in_pid_namespace(pidns)
    assert status == 200, answer
    assert answer["state"] in ("cancelled", "stopping"), answer
    if answer["state"] == "cancelled":
        assert left_at_answer == [], "the cancel answered 'cancelled' while the tree ran"
    assert ended["state"] == "cancelled" and ended["outcome"]["reason"] == "cancelled"
    assert left_at_end == []


#: A tree that does not resist: a setsid'd child and a double-forked daemon that
#: die on SIGTERM. Reports its namespace to argv[1], then waits.
S5_POLITE_TREE = r"""
import subprocess
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen(sleeper, start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, sleeper)
    os._exit(0)
report(sys.argv[1], pidns=pidns())
time.sleep(600)
"""


def test_a_fenced_execution_is_ended_when_a_new_attempt_of_its_invocation_starts(
    account: Account,
) -> None:
    """S5 by fencing: a second ``POST /v1/invocations`` with the same invocation
    fences the first execution; its tree must end too (within the stop's grace;
    this tree does not even resist SIGTERM), not run on unseen."""
    with (
        fifos(account, "first", "second") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        first = served.launch(guest(S5_POLITE_TREE), str(made["first"].path), invocation="inv-f")
        first_ns = made["first"].read()["pidns"]
        with pinned(first_ns):  # before the fence: its number must stay its own
            second = served.launch(
                guest(S5_POLITE_TREE), str(made["second"].path), invocation="inv-f"
            )
            made["second"].read()
            try:
                left = wait_namespace_empty(first_ns, timeout=5)  # the TERM's grace
                reported = served.executions()
                assert left == [], f"fenced, still running ({reported[first['execution_id']]})"
                assert reported[first["execution_id"]]["state"] == "fenced"
                assert reported[second["execution_id"]]["state"] == "running"
            finally:
                kill_namespace(first_ns)


def test_stopping_hostcall_serve_ends_every_guest_tree_before_it_exits(account: Account) -> None:
    """S5 by the end of ``hostcall serve`` (SIGTERM): two guests' trees, ignoring
    SIGTERM, are gone by the time serve has exited."""
    with fifos(account, "a", "b") as made, serving(account, sandbox=shared_plan(account)) as served:
        for name in made:
            served.launch(guest(S5_TREE), "wait", str(made[name].path))
        namespaces = [made[name].read()["pidns"] for name in made]
        with pinned(namespaces[0]), pinned(namespaces[1]):
            status = served.stop()
            left = {ns: processes_in_pid_namespace(ns) for ns in namespaces}
    assert status == 128 + signal.SIGTERM
    assert left == {ns: [] for ns in namespaces}


def test_a_supervisor_killed_with_sigkill_takes_every_guest_process_with_it(
    account: Account,
) -> None:
    """S5 by the supervisor's own death (SIGKILL: nothing of it runs to clean up):
    bubblewrap dies with its parent, its pid 1 with it, and the kernel ends the
    whole pid namespace — TERM-ignoring, setsid'd and daemonised processes too."""
    with hostcall_run(account, guest(S5_TREE), "wait") as run:
        pidns = json.loads(read_line(run))["pidns"]
        supervisor = run.pid
        with pinned(pidns):
            run.kill()
            run.wait(timeout=STEP_TIMEOUT_S)
            try:
                left = wait_namespace_empty(pidns, timeout=10)
                cgroups = [cg for cg in cgroups_of(supervisor) if (cg / "tasks").exists()]
                tasks = [t for cg in cgroups_of(supervisor) for t in tasks_in(cg)]
            finally:
                kill_namespace(pidns)
                remove_cgroups_of(supervisor)
    assert left == []
    assert tasks == [], "the dead supervisor's cgroups still hold processes"
    if account.root:
        assert cgroups, "as root the guest ran in a cgroup of the supervisor's"


#: Runs ARGV as a child subreaper and reaps every process that comes to it, so
#: that it returns only once nothing of a killed supervisor's guests is left;
#: prints the first child's wait status.
REAP_ALL = r"""
import os, subprocess, sys
from supervisor.tracking import become_subreaper
become_subreaper()
first = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
status = None
while True:
    try:
        pid, wait_status = os.wait()
    except ChildProcessError:
        break
    if pid == first.pid:
        status = os.waitstatus_to_exitcode(wait_status)
print(status)
"""


def test_a_supervisor_killed_while_its_guest_starts_never_lets_the_guest_run(
    account: Account,
) -> None:
    """S5 by the supervisor's death in the middle of a start, its sandbox's pid
    1 in the cgroup and waiting for the go-ahead (``HOSTCALL_FAULT`` kills the
    supervisor right there). bubblewrap takes the end of its block pipe for a
    go-ahead, and pid 1 has no parent-death signal until the guest runs: the
    guest ran, untracked, with nobody left to stop it. The gate before the
    guest's program ends the sandbox instead. Whatever the dead supervisor
    leaves comes to a subreaper, which returns once all of it has ended."""
    shared = guest_folder(account, "shared")
    supervisor = account.command(
        "run",
        "--state-dir",
        str(account.home / "state"),
        "--plan",
        str(plan_file(account, shared_plan(account))),
        "--",
        "/bin/sh",
        "-c",
        f"echo ran > {shared}/ran",
    )
    done = subprocess.run(
        [sys.executable, "-c", REAP_ALL, *supervisor],
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S * 2,
        check=False,
        cwd=account.home,
        env=account.env(HOSTCALL_FAULT="sandbox_joined"),
    )
    assert done.stdout.strip() == str(-signal.SIGKILL), done.stderr[-3000:]
    assert not (shared / "ran").exists(), "the guest ran after its supervisor died"


#: Tries the system calls the seccomp filter refuses as kernel attack surface,
#: printing each one's errno (0: it worked).
S3_KERNEL_SURFACE = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
calls = {
    "io_uring_setup": (425, 8, params),
    "io_uring_enter": (426, 0, 0, 0, 0, None, 0),
    "io_uring_register": (427, 0, 0, None, 0),
    "bpf": (321, 0, None, 0),
    "userfaultfd": (323, 0),
}
errnos = {}
for name, (number, *args) in calls.items():
    ctypes.set_errno(0)
    result = libc.syscall(number, *args)
    errnos[name] = ctypes.get_errno() if result == -1 else 0
print(json.dumps(errnos), flush=True)
"""


def test_a_guest_cannot_reach_io_uring_bpf_or_userfaultfd(account: Account) -> None:
    """Kernel attack surface no agent needs: io_uring looks absent (ENOSYS,
    so a runtime falls back to what it did without it), bpf and userfaultfd
    are refused (EPERM) — in both modes (docs/sandbox.md)."""
    if platform.machine() != "x86_64":
        pytest.skip("the guest names x86_64 system call numbers")
    done, _ = run_guest(account, guest(S3_KERNEL_SURFACE))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "io_uring_setup": errno.ENOSYS,
        "io_uring_enter": errno.ENOSYS,
        "io_uring_register": errno.ENOSYS,
        "bpf": errno.EPERM,
        "userfaultfd": errno.EPERM,
    }


#: Unties the sandbox's pid 1 from bubblewrap's monitor: ptrace-attaches to it
#: and makes it run prctl(PR_SET_PDEATHSIG, 0) on a `syscall` instruction it
#: already has (the one it is blocked in), then restores it. Prints what that
#: gave, then builds S5's tree and waits.
S5_UNTIE_PID1 = (
    r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
ATTACH, DETACH, GETREGS, SETREGS, PEEKTEXT, SINGLESTEP = 16, 17, 12, 13, 1, 9
RAX, RSI, RDI, ORIG_RAX, RIP = 10, 13, 14, 15, 16  # struct user_regs_struct, x86-64
WALL = 0x40000000
Regs = ctypes.c_ulong * 27
def ptrace(request, addr=None, data=None):
    ctypes.set_errno(0)
    result = libc.ptrace(request, 1, addr, data)
    if result == -1 and ctypes.get_errno():
        raise OSError(ctypes.get_errno(), "ptrace")
    return result
def untie():
    ptrace(ATTACH)
    os.waitpid(1, WALL)
    saved = Regs()
    ptrace(GETREGS, None, ctypes.addressof(saved))
    if ptrace(PEEKTEXT, ctypes.c_void_p(saved[RIP] - 2)) & 0xFFFF != 0x050F:
        raise OSError(0, "pid 1 is not in a system call")
    regs = Regs(*saved)
    regs[RIP], regs[RAX], regs[ORIG_RAX] = saved[RIP] - 2, 157, 2**64 - 1  # prctl
    regs[RDI], regs[RSI] = 1, 0  # PR_SET_PDEATHSIG, none
    ptrace(SETREGS, None, ctypes.addressof(regs))
    ptrace(SINGLESTEP)
    os.waitpid(1, WALL)
    ptrace(GETREGS, None, ctypes.addressof(regs))
    ptrace(SETREGS, None, ctypes.addressof(saved))
    ptrace(DETACH)
    return regs[RAX]
try:
    untied = ["prctl returned", untie()]
except OSError as e:
    untied = ["refused", e.errno]
print(json.dumps(untied), flush=True)
"""
    + S5_TREE
)


#: The same by writing pid 1's memory through /proc (a plain open(), which
#: seccomp cannot refuse by path): the code where pid 1 waits becomes
#: prctl(PR_SET_PDEATHSIG, 0), then pause() forever; S5's tree, whose orphans
#: pid 1 reaps, makes its wait return into it.
S5_UNTIE_PID1_BY_MEMORY = (
    r"""
untied = []
try:
    pc = int(open("/proc/1/syscall").read().split()[-1], 16)  # after its syscall
    code = bytes.fromhex("bf01000000" "31f6" "b89d000000" "0f05" "b822000000" "0f05" "ebf7")
    for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
        with open(path, "r+b", buffering=0) as memory:
            memory.seek(pc)
            memory.write(code)
            untied = ["written", path]
            break
except OSError as e:
    untied = untied or ["refused", e.errno]
print(json.dumps(untied), flush=True)
"""
    + S5_TREE
)


@pytest.mark.parametrize("route", ["ptrace", "proc-mem"])
def test_a_guest_cannot_untie_its_sandbox_from_the_supervisor_to_outlive_a_sigkill(
    account: Account, route: str
) -> None:
    """S5/S3: the sandbox's pid 1 dies with bubblewrap's monitor (PR_SET_PDEATHSIG),
    which dies with the supervisor. A guest that could ptrace pid 1, or write
    its memory through /proc/1/mem, could clear that and outlive a SIGKILLed
    supervisor: as root pid 1 is root's and refuses; in either mode the seccomp
    filter refuses ptrace itself, and /proc/1/mem is masked (F13, F25)."""
    untie = S5_UNTIE_PID1 if route == "ptrace" else S5_UNTIE_PID1_BY_MEMORY
    with hostcall_run(account, guest(untie), "wait") as run:
        untied = json.loads(read_line(run))
        pidns = json.loads(read_line(run))["pidns"]
        supervisor = run.pid
        with pinned(pidns):
            run.kill()
            run.wait(timeout=STEP_TIMEOUT_S)
            try:
                left = wait_namespace_empty(pidns, timeout=5)
            finally:
                kill_namespace(pidns)
                remove_cgroups_of(supervisor)
    if route == "proc-mem":
        assert untied[0] == "refused", untied
    elif account.root:
        assert untied == ["refused", errno.EPERM]
    assert left == [], f"the sandbox outlived its supervisor (pid 1 untied: {untied})"


# == S6: memory, processes and CPU stay within their limits ============================

#: The memory limit the S6 guests are given (MiB), and how much they try to use.
MEMORY_MB = 32
#: Uses 3× the memory limit by the route in argv[1], printing how far it got;
#: holds it for a second (ten sample intervals) and exits 0 if still alive.
S6_MEMORY = r"""
import mmap
route, limit = sys.argv[1], int(sys.argv[2]) << 20
chunk = b"\1" * (1 << 20)
def fill(f, budget):
    written = 0
    try:
        while written < budget:
            written += f.write(chunk)
            f.flush()
    except OSError:
        pass
    return written
used = {}
if route == "anonymous":
    held = [bytearray(chunk) for _ in range(3 * limit >> 20)]
    used["anonymous"] = len(held) << 20
elif route == "memfd":
    memfd = os.fdopen(os.memfd_create("hoard"), "wb", buffering=0)
    used["memfd"] = fill(memfd, 3 * limit)
elif route == "cwd":
    with open("hoard", "wb", buffering=0) as f:
        used["cwd"] = fill(f, 5 * limit)
elif route == "tmpfs":
    # Every writable tmpfs: /tmp, /dev/shm, /var/tmp and the working directory,
    # until it is full or 5× the limit is used in all.
    for folder in ("/tmp", "/dev/shm", "/var/tmp", os.getcwd()):
        with open(os.path.join(folder, "hoard"), "wb", buffering=0) as f:
            used[folder] = fill(f, 5 * limit - sum(used.values()))
elif route == "buffers":
    # Kernel memory: Unix socket buffers, filled and never read.
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    pairs, used["buffers"] = [], 0
    while used["buffers"] < 3 * limit:
        a, b = socket.socketpair()
        a.setblocking(False)
        pairs.append((a, b))
        try:
            while True:
                used["buffers"] += a.send(chunk)
        except BlockingIOError:
            pass
elif route == "burst":
    # 3× the limit, touched and returned, again and again: each far shorter
    # than a sample interval.
    size = 3 * limit
    bursts = 0
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x8000)
        area.close()  # MAP_POPULATE (0x8000): all pages at once
        bursts += 1
    used["bursts"] = bursts
print(json.dumps(used), flush=True)
time.sleep(1)
"""


@pytest.mark.parametrize("route", ["anonymous", "memfd", "tmpfs", "buffers", "burst"])
def test_memory_beyond_the_limit_by_any_route_ends_the_guest_where_the_kernel_counts(
    account: Account, route: str
) -> None:
    """S6 memory: anonymous pages, a memfd (in no process's RSS), every writable
    tmpfs, kernel socket buffers, and 3× the limit held for under a sample
    interval, again and again.
    With a cgroup (root here) the kernel stops each: exit 125, memory_limit,
    "limits": "cgroup-v1". Sampled (unprivileged here) only memory in RSS held
    across samples is seen; the others pass, and the execution says "sampled"."""
    done, summary = run_guest(
        account,
        guest(S6_MEMORY),
        route,
        str(MEMORY_MB),
        extra=("--memory", str(MEMORY_MB)),
    )
    execution = summary["executions"][0]
    if account.root:
        assert execution["sandbox"]["limits"] == "cgroup-v1"
        assert done.returncode == 125, done.stderr
        assert execution["reason"] == "memory_limit"
        assert done.stdout == "", "the guest got past its limit"
        return
    assert execution["sandbox"]["limits"] == "sampled"
    ended = (done.returncode, execution["reason"])
    if route == "anonymous":
        assert ended == (125, "memory_limit")  # in RSS, held across samples: seen
    elif route == "burst":
        # Seen only if a sample falls inside one of the bursts: either may happen.
        assert ended in ((0, "exited"), (125, "memory_limit")), done.stderr
    else:
        # Not in any RSS: unseen (documented). Each tmpfs is still capped at the
        # limit, so tmpfs holds at most four times it; a memfd has no cap.
        assert ended == (0, "exited"), done.stderr
        used = json.loads(done.stdout)
        assert sum(used.values()) > 2 * MEMORY_MB << 20
        if route == "tmpfs":
            assert all(size <= MEMORY_MB << 20 for size in used.values()), used


#: Makes argv[2] tasks at once by the route in argv[1], printing how many it got
#: (a fork or thread the kernel refuses ends the attempt); holds them a second.
S6_TASKS = r"""
import threading
route, wanted = sys.argv[1], int(sys.argv[2])
made = 0
if route == "processes":
    for _ in range(wanted):
        try:
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)
        except OSError:
            break
        made += 1
elif route == "threads":
    forever = threading.Event()
    for _ in range(wanted):
        try:
            threading.Thread(target=forever.wait, daemon=True).start()
        except RuntimeError:
            break
        made += 1
elif route == "churn":
    # `wanted` children at once, each exiting at once, again and again for a
    # second: never alive long enough for a sample to see them.
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        children = []
        for _ in range(wanted):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                os._exit(0)
            children.append(pid)
        made = max(made, len(children))
        for pid in children:
            os.waitpid(pid, 0)
        if len(children) < wanted:
            break
print(json.dumps({"made": made}), flush=True)
time.sleep(1)
"""

MAX_PROCS = 8


@pytest.mark.parametrize("route", ["processes", "threads", "churn"])
def test_tasks_beyond_the_process_limit_are_refused_by_the_kernel_where_it_counts(
    account: Account, route: str
) -> None:
    """S6 --max-procs: 3× the limit as processes, as threads, and as children that
    exit at once. With a cgroup the kernel refuses the task past the limit
    (threads count) and the guest ends 125 process_limit. Sampled, a process
    count held across samples is seen; threads are not processes there, and
    churning children are usually too quick (documented)."""
    done, summary = run_guest(
        account,
        guest(S6_TASKS),
        route,
        str(3 * MAX_PROCS),
        extra=("--max-procs", str(MAX_PROCS)),
    )
    execution = summary["executions"][0]
    ended = (done.returncode, execution["reason"])
    made = json.loads(done.stdout)["made"] if done.stdout else None
    if account.root:
        assert execution["sandbox"]["limits"] == "cgroup-v1"
        assert ended == (125, "process_limit"), done.stderr
        # The guest itself is one task: it never got more than the limit's worth.
        assert made is None or made < MAX_PROCS, made
        assert execution["peak_processes"] <= MAX_PROCS
        return
    assert execution["sandbox"]["limits"] == "sampled"
    if route == "processes":
        assert ended == (125, "process_limit"), done.stderr
    elif route == "threads":
        assert ended == (0, "exited") and made == 3 * MAX_PROCS, done.stderr
    else:
        assert ended in ((0, "exited"), (125, "process_limit")), done.stderr


#: Ignores SIGTERM and keeps forking: argv[1] chains, each forking its next
#: link and exiting, forever (a fork that fails is tried again).
S6_STORM = r"""
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print(json.dumps({"pidns": pidns()}), flush=True)
def chain():
    while True:
        try:
            if os.fork():
                os._exit(0)
        except OSError:
            pass
for _ in range(int(sys.argv[1])):
    try:
        if os.fork() == 0:
            chain()
    except OSError:
        pass
time.sleep(600)
"""


def test_a_fork_storm_that_ignores_sigterm_is_stopped_at_its_process_limit_leaving_nothing(
    account: Account,
) -> None:
    """S6/S5: forks that never stop, during the stop too, are bounded (by the
    kernel, or for the sampled case by the storm's own design) and ended at
    once when the KILL comes: exit 125, process_limit, an empty namespace."""
    limit = ("--max-procs", str(MAX_PROCS))
    with hostcall_run(account, guest(S6_STORM), str(3 * MAX_PROCS), extra=limit) as run:
        pidns = json.loads(read_line(run))["pidns"]
        with pinned(pidns):
            _, summary = finish(run)
            left = processes_in_pid_namespace(pidns)
    assert (run.returncode, summary["executions"][0]["reason"]) == (125, "process_limit")
    assert left == []


def test_writes_to_the_working_directory_count_against_the_memory_limit(
    account: Account,
) -> None:
    """S6 memory by the working directory: launched from a folder it can show,
    the guest writes into its working directory. With a cgroup that is an
    overlay whose writes the kernel counts (125, memory_limit). Sampled, an
    overlay's upper layer (bubblewrap's own tmpfs, no size) would go unseen, so
    a memory limit gives a fresh working directory of that size instead."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="hostcall-overlay-", dir="/var/lib"))
    except OSError:
        pytest.skip("no folder outside the sandbox's private ones to launch from")
    try:
        folder.chmod(0o755)
        os.chown(folder, account.uid, account.uid)
        hostcall = account.command(
            "run", "--state-dir", str(account.home / "state"), "--plan", str(plan_file(account)),
            "--json", "--memory", str(MEMORY_MB),
            "--", account.python, "-c", guest(S6_MEMORY), "cwd", str(MEMORY_MB),
        )  # fmt: skip
        done = subprocess.run(
            hostcall,
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S * 2,
            check=False,
            cwd=folder,
            env=account.env(),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    execution = summary_of(done.stderr)["executions"][0]
    ended = (done.returncode, execution["reason"])
    if account.root:
        assert execution["sandbox"]["workdir"] == "overlay", execution
        assert execution["sandbox"]["limits"] == "cgroup-v1"
        assert ended == (125, "memory_limit"), done.stderr
        assert done.stdout == ""
    else:
        # Sampled, an overlay's writes would go unseen: with a memory limit the
        # working directory is a fresh tmpfs of that size instead.
        assert execution["sandbox"]["limits"] == "sampled"
        assert execution["sandbox"]["workdir"] == "fresh", execution
        assert ended == (0, "exited"), done.stderr
        assert json.loads(done.stdout)["cwd"] <= MEMORY_MB << 20


#: Burns CPU by the route in argv[1] until it has used argv[2] seconds (or is
#: stopped); prints what it burned.
S6_CPU = r"""
import signal, struct
route, target = sys.argv[1], float(sys.argv[2])
def spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
burned = 0.0
deadline = time.monotonic() + 30
if route == "one":
    spin(target)
    burned = time.process_time()
else:
    # Two children at a time, 50 ms of CPU each, never waited for (SIGCHLD
    # ignored): the kernel reaps them at once and adds their time to no parent.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    r, w = os.pipe()
    while burned < target and time.monotonic() < deadline:
        for _ in range(2):
            if os.fork() == 0:
                spin(0.05)
                os.write(w, struct.pack("d", time.process_time()))
                os._exit(0)
        try:
            os.wait()  # returns (ECHILD) once both are gone
        except ChildProcessError:
            pass
        data = b""
        while len(data) < 16:
            data += os.read(r, 16 - len(data))
        burned += sum(struct.unpack("2d", data))
print(json.dumps({"burned": burned}), flush=True)
"""

CPU_S = 1


@pytest.mark.parametrize("route", ["one", "children"])
def test_cpu_beyond_the_limit_ends_the_guest_where_the_kernel_counts(
    account: Account, route: str
) -> None:
    """S6 --cpu: twice the limit in one process, and spread over children that
    live 50 ms each and are never waited for. The cgroup counts all of it (125,
    cpu_limit). Sampled, the one process is seen; the children's time is added
    to no process the sampler can read, so the guest burns past the limit and
    the outcome under-reports it (documented; see the report)."""
    done, summary = run_guest(
        account, guest(S6_CPU), route, str(2 * CPU_S), extra=("--cpu", str(CPU_S))
    )
    execution = summary["executions"][0]
    ended = (done.returncode, execution["reason"])
    if account.root:
        assert execution["sandbox"]["limits"] == "cgroup-v1"
        assert ended == (125, "cpu_limit"), done.stderr
        assert execution["cpu_s"] > CPU_S
        return
    assert execution["sandbox"]["limits"] == "sampled"
    if route == "one":
        assert ended == (125, "cpu_limit"), done.stderr
    elif ended != (125, "cpu_limit"):
        assert ended == (0, "exited"), done.stderr
        assert json.loads(done.stdout)["burned"] >= 2 * CPU_S
        assert execution["cpu_s"] < CPU_S, execution  # what the sampler saw


#: Finds its own cgroups (the folders whose cgroup.procs lists it) and tries to
#: leave them or raise their limits; then uses 3× the memory limit.
S6_CGROUP_ESCAPE = r"""
def attempt(path, text):
    try:
        with open(path, "w") as f:
            f.write(text)
        return 0
    except OSError as e:
        return e.errno
me = str(os.getpid())
tried = {}
for controller in ("memory", "pids", "freezer", "cpuacct"):
    top = f"/sys/fs/cgroup/{controller}"
    tried[f"{controller}:root"] = attempt(f"{top}/cgroup.procs", me)
    for folder, subfolders, files in os.walk(top):
        if folder.count("/") > 9:
            subfolders[:] = []
        try:
            mine = me in open(os.path.join(folder, "cgroup.procs")).read().split()
        except OSError:
            continue
        if mine and folder != top:
            tried[f"{controller}:parent"] = attempt(
                os.path.join(os.path.dirname(folder), "cgroup.procs"), me)
            for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max",
                         "freezer.state", "notify_on_release"):
                if name in files:
                    tried[f"{controller}:{name}"] = attempt(os.path.join(folder, name), "max")
print(json.dumps(tried), flush=True)
held = [bytearray(b"\1" * (1 << 20)) for _ in range(3 * int(sys.argv[1]))]
time.sleep(1)
"""


def test_a_guest_can_neither_leave_its_cgroup_nor_raise_its_limits(account: Account) -> None:
    """S6: the host's cgroup tree is read-only inside and root's outside: the
    guest cannot move itself to the root or parent cgroup, nor write its own
    memory, pids or freezer files; its memory limit then holds (125)."""
    done, summary = run_guest(
        account,
        guest(S6_CGROUP_ESCAPE),
        str(MEMORY_MB),
        extra=("--memory", str(MEMORY_MB), "--max-procs", str(MAX_PROCS)),
    )
    tried = json.loads(done.stdout.splitlines()[0])
    execution = summary["executions"][0]
    assert all(result in (errno.EROFS, errno.EACCES, errno.EPERM) for result in tried.values())
    assert (done.returncode, execution["reason"]) == (125, "memory_limit")
    if account.root:
        # It found its own cgroup in every hierarchy, and could change none of it.
        assert {"memory:memory.limit_in_bytes", "pids:pids.max", "freezer:freezer.state"} <= set(
            tried
        ), tried


# == S9: a guest cannot deny others =====================================================

#: Holds 64 channel connections (each served once), then tries a 65th, one from
#: a child in a session of its own, and one from a pid namespace (in a user
#: namespace) of its own making; once told, gives one back and retries.
S9_CONNECTIONS = r"""
import subprocess
def code(answer):
    status, body = answer
    return [status, ((body or {}).get("error") or {}).get("code")]
if sys.argv[1] == "nested":
    _CRED.append(os.environ["PARENT_CREDENTIAL"])
    print(json.dumps(code(hc("GET", "/v1/plan"))))
    sys.exit(0)
box = inbox(sys.argv[2])
held = []
for _ in range(64):
    s = connect_channel()
    held.append((s, code(hc("GET", "/v1/plan", sock=s))))
served = [c for _, c in held]
over = code(hc("GET", "/v1/plan"))
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    os.write(w, json.dumps(code(hc("GET", "/v1/plan"))).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1024))
me = open("/proc/self/cmdline", "rb").read().split(b"\0")[2].decode()
nested = subprocess.run(["unshare", "-Urpf", sys.executable, "-c", me, "nested"],
                        capture_output=True, text=True,
                        env={**os.environ, "PARENT_CREDENTIAL": credential()})
nested = json.loads(nested.stdout) if nested.returncode == 0 else ["refused", nested.stderr]
report(sys.argv[1], served=sorted(set(map(tuple, served))), over=over, child=child,
       nested=nested)
receive(box)
held[0][0].close()
deadline = time.monotonic() + 10  # until the supervisor has seen the close
while (again := code(hc("GET", "/v1/plan")))[0] == 503 and time.monotonic() < deadline:
    time.sleep(0.05)
report(sys.argv[1], again=again)
"""

#: Another guest, asking to be served.
S9_NEIGHBOUR = r"""
status, body = echo("served", "n1")
report(sys.argv[1], status=status, result=body.get("result"))
"""


def test_the_65th_connection_of_a_guest_is_refused_while_another_guest_is_still_served(
    account: Account,
) -> None:
    """S9: 64 open connections per execution, counted by sandbox (a child in a
    session of its own, or in a pid namespace of its own making, counts too);
    the next is 503 too_many_connections, another guest is served meanwhile,
    and a connection given back can be opened again."""
    with (
        fifos(account, "hog", "neighbour") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        hog_box = Fifo(account.home / "shared" / "hog-in", to_guest=True)
        try:
            hog = served.launch(guest(S9_CONNECTIONS), str(made["hog"].path), str(hog_box.path))
            held = made["hog"].read()
            neighbour = served.launch(guest(S9_NEIGHBOUR), str(made["neighbour"].path))
            served_neighbour = made["neighbour"].read()
            hog_box.send(go=True)
            again = made["hog"].read()
            for execution in (hog, neighbour):
                assert served.wait_ended(execution["execution_id"])["outcome"]["exit_code"] == 0
        finally:
            hog_box.close()
    assert held["served"] == [[200, None]]
    assert held["over"] == [503, "too_many_connections"]
    assert held["child"] == [503, "too_many_connections"]
    # No namespace of its own making: the seccomp filter (and unprivileged,
    # --disable-userns) refuses a user namespace, so nothing nests to count.
    assert held["nested"][0] == "refused", held["nested"]
    assert served_neighbour == {"status": 200, "result": "served"}
    assert again == {"again": [200, None]}


#: Opens three connections and times how long each stays open: one that sends
#: nothing, one that trickles a request that never ends (a byte every 0.2 s),
#: and one that made a request and then idles.
S9_IDLE = r"""
import threading
def until_closed(s, trickle=b""):
    start = time.monotonic()
    s.settimeout(0.2)
    sent = 0
    while time.monotonic() - start < 20:
        try:
            if sent < len(trickle):
                sent += s.send(trickle[sent:sent + 1])
            if not s.recv(65536):
                return round(time.monotonic() - start, 2)
        except socket.timeout:
            continue
        except OSError:
            return round(time.monotonic() - start, 2)
    return None
closed = {}
served = connect_channel()
closed["request"] = hc("GET", "/v1/plan", sock=served)[0]
trickle = b"GET /v1/plan HTTP/1.1\r\nHost: hostcall\r\nX-Padding: " + b"a" * 1000
cases = {"idle": (connect_channel(), b""), "slowloris": (connect_channel(), trickle),
         "after_request": (served, b"")}
def watch(name, s, data):
    closed[name] = until_closed(s, data)
threads = [threading.Thread(target=watch, args=(n, *c)) for n, c in cases.items()]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(closed), flush=True)
"""


def test_idle_and_slowloris_connections_are_closed_after_the_idle_timeout(
    account: Account,
) -> None:
    """S9: a connection that sends nothing, one that trickles a request without
    end, and one idle after its request are all closed by the supervisor once
    the idle timeout passes (1 s here, through the Python API; 30 s default)."""
    done, outcome = api_run(account, guest(S9_IDLE), options={"idle_timeout_s": 1})
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    closed = json.loads(done.stdout)
    assert outcome["executions"][0]["exit_code"] == 0
    assert closed["request"] == 200
    for name in ("idle", "slowloris", "after_request"):
        assert closed[name] is not None, f"{name}: still open after 20 s"
        assert 0.5 < closed[name] < 10, (name, closed)


#: Floods stdout, then stderr, with 16 MiB each (64 KiB a line), then exits.
S9_FLOOD = r"""
line = "x" * 65535
for _ in range(256):
    print(line, flush=True)
for _ in range(256):
    print(line, file=sys.stderr, flush=True)
"""

OUTPUT_CAP = 1 << 20
MARKER = b"[hostcall: output cut: this execution's output limit of 1 MiB was reached"


def test_an_output_flood_is_cut_at_the_execution_cap_with_a_marker_and_never_blocks_the_guest(
    account: Account,
) -> None:
    """S9: 32 MiB on stdout and stderr against a 1 MiB execution cap (the Python
    API's ``execution_output_limit``; the CLI's is the 64 MiB default): what
    passes through and what is logged stops at the cap with one marker per
    stream, and the guest, drained, runs to its own end (exit 0)."""
    done, outcome = api_run(
        account, guest(S9_FLOOD), options={"execution_output_limit": OUTPUT_CAP}
    )
    execution = outcome["executions"][0]
    assert (execution["exit_code"], execution["reason"]) == (0, "exited"), done.stderr[-500:]
    err = done.stderr.rsplit(b"\n", 2)[0]  # without the outcome's line
    logs = sorted((account.home / "state" / "logs").rglob("*.log"))
    assert [p.name.rsplit(".", 2)[1] for p in logs] == ["stderr", "stdout"]
    for stream in (done.stdout, err, *(p.read_bytes() for p in logs)):
        assert stream.count(MARKER) == 1, stream[-300:]
    # Both streams share the one budget: stdout took it all, stderr has the marker.
    assert len(done.stdout) <= OUTPUT_CAP + 200
    assert done.stdout.rstrip(b"\n").endswith(b"the rest was discarded]")
    assert done.stdout.count(b"x" * 65535) >= OUTPUT_CAP // 65536 - 1
    assert b"xxxx" not in err
    assert sum(p.stat().st_size for p in logs) <= OUTPUT_CAP + 400


#: Takes all it can of what it is allowed: 200 processes, the per-user pipe
#: buffer budget of its uid (which, unprivileged, is the supervisor's too), its
#: whole descriptor table (raised to the hard limit) and 64 channel
#: connections; holds them until told (argv[1:3]: FIFOs, or "-" for stdio).
S9_HOG = r"""
import fcntl, resource, subprocess
if sys.argv[1] == "-":  # talk on stdin/stdout
    tell, wait_go = lambda **f: print(json.dumps(f), flush=True), sys.stdin.readline
else:
    box = inbox(sys.argv[2])
    tell, wait_go = lambda **f: report(sys.argv[1], **f), lambda: receive(box)
took = {}
children = [subprocess.Popen(["sleep", "600"]) for _ in range(200)]
took["processes"] = len(children)
held = []
big = 0
try:
    while True:
        r, w = os.pipe()
        held += [r, w]
        fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MiB of the uid's budget
        big += 1
except OSError as e:
    took["big_pipes"], took["big_pipes_stop"] = big, e.errno
connections = []
for _ in range(70):
    s = connect_channel()
    if hc("GET", "/v1/plan", sock=s)[0] != 200:
        break
    connections.append(s)
took["connections"] = len(connections)
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
try:
    while True:
        held += list(os.pipe())
except OSError as e:
    took["descriptors"], took["descriptors_stop"] = len(held), e.errno
for fd in held[-4:]:  # room to report through (a FIFO is opened to tell)
    os.close(fd)
del held[-4:]
tell(**took)
wait_go()
for child in children:
    child.kill()
"""


def test_a_guest_exhausting_its_descriptors_processes_and_pipes_stops_no_launch_or_admin_call(
    account: Account,
) -> None:
    """S9: while one guest holds all the descriptors, pipe buffers, connections
    and (hundreds of) processes it can, the operator's CLI still answers and a
    new guest is launched and served."""
    with (
        fifos(account, "hog", "neighbour") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        hog_box = Fifo(account.home / "shared" / "hog-in", to_guest=True)
        try:
            hog = served.launch(guest(S9_HOG), str(made["hog"].path), str(hog_box.path))
            took = made["hog"].read(timeout=STEP_TIMEOUT_S * 2)
            listed = account.hostcall("approvals", "list", "--state-dir", str(served.state))
            neighbour = served.launch(guest(S9_NEIGHBOUR), str(made["neighbour"].path))
            answer = made["neighbour"].read()
            ended = served.wait_ended(neighbour["execution_id"])
            hog_box.send(go=True)
            hog_ended = served.wait_ended(hog["execution_id"])
        finally:
            hog_box.close()
    assert took["processes"] == 200 and took["connections"] == 64, took
    assert took["descriptors_stop"] == errno.EMFILE and took["descriptors"] > 1000, took
    assert took["big_pipes_stop"] == errno.EPERM, took  # its uid's pipe budget: all taken
    assert listed.returncode == 0 and listed.stdout.strip() == "no proposals", listed.stderr
    assert answer == {"status": 200, "result": "served"}
    assert ended["outcome"]["exit_code"] == 0
    assert hog_ended["outcome"]["exit_code"] == 0


#: Run as the supervisor's account: one supervisor, the hog (S9_HOG) and, once
#: it holds everything, a second guest with a memory limit that it crosses.
TWO_GUESTS = r"""
import asyncio, json, sys
from supervisor import Plan, Supervisor
from supervisor.limits import Limits
state, plan_path, python, hog_code, limited_code, memory_mb = sys.argv[1:7]
async def main():
    async with Supervisor(state) as sup:
        plan = Plan.load(plan_path)
        started = asyncio.get_running_loop().create_future()
        hog = asyncio.create_task(sup.run(
            plan, [python, "-c", hog_code, "-"], stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, on_start=started.set_result))
        execution = await asyncio.wait_for(started, 60)
        took = json.loads(await asyncio.wait_for(execution.process.stdout.readline(), 120))
        limited = await asyncio.wait_for(sup.run(
            plan, [python, "-c", limited_code, "anonymous", memory_mb],
            limits=Limits(memory_bytes=int(memory_mb) << 20)), 60)
        execution.process.stdin.write(b"go\n")
        await execution.process.stdin.drain()
        hogged = await asyncio.wait_for(hog, 60)
    print(json.dumps({"took": took, "limited": limited.to_json()["executions"][0],
                      "hog": hogged.to_json()["executions"][0]}))
asyncio.run(main())
"""


def test_limits_are_still_enforced_on_a_guest_while_another_exhausts_what_it_can(
    account: Account,
) -> None:
    """S9: the hog of the test above does not stop the supervisor from holding a
    second guest to its memory limit (the kernel's cgroup as root, the sampler
    unprivileged): 125, memory_limit."""
    script = [
        account.python, "-c", TWO_GUESTS, str(account.home / "state"), str(plan_file(account)),
        account.python, guest(S9_HOG), guest(S6_MEMORY), str(MEMORY_MB),
    ]  # fmt: skip
    done = subprocess.run(
        as_account(account, script),
        capture_output=True,
        text=True,
        timeout=STEP_TIMEOUT_S * 6,
        check=False,
        cwd=account.home,
        env=account.env(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["took"]["processes"] == 200, found["took"]
    assert found["took"]["descriptors_stop"] == errno.EMFILE, found["took"]
    limited = found["limited"]
    assert (limited["exit_status"], limited["reason"]) == (125, "memory_limit"), limited
    assert limited["sandbox"]["limits"] == ("cgroup-v1" if account.root else "sampled")
    assert found["hog"]["exit_code"] == 0, found["hog"]


#: Leaves 200 zombie children (never waited for) and 200 orphans (their parent
#: exits first), reports, and exits once told.
S9_ZOMBIES = r"""
box = inbox(sys.argv[2])
for _ in range(200):
    if os.fork() == 0:
        os._exit(0)
r, w = os.pipe()
for _ in range(200):
    if os.fork() == 0:
        if os.fork() == 0:
            os.read(r, 1)  # outlives its parent: an orphan, until the pipe closes
            os._exit(0)
        os._exit(0)
os.close(r)
zombies = sum(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
              for p in os.listdir("/proc") if p.isdigit())
report(sys.argv[1], zombies=zombies)
receive(box)
os.close(w)
"""


def zombie_children(pid: int) -> list[int]:
    """The children of ``pid`` that are zombies."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            for child in f.read().split():
                with contextlib.suppress(OSError), open(f"/proc/{child}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        found.append(int(child))
    return found


def test_zombies_and_orphans_a_guest_leaves_never_pile_up_in_the_supervisor(
    account: Account,
) -> None:
    """S9: a guest's zombies and orphans stay in its sandbox (its pid 1 adopts
    them); the supervisor — a subreaper — has no zombie child while it runs or
    after two such guests have ended."""
    with (
        fifos(account, "zombies") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        box = Fifo(account.home / "shared" / "zombies-in", to_guest=True)
        seen = []
        try:
            for _ in range(2):
                launched = served.launch(
                    guest(S9_ZOMBIES), str(made["zombies"].path), str(box.path)
                )
                left = made["zombies"].read()
                during = zombie_children(served.process.pid)
                box.send(go=True)
                ended = served.wait_ended(launched["execution_id"])
                seen.append((left["zombies"], during, ended["outcome"]["exit_code"]))
            after = zombie_children(served.process.pid)
        finally:
            box.close()
    for zombies, during, exit_code in seen:
        assert zombies >= 200 and exit_code == 0
        assert during == []
    assert after == []


#: With the host's network (the plan allows it) and a writable folder, binds
#: 800 Unix sockets there with long names, reports, and holds them.
S9_SOCKETS = r"""
folder = os.path.dirname(sys.argv[1])
held = []
for i in range(800):
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(folder, f"{i:04d}-" + "s" * (100 - len(folder) - 6)))
    held.append(s)
report(sys.argv[1], bound=len(held))
time.sleep(600)
"""


def test_unix_sockets_a_guest_binds_cannot_wedge_the_supervisors_next_launch(
    account: Account,
) -> None:
    """S9: a guest allowed the host's network and a writable folder binds 800
    Unix sockets there. Each becomes a mask in the next guest's sandbox; the
    next launch must still start (and the admin API still answer)."""
    sandbox = f'network = "host"\n{shared_plan(account)}'
    with (
        fifos(account, "binder", "neighbour") as made,
        serving(account, sandbox=sandbox) as served,
    ):
        try:
            binder = served.launch(guest(S9_SOCKETS), str(made["binder"].path))
            pidns = sandbox_pidns(binder["guest_pid"])
            assert made["binder"].read() == {"bound": 800}
            with pinned(pidns):
                try:
                    served.launch(guest(S9_NEIGHBOUR), str(made["neighbour"].path), timeout=15)
                    answer = made["neighbour"].read()
                    listed = account.hostcall(
                        "approvals", "list", "--state-dir", str(served.state), timeout=15
                    )
                finally:
                    if served.process.poll() is None:
                        served.process.kill()  # a wedged supervisor ignores SIGTERM
                        served.process.wait(timeout=STEP_TIMEOUT_S)
                    kill_namespace(pidns)
        finally:
            remove_cgroups_of(served.process.pid)
    assert answer == {"status": 200, "result": "served"}
    assert listed.returncode == 0


# == kernel state shared by uid: every guest is uid 65534 outside =======================

#: "put": adds a key to its user keyring, reports, and once told revokes it.
#: "get": looks for that key in its own user keyring and reports what it read.
KEYRING = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L, USER_KEYRING = ctypes.c_long, ctypes.c_long(-4)
if sys.argv[1] == "put":
    box = inbox(sys.argv[3])
    secret = b"from another guest"
    key = libc.syscall(L(248), b"user", b"hostcall-left", secret, L(len(secret)), USER_KEYRING)
    report(sys.argv[2], key=key, errno=ctypes.get_errno() if key < 0 else 0)
    receive(box)
    libc.syscall(L(250), L(3), L(key))  # KEYCTL_REVOKE
else:
    key = libc.syscall(L(250), L(10), USER_KEYRING, b"user", b"hostcall-left", L(0))  # SEARCH
    data = ctypes.create_string_buffer(64)
    size = libc.syscall(L(250), L(11), L(key), data, L(64)) if key > 0 else -1  # READ
    report(sys.argv[2], read=data.raw[:size].decode() if size > 0 else None)
"""


def test_a_guest_reads_nothing_another_guest_left_in_its_user_keyring(
    account: Account,
) -> None:
    """S3 across guests: what one guest stores in the kernel's per-user keyring
    must not reach another guest (nor any other process of uid 65534). As root
    every guest is uid 65534 and would share one keyring: the seccomp filter
    refuses the keyring calls, so nothing is stored at all."""
    with (
        fifos(account, "put", "get") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        box = Fifo(account.home / "shared" / "put-in", to_guest=True)
        try:
            served.launch(guest(KEYRING), "put", str(made["put"].path), str(box.path))
            put = made["put"].read()
            served.launch(guest(KEYRING), "get", str(made["get"].path))
            got = made["get"].read()
        finally:
            with contextlib.suppress(OSError):
                box.send(go=True)
            box.close()
    assert put == {"key": -1, "errno": errno.EPERM}, put
    assert got == {"read": None}


#: "hog": takes every inotify instance its uid may have, reports, holds them
#: until told. "try": reports whether it can still get one.
INOTIFY = r"""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
if sys.argv[1] == "hog":
    box = inbox(sys.argv[3])
    held = 0
    while held < 65536 and libc.inotify_init() >= 0:
        held += 1
    report(sys.argv[2], held=held, errno=ctypes.get_errno())
    receive(box)
else:
    fd = libc.inotify_init()
    report(sys.argv[2], got=fd >= 0, errno=0 if fd >= 0 else ctypes.get_errno())
"""


@pytest.mark.xfail(
    strict=True,
    reason="S9 cross-guest denial: per-uid kernel quotas (inotify instances here; also "
    "pipe-user-pages, RLIMIT_NPROC, RLIMIT_SIGPENDING, key quotas) are shared by every "
    "guest, as all are uid 65534 outside (unprivileged: also the supervisor's own uid)",
)
def test_a_guest_cannot_take_a_per_user_kernel_quota_from_other_guests(
    account: Account,
) -> None:
    """S9: one guest holds all the inotify instances it can get; a second guest
    (another sandbox, another invocation) must still get one."""
    with (
        fifos(account, "hog", "try") as made,
        serving(account, sandbox=shared_plan(account)) as served,
    ):
        box = Fifo(account.home / "shared" / "hog-in", to_guest=True)
        try:
            served.launch(guest(INOTIFY), "hog", str(made["hog"].path), str(box.path))
            hog = made["hog"].read()
            served.launch(guest(INOTIFY), "try", str(made["try"].path))
            tried = made["try"].read()
        finally:
            with contextlib.suppress(OSError):
                box.send(go=True)
            box.close()
    assert hog["errno"] == errno.EMFILE, hog
    assert tried == {"got": True, "errno": 0}, (hog, tried)
