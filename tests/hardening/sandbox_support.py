"""Running the real ``hostcall`` CLI as root and as an unprivileged user.

SPEC §13 differs by who the supervisor is: as root, bubblewrap runs as root
and the guest drops to uid 65534; as anyone else, the guest runs in a user
namespace as that user. CI runs as root, so the unprivileged case is made by
dropping the *supervisor* to uid 65534 with ``setpriv`` (user namespaces work
unprivileged here). When the tests themselves run as a user, that user is the
unprivileged case and the root case is skipped.

Everything an unprivileged supervisor needs lives in a folder it owns under
``/tmp`` (pytest's own ``tmp_path`` sits in a 0700 folder of root's), and it
runs a Python it can reach: the interpreter of this venv may live under
``/root`` (pyenv), so a system Python of the same version is used with this
venv's packages on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.harness import STEP_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
#: The uid an unprivileged supervisor (and, as root, every guest) runs as.
NOBODY = 65534
IS_ROOT = os.geteuid() == 0


def _reachable_by(path: Path, uid: int) -> bool:
    """Whether ``uid`` (no groups) can search every folder to ``path`` and read it."""
    real = path.resolve()
    for folder in [*reversed(real.parents)]:
        st = folder.stat()
        bits = st.st_mode >> 6 if st.st_uid == uid else st.st_mode
        if not bits & 0o1:
            return False
    st = real.stat()
    bits = st.st_mode >> 6 if st.st_uid == uid else st.st_mode
    return bool(bits & 0o4)


def python_for(uid: int) -> str | None:
    """A Python of this version that ``uid`` can run: this one, or a system one."""
    if _reachable_by(Path(sys.executable), uid):
        return sys.executable
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/{version}", f"/usr/local/bin/{version}", shutil.which(version)):
        if candidate and os.path.exists(candidate) and _reachable_by(Path(candidate), uid):
            return candidate
    return None


@dataclass
class Account:
    """Who runs the supervisor: root (the tests' own uid) or an unprivileged one."""

    name: str
    uid: int
    python: str
    home: Path

    @property
    def root(self) -> bool:
        return self.uid == 0

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment for the CLI: this venv's packages, no HOSTCALL_*,
        and no bytecode written beside the plan's tools when the supervisor
        imports them (a test compares the plan's folder before and after a
        guest: only what the guest did may count)."""
        paths = [str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOSTCALL_")}
        env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), HOME=str(self.home))
        env.update(PYTHONDONTWRITEBYTECODE="1")
        env.update(extra)
        return env

    def command(self, *args: str) -> list[str]:
        """``python -m supervisor.cli ARGS`` as this account."""
        argv = [self.python, "-m", "supervisor.cli", *args]
        if self.uid != os.geteuid():
            argv = [
                "setpriv",
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--",
                *argv,
            ]
        return argv

    def hostcall(
        self, *args: str, timeout: float = STEP_TIMEOUT_S * 2, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the CLI to its end."""
        return subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.home,
            env=env or self.env(),
        )

    def popen(self, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
        """Start the CLI (the caller waits, bounded)."""
        kwargs.setdefault("env", self.env())
        return subprocess.Popen(self.command(*args), cwd=self.home, text=True, **kwargs)

    def file(self, relative: str, text: str, mode: int = 0o644) -> Path:
        """A file in the account's folder, owned by it."""
        path = self.home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(mode)
        _own(path, self.uid)
        return path

    def folder(self, relative: str, mode: int = 0o755) -> Path:
        """A folder in the account's folder, owned by it."""
        path = self.home / relative
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
        _own(path, self.uid)
        return path


def _own(path: Path, uid: int) -> None:
    if IS_ROOT and uid != 0:
        for parent in [path, *path.parents]:
            if parent.stat().st_uid == uid or parent == Path("/tmp"):
                break
            os.chown(parent, uid, uid)


@pytest.fixture(params=["root", "unprivileged"])
def account(request: pytest.FixtureRequest) -> Iterator[Account]:
    """The supervisor's account: root (when the tests run as root) and an
    unprivileged one (uid 65534 under root; the tests' own uid otherwise)."""
    wanted = request.param
    if wanted == "root" and not IS_ROOT:
        pytest.skip("the root case needs the tests to run as root (CI does)")
    uid = 0 if wanted == "root" or not IS_ROOT else NOBODY
    if not IS_ROOT:
        uid = os.geteuid()
    python = python_for(uid)
    if python is None:
        pytest.fail(
            f"no Python {sys.version_info.major}.{sys.version_info.minor} that uid {uid} can "
            "run (install the distribution's python3 of this version)"
        )
    home = Path(tempfile.mkdtemp(prefix=f"hostcall-{wanted}-", dir="/tmp"))
    home.chmod(0o755)
    _own(home, uid)
    try:
        yield Account(wanted, uid, python, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


#: A plan with one tool; handlers import nothing but hostcall.
TOOLS = """
from supervisor import tool

@tool(reversibility="reversible")
def echo(text: str) -> str:
    return text

@tool(reversibility="irreversible", approval="always")
def charge(account: str, cents: int) -> dict:
    return {"charged": cents}
"""


def plan_file(account: Account, sandbox: str = "") -> Path:
    """``plan/plan.toml`` (and its tools) in the account's folder."""
    account.file("plan/attack_tools.py", TOOLS)
    body = (
        '[plan]\nname = "attack"\n\n[tools.echo]\nhandler = "attack_tools:echo"\n\n'
        '[tools.charge]\nhandler = "attack_tools:charge"\n'
    )
    if sandbox:
        body += "\n[sandbox]\n" + sandbox
    return account.file("plan/plan.toml", body)


def run_guest(
    account: Account,
    code: str,
    *args: str,
    sandbox: str = "",
    extra: Sequence[str] = (),
    timeout: float = STEP_TIMEOUT_S * 2,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``hostcall run --json -- python -c CODE ARGS`` as ``account``; returns the
    finished process and the JSON summary (the last line of stderr)."""
    plan = plan_file(account, sandbox)
    done = account.hostcall(
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
        timeout=timeout,
    )
    lines = done.stderr.strip().splitlines()
    try:
        summary = json.loads(lines[-1]) if lines else {}
    except ValueError:
        summary = {}
    return done, summary
