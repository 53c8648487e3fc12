"""What a guest's command needs from the host's file system, and who may reach it.

Two questions the sandbox builder asks of real paths:

- which host paths does the command resolve through — the executable found on
  ``PATH``, every symlink hop to its real file, the interpreter of a ``#!``
  script, a virtual environment and the Python it was made from, and the
  files named in its arguments (docs/sandbox.md: they "stay readable and executable
  for the guest's uid");
- can a given uid traverse to a path at all (a supervisor running as root
  starts guests under an unprivileged uid, for which ``/root`` is closed).

Plain ``os`` calls, no policy: the decisions are in :mod:`.layout`.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "Account",
    "bound_unix_sockets",
    "command_paths",
    "is_within",
    "mount_points",
    "reachable",
    "resolve",
]

#: How many symlink hops and ``#!`` levels are followed before giving up.
_MAX_HOPS: Final = 40
_MAX_SHEBANG_DEPTH: Final = 3
#: A ``#!`` line longer than this is not a shebang the kernel would honour.
_SHEBANG_MAX: Final = 256
#: setuptools' editable finder: ``MAPPING: dict[str, str] = {'pkg': '/src/pkg'}``.
_MAPPING: Final = re.compile(r"^MAPPING(?:\s*:[^=]*)?\s*=\s*(\{.*?\})\s*$", re.M)


@dataclass(frozen=True, slots=True)
class Account:
    """A uid and gid, without supplementary groups (the guest has none)."""

    uid: int
    gid: int

    def may(self, st: os.stat_result, bit: int) -> bool:
        """Whether the mode bits of ``st`` grant this account ``bit`` (4 r, 2 w, 1 x).

        Root is not special here: the guest is never root. POSIX ACLs are not
        consulted, so the answer may say no where an ACL would say yes; the
        caller then exposes the path itself, which is harmless.
        """
        if st.st_uid == self.uid:
            return bool(st.st_mode & (bit << 6))
        if st.st_gid == self.gid:
            return bool(st.st_mode & (bit << 3))
        return bool(st.st_mode & bit)


def is_within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies below it (both absolute, normalised)."""
    p, f = str(path), str(folder)
    return p == f or f == "/" or p.startswith(f + "/")


def reachable(path: Path, account: Account) -> Path | None:
    """The first directory on the way to ``path`` that ``account`` cannot
    search, or ``None`` when every ancestor lets it through.

    Only the ancestors are checked (search permission); whether the path itself
    may be read is the caller's question.
    """
    for ancestor in reversed(path.parents):
        try:
            st = os.stat(ancestor)
        except OSError:
            return ancestor
        if not account.may(st, 1):
            return ancestor
    return None


def _symlink_hops(path: Path) -> list[Path]:
    """``path`` and every path its symlinks lead through, ending at the real file."""
    hops = [path]
    current = path
    for _ in range(_MAX_HOPS):
        # Resolve the parent first: a symlink hop is relative to the real folder.
        parent = current.parent.resolve()
        candidate = parent / current.name
        if candidate != current:
            hops.append(candidate)
        try:
            target = os.readlink(candidate)
        except OSError:  # not a symlink (or gone): this is the end of the chain
            break
        current = Path(os.path.normpath(parent / target))
        hops.append(current)
    real = path.resolve()
    if real not in hops:
        hops.append(real)
    return hops


def resolve(path: Path) -> tuple[Path, list[Path]]:
    """``path`` (absolute) resolved as the kernel would, a missing rest taken
    as it is: its real path, and every symlink met on the way, in order, each
    named by its real place (its folder resolved): the links in its folders,
    the links those lead through, and ``path`` itself if it is one. After a
    loop of links, the real path is
    the link where the resolving stopped: a symlink, never a folder before it."""
    found: list[Path] = []
    current = Path("/")
    todo = list(path.parts[1:])
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            target = os.readlink(candidate)
        except OSError:  # not a symlink, or missing: go on lexically
            current = candidate
            continue
        found.append(candidate)
        if len(found) > _MAX_HOPS:
            # A loop: the kernel would refuse it (ELOOP). The link is the
            # "real path", so that a walk to it fails as the kernel would.
            return candidate, found
        if os.path.isabs(target):
            current = Path("/")
        todo = [*Path(target).parts[1 if os.path.isabs(target) else 0 :], *todo]
    return current, found


def _shebang(path: Path) -> list[str]:
    """The interpreter and its argument from a ``#!`` line, or ``[]``."""
    try:
        with open(path, "rb") as f:
            head = f.read(_SHEBANG_MAX)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    line = head[2:].split(b"\n", 1)[0].decode(errors="replace").strip()
    return line.split(None, 1)


def _which(name: str, env: Mapping[str, str], cwd: Path) -> Path | None:
    if "/" in name:
        candidate = Path(name)
        return candidate if candidate.is_absolute() else cwd / candidate
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    return Path(found).absolute() if found is not None else None


def _prefix(executable: Path) -> Path:
    """The installation an executable belongs to: ``X`` for ``X/bin/name``
    (its libraries live beside, in ``X/lib``), else its own folder."""
    folder = executable.parent
    if folder.name in ("bin", "sbin") and folder.parent != folder:
        return folder.parent
    return folder


def _venv_home(prefix: Path) -> Path | None:
    """The Python a virtual environment was made from (``home`` in pyvenv.cfg)."""
    try:
        text = (prefix / "pyvenv.cfg").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "home" and value.strip():
            return Path(value.strip())
    return None


def _python_imports(prefix: Path) -> list[Path]:
    """Folders a Python installation imports from outside itself: what its
    site folders' ``.pth`` files name, and the sources of editable installs
    (setuptools' ``__editable__…_finder.py`` maps packages to folders)."""
    found: list[Path] = []
    for site_dir in prefix.glob("lib/python3*/site-packages"):
        for pth in site_dir.glob("*.pth"):
            try:
                lines = pth.read_text(errors="replace").splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.strip()
                if line and not line.startswith(("#", "import ", "import\t")):
                    found.append(Path(os.path.normpath(site_dir / line)))
        for finder in site_dir.glob("__editable__*finder.py"):
            with contextlib.suppress(OSError, ValueError, SyntaxError):
                source = finder.read_text(errors="replace")
                match = _MAPPING.search(source)
                if match is not None:
                    mapping = ast.literal_eval(match.group(1))
                    found.extend(Path(p) for p in mapping.values() if isinstance(p, str))
    return [p for p in found if p.is_absolute() and os.path.isdir(p)]


def command_paths(argv: Sequence[str], env: Mapping[str, str], cwd: Path) -> list[Path]:
    """The host paths the guest's command resolves through (docs/sandbox.md).

    The executable (``PATH`` lookup in the guest's own environment), each
    symlink hop, the installation prefix of every resolved executable, the
    interpreter of a ``#!`` script (``/usr/bin/env X`` looked up on ``PATH``),
    the Python a virtual environment was created from and the folders it
    imports from outside itself (editable installs, ``.pth`` files), the
    guest's ``PYTHONPATH``, and every argument that names an existing file or
    folder (absolute, or relative to ``cwd``). Each path is returned once,
    absolute; the caller decides what to expose.
    """
    found: dict[Path, None] = {}

    def executable(path: Path, depth: int) -> None:
        for hop in _symlink_hops(path):
            found.setdefault(hop, None)
            prefix = _prefix(hop)
            found.setdefault(prefix, None)
            home = _venv_home(prefix)
            if home is not None:
                for imported in _python_imports(prefix):
                    found.setdefault(imported, None)
                for real in _symlink_hops(home):
                    found.setdefault(_prefix(real / "python"), None)
        if depth >= _MAX_SHEBANG_DEPTH:
            return
        interpreter = _shebang(path.resolve())
        if not interpreter:
            return
        first = Path(interpreter[0])
        executable(first, depth + 1)
        if first.name == "env" and len(interpreter) > 1:
            named = interpreter[1].split()[-1] if interpreter[1].split() else ""
            program = _which(named, env, cwd) if named and not named.startswith("-") else None
            if program is not None:
                executable(program, depth + 1)

    program = _which(argv[0], env, cwd) if argv else None
    if program is not None:
        executable(program, 0)
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if os.path.isabs(entry) and os.path.isdir(entry):
            found.setdefault(Path(os.path.normpath(entry)), None)
    for argument in argv[1:]:
        if not argument or argument.startswith("-") or "\0" in argument:
            continue
        candidate = Path(argument) if os.path.isabs(argument) else cwd / argument
        try:
            if not os.path.lexists(candidate):
                continue
        except (OSError, ValueError):
            continue
        for hop in _symlink_hops(Path(os.path.normpath(candidate))):
            found.setdefault(hop, None)
    return [p for p in found if p.is_absolute()]


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> list[Path]:
    """Every mount point of this process's mount namespace."""
    points = []
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    points.append(Path(_unescape(fields[4])))
    except OSError:
        pass
    return points


def bound_unix_sockets(table: str = "/proc/net/unix") -> list[Path]:
    """Paths of the Unix sockets bound in this network namespace (not abstract ones)."""
    paths = []
    try:
        with open(table, encoding="utf-8", errors="surrogateescape") as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split(None, 7)
                if len(fields) == 8 and fields[7].startswith("/"):
                    paths.append(Path(fields[7].rstrip("\n")))
    except OSError:
        pass
    return paths


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (``\\040``)."""
    if "\\" not in field:
        return field
    out = []
    i = 0
    while i < len(field):
        digits = field[i + 1 : i + 4]
        if field[i] == "\\" and len(digits) == 3 and digits.isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def existing(paths: Iterable[Path]) -> list[Path]:
    """Those of ``paths`` that exist (without following a final symlink)."""
    return [p for p in paths if os.path.lexists(p)]


def is_dir(path: Path) -> bool:
    """Whether ``path`` is a directory (following symlinks), False on any error."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except OSError:
        return False
