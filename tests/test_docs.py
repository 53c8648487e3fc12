"""The docs run as written (issue 14): every code sample of README.md, docs/
and examples/ is checked, and the README's example is run for real.

- ``python`` blocks compile, name nothing undefined (ruff's pyflakes rules)
  and import only what exists; the README's files and host-API script run.
- ``toml`` blocks parse; a plan's tables and keys are the plan file's own.
- ``sh`` and ``console`` blocks: every ``hostcall …`` line is one the CLI
  accepts. ``text`` blocks (synopses, output) are prose.
- A test the docs name as ``file.py::test_name`` exists in that file.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.cli.parser import build_parser
from tests.harness import STEP_TIMEOUT_S, without_hostcall_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "examples").rglob("*.md"))]  # fmt: skip
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
#: A file a python block is (its first line names it: ``# billing_tools.py — …``).
FILE_NAME = re.compile(r"^# ([\w./-]+\.(?:py|toml))\b")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(language: str | None = None) -> list[Block]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 2
            block = Block(doc, line, match.group(1), match.group(2))
            if language is None or block.language == language:
                found.append(block)
    return found


def test_every_code_block_says_its_language() -> None:
    """A bare fence is neither checked nor highlighted: each says what it is."""
    bare = [b.where for b in blocks("")]
    assert bare == [], "give these blocks a language (text for prose or output): " + str(bare)


@pytest.mark.parametrize("block", blocks("python"), ids=lambda b: b.where)
def test_a_python_block_compiles_names_nothing_undefined_and_imports_what_exists(
    block: Block,
) -> None:
    tree = ast.parse(block.code, filename=block.where)  # a SyntaxError fails the test
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "F", "--ignore", "F401,F841",
         "--output-format", "concise", "--stdin-filename", "block.py", "-"],
        input=block.code, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert lint.returncode == 0, f"{block.where}: {lint.stdout}"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in ("supervisor", "channel", "guest_client"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.where}: no {node.module}.{alias.name}"


@pytest.mark.parametrize("block", blocks("toml"), ids=lambda b: b.where)
def test_a_toml_block_parses_and_a_plan_has_only_known_keys(block: Block) -> None:
    from supervisor.plan import _PlanFile

    raw = tomllib.loads(block.code)
    if {"plan", "tools", "sandbox"} & set(raw):
        _PlanFile.model_validate(raw)


def _commands(block: Block) -> list[str]:
    """The ``hostcall …`` command lines of a shell or console block."""
    text = block.code.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("hostcall "):
            found.append(line.split(" #")[0].rstrip(" &"))
    return found


SHELL = [b for b in blocks() if b.language in ("sh", "console") and _commands(b)]


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_every_hostcall_command_in_the_docs_is_one_the_cli_accepts(block: Block) -> None:
    parser = build_parser()
    for command in _commands(block):
        argv = shlex.split(command.replace("…", "x"))[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{block.where}: `{command}` is refused") from exc


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder for an example to run in, outside /tmp: a sandboxed guest
    does not see the host's /tmp, so a relative ``python agent.py`` launched
    from there would find nothing (docs/sandbox.md)."""
    base = Path.home() / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="hostcall-docs-", dir=base))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _readme_files(tmp_path: Path) -> None:
    """The README's example, written out as its blocks name the files."""
    readme = ROOT / "README.md"
    for block in blocks():
        if block.doc != readme:
            continue
        named = FILE_NAME.match(block.code)
        if named is not None:
            (tmp_path / named.group(1)).write_text(block.code)


def _a_users_shell(tmp_path: Path) -> dict[str, str]:
    """hostcall and python on PATH, as after `source .venv/bin/activate`."""
    env = without_hostcall_env()
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env["HOME"] = str(tmp_path)
    return env


def test_the_readme_example_runs_as_written_and_charges_once(folder: Path) -> None:
    tmp_path = folder
    _readme_files(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"billing_tools.py", "plan.toml", "agent.py"}
    [command] = [
        c for b in blocks("sh") if b.doc.name == "README.md" for c in _commands(b)
        if "--invocation" in c
    ]  # fmt: skip
    runs = [
        subprocess.run(
            shlex.split(command),
            cwd=tmp_path,
            env=_a_users_shell(tmp_path),
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT_S * 2,
            check=False,
        )
        for _ in range(2)
    ]
    first, second = runs
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout  # the same result, printed by the guest
    assert "calls: executed 1" in first.stderr
    assert "calls: replayed 1" in second.stderr  # the charge happened once


def test_the_readme_host_api_script_runs_as_written(folder: Path) -> None:
    tmp_path = folder
    _readme_files(tmp_path)
    [script] = [
        b.code for b in blocks("python")
        if b.doc.name == "README.md" and "Supervisor(" in b.code
    ]  # fmt: skip
    (tmp_path / "host.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "host.py"], cwd=tmp_path, env=_a_users_shell(tmp_path),
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S * 2, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert re.search(r"^0 inv_\w+ ", done.stdout, re.M), done.stdout


GUEST_TOOLS = """
from supervisor import tool

@tool(reversibility="irreversible", target_args=["account"])
def charge(account: str, cents: int) -> dict:
    return {"charge_id": f"ch_{account}_{cents}"}

@tool(reversibility="reversible")
def lookup(account: str) -> dict:
    return {"account": account}
"""
GUEST_PLAN = """
[plan]
name = "docs"

[tools.charge]
handler = "doc_tools:charge"

[tools.lookup]
handler = "doc_tools:lookup"
"""


@pytest.mark.parametrize(
    "block",
    [b for b in blocks("python") if b.doc.name == "guests.md" and "connect(" in b.code
     and "call_openai" not in b.code],
    ids=lambda b: b.where,
)  # fmt: skip
def test_a_guest_sample_of_the_guide_runs_as_a_guest(folder: Path, block: Block) -> None:
    tmp_path = folder
    (tmp_path / "doc_tools.py").write_text(GUEST_TOOLS)
    (tmp_path / "plan.toml").write_text(GUEST_PLAN)
    (tmp_path / "sample.py").write_text(block.code)
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "run", "--state-dir", str(tmp_path / "st"),
         "--plan", "plan.toml", "--json", "out.json", "--", sys.executable, "sample.py"],
        cwd=tmp_path, env={**_a_users_shell(tmp_path), "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=STEP_TIMEOUT_S * 2, check=False,
    )  # fmt: skip
    outcome = json.loads((tmp_path / "out.json").read_text())
    assert done.returncode == 0, done.stderr
    assert "refused" not in outcome["executions"][0]["calls"], done.stderr


def test_the_docs_name_every_subcommand_the_cli_has() -> None:
    parser = build_parser()
    [subcommands] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    operations = (ROOT / "docs" / "operations.md").read_text()
    missing = [name for name in subcommands.choices if f"hostcall {name}" not in operations]
    assert missing == []


#: A test named in full in the docs: ``test_x.py::test_name`` (and a ``[case]``).
TEST_REFERENCE = re.compile(r"\b(test_\w+\.py)::(test_\w+)")


def test_every_test_the_docs_name_in_full_exists() -> None:
    """The evidence the docs cite (security.md's rows and findings, the
    guarantees) is a real test: a renamed or removed one is caught here."""
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), re.M))
        defined.setdefault(path.name, set()).update(names)
    missing = [
        f"{doc.relative_to(ROOT)}: {file}::{name}"
        for doc in DOCS
        for file, name in TEST_REFERENCE.findall(doc.read_text())
        if name not in defined.get(file, set())
    ]
    assert missing == []
