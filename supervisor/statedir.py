"""The state dir: its lock, its layout and where its sockets live (docs/operations.md)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

from supervisor.errors import StateDirBusy, UnsafeStateDir
from supervisor.lockfile import drop_lock, hold_lock
from supervisor.sockets import MAX_SOCKET_PATH

__all__ = ["StateDir", "chosen_state_dir"]

#: Where a command keeps its state when neither ``--state-dir`` nor the
#: environment names a place (docs/operations.md).
DEFAULT_STATE_DIR: Final = ".hostcall"


def chosen_state_dir(given: str | os.PathLike[str] | None) -> Path:
    """``given`` (``--state-dir``), else ``$HOSTCALL_STATE_DIR``, else
    ``./.hostcall`` (docs/operations.md)."""
    return Path(given or os.environ.get("HOSTCALL_STATE_DIR") or DEFAULT_STATE_DIR)


def _owner_only(folder: Path) -> None:
    """Make a folder of ours 0700 (docs/sandbox.md), never following a symlink.

    Raises:
        UnsafeStateDir: it is a symlink or belongs to another user.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise UnsafeStateDir(f"cannot open {folder}: {exc.strerror}") from None
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise UnsafeStateDir(f"{folder} belongs to another user")
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


class StateDir:
    """A supervisor's state directory, held under an exclusive lock while open."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).absolute()
        self._lock_fd: int | None = None
        self._private_run_dir: Path | None = None
        self.run_dir = self.path / "run"

    @property
    def logs_dir(self) -> Path:
        """Where guest output is kept, per invocation and execution."""
        return self.path / "logs"

    @property
    def receipts_dir(self) -> Path:
        """Where receipt files live, one per invocation."""
        return self.path / "receipts"

    def acquire(self) -> None:
        """Create the layout and take the lock.

        Raises:
            StateDirBusy: another running supervisor holds it.
            UnsafeStateDir: it cannot be made or used (a file, not writable,
                another user's, a symlink where a folder must be).
        """
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise UnsafeStateDir(
                f"state dir {self.path} is a file, not a folder: name another --state-dir"
            ) from None
        except OSError as exc:
            raise UnsafeStateDir(
                f"cannot create state dir {self.path}: {exc.strerror}; name another --state-dir"
            ) from None
        _owner_only(Path(os.path.realpath(self.path)))
        try:
            # O_NOFOLLOW: a symlink planted at the lock must not get its target emptied.
            fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise UnsafeStateDir(
                f"cannot write in state dir {self.path} ({exc.strerror}): name another --state-dir"
            ) from None
        holder = hold_lock(fd)
        if holder is not None:
            os.close(fd)
            raise StateDirBusy(
                f"state dir {self.path} is in use by a running supervisor (pid {holder}); "
                "use another --state-dir, or launch guests on it with `hostcall serve`"
            )
        self._lock_fd = fd
        for folder in (self.receipts_dir, self.logs_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
            _owner_only(folder)
        self.run_dir = self._socket_dir()

    def _socket_dir(self) -> Path:
        preferred = self.path / "run"
        if len(os.fsencode(preferred / "channel.sock")) <= MAX_SOCKET_PATH:
            if preferred.is_symlink():
                # Never follow it: that would chmod, and bind in, someone else's directory.
                raise UnsafeStateDir(f"{preferred} is a symlink; remove it")
            preferred.mkdir(mode=0o700, exist_ok=True)
            _owner_only(preferred)
            return preferred
        # Too long for sun_path: a private short directory instead (docs/guests.md).
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        if len(base) > 60:
            base = "/tmp"
        self._private_run_dir = Path(tempfile.mkdtemp(prefix="hostcall-", dir=base))
        return self._private_run_dir

    def release(self) -> None:
        """Drop the lock and any private socket directory."""
        if self._private_run_dir is not None:
            shutil.rmtree(self._private_run_dir, ignore_errors=True)
            self._private_run_dir = None
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            drop_lock(fd)
