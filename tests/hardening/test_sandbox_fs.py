"""SPEC §13 rows S1, S2, S7 and S8, mounted by hostile guests against the real
``hostcall run``, as root and as an unprivileged user (see
tests/hardening/sandbox_support.py; the machinery is in attack_support.py).

Every guest tries every route it knows and reports, as JSON, what it managed.
Each test asserts that nothing got through *and* that the defence is the one
the spec claims: the state dir and the hide list are absent (masked), not
merely closed by their mode; the host's files are unchanged; no listener of
the test received anything. Guests learn host paths from a hex-encoded
argument: an argument that names a path would be exposed to them, and would
name the state dir in their argv.

The attacks that succeed today are kept as strict expected failures whose
reason names the route; they pass once the hole is closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sysconfig
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from supervisor.audit import SQLiteEffectsView, audit_receipts
from tests.hardening.attack_support import (
    Listeners,
    LiveRun,
    UnixListeners,
    fingerprint,
    guest_report,
    host_addresses,
    hostcall_run,
    in_new_network_namespace,
    inodes,
    own,
    sandbox_processes,
    stage_folder,
    write_plan,
)
from tests.hardening.sandbox_support import IS_ROOT, NOBODY, REPO, TOOLS, Account, account

__all__ = ["account"]  # the fixture, parametrized root / unprivileged

#: The uid of every guest, seen from outside: root drops its guests to it, and
#: the unprivileged supervisor of these tests is it.
#: The guests' uid: 65534 under root, the tests' own uid otherwise.
GUEST_UID = NOBODY if IS_ROOT else os.geteuid()
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])
#: What a refused write, mount or privileged call may fail with.
DENIED = ("EROFS", "EACCES", "EPERM", "EINVAL")


@pytest.fixture
def stage(account: Account) -> Iterator[Path]:
    """A folder outside /tmp, owned by the account, that the guest can see."""
    with stage_folder(account) as folder:
        yield folder


def overlaid(summary: dict[str, Any]) -> bool:
    """Whether the working directory was an overlay of the launch folder (skips
    the test when this host cannot give one: hostcall then gives a fresh one)."""
    workdir = summary["executions"][0]["sandbox"]["workdir"]
    if workdir != "overlay":
        pytest.skip(f"no overlay of the launch folder on this host (workdir {workdir!r})")
    return True


def xfail_if(request: pytest.FixtureRequest, condition: bool, reason: str) -> None:
    """Mark this test case an expected failure (strict) when ``condition`` holds."""
    if condition:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=reason))


# --------------------------------------------------------------------------
# S1: the state dir
# --------------------------------------------------------------------------

#: Makes two calls, attacks the state dir by every name it is given or can
#: make, scans every process it can see, then tries a third call (the plan
#: allows two: a store it could edit would let it through).
STATE_DIR_ATTACK = r"""
inv = os.environ["HOSTCALL_INVOCATION"]
calls = [call("echo", {"text": t}, "call-" + t) for t in ("one", "two")]
secrets = CONFIG["secrets"]  # the state dir's path as given, and its real path
aliases = CONFIG["aliases"]  # names of the state dir: must show its mask
# ... and the private socket folders it finds (a state dir too long for sun_path)
discovered = [os.path.join(d, n) for d in CONFIG["discover"] for n in os.listdir(d)]
aliases += discovered
routes = CONFIG["routes"]  # indirect routes: must reach nothing
links = []  # its own symlinks to the state dir, in its workdir and its /tmp
for where in (".", "/tmp"):
    for n, target in enumerate(secrets):
        if outcome(os.symlink, target, f"{where}/to-state-{n}") == "ok":
            links.append(f"{where}/to-state-{n}")
entries = ["effects.db", "effects.db-wal", "effects.db-shm", "lock", "receipts",
           f"receipts/{inv}.jsonl", "logs", f"logs/{inv}", "admin.sock", "run",
           "run/channel.sock", "channel.sock"]
def listing(path):
    if not os.listdir(path):
        raise FileNotFoundError(errno.ENOENT, "empty")
def write(path):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
    try:
        os.write(fd, b"\n")
    finally:
        os.close(fd)
def rename(path):
    os.rename(path, path + ".moved")
    os.rename(path + ".moved", path)
def connect(path):
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
attacks = {
    "list": listing, "read": peek, "write": write, "rename": rename, "connect": connect,
    "create": lambda p: os.close(os.open(p + ".planted", os.O_WRONLY | os.O_CREAT | os.O_EXCL)),
    "mkdir": lambda p: os.mkdir(p + ".dir"),
    "unlink": lambda p: (os.rmdir if os.path.isdir(p) else os.unlink)(p),
    "chmod": lambda p: os.chmod(p, 0o777),
    "link": lambda p: os.link(p, p + ".hard"),
    "symlink": lambda p: os.symlink("/", p + ".lnk"),
}
reached, shown = [], {}
for base in aliases + routes + links:
    shown[base] = outcome(listing, base)
    for name in ("rename", "unlink", "chmod"):  # the mask itself stays put
        if base not in links and outcome(attacks[name], base) == "ok":
            reached.append(f"{name} {base}")
    for entry in entries:
        path = os.path.join(base, entry)
        reached += [f"{n} {path}" for n, a in attacks.items() if outcome(a, path) == "ok"]
# Every process it can see: does any name the state dir; what files are open.
named, descriptors = [], []
for pid in filter(str.isdigit, os.listdir("/proc")):
    for what in ("cmdline", "environ"):
        try:
            with open(f"/proc/{pid}/{what}", "rb") as f:
                data = f.read()
        except OSError:
            continue
        named += [f"{pid} {what}" for s in secrets if s.encode() in data]
    for what in ("cwd", "root", "exe"):
        try:
            target = os.readlink(f"/proc/{pid}/{what}")
        except OSError:
            continue
        named += [f"{pid} {what} {target}" for s in secrets if s in target]
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            target, st = os.readlink(path), os.stat(path)
        except OSError:
            continue
        named += [f"{pid} fd {fd} {target}" for s in secrets if s in target]
        descriptors.append([st.st_dev, st.st_ino, f"{pid}/{fd} {target}"])
third = call("echo", {"text": "three"}, "call-three")
report(calls=calls, third=third, reached=reached, shown=shown, named=named,
       descriptors=descriptors, discovered=discovered)
"""


@dataclass
class StateLayout:
    """Where the state dir is, seen from the host and named by the guest."""

    cwd: Path
    plan: Path
    #: ``--state-dir`` (None: the default ``./.hostcall`` of ``cwd``).
    given: Path | None
    real: Path
    #: Names of the state dir, which must show its mask (an empty folder) or nothing.
    aliases: list[str] = field(default_factory=list)
    #: Other ways to it, which must reach nothing.
    routes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: A folder whose entries are named at run time (the private socket folder's parent).
    discover: list[str] = field(default_factory=list)


def _state_layout(name: str, account: Account, stage: Path) -> StateLayout:
    budget = "max_calls = 2"
    if name == "launch-folder":
        # The default ./.hostcall: the working directory is an overlay of the
        # launch folder, which holds the state dir.
        real = stage / ".hostcall"
        return StateLayout(
            cwd=stage,
            plan=write_plan(account, stage / "plan", plan=budget),
            given=None,
            real=real,
            aliases=[
                str(real),
                ".hostcall",
                f"../{stage.name}/.hostcall",
                f"{stage}//.hostcall",
                f"{stage}/plan/../.hostcall",
            ],
            routes=[
                "/proc/self/cwd/.hostcall",
                "/proc/1/cwd/.hostcall",
                f"/proc/1/root{real}",
                f"/proc/self/root{real}",
            ],
            # A variable of the operator's that names the state dir is not passed on.
            env={"OPERATOR_STATE": str(real)},
        )
    if name == "read-only-folder":
        # The plan shows the folder that holds the state dir, read-only, and
        # --state-dir names it through a symlink in that folder, too long a
        # path for the sockets: they move to a private folder in
        # $XDG_RUNTIME_DIR, which is in the guest's view as well.
        real = stage / "state"
        real.mkdir(mode=0o700)
        own(real, account)
        link = stage / ("state-link-" + "x" * 80)
        link.symlink_to(real.name)
        runtime = stage / "runtime"
        runtime.mkdir(mode=0o755)
        own(runtime, account)
        sandbox = f'read_only = ["{stage}"]\n'
        return StateLayout(
            cwd=account.home,
            plan=write_plan(account, account.home / "plan", sandbox, budget),
            given=link,
            real=real,
            aliases=[str(real), f"{stage}/./state"],
            routes=[str(link), f"/proc/self/root{real}", f"/proc/1/root{real}"],
            env={"XDG_RUNTIME_DIR": str(runtime)},
            discover=[str(runtime)],
        )
    assert name == "read-only-symlink", name
    # The spec's own example, read_only = ["/tmp/inputs"], with /tmp/inputs a
    # symlink to the folder that holds the state dir: bubblewrap mounts the
    # target at the symlink's place, inside the private /tmp.
    inputs = account.home / "inputs"
    inputs.symlink_to(account.home)
    real = account.home / "state"
    return StateLayout(
        cwd=account.home,
        plan=write_plan(account, account.home / "plan", f'read_only = ["{inputs}"]\n', budget),
        given=real,
        real=real,
        aliases=[str(inputs / "state"), str(real)],
        routes=[f"/proc/self/root{inputs}/state"],
    )


@pytest.mark.parametrize("layout", ["launch-folder", "read-only-folder", "read-only-symlink"])
def test_a_guest_cannot_read_list_or_change_the_state_dir_by_any_path(
    account: Account, stage: Path, layout: str, request: pytest.FixtureRequest
) -> None:
    where = _state_layout(layout, account, stage)
    secrets = sorted({str(where.real), str(where.given or where.real)})
    config = {
        "secrets": secrets,
        "aliases": where.aliases,
        "routes": where.routes,
        "discover": where.discover,
    }
    done, summary = hostcall_run(
        account,
        STATE_DIR_ATTACK,
        config,
        cwd=where.cwd,
        plan=where.plan,
        state_dir=where.given,
        env=account.env(**where.env),
    )
    found = guest_report(done)
    assert done.returncode == 0, done.stderr[-3000:]
    workdir = summary["executions"][0]["sandbox"]["workdir"]
    # (The launch folder may also be shown as a fresh folder where overlays
    # are not allowed: the state dir is then in view at its own path only.)
    assert workdir == "fresh" or (layout == "launch-folder" and workdir == "overlay")

    # Nothing reached: no list, read, write, create, rename, unlink, chmod,
    # link or connect, by any name or route.
    assert found["reached"] == [], found["reached"]
    # The defence is absence, not the folder's mode: every name of the state
    # dir shows its mask (an empty folder) or nothing.
    aliases = where.aliases + found["discovered"]
    assert {a: found["shown"][a] for a in aliases} == dict.fromkeys(aliases, "ENOENT"), found
    assert len(found["discovered"]) == len(where.discover)  # the private socket folder
    # No process it can see names the state dir (mount points excepted) ...
    assert found["named"] == [], found["named"]
    # ... or holds a descriptor of anything in it.
    on_host = inodes(where.real)
    held = [d[2] for d in found["descriptors"] if (d[0], d[1]) in on_host]
    assert held == [], held

    # The store and the receipts are the supervisor's alone: the budget held
    # (the third call is refused), the chain is intact and agrees with the store.
    assert [status for status, _ in found["calls"]] == [200, 200], found["calls"]
    status, body = found["third"]
    assert (status, body["error"]["code"]) == (429, "budget_exhausted"), found["third"]
    receipts = where.real / "receipts" / f"{summary['invocation_id']}.jsonl"
    assert list((where.real / "receipts").iterdir()) == [receipts]
    # What `hostcall receipts verify --state-dir` runs (SQLite opened read-only).
    audit = audit_receipts(receipts, effects=SQLiteEffectsView(where.real / "effects.db"))
    assert audit.ok and audit.receipts == 3, audit.lines()  # two executed, one refused
    # Nothing was planted in it, and the supervisor's 0700/0600 still hold.
    for path in [where.real, *where.real.rglob("*")]:
        assert not path.name.endswith((".planted", ".dir", ".moved", ".hard", ".lnk")), path
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        if path.is_dir() and not path.is_symlink():
            assert mode == 0o700, (path, oct(mode))
        elif path.is_file():
            assert mode == 0o600, (path, oct(mode))


#: Looks at every descriptor it holds beyond its stdio and its credential, and
#: through those that are folders tries the state dir, a hidden file and a write.
INHERITED_FDS_ATTACK = r"""
def listing(path):
    if not os.listdir(path):
        raise FileNotFoundError(errno.ENOENT, "empty")
credential = os.environ["HOSTCALL_CREDENTIAL_FD"]
held, reached = {}, []
for fd in os.listdir("/proc/self/fd"):
    path = f"/proc/self/fd/{fd}"
    try:
        target = os.readlink(path)
    except OSError:
        continue  # the descriptor of this very listing
    if fd in ("0", "1", "2", credential) or target.startswith(("socket:", "pipe:", "/dev/")):
        continue
    held[fd] = target
    if os.path.isdir(path):
        for name, attempt in {
            "list the state dir": lambda: listing(f"{path}/.hostcall"),
            "read the store": lambda: peek(f"{path}/.hostcall/effects.db"),
            "read a hidden file": lambda: peek(f"{path}/hidden/secret.txt"),
            "write the launch folder": lambda: open(f"{path}/planted-by-guest", "x").close(),
        }.items():
            if outcome(attempt) == "ok":
                reached.append(f"{name} through fd {fd} ({target})")
report(held=held, reached=reached)
"""


def test_a_descriptor_hostcall_inherits_never_reaches_its_guest(
    account: Account, stage: Path, request: pytest.FixtureRequest
) -> None:
    """Whoever starts ``hostcall run`` may leave descriptors open (a shell's
    redirection, a CI runner, a make jobserver, a program's pass_fds). A folder
    descriptor in the guest would be a door out of its mount namespace: path
    lookups through ``/proc/self/fd/N`` happen in the host's mounts, where no
    mask and no read-only bind exist."""
    hidden = stage / "hidden"
    hidden.mkdir()
    (hidden / "secret.txt").write_text("hidden\n")
    (hidden / "secret.txt").chmod(0o644)
    own(hidden / "secret.txt", account)
    plan = write_plan(account, account.home / "plan", f'hide = ["{hidden}"]\n')
    folder = os.open(stage, os.O_RDONLY | os.O_DIRECTORY)  # inheritable (no O_CLOEXEC)
    os.set_inheritable(folder, True)
    try:
        done, _ = hostcall_run(
            account, INHERITED_FDS_ATTACK, cwd=stage, plan=plan, pass_fds=[folder]
        )
    finally:
        os.close(folder)
    found = guest_report(done)
    assert done.returncode == 0, done.stderr[-3000:]
    assert found["reached"] == [], found
    assert not (stage / "planted-by-guest").exists()
    # The guest holds nothing but its stdio and its credential.
    assert found["held"] == {}, found


#: Lists its private folders and what an earlier attempt left, leaves a mark
#: in its working directory and its /tmp, and fails: --attempts 2 runs it again.
WORKDIR_PROBE = r"""
execution = os.environ["HOSTCALL_EXECUTION"]
private = {d: sorted(os.listdir(d)) for d in ("/tmp", "/var/tmp", "/dev/shm", "/run")}
here = sorted(os.listdir("."))
marks = {d: outcome(lambda: open(f"{d}/left-by-{execution}", "x").close()) for d in (".", "/tmp")}
report(execution=execution, cwd=os.getcwd(), private=private, here=here, marks=marks)
sys.exit(3)
"""


@pytest.mark.parametrize("workdir", ["fresh", "overlay"])
def test_each_execution_gets_an_empty_private_tmp_and_a_fresh_writable_workdir(
    account: Account, stage: Path, workdir: str
) -> None:
    """Fresh: the launch folder is in the host's /tmp, which the guest never
    sees. Overlay: the launch folder is shown, writes stay in the sandbox."""
    cwd = stage if workdir == "overlay" else account.home
    plan = write_plan(account, cwd / "plan")
    before = fingerprint(stage)
    planted = []  # host files in the folders the guest gets private ones of
    for folder in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(folder):
            fd, name = tempfile.mkstemp(prefix="hostcall-host-", dir=folder)
            os.close(fd)
            os.chmod(name, 0o644)
            planted.append(Path(name))
    try:
        done, summary = hostcall_run(
            account, WORKDIR_PROBE, cwd=cwd, plan=plan, extra=["--attempts", "2"]
        )
    finally:
        for path in planted:
            path.unlink()
    assert done.returncode == 3, done.stderr[-3000:]
    assert workdir == "fresh" or overlaid(summary)
    assert [e["sandbox"]["workdir"] for e in summary["executions"]] == [workdir, workdir]
    first, second = (json.loads(line) for line in done.stdout.splitlines())
    assert first["execution"] != second["execution"]
    for seen in (first, second):
        # Nothing of the host's temporary and runtime folders: empty, but for
        # hostcall's own /run/hostcall ...
        empty = {"/tmp": [], "/var/tmp": [], "/dev/shm": [], "/run": ["hostcall"]}
        assert seen["private"] == empty, seen["private"]
        # ... and a writable working directory ...
        assert seen["marks"] == {".": "ok", "/tmp": "ok"}
    # ... fresh for each execution: the second sees nothing the first left.
    assert not [n for n in second["here"] if n.startswith("left-by-")], second["here"]
    if workdir == "overlay":
        assert first["cwd"] == str(stage)
        assert {".hostcall", "plan"} <= set(first["here"])  # the launch folder, shown
        after = fingerprint(stage)
        # ... and never written through to the host (the state dir aside: the supervisor's).
        assert {k: v for k, v in after.items() if not k.startswith(".hostcall")} == {
            k: v for k, v in before.items() if not k.startswith(".hostcall")
        }
    else:
        assert first["cwd"] == second["cwd"] == "/run/hostcall/work"
    assert not list(Path("/tmp").glob("left-by-*"))


# --------------------------------------------------------------------------
# S2: the plan, its tools, what the supervisor imports; the hide list
# --------------------------------------------------------------------------

#: Tries to change the plan, its tools module and the places the supervisor
#: imports from, and to read what the plan hides by every name it can make.
TRUSTED_FILES_ATTACK = r"""
plan_dir, repo, site = CONFIG["plan_dir"], CONFIG["repo"], CONFIG["site"]
pyc = "attack_tools.cpython-%d%d.pyc" % sys.version_info[:2]
def append(path, data=b"# the guest was here\n"):
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
def create(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "x") as f:
        f.write("raise SystemExit('planted by the guest')\n")
plan_attempts = {
    "append plan.toml": lambda: append(f"{plan_dir}/plan.toml"),
    "append attack_tools.py": lambda: append(f"{plan_dir}/attack_tools.py"),
    "create a module beside the tools": lambda: create(f"{plan_dir}/planted_by_guest.py"),
    "create a package over the tools": lambda: create(f"{plan_dir}/attack_tools/__init__.py"),
    "create the tools' bytecode": lambda: create(f"{plan_dir}/__pycache__/{pyc}"),
    "rename attack_tools.py": lambda: os.rename(f"{plan_dir}/attack_tools.py", f"{plan_dir}/x"),
    "unlink plan.toml": lambda: os.unlink(f"{plan_dir}/plan.toml"),
    "chmod the plan's folder": lambda: os.chmod(plan_dir, 0o777),
}
# Opened for writing, nothing written: the repository is not damaged if this works.
host_attempts = {
    "open supervisor/__init__.py": lambda: append(f"{repo}/supervisor/__init__.py", b""),
    "create a supervisor module": lambda: create(f"{repo}/supervisor/planted_by_guest.py"),
    "create sitecustomize.py on sys.path": lambda: create(f"{repo}/sitecustomize.py"),
    "create a .pth in site-packages": lambda: create(f"{site}/zz_planted_by_guest.pth"),
}
results = {name: outcome(attempt) for name, attempt in {**plan_attempts, **host_attempts}.items()}
hidden = {}
for n, path in enumerate(CONFIG["hidden"]):
    link = f"/tmp/to-hidden-{n}"
    os.symlink(path, link)
    parent, name = os.path.split(path)
    for route in (path, f"{parent}/./{name}", f"/proc/self/root{path}", f"/proc/1/root{path}",
                  link):
        hidden[route] = absent(route)
report(results=results, plan_attempts=sorted(plan_attempts), hidden=hidden)
"""


@pytest.mark.parametrize("where", ["read-only-folder", "launch-folder"])
def test_a_guest_cannot_write_the_plan_its_tools_or_what_the_supervisor_imports(
    account: Account, stage: Path, where: str
) -> None:
    """The plan in a folder the guest sees read-only, or in the launch folder
    (the working directory is then an overlay of it: the guest may write there,
    nothing reaches the host). The hide list is absent either way."""
    plan_dir = stage / "plan"
    secret, keys, other = stage / "secret.txt", stage / "keys", stage / "other-secret.txt"
    secret.write_text("hidden\n")
    keys.mkdir()
    (keys / "id").write_text("key\n")
    other.write_text("hidden too\n")
    link = stage / "secret-link"  # the hide list names a symlink: its target is hidden
    link.symlink_to(other.name)
    for path in (secret, keys, keys / "id", other):
        path.chmod(0o755 if path.is_dir() else 0o644)  # only the mask keeps the guest out
        own(path, account)
    hide = json.dumps([str(secret), str(keys), str(link)])
    plan = write_plan(account, plan_dir, f"hide = {hide}\n")
    planted = [
        REPO / "supervisor" / "planted_by_guest.py",
        REPO / "sitecustomize.py",
        SITE_PACKAGES / "zz_planted_by_guest.pth",
    ]
    assert not [p for p in planted if p.exists()]
    package = (REPO / "supervisor" / "__init__.py").stat().st_mtime_ns
    before = fingerprint(plan_dir)
    config = {
        "plan_dir": str(plan_dir),
        "repo": str(REPO),
        "site": str(SITE_PACKAGES),
        "hidden": [str(secret), str(keys), str(keys / "id"), str(link), str(other)],
    }
    try:
        done, summary = hostcall_run(
            account,
            TRUSTED_FILES_ATTACK,
            config,
            cwd=stage if where == "launch-folder" else account.home,
            plan=plan,
            state_dir=account.home / "state",
        )
    finally:
        leftovers = [p for p in planted if p.exists()]
        for path in leftovers:
            path.unlink()
    found = guest_report(done)
    assert done.returncode == 0, done.stderr[-3000:]
    workdir = summary["executions"][0]["sandbox"]["workdir"]
    assert where == "read-only-folder" or overlaid(summary)
    assert workdir == ("overlay" if where == "launch-folder" else "fresh")
    results = found["results"]
    # Nothing the supervisor imports from was written or added to.
    assert leftovers == []
    assert (REPO / "supervisor" / "__init__.py").stat().st_mtime_ns == package
    host = {k: v for k, v in results.items() if k not in found["plan_attempts"]}
    assert {k: v for k, v in host.items() if v not in DENIED} == {}, host
    if where == "read-only-folder":
        plan_results = {k: results[k] for k in found["plan_attempts"]}
        assert {k: v for k, v in plan_results.items() if v not in DENIED} == {}, plan_results
    # Whatever the guest did inside, the plan's folder on the host is as it was.
    assert fingerprint(plan_dir) == before
    # The hide list is absent inside, not merely closed: by its name, through
    # the guest's own symlink, /proc/self/root and /proc/1/root; a symlink in
    # the list hides its target. (/proc/1 is bubblewrap's pid 1, root's when
    # the supervisor is root: closed to the guest altogether.)
    hidden = found["hidden"]
    assert {r: v for r, v in hidden.items() if v != "absent"} == {
        r: "EACCES" for r in hidden if r.startswith("/proc/1/") and account.root
    }, hidden


#: Never meant to run: its plan must be refused before any guest starts.
RAN = "report(ran=True)\n"

#: Writable paths that reach what the supervisor trusts, and the path the
#: refusal must name (relative paths are the plan folder's: BASE/plan).
REFUSED = {
    "the tools module": ('read_write = ["./attack_tools.py"]', "{base}/plan/attack_tools.py"),
    "a symlink to the state dir": ('read_write = ["{base}/state-link"]', "{base}/state-link"),
    "a folder that holds the state dir": ('workdir = ".."', "{base}"),
    "a folder on the supervisor's sys.path": ('read_write = ["{repo}"]', "{repo}"),
}


def _refusal(account: Account, n: int, route: str) -> tuple[str, subprocess.CompletedProcess[str]]:
    """``hostcall run`` of a plan with the route's [sandbox] line, in a folder of its own."""
    base = account.folder(f"route-{n}")
    line, named = (text.format(base=base, repo=REPO) for text in REFUSED[route])
    plan = write_plan(account, base / "plan", line + "\n")
    (base / "state-link").symlink_to("state")
    done, _ = hostcall_run(account, RAN, cwd=base, plan=plan, state_dir=base / "state")
    return named, done


def test_a_plan_whose_writable_paths_reach_what_the_supervisor_trusts_is_refused_before_it_runs(
    account: Account,
) -> None:
    # Independent runs (each its own plan and state dir): a few at once.
    with ThreadPoolExecutor(max_workers=4) as pool:
        outcomes = pool.map(lambda args: _refusal(account, *args), enumerate(REFUSED))
        runs = dict(zip(REFUSED, outcomes, strict=True))
    wrong = {}
    for route, (named, done) in runs.items():
        lines = done.stderr.strip().splitlines()
        if not (done.returncode == 2 and len(lines) == 1 and named in lines[0] and not done.stdout):
            wrong[route] = (done.returncode, done.stdout, done.stderr[-600:])
    assert wrong == {}, wrong


#: Plants code where the next supervisor runs it: an unchecked hash-based .pyc
#: of the tools module (Python loads it without looking at the source) and a
#: .pth file in the user site-packages.
PLANT_CODE = r"""
import importlib.util, marshal
home, marker = CONFIG["home"], CONFIG["marker"]
def payload(kind):
    return f"import os\nopen({marker!r} + '-{kind}', 'w').write(str(os.getuid()))\n"
source = payload("pyc") + CONFIG["tools"]
code = marshal.dumps(compile(source, "attack_tools.py", "exec"))
pyc = importlib.util.MAGIC_NUMBER + (0b01).to_bytes(4, "little")
pyc += importlib.util.source_hash(source.encode()) + code
version = sys.version_info[:2]
def plant_pyc():
    with open(f"{home}/plan/__pycache__/attack_tools.cpython-%d%d.pyc" % version, "wb") as f:
        f.write(pyc)
def plant_pth():
    site = "%s/.local/lib/python%d.%d/site-packages" % (home, *version)
    os.makedirs(site, exist_ok=True)
    with open(f"{site}/zz-planted.pth", "w") as f:
        f.write(payload("pth").replace("\n", "; ").rstrip("; ") + "\n")
report(pyc=outcome(plant_pyc), pth=outcome(plant_pth))
"""


def test_code_planted_through_a_writable_path_never_runs_in_the_next_supervisor(
    account: Account, request: pytest.FixtureRequest
) -> None:
    """``read_write`` naming the plan folder's ``__pycache__`` or the user
    site-packages (``~/.local``) must be refused like the plan's folder: what
    a guest leaves there runs in the next supervisor, with its uid."""
    marker = account.home / "planted-code-ran"
    # The supervisor writes no bytecode itself: hostcall makes __pycache__ for the guest.
    env = account.env(PYTHONDONTWRITEBYTECODE="1")
    plan = write_plan(
        account, account.home / "plan", 'read_write = ["./__pycache__", "~/.local"]\n'
    )
    config = {"home": str(account.home), "marker": str(marker), "tools": TOOLS}
    state = account.home / "state"
    planting, _ = hostcall_run(
        account, PLANT_CODE, config, cwd=account.home, plan=plan, state_dir=state, env=env
    )
    # The next supervisor, with a plan that asks for nothing.
    plan = write_plan(account, account.home / "plan")
    later, _ = hostcall_run(account, "", cwd=account.home, plan=plan, state_dir=state, env=env)
    assert later.returncode == 0, later.stderr[-3000:]
    ran = {p.name: f"uid {p.read_text()}" for p in account.home.glob("planted-code-ran-*")}
    assert ran == {}, f"planted code ran in the supervisor: {ran} ({planting.stdout})"
    lines = planting.stderr.strip().splitlines()
    assert planting.returncode == 2 and len(lines) == 1, planting.stderr[-3000:]


def test_a_hidden_path_stays_absent_when_a_read_only_symlink_shows_its_folder_elsewhere(
    account: Account, stage: Path, request: pytest.FixtureRequest
) -> None:
    """``read_only = ["/tmp/inputs"]`` with /tmp/inputs a symlink to a folder
    that holds a hidden file: the file must be absent under both names."""
    secret = stage / "secret.txt"
    secret.write_text("hidden\n")
    secret.chmod(0o644)
    own(secret, account)
    inputs = account.home / "inputs"
    inputs.symlink_to(stage)
    sandbox = f'read_only = ["{inputs}"]\nhide = ["{secret}"]\n'
    plan = write_plan(account, account.home / "plan", sandbox)
    routes = [str(secret), str(inputs / secret.name)]
    done, _ = hostcall_run(
        account,
        "report(**{r: absent(r) for r in CONFIG})",
        routes,
        cwd=account.home,
        plan=plan,
        state_dir=account.home / "state",
    )
    assert guest_report(done) == dict.fromkeys(routes, "absent")


#: Swaps the folder on the way to its plan's nested writable path for a
#: symlink to a folder of its user's.
PLANT_LINK = r"""
ws, victim = CONFIG["ws"], CONFIG["victim"]
def plant():
    os.rename(ws + "/a", ws + "/a-was")
    os.symlink(victim, ws + "/a")
report(plant=outcome(plant))
"""


def test_a_symlink_a_guest_leaves_in_its_writable_folder_redirects_no_later_mount(
    account: Account, stage: Path
) -> None:
    """``read_write = [ws, ws/a/b]``: a guest swaps ``ws/a`` for a symlink to a
    folder of its user's. The next launch must refuse the plan, not make
    (as root: make and chown) that folder's ``b`` and mount it read-write."""
    ws, victim = stage / "ws", account.home / "victim"
    victim.mkdir()
    own(victim, account)
    plan = write_plan(account, stage / "plan", f'read_write = ["{ws}", "{ws / "a" / "b"}"]\n')
    config = {"ws": str(ws), "victim": str(victim)}
    state = account.home / "state"
    first, _ = hostcall_run(
        account, PLANT_LINK, config, cwd=account.home, plan=plan, state_dir=state
    )
    assert guest_report(first) == {"plant": "ok"}
    target = str(ws / "a" / "b" / "planted")
    second, _ = hostcall_run(
        account,
        "open(CONFIG, 'w').write('x')",
        target,
        cwd=account.home,
        plan=plan,
        state_dir=state,
    )
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr[-3000:]
    assert "inside the writable path" in lines[0]
    assert list(victim.iterdir()) == []


def test_a_read_write_folder_inside_the_launch_folder_is_written_on_the_host(
    account: Account, stage: Path, request: pytest.FixtureRequest
) -> None:
    out = stage / "out"
    plan = write_plan(account, stage / "plan", f'read_write = ["{out}"]\n')
    done, summary = hostcall_run(
        account,
        "open(CONFIG + '/result.txt', 'w').write('kept')\nreport(cwd=os.getcwd())",
        str(out),
        cwd=stage,
        plan=plan,
        state_dir=account.home / "state",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert overlaid(summary)
    assert (out / "result.txt").read_text() == "kept"


# --------------------------------------------------------------------------
# S7: privileges
# --------------------------------------------------------------------------

#: Says where it is, waits while the test looks at it from the host, then
#: tries what a privilege would allow, setuid programs, and a nested user namespace.
PRIVILEGE_ATTACK = r"""
import ctypes, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def check(rc):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
report(pidns=os.stat("/proc/self/ns/pid").st_ino, pid=os.getpid())
sys.stdin.readline()
with open("/proc/self/status") as f:
    status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
ro, rw, secret, hidden = CONFIG["ro"], CONFIG["rw"], CONFIG["secret"], CONFIG["hidden"]
open("mine.txt", "w").close()
open(f"{rw}/made-by-guest", "w").close()
MS_REMOUNT, MS_BIND = 32, 4096
attempts = {
    "setuid(0)": lambda: os.setuid(0),
    "setgid(0)": lambda: os.setgid(0),
    "setgroups([0])": lambda: os.setgroups([0]),
    "chown its file to root": lambda: os.chown("mine.txt", 0, 0),
    "chown its file to uid 1": lambda: os.chown("mine.txt", 1, 1),
    "chown a read_write file to root": lambda: os.chown(f"{rw}/made-by-guest", 0, 0),
    "mount a tmpfs": lambda: check(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "unmount the channel's folder": lambda: check(libc.umount2(b"/run/hostcall", 2)),
    "unmount a mask": lambda: check(libc.umount2(hidden.encode(), 2)),
    "remount / read-write": lambda: check(libc.mount(None, b"/", None, MS_REMOUNT | MS_BIND, None)),
    "mknod a memory device": lambda: os.mknod("mem", stat.S_IFCHR | 0o666, os.makedev(1, 1)),
    "chroot": lambda: os.chroot("/tmp"),
    "sethostname": lambda: check(libc.sethostname(b"pwned", 5)),
    "read a root-only file": lambda: peek(secret),
    "write into a read_only folder": lambda: open(f"{ro}/made-by-guest", "w").close(),
}
if CONFIG["shadow"]:
    attempts["read /etc/shadow"] = lambda: peek("/etc/shadow")
results = {name: outcome(attempt) for name, attempt in attempts.items()}
# setuid programs gain nothing (no_new_privs, nosuid mounts): their privileged
# effect is what is checked.
point, proof = os.path.abspath("mount-point"), os.path.abspath("su-ran")
os.mkdir(point)
setuid = {}
for program in CONFIG["setuid"]:
    argv = {"mount": [program, "-t", "tmpfs", "none", point],
            "su": [program, "root", "-c", f"touch {proof}"]}.get(os.path.basename(program),
                                                               [program, "--help"])
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    setuid[program] = done.returncode
with open("/proc/self/mountinfo") as f:
    gained = [line for line in f if f" {point} " in line]
gained += ["su ran its command"] if os.path.exists(proof) else []
# A nested user namespace: root inside it, and nothing outside.
INNER = '''
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ro, secret, hidden = sys.argv[1:4]
def attempt(action):
    try:
        if action() not in (0, None):
            return errno.errorcode.get(ctypes.get_errno(), "?")
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, "?")
    return "ok"
def bind_without_the_mask():
    os.makedirs("/tmp/bound", exist_ok=True)
    if libc.mount(os.path.dirname(hidden).encode(), b"/tmp/bound", None, 4096, None) != 0:
        return -1
    return 0 if os.path.exists("/tmp/bound/" + os.path.basename(hidden) + "/inside") else -1
def remount_writable():
    return libc.mount(None, ro.encode(), None, 32 | 4096, None)
print(json.dumps({
    "uid": os.getuid(),
    "unmount a mask": attempt(lambda: libc.umount2(hidden.encode(), 2)),
    "bind a folder without its mask": attempt(bind_without_the_mask),
    "remount a read_only folder read-write": attempt(remount_writable),
    "write into a read_only folder": attempt(lambda: open(ro + "/made-in-userns", "w").close()),
    "read a root-only file": attempt(lambda: open(secret).read()),
}))
'''
argv = ["unshare", "--user", "--map-root-user", "--mount", "--", sys.executable, "-c", INNER]
nested = subprocess.run(argv + [ro, secret, hidden], capture_output=True, text=True, timeout=30)
inner = json.loads(nested.stdout) if nested.returncode == 0 and nested.stdout else None
report(status=status, results=results, setuid=setuid, gained=gained,
       nested=[nested.returncode, nested.stderr[-300:]], inner=inner)
"""


def root_only_file(stage: Path) -> Path:
    """A file only root may read, in a folder the guest sees: made in
    ``stage`` when the tests run as root, else one of the host's."""
    if IS_ROOT:
        secret = stage / "root-only"
        secret.write_text("root only\n")
        secret.chmod(0o600)
        os.chown(secret, 0, 0)
        return secret
    for path in map(Path, ("/etc/shadow", "/etc/gshadow", "/etc/sudoers")):
        if path.exists() and not os.access(path, os.R_OK):
            return path
    pytest.skip("run as a user, and no file of this host is root's alone to read")


def test_a_guest_has_no_privilege_and_gains_none(account: Account, stage: Path) -> None:
    ro, rw, hidden = stage / "ro", stage / "rw", stage / "hidden"
    for folder in (ro, rw, hidden):
        folder.mkdir()
        own(folder, account)
    os.chown(rw, GUEST_UID, GUEST_UID)  # as root, hostcall asks for it: guests are never root
    (ro / "data.txt").write_text("read only\n")
    (hidden / "inside").write_text("hidden\n")
    secret = root_only_file(stage)
    shadow = Path("/etc/shadow")
    setuid = [
        str(p)
        for p in (Path("/usr/bin") / n for n in ("su", "mount", "passwd", "newgrp"))
        if p.exists() and p.stat().st_mode & stat.S_ISUID and p.stat().st_uid == 0
    ]
    sandbox = f'read_only = ["{ro}"]\nread_write = ["{rw}"]\nhide = ["{hidden}"]\n'
    plan = write_plan(account, account.home / "plan", sandbox)
    config = {
        "ro": str(ro),
        "rw": str(rw),
        "secret": str(secret),
        "hidden": str(hidden),
        "shadow": shadow.exists() and not shadow.stat().st_mode & 0o004,
        "setuid": setuid,
    }
    before = fingerprint(ro)
    state = account.home / "state"
    with LiveRun(
        account, PRIVILEGE_ATTACK, config, cwd=account.home, plan=plan, state_dir=state
    ) as run:
        where = run.read_json()
        # Seen from the host: no process of the sandbox has a capability or
        # lacks no_new_privs, and the guest's uids and gids are unprivileged.
        # (pid 1 is bubblewrap's: root's when the supervisor is root.)
        inside = sandbox_processes(where["pidns"])
        ours = [f for f in inside.values() if f["NSpid"].split()[-1] == str(where["pid"])]
        assert len(ours) == 1, inside
        for fields in inside.values():
            caps = {k: int(fields[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")}
            assert caps == dict.fromkeys(caps, 0), fields
            assert fields["NoNewPrivs"] == "1", fields
            if fields["NSpid"].split()[-1] != "1":
                assert fields["Uid"].split() == [str(GUEST_UID)] * 4, fields
                assert fields["Gid"].split() == [str(GUEST_UID)] * 4, fields
        run.send()
        found = run.read_json()
        code, summary = run.finish()
    assert code == 0, run.stderr()[-3000:]
    assert summary["executions"][0]["sandbox"]["uid"] == GUEST_UID

    status = found["status"]
    caps = {k: int(status[k], 16) for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")}
    assert caps == dict.fromkeys(caps, 0), status
    assert status["NoNewPrivs"] == "1"
    assert {k: v for k, v in found["results"].items() if v not in DENIED} == {}, found["results"]
    assert found["gained"] == [], found  # no setuid program did its privileged work
    # What it made in its read_write folder is the guest uid's on the host.
    made = rw / "made-by-guest"
    assert (made.stat().st_uid, made.stat().st_gid) == (GUEST_UID, GUEST_UID)
    assert fingerprint(ro) == before
    assert (hidden / "inside").read_text() == "hidden\n"
    # A nested user namespace: refused when the guest has a user namespace of its
    # own (--disable-userns). As root there is none to limit it; being root in
    # one it makes reveals no mask, opens no read-only mount, reads no root file.
    if not account.root:
        assert found["nested"][0] != 0 and found["inner"] is None, found["nested"]
    elif found["inner"] is not None:
        inner = found["inner"]
        assert inner.pop("uid") == 0
        assert {k: v for k, v in inner.items() if v not in DENIED} == {}, inner


# --------------------------------------------------------------------------
# S8: the network
# --------------------------------------------------------------------------

#: Tries every way out it is given: TCP and UDP, Unix sockets by name and by
#: path, ICMP; and raw and packet sockets.
NETWORK_ATTACK = r"""
def inet(kind, family, host, port):
    with socket.socket(family, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM) as s:
        s.settimeout(5)
        if kind == "tcp":
            s.connect((host, port))
            s.sendall(b"from the guest")
        else:
            s.sendto(b"from the guest", (host, port))
def unix(kind, address):
    if address.startswith("@"):
        address = b"\0" + address[1:].encode()
    with socket.socket(socket.AF_UNIX, getattr(socket, "SOCK_" + kind.upper())) as s:
        s.settimeout(5)
        if kind == "stream":
            s.connect(address)
            s.sendall(b"from the guest")
        else:
            s.sendto(b"from the guest", address)
def ping(host):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP) as s:
        s.sendto(b"\x08\0\0\0\0\0\0\0", (host, 0))
results = {f"{k} {h} {p}": outcome(inet, k, f, h, p) for k, f, h, p in CONFIG["inet"]}
results.update({f"unix {k} {a}": outcome(unix, k, a) for k, a in CONFIG["unix"]})
results.update({f"icmp {h}": outcome(ping, h) for h in CONFIG["ping"]})
raw = (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
results["raw socket"] = outcome(lambda: socket.socket(*raw).close())
results["packet socket"] = outcome(lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW).close())
report(results=results, interfaces=sorted(name for _, name in socket.if_nameindex()))
"""


def _host_tcp_services() -> list[list[object]]:
    """Services listening on this host's loopback (PostgreSQL here, and others)."""
    found: list[list[object]] = []
    for port in (5432, 6379, 3306, 5672):
        with socket.socket() as probe:
            probe.settimeout(1)
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                found.append(["tcp", int(socket.AF_INET), "127.0.0.1", port])
    return found


def test_no_connection_or_datagram_of_a_guest_reaches_an_address_outside_its_sandbox(
    account: Account, stage: Path
) -> None:
    addresses = host_addresses()  # loopback and the machine's other addresses
    sockets = stage / "sockets"
    sockets.mkdir(mode=0o755)
    # Path sockets bound before launch are masked; abstract ones belong to the
    # host's network namespace; PostgreSQL's socket is in the private /run.
    named = [
        ("stream", str(sockets / "stream.sock")),
        ("dgram", str(sockets / "dgram.sock")),
        ("stream", f"@{stage.name}-stream"),
        ("dgram", f"@{stage.name}-dgram"),
    ]
    postgres = "/var/run/postgresql/.s.PGSQL.5432"
    with Listeners(addresses) as listeners, UnixListeners() as unix:
        for kind, address in named:
            bound = b"\0" + address[1:].encode() if address.startswith("@") else address
            unix.bind(address, bound, getattr(socket, "SOCK_" + kind.upper()))
        config = {
            "inet": listeners.targets() + _host_tcp_services(),
            "unix": named + ([("stream", postgres)] if os.path.exists(postgres) else []),
            "ping": [a for f, a in addresses if f == socket.AF_INET],
        }
        plan = write_plan(account, account.home / "plan")
        done, summary = hostcall_run(
            account,
            NETWORK_ATTACK,
            config,
            cwd=account.home,
            plan=plan,
            state_dir=account.home / "state",
        )
        found = guest_report(done)
        arrived = listeners.arrived() + unix.arrived()
    assert done.returncode == 0, done.stderr[-3000:]
    sandbox = summary["executions"][0]["sandbox"]
    assert sandbox["network"] == "none" and "net" in sandbox["namespaces"].split(",")
    # Nothing arrived: no connection, no datagram, on loopback or elsewhere.
    assert arrived == []
    # Inside: only its own loopback; nothing connected, no raw or packet socket.
    # (UDP and ICMP to 127.0.0.1 and ::1 are sent to the sandbox's own loopback:
    # that nothing left it is what `arrived` shows.)
    assert found["interfaces"] == ["lo"]
    local = ("udp 127.0.0.1 ", "udp ::1 ", "icmp 127.0.0.1")
    got_out = {k: v for k, v in found["results"].items() if v == "ok" and not k.startswith(local)}
    assert got_out == {}, found["results"]


#: Says it started, waits until the test has bound one more socket, then
#: tries every socket and FIFO it is given.
UNMASKED_ATTACK = r"""
def reach(path):
    if stat.S_ISFIFO(os.stat(path).st_mode):
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"from the guest")
        finally:
            os.close(fd)
        return
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"from the guest")
report(started=True)
sys.stdin.readline()
report(**{path: outcome(reach, path) for path in CONFIG})
"""


def test_no_host_socket_or_fifo_is_reachable_however_it_was_bound(
    account: Account, stage: Path, request: pytest.FixtureRequest
) -> None:
    """Bound sockets are masked as /proc/net/unix lists them at launch. Others
    lead to a host process too: bound by a relative path, renamed or
    hard-linked since, bound in another network namespace or after the guest
    started; and FIFOs, which a read-only mount does not stop either."""
    xfail_if(
        request,
        True,
        "S8 hole: Layout.mask() masks only the absolute paths that /proc/net/unix of the "
        "supervisor's network namespace lists at launch; the guest connects to a socket bound "
        "by a relative path, renamed or hard-linked since, bound in another network namespace "
        "or after launch, and writes into a FIFO (a read-only mount stops neither)",
    )
    folder = stage / "sockets"
    folder.mkdir(mode=0o755)
    with UnixListeners() as unix:
        previous = Path.cwd()
        os.chdir(folder)
        try:
            unix.bind("bound by a relative path", "relative.sock")
        finally:
            os.chdir(previous)
        unix.bind("renamed", str(folder / "old.sock"))
        os.rename(folder / "old.sock", folder / "renamed.sock")
        unix.bind("hard-linked", str(folder / "original.sock"))
        os.link(folder / "original.sock", folder / "linked.sock")
        paths = [folder / n for n in ("relative.sock", "renamed.sock", "linked.sock")]
        if os.geteuid() == 0:

            def bind_elsewhere() -> socket.socket:
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(str(folder / "other-netns.sock"))
                os.chmod(folder / "other-netns.sock", 0o777)
                sock.listen(8)
                return sock

            with contextlib.suppress(PermissionError):  # no CAP_SYS_ADMIN in this container
                elsewhere = in_new_network_namespace(bind_elsewhere)
                unix.add("in another network namespace", elsewhere)
                paths.append(folder / "other-netns.sock")
        os.mkfifo(folder / "fifo", 0o666)
        os.chmod(folder / "fifo", 0o666)
        fifo = os.open(folder / "fifo", os.O_RDONLY | os.O_NONBLOCK)
        try:
            paths += [folder / "fifo", folder / "late.sock"]
            plan = write_plan(account, account.home / "plan")
            state = account.home / "state"
            config = [str(p) for p in paths]
            with LiveRun(
                account, UNMASKED_ATTACK, config, cwd=account.home, plan=plan, state_dir=state
            ) as run:
                assert run.read_json() == {"started": True}
                unix.bind("bound after launch", str(folder / "late.sock"))
                run.send()
                found = run.read_json()
                code, _ = run.finish()
            assert code == 0, run.stderr()[-3000:]
            arrived = unix.arrived()
            with contextlib.suppress(BlockingIOError):
                if data := os.read(fifo, 64):
                    arrived.append(f"fifo: {data!r}")
        finally:
            os.close(fifo)
    assert arrived == [], (arrived, found)


def test_a_plan_with_host_network_lets_its_guest_reach_the_hosts_loopback(
    account: Account,
) -> None:
    """The other side of S8: ``network = "host"`` is the plan's explicit choice,
    and then the test's listener does see the guest (so it would have above)."""
    with Listeners([(socket.AF_INET, "127.0.0.1")]) as listeners:
        plan = write_plan(account, account.home / "plan", 'network = "host"\n')
        done, summary = hostcall_run(
            account,
            NETWORK_ATTACK,
            {"inet": listeners.targets(), "unix": [], "ping": []},
            cwd=account.home,
            plan=plan,
            state_dir=account.home / "state",
        )
        found = guest_report(done)
        arrived = listeners.arrived()
    assert done.returncode == 0, done.stderr[-3000:]
    sandbox = summary["executions"][0]["sandbox"]
    assert sandbox["network"] == "host" and "net" not in sandbox["namespaces"].split(",")
    assert sorted(a.split()[0] for a in arrived) == ["tcp", "udp"], (arrived, found)
    assert all("from the guest" in a for a in arrived), arrived
