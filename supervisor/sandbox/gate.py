"""The gate: a sandboxed guest's program runs only on the supervisor's go-ahead.

bubblewrap's ``--block-fd`` takes a pipe's end for a go-ahead, and a pipe's
end is what a supervisor killed while a guest starts leaves behind
(docs/security.md, F37). So the guest's own program runs behind a shell line
that reads a second descriptor of that pipe and ``exec``\\ s the guest only once
it has read the go-ahead's line; at the pipe's end it exits
:data:`GATE_SHUT_EXIT` and nothing of the guest runs.

Before it waits for that line, the gate says it has been reached
(:data:`GATE_REACHED`, on a pipe of its own: :func:`reached_pipe`). bubblewrap
has then built the whole sandbox — every mount, setpriv, setsid — and what
fails before that (a masked path gone since, say) is the sandbox's failure,
not the guest's: bubblewrap exits 1 then, as a guest may. The supervisor
writes the gate's line only once it has read that line, so no code of the
guest runs before the start knows which it was.

A shell passes on the environment it is given, but not to the letter
(docs/sandbox.md, Limits): it sets ``PWD`` to the working directory, bash adds
``SHLVL``, and dash drops every variable whose name is not a shell name
(``BASH_FUNC_module%%``, ``spring.profiles.active``). A guest given such a
name gets, where ``/bin/sh`` drops it, a gate of bash's (``--posix``: it reads
no startup file, and no function overrides ``exec``), which keeps it; where
there is no bash, the supervisor's log names what the guest loses.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Final

__all__ = [
    "BWRAP_GO_AHEAD",
    "GATE_GO_AHEAD",
    "GATE_REACHED",
    "GATE_SHUT_EXIT",
    "GO_AHEAD",
    "Gate",
    "Gates",
    "gate_pipe",
    "reached_pipe",
]

logger = logging.getLogger(__name__)

#: What the supervisor writes to the block pipe to let a guest run: one byte
#: for bubblewrap's ``--block-fd``, then one line for the gate.
GO_AHEAD: Final = b"x\n"
#: bubblewrap's part of :data:`GO_AHEAD` (``--block-fd`` reads one byte) …
BWRAP_GO_AHEAD: Final = GO_AHEAD[:1]
#: … and the gate's: the line after it.
GATE_GO_AHEAD: Final = GO_AHEAD[1:]
#: What the gate writes to its :func:`reached_pipe` once it runs, before it
#: reads its line.
GATE_REACHED: Final = b"r\n"
#: The exit status of a gate that found the block pipe ended, not the go-ahead.
GATE_SHUT_EXIT: Final = 125
#: How long checking one shell may take.
PROBE_TIMEOUT_S: Final = 10.0
#: A name that dash drops and bash keeps: how :meth:`Gate.probe` tells them apart.
_PROBE_NAME: Final = "hostcall.gate-probe%%"
_SHELL_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: ``--`` first where the shell takes it, so that a program named ``-x`` is
#: not an option of ``exec`` (bash, busybox); dash takes no ``--`` there, and
#: no option either.
_EXEC_LINES: Final = ('exec -- "$@"', 'exec "$@"')


@dataclass(frozen=True, slots=True)
class Gate:
    """One shell's gate line."""

    #: The shell and its options, before ``-c``.
    shell: tuple[str, ...]
    #: How it runs the guest: one of :data:`_EXEC_LINES`.
    exec_line: str = 'exec "$@"'
    #: Whether it passes on variables whose names are not shell names.
    keeps_any_name: bool = False

    def command(self, fd: int, reached_fd: int) -> list[str]:
        """The gate reading the go-ahead from descriptor ``fd``; the guest's
        argv follows it. First it writes :data:`GATE_REACHED` to
        ``reached_fd`` (the write end of a :func:`reached_pipe`).

        ``$1`` is the gate's own descriptor of the block pipe (bubblewrap
        closes the one it reads before the command runs), ``$2`` the reached
        pipe's. dash takes no descriptor above 9 in a redirection, so each
        pipe is opened again through ``/proc``; the descriptors stay open in
        the guest, the block pipe at its end. ``unset -f`` first: bash
        imports functions from the environment, and one named ``read`` would
        open the gate, one named ``echo`` say it was reached (``unset``,
        ``exit``, ``shift`` and ``exec`` are special builtins, which no
        function overrides in a POSIX shell)."""
        script = (
            f"unset -f read echo; "
            f'echo {GATE_REACHED.decode().strip()} > "/proc/self/fd/$2" || exit {GATE_SHUT_EXIT}; '
            f'read -r _ < "/proc/self/fd/$1" || exit {GATE_SHUT_EXIT}; '
            f"shift 2; {self.exec_line}"
        )
        return [*self.shell, "-c", script, "hostcall-gate", str(fd), str(reached_fd)]

    @classmethod
    def probe(cls, *shell: str) -> Gate | None:
        """The gate of ``shell`` (its path and options), found by running it
        on this host; None if it cannot ``exec`` a program."""
        env_program = shutil.which("env") or "/usr/bin/env"
        for exec_line in _EXEC_LINES:
            command = [*shell, "-c", exec_line, "hostcall-gate", env_program]
            try:
                done = subprocess.run(
                    command,
                    env={"PATH": os.defpath, _PROBE_NAME: "1"},
                    capture_output=True,
                    timeout=PROBE_TIMEOUT_S,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired):
                return None
            if done.returncode == 0:
                kept = f"{_PROBE_NAME}=1".encode() in done.stdout.splitlines()
                return cls(shell, exec_line, kept)
        return None


@dataclass(frozen=True, slots=True)
class Gates:
    """This host's gates: ``/bin/sh``'s, and bash's where that one drops names."""

    usual: Gate
    #: One that keeps every name, where :attr:`usual` does not: None if it
    #: does, or if this host has no bash.
    any_name: Gate | None = None

    @classmethod
    def probe(cls) -> Gates | None:
        """``/bin/sh``'s gate, and bash's if ``/bin/sh`` drops names; None if
        ``/bin/sh`` cannot run a program."""
        usual = Gate.probe("/bin/sh")
        if usual is None:
            return None
        if usual.keeps_any_name:
            return cls(usual)
        bash = shutil.which("bash", path=os.defpath)
        wide = Gate.probe(bash, "--posix") if bash is not None else None
        return cls(usual, wide if wide is not None and wide.keeps_any_name else None)

    def for_env(self, env: Mapping[str, str]) -> Gate:
        """The gate for a guest given ``env``: the usual one, unless ``env``
        has a name it would drop."""
        if self.usual.keeps_any_name:
            return self.usual
        odd = tuple(sorted(name for name in env if not _SHELL_NAME.match(name)))
        if not odd:
            return self.usual
        if self.any_name is not None:
            return self.any_name
        _warn_of_dropped(odd)
        return self.usual


@functools.lru_cache(maxsize=64)
def _warn_of_dropped(names: Iterable[str]) -> None:
    """Once per set of names (names only: a value may be a secret)."""
    logger.warning(
        "a sandboxed guest's environment loses %s: this host's /bin/sh, which lets "
        "the guest run, passes on only variables named as in a shell, and there is "
        "no bash to use instead",
        ", ".join(names),
    )


def gate_pipe(group: int | None) -> tuple[int, int, int]:
    """The block pipe and the gate's second descriptor of it: ``(read, gate, write)``.

    ``group``: the gate's gid where the gate is not the supervisor's uid (as
    root). The pipe then stays the supervisor's, readable by that group only
    (0440): the gate may open it again through ``/proc``, and no process of
    the guest's uid — the guest's own, or any other on the host — may open it
    for writing (nor change its mode) to give a go-ahead of its own."""
    block_r, block_w = _pipe_of(group, 0o440)
    try:
        gate_r = os.dup(block_r)
    except BaseException:
        os.close(block_r)
        os.close(block_w)
        raise
    return block_r, gate_r, block_w


def reached_pipe(group: int | None) -> tuple[int, int]:
    """The pipe the gate says it was reached on: ``(read, write)``.

    Both ends go into the sandbox: a gate whose supervisor has gone writes
    into a pipe it still reads itself, rather than die of ``SIGPIPE``, and
    exits :data:`GATE_SHUT_EXIT` at the block pipe's end as it would have.
    ``group`` as for :func:`gate_pipe`: the pipe is then the supervisor's,
    writable by that group only (0220), so that the gate may open it again
    through ``/proc``, and no other process of the guest's uid may open it
    to read (and take the gate's byte before the supervisor does).
    """
    return _pipe_of(group, 0o220)


def _pipe_of(group: int | None, mode: int) -> tuple[int, int]:
    """A pipe ``(read, write)``; given ``group``, the supervisor's with that
    group and ``mode`` (what a process of the group may open it again for
    through ``/proc``)."""
    read, write = os.pipe()
    try:
        if group is not None:
            os.fchown(read, -1, group)
            os.fchmod(read, mode)
    except BaseException:
        os.close(read)
        os.close(write)
        raise
    return read, write
