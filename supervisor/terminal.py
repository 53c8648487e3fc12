"""The operator's terminal, kept out of a guest's reach.

A guest's output is untrusted text. Passed raw to a terminal, escape
sequences in it can rewrite what the operator sees (move the cursor over
hostcall's own lines, fake a summary or an approval prompt, set the window
title, and on some terminals make the terminal answer back into its input).
So output bound for a terminal shows control characters as ``\\xNN`` text;
output bound for a pipe or file is passed as is.

A terminal inherited as the guest's stdin would also be a way around that
(the descriptor is open for writing too) and would let the guest read what
the operator types. A sandboxed guest gets a pipe instead, fed from our own
stdin by :class:`StdinRelay`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from typing import Final

__all__ = ["StdinRelay", "escape_controls", "is_terminal"]

#: C0 controls but newline, carriage return and tab; DEL; C1 controls as UTF-8.
_CONTROLS: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\xc2[\x80-\x9f]")
_CHUNK: Final = 64 * 1024


def is_terminal(fd: int) -> bool:
    """Whether ``fd`` is a terminal (False for a closed descriptor)."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


def escape_controls(data: bytes) -> bytes:
    """``data`` with every control character but newline, return and tab shown as text."""
    return _CONTROLS.sub(lambda m: "".join(f"\\x{b:02x}" for b in m.group()).encode(), data)


class StdinRelay:
    """Copies this process's stdin to one guest's stdin pipe at a time.

    One daemon thread reads our stdin for the whole process (a read cannot be
    interrupted, so a second reader would race the first); what it reads goes
    to the guest attached at that moment, or is dropped if none is.
    """

    _instance: StdinRelay | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._target: tuple[asyncio.AbstractEventLoop, asyncio.StreamWriter] | None = None
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="hostcall-stdin", daemon=True)
        self._thread.start()

    @classmethod
    def shared(cls) -> StdinRelay:
        """The one relay of this process."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def attach(self, writer: asyncio.StreamWriter) -> None:
        """Send what is typed from now on to ``writer`` (a guest's stdin)."""
        if self._ended:
            _close(writer)  # our stdin has ended: so has the guest's
            return
        self._target = (asyncio.get_running_loop(), writer)

    def detach(self, writer: asyncio.StreamWriter) -> None:
        """Stop sending to ``writer`` if it is the one attached."""
        if self._target is not None and self._target[1] is writer:
            self._target = None

    def _run(self) -> None:
        while True:
            try:
                data = os.read(0, _CHUNK)
            except OSError:
                data = b""
            if not data:
                self._ended = True
            target = self._target
            if target is None:
                continue
            loop, writer = target
            with contextlib.suppress(RuntimeError):  # the loop has closed
                if data:
                    loop.call_soon_threadsafe(_write, writer, data)
                else:
                    loop.call_soon_threadsafe(_close, writer)
            if not data:
                return  # end of our stdin: the guest sees it too


def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    if not writer.is_closing():
        writer.write(data)


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        writer.close()
