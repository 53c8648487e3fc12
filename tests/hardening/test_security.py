"""The security matrix (docs/security.md): each attack, with a real guest and real sockets.

SPEC §4.1's own identity checks are covered one by one in
tests/channel/test_identity.py; this module adds the attacks around them:
credentials carried across invocations and executions, symlinks planted
where the supervisor puts its sockets, guests reaching for the admin
socket by every way a process can leave its tree, and a scan for the
credential everywhere it must not be.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from supervisor import Supervisor
from supervisor.admin_client import AdminClient
from supervisor.sandbox import SandboxPolicy
from tests.harness import (
    STEP_TIMEOUT_S,
    Ledger,
    billing_plan,
    driven_guest,
    identity_headers,
    raw_request,
    wait_until,
)

CHARGE = {"account": "acct_1", "cents": 5}


def call_body(call_id: str) -> dict[str, Any]:
    return {"call_id": call_id, "tool": "charge", "args": CHARGE}


# -- credentials carried across invocations and executions ------------------------


async def test_a_credential_of_one_invocation_is_refused_with_another_invocations_identity(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan) as a, driven_guest(sup, plan) as b:
        a_credential = await a.credential()
        b_headers = identity_headers(b.execution, await b.credential())
        # B's guest presents A's credential under B's execution, then under
        # A's execution with B's invocation: both are unauthenticated.
        with_b_execution = await b.request(
            body=call_body("x1"), headers={**b_headers, "Authorization": f"Bearer {a_credential}"}
        )
        with_b_invocation = await b.request(
            body=call_body("x2"),
            headers={
                **identity_headers(a.execution, a_credential),
                "Hostcall-Invocation": b.execution.invocation_id,
            },
        )
        # All of A's identity from B's guest: A is live, but B is not A's tree.
        all_of_a = await b.request(
            body=call_body("x3"), headers=identity_headers(a.execution, a_credential)
        )
        records = [await sup.store.calls(g.execution.invocation_id) for g in (a, b)]
    assert (with_b_execution["status"], with_b_execution["body"]["error"]["code"]) == (
        401,
        "unauthenticated",
    )
    assert (with_b_invocation["status"], with_b_invocation["body"]["error"]["code"]) == (
        401,
        "unauthenticated",
    )
    assert (all_of_a["status"], all_of_a["body"]["error"]["code"]) == (403, "origin_denied")
    assert records == [[], []]
    assert ledger.runs == {}


async def test_a_fenced_executions_credential_replayed_by_the_new_executions_guest_is_fenced(
    sup: Supervisor, ledger: Ledger
) -> None:
    plan = billing_plan(ledger)
    async with driven_guest(sup, plan, invocation_id="inv_replay") as old:
        old_headers = identity_headers(old.execution, await old.credential())
        async with driven_guest(sup, plan, invocation_id="inv_replay") as new:
            new_headers = identity_headers(new.execution, await new.credential())
            replayed = await new.request(body=call_body("r1"), headers=old_headers)
            # The old credential with the new execution's id: not its credential.
            spliced = await new.request(
                body=call_body("r2"),
                headers={**new_headers, "Authorization": old_headers["Authorization"]},
            )
            own = await new.call("r4", "charge", CHARGE)
            # The old guest itself does not run on to try: fencing ended it (S5).
            await wait_until(lambda: old.execution.outcome is not None, "the old one stopped")
    assert (replayed["status"], replayed["body"]["error"]["code"]) == (403, "execution_fenced")
    assert (spliced["status"], spliced["body"]["error"]["code"]) == (401, "unauthenticated")
    assert old.execution.outcome is not None
    assert old.execution.outcome.reason == "fenced"
    assert own["status"] == 200
    assert ledger.runs == {"charge": 1}


async def test_a_process_of_another_uid_cannot_even_connect_to_the_channel(
    ledger: Ledger,
) -> None:
    """The socket's modes (a ``0700`` directory, a ``0600`` file) keep other
    users out before any check runs. The state dir sits in a directory every
    user may traverse, so that only those modes stand in the way."""
    open_dir = Path(tempfile.mkdtemp(prefix="hcsec-"))
    try:
        os.chmod(open_dir, 0o755)
        async with Supervisor(open_dir / "state") as sup:
            if os.getuid() != 0:
                # Becoming uid 65534 needs root (CI runs as root): the modes, then.
                modes = (mode_of(sup.socket_path.parent), mode_of(sup.socket_path))
                assert modes == (0o700, 0o600)
                return
            code = (
                "import os, socket, sys\n"
                "os.setgid(65534); os.setuid(65534)\n"
                "os.stat(os.path.dirname(os.path.dirname(sys.argv[1])))  # reachable\n"
                "s = socket.socket(socket.AF_UNIX)\n"
                "try:\n"
                "    s.connect(sys.argv[1]); print('connected')\n"
                "except PermissionError:\n"
                "    print('denied')\n"
            )
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, str(sup.socket_path), stdout=asyncio.subprocess.PIPE
            )
            async with asyncio.timeout(STEP_TIMEOUT_S):
                out, _ = await process.communicate()
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)
    assert out.decode().strip() == "denied"


# -- symlinks where the supervisor puts its sockets ---------------------------------------


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def test_a_socket_dir_replaced_by_a_symlink_is_never_followed(tmp_path: Path) -> None:
    """``run/`` is a symlink to someone else's directory when the supervisor starts:
    it must refuse, or put a real directory in its place - never chmod the other
    directory or bind its socket there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chmod(elsewhere, 0o755)
    (elsewhere / "theirs.txt").write_text("theirs")
    state = tmp_path / "state"
    state.mkdir()
    (state / "run").symlink_to(elsewhere, target_is_directory=True)
    facts: tuple[bool, Path, int, list[str]] | None = None
    try:
        async with Supervisor(state) as sup:
            socket_dir = sup.socket_path.parent
            facts = (
                socket_dir.is_symlink(),
                socket_dir.resolve(),
                mode_of(socket_dir),
                sorted(os.listdir(elsewhere)),
            )
    except Exception:  # boundary: refusing to start, with any error, is a safe answer
        pass
    if facts is not None:
        is_symlink, resolved, mode, in_elsewhere_while_running = facts
        assert not is_symlink
        assert resolved != elsewhere.resolve()
        assert mode == 0o700
        assert in_elsewhere_while_running == ["theirs.txt"]
    assert mode_of(elsewhere) == 0o755
    assert sorted(os.listdir(elsewhere)) == ["theirs.txt"]


@pytest.mark.parametrize("where", ["run/channel.sock", "admin.sock"])
async def test_a_symlink_planted_at_a_socket_path_is_replaced_and_its_target_untouched(
    tmp_path: Path, ledger: Ledger, where: str
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True, mode=0o700)
    (state / where).symlink_to(victim)
    async with Supervisor(state) as sup, driven_guest(sup, billing_plan(ledger)) as guest:
        planted = state / where
        is_socket = stat.S_ISSOCK(os.lstat(planted).st_mode)
        planted_mode = stat.S_IMODE(os.lstat(planted).st_mode)
        reply = await guest.call("c1", "lookup", {"account": "a"})
    assert is_socket
    assert planted_mode == 0o600
    assert reply["status"] == 200
    assert victim.read_text() == "precious"
    assert mode_of(victim) == 0o644


async def test_a_socket_dir_that_existed_with_0755_is_made_0700(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "run").mkdir(parents=True)
    os.chmod(state / "run", 0o755)
    async with Supervisor(state) as sup:
        socket_dir_mode = mode_of(sup.socket_path.parent)
        socket_mode = stat.S_IMODE(os.lstat(sup.socket_path).st_mode)
        admin_mode = stat.S_IMODE(os.lstat(state / "admin.sock").st_mode)
    assert (socket_dir_mode, socket_mode, admin_mode) == (0o700, 0o600, 0o600)


async def test_a_symlink_planted_at_the_lock_file_does_not_clobber_its_target(
    tmp_path: Path,
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    state = tmp_path / "state"
    state.mkdir()
    (state / "lock").symlink_to(victim)
    try:
        async with Supervisor(state):
            pass
    except Exception:  # boundary: refusing to start, with any error, is a safe answer
        pass
    assert victim.read_text() == "precious"


# -- guests reaching for the admin socket ------------------------------------------------

#: An admin client in one string: it lists waiting proposals and approves each,
#: then writes what it got to argv[2] (renamed into place, so it appears whole).
ADMIN_CLIENT = r"""
import http.client, json, os, socket, sys
admin, out = sys.argv[1], sys.argv[2]

def request(method, path):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    try:
        sock.connect(admin)
        conn = http.client.HTTPConnection("admin")
        conn.sock = sock
        conn.request(method, path, b"{}" if method == "POST" else None,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        return [response.status, json.loads(response.read())]
    except OSError as exc:
        return [None, repr(exc)]
    finally:
        sock.close()

results = [request("GET", "/v1/approvals?state=waiting")]
waiting = results[0][1] if results[0][0] == 200 else [{"id": "prop_unknown"}]
for proposal in waiting:
    results.append(request("POST", "/v1/approvals/%s/approve" % proposal["id"]))
with open(out + ".tmp", "w") as f:
    json.dump(results, f)
os.rename(out + ".tmp", out)
"""

#: A guest that makes a call needing approval, waits until it is waiting, then
#: runs ADMIN_CLIENT as argv[1] says: in its own process, as a grandchild with
#: an empty environment (env -i), or as a double-forked daemon that exec's with
#: an empty environment once it has been orphaned.
ATTACKER = r"""
import http.client, json, os, socket, subprocess, sys, threading, time
how, admin, out, client = sys.argv[1:5]
with os.fdopen(int(os.environ["HOSTCALL_CREDENTIAL_FD"]), "rb") as f:
    credential = f.read().decode()
identity = {
    "Authorization": "Bearer " + credential,
    "Hostcall-Invocation": os.environ["HOSTCALL_INVOCATION"],
    "Hostcall-Execution": os.environ["HOSTCALL_EXECUTION"],
    "Hostcall-Plan": os.environ["HOSTCALL_PLAN"],
    "Content-Type": "application/json",
}

def channel(method, path, body=None):
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(os.environ["HOSTCALL_SOCKET"])
    conn = http.client.HTTPConnection("hostcall")
    conn.sock = sock
    conn.request(method, path, json.dumps(body) if body else None, identity)
    status = conn.getresponse().status
    sock.close()
    return status

body = {"call_id": "c1", "tool": "charge", "args": {"account": "acct_1", "cents": 5}}
call = threading.Thread(target=channel, args=("POST", "/v1/calls", body), daemon=True)
call.start()
deadline = time.monotonic() + 30
while channel("GET", "/v1/calls/c1") != 202 and time.monotonic() < deadline:
    time.sleep(0.01)
argv = [sys.executable, "-c", client, admin, out]
if how == "self":
    sys.argv = argv[2:]
    exec(client, {"__name__": "__main__"})
elif how == "grandchild_env_i":
    subprocess.run(["env", "-i", *argv], check=True)
elif how == "daemon":
    parent = os.fork()
    if parent == 0:
        os.setsid()
        middle = os.getpid()
        if os.fork() == 0:
            while os.getppid() == middle:  # until orphaned
                time.sleep(0.001)
            os.execve(sys.executable, argv, {})
        os._exit(0)
    os.waitpid(parent, 0)
deadline = time.monotonic() + 10
while not os.path.exists(out) and time.monotonic() < deadline:
    time.sleep(0.01)
try:  # a daemon ended before it could ask anything: say so, unless it did
    with open(out, "x") as f:
        json.dump([[None, "the attacker was ended before it got an answer"]], f)
except FileExistsError:
    pass
call.join(60)
"""


@pytest.fixture
async def gated(tmp_path: Path) -> AsyncIterator[Supervisor]:
    """Unsandboxed: the guest is our uid and can name the admin socket, so these
    tests show the admin API's own check (a sandboxed guest cannot even reach
    the socket: tests/hardening/test_sandbox.py)."""
    async with Supervisor(tmp_path / "state", sandbox=False) as supervisor:
        yield supervisor


@pytest.mark.parametrize("how", ["self", "grandchild_env_i", "daemon"])
async def test_no_process_of_a_guest_tree_can_use_the_admin_socket_to_approve_its_call(
    gated: Supervisor, ledger: Ledger, tmp_path: Path, how: str
) -> None:
    plan = billing_plan(ledger, require_approval_for_irreversible=True)
    out = tmp_path / "attack.json"
    argv = [
        sys.executable,
        "-c",
        ATTACKER,
        how,
        str(gated.state.path / "admin.sock"),
        str(out),
        ADMIN_CLIENT,
    ]
    run = asyncio.create_task(gated.run(plan, argv, timeout_s=STEP_TIMEOUT_S))
    try:
        await wait_until(lambda: out.exists() or run.done(), "the attack's results")
        assert out.exists(), run.result()
        results = json.loads(out.read_text())
        states = [p.state for p in gated.approvals.list()]
    finally:
        for proposal in gated.approvals.list(state="waiting"):
            gated.approvals.reject(proposal.id)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            await run
    assert results, "the attacker made no request"
    for status, body in results:
        # Refused - or ended by the supervisor before it could ask.
        assert status in (403, None), results
        if status == 403:
            assert body["error"]["code"] == "origin_denied"
    assert states == ["waiting"]
    assert ledger.runs == {}


async def test_the_operator_still_reaches_the_admin_socket(gated: Supervisor) -> None:
    """The other side of the admin tests above: a process outside every guest tree."""
    answer = await asyncio.to_thread(
        AdminClient(gated.state.path).request, "GET", "/v1/approvals", None
    )
    assert answer == []


#: A guest that leaves a daemon behind: fork, setsid, fork, the middle exits,
#: and the orphan exec's itself with an empty environment (no HOSTCALL_*
#: marker), writes its pid to argv[1] and sleeps. The guest exits once the
#: pid is written.
DAEMON_GUEST = r"""
import os, sys, time
out = sys.argv[1]
if os.fork() == 0:
    os.setsid()
    middle = os.getpid()
    if os.fork() == 0:
        while os.getppid() == middle:
            time.sleep(0.001)
        code = "import os, sys, time; open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); " \
               "os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(120)"
        os.execve(sys.executable, [sys.executable, "-c", code, out], {})
    os._exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(out) and time.monotonic() < deadline:
    time.sleep(0.01)
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_a_double_forked_daemon_with_a_scrubbed_environment_does_not_outlive_its_guest(
    tmp_path: Path, ledger: Ledger
) -> None:
    """SPEC §3: every process of the guest's tree is ended when the guest exits —
    unsandboxed, where the tree can leave its session (in a sandbox it cannot
    leave its pid namespace: tests/hardening/test_sandbox.py)."""
    out = tmp_path / "daemon.pid"
    pid = None
    try:
        async with Supervisor(tmp_path / "state", stop_grace_s=0.5, sandbox=False) as sup:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                outcome = await sup.run(
                    billing_plan(ledger), [sys.executable, "-c", DAEMON_GUEST, str(out)]
                )
            pid = int(out.read_text())
            # Bounded by the grace period and a few sampling rounds, not STEP_TIMEOUT_S.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3.0
            while alive(pid) and loop.time() < deadline:
                await asyncio.sleep(0.05)
            survived_its_guest = alive(pid)
        survived_the_supervisor = alive(pid)
    finally:
        if pid is not None and alive(pid):
            os.kill(pid, 9)
    assert outcome.exit_status == 0
    assert not survived_its_guest
    assert not survived_the_supervisor


# -- the credential is nowhere it must not be ---------------------------------------------

#: A guest that prints its own credential (and hands it to the test through a
#: file outside the state dir, since its printed copy is redacted), makes a call
#: with it and exits.
PRINTER = r"""
import http.client, json, os, socket, sys
credential = os.read(int(os.environ["HOSTCALL_CREDENTIAL_FD"]), 100).decode()
with open(sys.argv[1], "w") as f:
    f.write(credential)
print("my credential is", credential, flush=True)
print("and again:" + credential, file=sys.stderr, flush=True)
sock = socket.socket(socket.AF_UNIX)
sock.connect(os.environ["HOSTCALL_SOCKET"])
conn = http.client.HTTPConnection("hostcall")
conn.sock = sock
conn.request("POST", "/v1/calls", json.dumps(
    {"call_id": "p1", "tool": "broken", "args": {"x": 1}}), {
    "Authorization": "Bearer " + credential,
    "Hostcall-Invocation": os.environ["HOSTCALL_INVOCATION"],
    "Hostcall-Execution": os.environ["HOSTCALL_EXECUTION"],
    "Hostcall-Plan": os.environ["HOSTCALL_PLAN"],
    "Content-Type": "application/json"})
print(conn.getresponse().read().decode(), flush=True)
"""


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink()]


def containing(needle: bytes, paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        try:
            if needle in path.read_bytes():
                found.append(str(path))
        except OSError:
            pass  # a socket, or a file removed while we looked
    return found


async def test_the_credential_is_in_no_file_log_environment_argv_or_answer(
    tmp_path: Path,
    ledger: Ledger,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level("DEBUG")
    state = tmp_path / "state"
    shared = tmp_path / "shared"  # where the printer hands its credential over
    plan = billing_plan(ledger, sandbox=SandboxPolicy(read_write=(shared,)))
    ledger.release.set()
    answers: list[Any] = []
    async with Supervisor(state) as sup:
        async with driven_guest(sup, plan) as guest:
            credential = await guest.credential()
            # Calls of every outcome: executed, replayed, refused, tool error,
            # invalid result, ambiguous, and identity failures of each kind.
            for call_id, tool, args in [
                ("c1", "charge", CHARGE),
                ("c1", "charge", CHARGE),
                ("c1", "charge", {"account": "other", "cents": 1}),
                ("c2", "broken", {"x": 1}),
                ("c3", "bad_result", {}),
                ("c4", "flaky_send", {"to": "a@b"}),
                ("c5", "nope", {}),
                ("c6", "charge", {"account": "", "cents": 1}),
            ]:
                answers.append(await guest.call(call_id, tool, args))
            answers.append(await guest.request(method="GET", path="/v1/calls/c4"))
            answers.append(await guest.request(method="GET", path="/v1/plan"))
            answers.append(await guest.request(raw="{not json"))
            answers.append(
                await guest.request(
                    body=call_body("c7"), headers={"Hostcall-Plan": "sha256:" + "0" * 64}
                )
            )
            answers.append(
                await guest.request(
                    body=call_body("c8"), headers={"Hostcall-Invocation": "inv_other"}
                )
            )
            # From outside the tree, with the real credential: origin_denied.
            headers = identity_headers(guest.execution, credential)
            answers.append(
                await asyncio.to_thread(
                    raw_request, str(sup.socket_path), "GET", "/v1/plan", headers
                )
            )
            guest_pid = guest.execution.guest_pid
            guest_proc = [
                Path(f"/proc/{guest_pid}/environ").read_bytes(),
                Path(f"/proc/{guest_pid}/cmdline").read_bytes(),
            ]
            invocation = guest.execution.invocation_id
        admin = AdminClient(state)
        for path in ("/v1/invocations", f"/v1/invocations/{invocation}/calls", "/v1/approvals"):
            answers.append(await asyncio.to_thread(admin.request, "GET", path, None))
        metrics = str(await asyncio.to_thread(admin.request, "GET", "/metrics", None))
        printed_to = shared / "printed_credential"
        async with asyncio.timeout(STEP_TIMEOUT_S):
            printer = await sup.run(plan, [sys.executable, "-c", PRINTER, str(printed_to)])
        printed = printed_to.read_text()
        own_proc = [
            # Not /proc/self/environ: the environment this process started
            # with (what putenv adds is not there), and, the supervisor not
            # being dumpable, root's to read.
            b"\0".join(key + b"=" + value for key, value in os.environb.items()),
            Path("/proc/self/cmdline").read_bytes(),
        ]
        files_while_running = files_under(state)
        found_while_running = {
            secret: containing(secret.encode(), files_while_running)
            for secret in (credential, printed)
        }
    files_after = files_under(state)
    seen = capfd.readouterr()
    logs = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    answer_text = json.dumps(answers) + metrics
    assert printer.exit_status == 0
    assert len(credential) == len(printed) == 43
    # The scan does find the secret where it is: the file the printer wrote.
    assert containing(printed.encode(), [printed_to]) == [str(printed_to)]
    for secret in (credential, printed):
        assert found_while_running[secret] == []
        assert containing(secret.encode(), files_after) == []
        assert secret not in logs
        assert secret not in answer_text
        assert secret not in seen.out + seen.err
        for blob in (*guest_proc, *own_proc):
            assert secret.encode() not in blob
    # What was scanned is what SPEC §3 and §8 promise to keep the secret out of.
    names = {p.name for p in files_after}
    assert "effects.db" in names
    assert any(p.suffix == ".jsonl" for p in files_after)
    assert any(p.name.endswith(".stdout.log") for p in files_after)
    stdout_log = next(p for p in files_after if p.name == f"{printer.execution_id}.stdout.log")
    stderr_log = next(p for p in files_after if p.name == f"{printer.execution_id}.stderr.log")
    assert "my credential is [hostcall: credential redacted]" in stdout_log.read_text()
    assert "and again:[hostcall: credential redacted]" in stderr_log.read_text()
    assert "[hostcall: credential redacted]" in seen.out
