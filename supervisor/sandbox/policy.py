"""The plan's ``[sandbox]`` table (docs/sandbox.md) and the rules its paths must obey.

```toml
[sandbox]
network = "none"                 # none (default) | host
workdir = "./work"               # the guest's working directory (default: fresh per execution)
read_only = ["/tmp/inputs"]      # extra read-only paths (relative: to the plan file)
read_write = ["./workspace"]     # extra writable paths
hide = ["~/.ssh", "~/.aws"]      # absent inside; the state dir always is
```

A writable path must never reach what the supervisor trusts: the state dir,
the plan file, the modules its tools import, or any folder Python imports
from (a guest that could write there would run its code in the next
supervisor). :func:`check_writable` refuses such a plan before anything runs.
"""

from __future__ import annotations

import contextlib
import os
import site
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from supervisor.errors import HostcallError
from supervisor.sandbox.paths import is_within, resolve

__all__ = [
    "Network",
    "SandboxError",
    "SandboxPolicy",
    "check_links",
    "check_writable",
    "trusted_paths",
]

Network = Literal["none", "host"]


class SandboxError(HostcallError):
    """The sandbox cannot be set up as asked (an unsafe path, no sandbox on this host)."""

    code = "sandbox_unavailable"


def _absolute(raw: str, base: Path | None) -> Path:
    path = Path(os.path.expanduser(raw))
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return Path(os.path.normpath(path))


@dataclass(frozen=True, slots=True)
class SandboxPolicy:
    """What a plan lets its guests see and touch; paths absolute and normalised."""

    network: Network = "none"
    workdir: Path | None = None
    read_only: tuple[Path, ...] = ()
    read_write: tuple[Path, ...] = ()
    hide: tuple[Path, ...] = ()
    #: The plan file's folder: relative paths were resolved against it.
    base: Path | None = field(default=None, compare=False)

    @classmethod
    def from_table(
        cls,
        *,
        network: Network = "none",
        workdir: str | None = None,
        read_only: Sequence[str] = (),
        read_write: Sequence[str] = (),
        hide: Sequence[str] = (),
        base: Path | None = None,
    ) -> SandboxPolicy:
        """Resolve the ``[sandbox]`` table's paths (``~`` expanded, relative to ``base``)."""
        return cls(
            network=network,
            workdir=_absolute(workdir, base) if workdir else None,
            read_only=tuple(_absolute(p, base) for p in read_only),
            read_write=tuple(_absolute(p, base) for p in read_write),
            hide=tuple(_absolute(p, base) for p in hide),
            base=base,
        )

    @property
    def is_default(self) -> bool:
        """Whether nothing was asked beyond the defaults."""
        return self == SandboxPolicy()

    def resolved(self) -> dict[str, Any]:
        """The policy as it enters the plan's hash."""
        return {
            "network": self.network,
            "workdir": str(self.workdir) if self.workdir else None,
            "read_only": [str(p) for p in self.read_only],
            "read_write": [str(p) for p in self.read_write],
            "hide": [str(p) for p in self.hide],
        }

    @property
    def writable(self) -> tuple[Path, ...]:
        """Every host path the guest may write."""
        return (*self.read_write, *([self.workdir] if self.workdir else []))


def trusted_paths(extra: Iterable[Path] = ()) -> list[Path]:
    """What the supervisor trusts not to change under it: the files of every
    imported module, every folder on ``sys.path``, and ``extra`` (the plan
    file, the state dir). Real paths, so a symlinked folder is caught too."""
    found: set[Path] = set()
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if isinstance(name, str) and os.path.isabs(name):
            found.add(Path(os.path.realpath(name)))
    for entry in sys.path:
        if entry and os.path.isabs(entry) and os.path.isdir(entry):
            found.add(Path(os.path.realpath(entry)))
    for path in extra:
        found.add(Path(os.path.realpath(path)))
    return sorted(found)


def import_paths() -> list[Path]:
    """Folders whose new files Python would run in a later supervisor although
    none is there yet: the site folders (a ``.pth`` file there runs at start-up;
    the user's own ``~/.local/...`` counts even before it exists) and the
    bytecode cache prefix, if one is set."""
    found = []
    with contextlib.suppress(AttributeError):
        found += site.getsitepackages()
    with contextlib.suppress(AttributeError):
        found += [site.getuserbase(), site.getusersitepackages()]
    if sys.pycache_prefix:
        found.append(sys.pycache_prefix)
    return [Path(os.path.realpath(p)) for p in found if p]


def check_writable(
    policy: SandboxPolicy,
    trusted: Iterable[Path],
    state_dir: Path,
    vetted: Mapping[Path, Path] | None = None,
) -> None:
    """Refuse a writable path that holds, or lies inside, something trusted.

    ``vetted`` is each plan path's real path as :func:`check_links` resolved
    it, which the launch then mounts: checking a path resolved again could
    pass a folder other than the one mounted (a link swapped in between).
    Without it, each path is resolved here.

    Trusted are the state dir, ``trusted`` (see :func:`trusted_paths`), the
    site folders and bytecode cache (:func:`import_paths`, inside or holding),
    and any ``__pycache__`` folder: Python loads the bytecode it finds there
    without reading the source, so a guest writing one would run its code in
    the next supervisor that imports the module beside it.

    Raises:
        SandboxError: with a one-line reason naming both paths.
    """
    state = Path(os.path.realpath(state_dir))
    trusted = list(trusted)
    imports = import_paths()
    for writable in policy.writable:
        real = vetted[writable] if vetted is not None else resolve(writable)[0]
        if real == Path("/"):
            raise SandboxError(f"[sandbox] cannot make / writable for the guest ({writable})")
        if "__pycache__" in real.parts:
            raise SandboxError(
                f"[sandbox] writable path {writable} is a bytecode cache (__pycache__): "
                "a guest writing there would run its code in the supervisor"
            )
        for path in imports:
            if is_within(real, path) or is_within(path, real):
                raise SandboxError(
                    f"[sandbox] writable path {writable} reaches {path}, where Python finds "
                    "code to run at start-up; name a folder outside it"
                )
        if is_within(real, state) or is_within(state, real):
            raise SandboxError(
                f"[sandbox] writable path {writable} overlaps the state dir {state_dir}: "
                "the guest must never reach it"
            )
        for path in trusted:
            if is_within(path, real):
                raise SandboxError(
                    f"[sandbox] writable path {writable} holds {path}, which the supervisor "
                    "imports or trusts; a guest writing there would run code in the supervisor. "
                    "Name a folder that holds none of it"
                )


def check_links(policy: SandboxPolicy, guest_uid: int | None) -> dict[Path, Path]:
    """Refuse a plan path reached through a symlink a guest could have made;
    returns each plan path's real path as checked.

    A guest may leave a symlink in what it may write. Were a plan path's way
    through it, the guest would choose what a later guest gets mounted there
    — its user's home, read-write, say. Refused: a symlink inside one of this
    plan's writable paths, and, when the guests have a uid of their own
    (``guest_uid``: the supervisor runs as root), a symlink that uid owns,
    wherever it is (another plan's folder). An unprivileged supervisor's guests
    share its uid, so such a link made through another plan is not told from
    the user's own (docs/security.md, Not defended).

    The real paths are what the launch then checks (:func:`check_writable`),
    walks and mounts, never through a symlink: a link a guest swaps in after
    this check fails that walk, where resolving the name again would follow it.

    Raises:
        SandboxError: with a one-line reason naming the path and the link.
    """
    resolved = {path: resolve(path) for path in (*policy.read_only, *policy.writable)}
    writable = [resolved[p][0] for p in policy.writable]
    for path, (_, links) in resolved.items():
        for link in links:
            inside = next((w for w in writable if is_within(link, w)), None)
            if inside is not None:
                raise SandboxError(
                    f"[sandbox] {path} is reached through the symlink {link}, inside the "
                    f"writable path {inside}: a guest could have made it; name the real path"
                )
            if guest_uid is not None and _owner(link) == guest_uid:
                raise SandboxError(
                    f"[sandbox] {path} is reached through the symlink {link}, which a guest "
                    f"made (uid {guest_uid}): name the real path"
                )
    return {path: real for path, (real, _) in resolved.items()}


def _owner(path: Path) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:  # gone since: bubblewrap will find nothing there
        return None
