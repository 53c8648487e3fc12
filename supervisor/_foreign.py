"""``supervisor`` is also the import name of supervisord (PyPI ``supervisor``).

Installed into one environment, the two packages share a folder or shadow
each other, and hostcall breaks in ways that name neither. Both hostcall's
``supervisor/__init__.py`` and its CLI check for that first and stop with one
line saying so.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["FOREIGN_MESSAGE", "ForeignSupervisor", "foreign_files", "is_foreign"]

#: Files of supervisord's package that hostcall's never has.
_THEIRS: Final = ("supervisord.py", "supervisorctl.py", "options.py", "xmlrpc.py")

FOREIGN_MESSAGE: Final = (
    "another package named 'supervisor' (supervisord) is installed in this Python "
    "environment and clashes with hostcall's; install hostcall in an environment of "
    "its own (python -m venv), or uninstall supervisord from this one"
)


class ForeignSupervisor(ImportError):
    """supervisord's ``supervisor`` package is installed where hostcall's is."""


def foreign_files(folder: str) -> list[str]:
    """supervisord's files found in ``folder`` (a ``supervisor`` package folder)."""
    return [name for name in _THEIRS if os.path.exists(os.path.join(folder, name))]


def is_foreign(package: object) -> bool:
    """Whether the imported ``supervisor`` package is not (only) hostcall's:
    supervisord's ``__init__`` won, or its files lie beside ours."""
    return not getattr(package, "_HOSTCALL", False) or bool(getattr(package, "_FOREIGN", True))
