"""The sandbox's view of the host, decided without starting anything (supervisor/sandbox/).

What the guest's command resolves through, which folders an unprivileged uid
can search, which plan paths are refused, and the order of bubblewrap's
mounts. The sandbox itself, with real guests, is tested in
tests/hardening/test_sandbox.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import site
import socket
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.errors import PlanError
from supervisor.plan import Plan
from supervisor.sandbox.layout import GUEST_SOCKET, GUEST_WORKDIR, Layout
from supervisor.sandbox.paths import (
    Account,
    command_paths,
    reachable,
    resolve,
)
from supervisor.sandbox.policy import (
    SandboxError,
    SandboxPolicy,
    check_links,
    check_writable,
    trusted_paths,
)
from tests.harness import STEP_TIMEOUT_S

NOBODY = Account(65534, 65534)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder every uid may search (pytest's own tmp_path sits in a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="hostcall-layout-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_the_command_resolves_through_its_symlinks_to_the_real_interpreter_and_its_prefix(
    tmp_path: Path,
) -> None:
    prefix = tmp_path / "python-install"
    (prefix / "bin").mkdir(parents=True)
    real = prefix / "bin" / "python3.11"
    real.write_text("#!/bin/sh\n")
    real.chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(real)
    (venv / "pyvenv.cfg").write_text(f"home = {prefix / 'bin'}\n")
    script = tmp_path / "agent.py"
    script.write_text("print(1)\n")

    paths = command_paths(["python", "agent.py", "--flag"], {"PATH": str(venv / "bin")}, tmp_path)

    assert venv / "bin" / "python" in paths
    assert real in paths
    assert prefix in paths  # its libraries live beside bin/
    assert venv in paths
    assert script in paths  # an argument naming an existing file, relative to cwd
    assert not any(p.name == "--flag" for p in paths)


def test_a_shebang_script_brings_its_interpreter_found_through_env(tmp_path: Path) -> None:
    tools = tmp_path / "tools" / "bin"
    tools.mkdir(parents=True)
    interpreter = tools / "node"
    interpreter.write_text("")
    interpreter.chmod(0o755)
    script = tmp_path / "agent"
    script.write_text("#!/usr/bin/env node\nconsole.log(1)\n")
    script.chmod(0o755)

    paths = command_paths([str(script)], {"PATH": str(tools)}, tmp_path)

    assert script in paths
    assert interpreter in paths


def test_an_unprivileged_uid_cannot_search_a_0700_folder_of_roots(open_dir: Path) -> None:
    closed = open_dir / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    st = os.stat(closed)
    account = Account(st.st_uid + 1, st.st_gid + 1)
    assert reachable(closed / "inner" / "file", account) == closed
    assert reachable(closed / "inner" / "file", Account(st.st_uid, st.st_gid)) is None


def test_a_plan_cannot_make_the_state_dir_or_the_tools_writable(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    plan_dir.mkdir()
    tools = plan_dir / "tools.py"
    tools.write_text("")
    state = tmp_path / "state"
    trusted = trusted_paths([tools])

    for writable, why in [
        (tmp_path, "state dir"),  # holds the state dir
        (state / "receipts", "state dir"),  # inside it
        (plan_dir, "imports or trusts"),  # holds a tool module
        (Path(sys.prefix), "code to run at start-up"),  # holds the supervisor's packages
        (plan_dir / "__pycache__", "bytecode cache"),  # its .pyc would be loaded unread
        (Path(site.getuserbase()) / "lib", "code to run at start-up"),  # a .pth, later
    ]:
        policy = SandboxPolicy(read_write=(writable,))
        with pytest.raises(SandboxError, match=why):
            check_writable(policy, trusted, state)
    check_writable(SandboxPolicy(read_write=(tmp_path / "workspace",)), trusted, state)


def test_every_symlink_on_the_way_to_a_path_is_found_at_its_real_place(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "deep").mkdir(parents=True)
    (tmp_path / "hop").symlink_to("real")  # relative
    (real / "up").symlink_to(tmp_path / "hop" / "deep")  # absolute, through another link
    (tmp_path / "loop").symlink_to("loop")
    path = tmp_path / "hop" / "up" / ".." / "deep" / "missing"
    assert resolve(path) == (
        real / "deep" / "missing",
        [tmp_path / "hop", real / "up", tmp_path / "hop"],
    )
    assert resolve(path)[0] == Path(os.path.realpath(path))
    assert resolve(real / "deep") == (real / "deep", [])
    stopped, links = resolve(tmp_path / "loop" / "x")
    assert len(links) == 41  # bounded
    assert stopped.is_symlink()  # a walk to it fails; no folder before it stands in


def test_a_plan_path_through_a_link_a_guest_could_have_made_is_refused(tmp_path: Path) -> None:
    """A guest may leave a symlink in what it may write; a later guest's plan
    path through it would be mounted wherever the first one chose."""
    shared, home = tmp_path / "shared", tmp_path / "home"
    shared.mkdir()
    home.mkdir()
    (shared / "inputs").symlink_to(home)
    nested = SandboxPolicy(read_write=(shared, shared / "inputs" / "cache"))
    with pytest.raises(SandboxError, match="inside the writable path"):
        check_links(nested, None)
    with pytest.raises(SandboxError, match="inside the writable path"):
        check_links(SandboxPolicy(workdir=shared, read_only=(shared / "inputs",)), None)
    # Another plan's folder: told by its owner when guests have a uid of their own.
    elsewhere = SandboxPolicy(read_only=(shared / "inputs",))
    check_links(elsewhere, None)
    with pytest.raises(SandboxError, match="which a guest made"):
        check_links(elsewhere, os.lstat(shared / "inputs").st_uid)
    # The operator's own links stay: one outside every writable path, not the guests'.
    check_links(SandboxPolicy(read_write=(shared / "inputs",)), os.getuid() + 1)


def test_a_sandbox_table_in_a_plan_file_resolves_relative_paths_against_the_plan(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(
        '[plan]\nname = "p"\n[sandbox]\nnetwork = "host"\nworkdir = "./work"\n'
        'read_only = ["inputs"]\nhide = ["~/.ssh"]\n'
    )
    plan = Plan.load(tmp_path / "plan.toml")
    assert plan.sandbox.network == "host"
    assert plan.sandbox.workdir == tmp_path / "work"
    assert plan.sandbox.read_only == (tmp_path / "inputs",)
    assert plan.sandbox.hide == (Path.home() / ".ssh",)
    assert plan.resolved()["sandbox"]["network"] == "host"


def test_a_plan_without_a_sandbox_table_keeps_its_hash_and_an_unknown_key_is_refused(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text('[plan]\nname = "p"\n')
    plan = Plan.load(tmp_path / "plan.toml")
    assert "sandbox" not in plan.resolved()
    (tmp_path / "bad.toml").write_text('[plan]\nname = "p"\n[sandbox]\nnetwork = "lan"\n')
    with pytest.raises(PlanError, match="network"):
        Plan.load(tmp_path / "bad.toml")
    (tmp_path / "typo.toml").write_text('[plan]\nname = "p"\n[sandbox]\nread_olny = []\n')
    with pytest.raises(PlanError, match="read_olny"):
        Plan.load(tmp_path / "typo.toml")


def _pairs(args: list[str], option: str) -> list[str]:
    return [args[i + 2] for i, a in enumerate(args) if a == option]


def test_folders_root_closes_are_covered_and_the_needed_paths_bound_back_for_the_guest(
    open_dir: Path,
) -> None:
    closed = open_dir / "home"
    prefix = closed / "python"
    prefix.mkdir(parents=True)
    (closed / "secret").write_text("x")
    closed.chmod(0o700)

    layout = Layout(NOBODY, builder_is_root=True)
    layout.base(private_dirs=())
    layout.expose([prefix])

    args = layout.args
    assert str(closed) in [args[i + 1] for i, a in enumerate(args) if a == "--tmpfs"]
    assert str(prefix) in _pairs(args, "--ro-bind")
    assert layout.reachable(prefix) and layout.shows(prefix)
    assert not layout.shows(closed / "secret")


def test_masks_come_last_and_only_where_the_guest_would_see_the_path(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    layout = Layout(NOBODY, builder_is_root=True)
    layout.base()
    # Under /tmp the state dir is invisible already: nothing to mask.
    layout.mask([state])
    assert layout.masked == []
    # Once a read-only path shows its folder, the state dir inside is masked.
    layout.bind(tmp_path, writable=False)
    layout.mask([state])
    assert layout.masked == [state]
    assert layout.args[-2:] == ["--remount-ro", str(state)]


def test_the_socket_is_bound_at_its_fixed_place_and_the_fresh_workdir_stays_writable() -> None:
    layout = Layout(NOBODY, builder_is_root=True)
    layout.base()
    assert layout.fresh_workdir() == GUEST_WORKDIR
    assert layout.socket(Path("/some/state/run/channel.sock")) == GUEST_SOCKET
    args = layout.args
    assert args[-5:] == [
        "--ro-bind",
        "/some/state/run/channel.sock",
        str(GUEST_SOCKET),
        "--remount-ro",
        str(GUEST_SOCKET.parent),
    ]
    # The work dir is a mount of its own: making its parent read-only leaves it writable.
    assert str(GUEST_WORKDIR) in [args[i + 1] for i, a in enumerate(args) if a == "--tmpfs"]


def test_a_writable_folder_is_made_step_by_step_never_through_a_symlink(tmp_path: Path) -> None:
    """The folder checked is the one made, given to the guest and mounted (from
    the descriptor the walk opened): a symlink swapped in on the way after the
    check (by a guest still running) is refused, and what it points at is
    neither made into nor given away."""
    from supervisor.sandbox.bwrap import _walk_folders

    owner = (os.getuid() + 1, os.getgid() + 1) if os.geteuid() == 0 else None
    fd, st, made = _walk_folders(tmp_path / "ws" / "a" / "log", owner)
    try:
        assert made and (tmp_path / "ws" / "a" / "log").is_dir()
        assert os.readlink(f"/proc/self/fd/{fd}") == str(tmp_path / "ws" / "a" / "log")
    finally:
        os.close(fd)
    if owner is not None:
        assert (st.st_uid, st.st_gid) == owner  # only the last folder is the guest's
        assert (tmp_path / "ws" / "a").stat().st_uid == 0
    fd, st, made = _walk_folders(tmp_path / "ws" / "a" / "log", owner)
    os.close(fd)
    assert not made
    # A guest swaps ws/a for a link to a folder of the host's.
    host = tmp_path / "host"
    (host / "log").mkdir(parents=True)
    (tmp_path / "ws" / "a").rename(tmp_path / "ws" / "a-was")
    (tmp_path / "ws" / "a").symlink_to(host)
    swapped = "Not a directory|Too many levels of symbolic links"
    with pytest.raises(OSError, match=swapped) as refused:
        _walk_folders(tmp_path / "ws" / "a" / "log", owner)
    assert refused.value.filename == str(tmp_path / "ws" / "a")
    assert (host / "log").stat().st_uid == os.geteuid()
    with pytest.raises(OSError, match=swapped):
        _walk_folders(tmp_path / "ws" / "a" / "new", owner)
    assert list(host.iterdir()) == [host / "log"]


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root supervisor gives a made folder away")
def test_a_folder_swapped_over_the_one_just_made_is_not_given_to_the_guest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As root, a missing writable folder is made and given to the guest's
    uid. A guest still running whose writable folder holds this plan's path
    renames a root-only folder of its tree over the fresh one between the
    ``mkdir`` and the ``chown``: that folder was given away (with the key
    in it) and, "made here", never had its owner checked. Now only the
    empty folder just made is given, by its descriptor; anything else is an
    existing folder, checked as one."""
    from supervisor.sandbox import bwrap

    ws = tmp_path / "ws"
    ws.mkdir()
    os.chown(ws, NOBODY.uid, NOBODY.gid)  # the running guest's own folder
    root_only = ws / "root-only"
    root_only.mkdir(mode=0o700)
    (root_only / "key").write_text("secret")
    real_mkdir = os.mkdir

    def mkdir_then_swap(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(path, mode, dir_fd=dir_fd)
        if path == "new":
            os.rename(root_only, ws / "new")  # over the empty folder just made

    monkeypatch.setattr(bwrap.os, "mkdir", mkdir_then_swap)
    (tmp_path / "channel.sock").touch()

    with pytest.raises(SandboxError, match="not writable by the guest's uid 65534"):
        bwrap.SandboxHost.probe().build(
            SandboxPolicy(read_write=(ws / "new",)),
            argv=["/bin/true"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            state_dir=tmp_path / "state",
            socket=tmp_path / "channel.sock",
        )
    st = (ws / "new").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o700)
    assert (ws / "new" / "key").stat().st_uid == 0


async def _run_built(
    tmp_path: Path,
    policy: SandboxPolicy,
    argv: list[str],
    *,
    host: Any = None,
    after_build: Callable[[], None] = lambda: None,
    **io: Any,
) -> None:
    """Build a sandbox (on ``host``, or this one's), call ``after_build``,
    then start it and wait for exit 0."""
    from supervisor.process import wait_exited
    from supervisor.sandbox.bwrap import SandboxHost
    from supervisor.sandbox.start import launch_sandboxed

    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tmp_path / "channel.sock"))
        launch = (host or SandboxHost.probe()).build(
            policy,
            argv=argv,
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            state_dir=tmp_path,
            socket=tmp_path / "channel.sock",
        )
        after_build()
        process, sandboxed = await launch_sandboxed(launch, credential="x" * 43, **io)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            assert await wait_exited(process) == 0
        sandboxed.close()


async def _run_after_a_swap(
    tmp_path: Path, ws: Path, decoy: Path, policy: SandboxPolicy, argv: list[str], **io: Any
) -> None:
    """Build a sandbox, then swap ``ws/a`` for a link to ``decoy`` as a guest
    still running could just after a launch's checks, then run it to exit 0."""

    def swap() -> None:
        (ws / "a").rename(ws / "a-was")
        (ws / "a").symlink_to(decoy)

    await _run_built(tmp_path, policy, argv, after_build=swap, **io)


@pytest.fixture
def swap_base() -> Iterator[Path]:
    """A folder outside /tmp (the sandbox's /tmp is private), searchable by the guests."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="hostcall-swap-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def test_a_folder_swapped_after_the_checks_does_not_redirect_the_mount(
    tmp_path: Path, swap_base: Path
) -> None:
    """A guest still running swaps ``ws/a`` for a link to another folder just
    after a launch's checks (here: between building the sandbox and starting
    it). bubblewrap mounted by name, so the new guest's writes went to that
    folder; it now mounts the descriptor the checks' walk opened."""
    ws, decoy = swap_base / "ws", swap_base / "decoy"
    ws.mkdir()
    (decoy / "out").mkdir(parents=True)
    (decoy / "out").chmod(0o777)
    if os.geteuid() == 0:
        os.chown(ws, NOBODY.uid, NOBODY.gid)  # the guests' own folder
    out = ws / "a" / "out"

    await _run_after_a_swap(
        tmp_path,
        ws,
        decoy,
        SandboxPolicy(read_write=(out,)),
        ["/bin/sh", "-c", f"echo planted > {out}/file"],
    )

    assert (ws / "a-was" / "out" / "file").read_text() == "planted\n"
    assert not (decoy / "out" / "file").exists()


@pytest.mark.parametrize("kind", ["folder", "file"])
async def test_a_read_only_path_swapped_after_the_checks_still_shows_what_was_checked(
    tmp_path: Path, swap_base: Path, kind: str
) -> None:
    """The same swap for a ``read_only`` path inside a writable one: it was
    mounted by name, so the next guest read the decoy; it now mounts the
    descriptor of a walk that never follows a symlink."""
    ws, decoy = swap_base / "ws", swap_base / "decoy"
    for root, text in ((ws / "a", "checked\n"), (decoy, "decoy\n")):
        (root / "src").mkdir(parents=True)
        (root / "src" / "which").write_text(text)
        (root / "which").write_text(text)
        for path in (root, root / "src", root / "src" / "which", root / "which"):
            path.chmod(0o755 if path.is_dir() else 0o644)
    shown = ws / "a" / "src" if kind == "folder" else ws / "a" / "which"
    read = shown / "which" if kind == "folder" else shown
    seen = tmp_path / "seen"

    with seen.open("wb") as output:
        await _run_after_a_swap(
            tmp_path,
            ws,
            decoy,
            SandboxPolicy(read_only=(shown,)),
            ["/bin/cat", str(read)],
            stdout=output,
        )

    assert seen.read_text() == "checked\n"


@pytest.mark.skipif(
    os.geteuid() != 0, reason="as root only: an unprivileged sandbox keeps no capability to drop"
)
async def test_nothing_but_setpriv_runs_with_the_capabilities_kept_for_it(
    tmp_path: Path, swap_base: Path
) -> None:
    """As root, bubblewrap keeps CAP_SETUID, CAP_SETGID and CAP_SETPCAP for
    setpriv, which drops them and uid 0 before the guest runs. util-linux's
    setsid ran before setpriv, as uid 0 holding them; it now runs after.
    A stand-in setsid reports what it runs as, then execs the real one."""
    from supervisor.sandbox.bwrap import SandboxHost

    host = SandboxHost.probe()
    if host.setsid is None:
        pytest.skip("util-linux's setsid is not installed")
    spy = swap_base / "setsid"
    spy.write_text(
        f'#!/bin/sh\ngrep -E "^(Uid|CapEff|CapBnd):" /proc/self/status\nexec {host.setsid} "$@"\n'
    )
    spy.chmod(0o755)
    seen = tmp_path / "seen"

    with seen.open("wb") as output:
        await _run_built(
            tmp_path,
            SandboxPolicy(read_only=(spy,)),
            ["/bin/true"],
            host=dataclasses.replace(host, setsid=spy),
            stdout=output,
        )

    status = dict(line.split(":", 1) for line in seen.read_text().splitlines())
    assert status["Uid"].split() == [str(host.account.uid)] * 4
    assert int(status["CapEff"], 16) == int(status["CapBnd"], 16) == 0


def test_a_read_only_path_is_opened_by_a_walk_that_follows_no_symlink(tmp_path: Path) -> None:
    from supervisor.sandbox.bwrap import _open_read_only, _walk_folders

    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "file").write_text("x")
    (tmp_path / "swapped").symlink_to(tmp_path / "real")
    # The walk itself: a link at the end is opened as a link (refused by its
    # caller), a link on the way fails, and nothing is made.
    fd, st, made = _walk_folders(tmp_path / "swapped", None, make=False)
    os.close(fd)
    assert stat.S_ISLNK(st.st_mode) and not made
    with pytest.raises(OSError, match=r"Not a directory|Too many levels of symbolic links"):
        _walk_folders(tmp_path / "swapped" / "file", None, make=False)
    with pytest.raises(FileNotFoundError):
        _walk_folders(tmp_path / "real" / "new", None, make=False)
    fd, st, _ = _walk_folders(tmp_path / "real" / "file", None, make=False)
    os.close(fd)
    assert stat.S_ISREG(st.st_mode)
    fd, real = _open_read_only(tmp_path / "swapped", tmp_path / "real")
    os.close(fd)
    assert real == tmp_path / "real"
    with pytest.raises(SandboxError, match="became a symlink"):
        _open_read_only(tmp_path / "swapped", tmp_path / "swapped")
    with pytest.raises(SandboxError, match="does not exist"):
        _open_read_only(tmp_path / "missing", tmp_path / "missing")


@pytest.mark.parametrize("check", ["check_links", "check_writable"])
@pytest.mark.parametrize("kind", ["read_only", "read_write"])
def test_a_link_swapped_in_right_after_a_check_fails_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, check: str
) -> None:
    """The narrowest windows: a guest swaps a folder on the way for a link
    just after one of the launch's checks of a plan path. The symlink
    check resolves each path once; the check of what a writable path may
    hold (the state dir, trusted code) and the walk take its real path,
    never the name again, so the swap fails the launch instead of choosing
    what is mounted (or, as root, made and given to the guest). The
    trusted-path check resolved the name itself, before the symlink
    check: a link swapped in between led to a folder it never saw."""
    from supervisor.sandbox import bwrap

    ws, decoy = tmp_path / "ws", tmp_path / "decoy"
    (ws / "a" / "src").mkdir(parents=True)
    (decoy / "src").mkdir(parents=True)
    if os.geteuid() == 0:  # both the guests' to write: only the swap may refuse
        for folder in (ws / "a" / "src", decoy / "src"):
            os.chown(folder, NOBODY.uid, NOBODY.gid)
    real_check = getattr(bwrap, check)

    def check_then_swap(*args: Any) -> Any:
        done = real_check(*args)
        (ws / "a").rename(ws / "a-was")
        (ws / "a").symlink_to(decoy)
        return done

    monkeypatch.setattr(bwrap, check, check_then_swap)
    path = ws / "a" / "src"
    policy = SandboxPolicy(**{kind: (path,)})  # type: ignore[arg-type]
    (tmp_path / "channel.sock").touch()

    with pytest.raises(SandboxError, match="symlink"):
        bwrap.SandboxHost.probe().build(
            policy,
            argv=["/bin/true"],
            env={"PATH": "/usr/bin:/bin"},
            cwd=Path("/"),
            state_dir=tmp_path / "state",
            socket=tmp_path / "channel.sock",
        )
    assert list((decoy / "src").iterdir()) == []
