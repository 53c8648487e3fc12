"""What the wheels hold (issue 14): hostcall's has its page, its OpenAPI
document and no test or state; hostcall-guest is guest_client alone and
works where none of the server's dependencies is installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.harness import STEP_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]


#: What a build must not see (and must not write into: pip builds in the tree).
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", ".hostcall", "__pycache__",
    ".pytest_cache", ".mypy_cache", ".ruff_cache", "bench-results", "node_modules",
)  # fmt: skip


def build(source: Path, out: Path) -> Path:
    """A wheel of ``source``, built from a copy of it."""
    copy = out.parent / f"{source.name}-source"
    shutil.copytree(source, copy, ignore=_NOT_SOURCE)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps",
         "--quiet", "--disable-pip-version-check", "-w", str(out), str(copy)],
        check=True, capture_output=True, timeout=STEP_TIMEOUT_S * 4,
    )  # fmt: skip
    [wheel] = out.glob("*.whl")
    return wheel


def test_hostcalls_wheel_holds_the_console_and_the_openapi_document(tmp_path: Path) -> None:
    names = set(zipfile.ZipFile(build(ROOT, tmp_path / "dist")).namelist())
    assert "channel/openapi.json" in names
    assert {f"supervisor/console/static/{n}" for n in ("index.html", "console.js",
                                                        "console.css")} <= names  # fmt: skip
    assert "guest_client/__init__.py" in names
    assert not [n for n in names if n.startswith(("tests/", ".hostcall")) or n.endswith(".pyc")]


def test_the_guest_distribution_is_guest_client_alone_and_imports_without_the_servers_deps(
    tmp_path: Path,
) -> None:
    wheel = build(ROOT / "guest_client", tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert wheel.name.startswith("hostcall_guest-")
    packages = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert packages == {"guest_client"}
    assert "guest_client/pyproject.toml" not in names
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True, capture_output=True, timeout=STEP_TIMEOUT_S * 2,
    )  # fmt: skip
    # -I -S: no site-packages, so aiohttp, pydantic & co. are out of reach.
    probe = (
        f"import sys; sys.path.insert(0, {str(target)!r}); import guest_client, guest_client.aio; "
        "import importlib.util as u; "
        "print(guest_client.__file__, [m for m in ('aiohttp', 'pydantic', 'supervisor') "
        "if u.find_spec(m)])"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", probe],
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=True, cwd=tmp_path,
    )  # fmt: skip
    where, reachable = done.stdout.rsplit(" ", 1)
    assert where.startswith(str(target))
    assert reachable.strip() == "[]"
