"""The layering rules of the project, checked on the source itself."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _imported_modules(package: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found


def test_the_channel_never_imports_the_supervisor() -> None:
    assert "supervisor" not in _imported_modules("channel")


def test_the_guest_client_imports_only_the_standard_library() -> None:
    outside = _imported_modules("guest_client") - set(sys.stdlib_module_names) - {"guest_client"}
    assert outside == set()


@pytest.mark.parametrize("package", ["supervisor", "channel", "guest_client"])
def test_every_name_in_a_packages_all_exists_and_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value) or inspect.isfunction(value):
            assert value.__doc__, f"{package}.{name} has no docstring"


# -- the import rules of supervisor/ (issue 15) ---------------------------------

#: Decisions and data, no I/O: they import no I/O module and only each other.
PURE = {
    "supervisor.addresses",
    "supervisor.budget",
    "supervisor.canonical",
    "supervisor.errors",
    "supervisor.ids",
    "supervisor.limits",
    "supervisor.outcomes",
    "supervisor.receipts",
    "supervisor.replay",
    "supervisor.admission",
    "supervisor.storespec",
    "supervisor.stores.base",
    "supervisor.timestamps",
    "channel.errors",
    "channel.frozen",
    "channel.ids",
}
#: Modules that do I/O: sockets, processes, threads, files by descriptor, databases.
IO_MODULES = {
    "asyncio", "socket", "subprocess", "sqlite3", "asyncpg", "aiohttp", "threading",
    "select", "selectors", "fcntl", "shutil", "tempfile", "http", "psutil", "uvloop",
}  # fmt: skip
#: What an effect store may import of the project: stores, pure modules, the
#: receipt files' helpers, and the fault harness's crash points.
STORE_MAY_IMPORT = {"supervisor.receipt_files", "supervisor.faults", "supervisor.lockfile"}
#: The top of the house: what runs a supervisor or serves its operators.
TOP = {"supervisor.admin", "supervisor.demo"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


SOURCES = {
    _module_name(path): path
    for package in ("supervisor", "channel")
    for path in (ROOT / package).rglob("*.py")
}


def _project(imported: set[str]) -> set[str]:
    return {name for name in imported if name in SOURCES}


def test_pure_modules_import_no_io_module_and_only_pure_modules() -> None:
    wrong = {}
    for name in sorted(PURE):
        imported = _imports_of(SOURCES[name])
        io = {m for m in imported if m.split(".")[0] in IO_MODULES}
        impure = _project(imported) - PURE - {"channel"}
        if io or impure:
            wrong[name] = sorted(io | impure)
    assert wrong == {}


def test_stores_import_only_stores_pure_modules_and_the_receipt_files() -> None:
    wrong = {}
    for name, path in SOURCES.items():
        if not name.startswith("supervisor.stores"):
            continue
        allowed = PURE | STORE_MAY_IMPORT | {"supervisor", "channel"}
        outside = {
            m for m in _project(_imports_of(path))
            if not m.startswith("supervisor.stores") and m not in allowed
        }  # fmt: skip
        if outside:
            wrong[name] = sorted(outside)
    assert wrong == {}


def test_nothing_below_the_supervisor_imports_the_admin_api_the_cli_or_the_demo() -> None:
    above = {"supervisor", "supervisor.supervisor", *TOP}
    wrong = {}
    for name, path in SOURCES.items():
        if name in above or name.startswith(("supervisor.cli", "supervisor.console")):
            continue
        reached = {
            m for m in _project(_imports_of(path))
            if m in TOP or m.startswith("supervisor.cli")
        }  # fmt: skip
        if reached:
            wrong[name] = sorted(reached)
    assert wrong == {}


def test_only_the_stores_package_names_the_concrete_stores() -> None:
    concrete = {
        "supervisor.stores.sqlite",
        "supervisor.stores.postgres",
        "supervisor.stores.memory",
    }
    wrong = {}
    for name, path in SOURCES.items():
        if name.startswith("supervisor.stores"):
            continue
        named = _project(_imports_of(path)) & concrete
        if named:
            wrong[name] = sorted(named)
    assert wrong == {}


def test_the_house_has_no_import_circle() -> None:
    graph = {
        name: {m for m in _project(_imports_of(path)) if m != name and m in SOURCES}
        for name, path in SOURCES.items()
    }
    # A package's __init__ hands names on; its arrows are not the modules' own.
    graph = {n: {m for m in deps if SOURCES[m].name != "__init__.py"} for n, deps in graph.items()}
    circles = []
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    circles.append(trail)
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert circles == []
