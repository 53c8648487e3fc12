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
