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

__all__ = ["StdinRelay", "TerminalText", "escape_controls", "is_terminal"]

#: C0 controls but newline, carriage return and tab; DEL; C1 controls; and,
#: as ``surrogateescape`` decodes them, bytes that are not UTF-8 (a lone
#: 0x9b is CSI to a terminal in an 8-bit mode).
_CONTROLS: Final = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\udc80-\udcff]+")
_CHUNK: Final = 64 * 1024


def is_terminal(fd: int) -> bool:
    """Whether ``fd`` is a terminal (False for a closed descriptor)."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


def escape_controls(data: bytes) -> bytes:
    """``data`` with every control character but newline, return and tab, and
    every byte that is not UTF-8, shown as ``\\xNN`` text (of its bytes)."""
    text = data.decode("utf-8", "surrogateescape")
    return _CONTROLS.sub(_as_hex, text).encode()


def _as_hex(match: re.Match[str]) -> str:
    return "".join(f"\\x{b:02x}" for b in match.group().encode("utf-8", "surrogateescape"))


class TerminalText:
    """A stream of guest bytes made safe for a terminal, chunk by chunk.

    A character split across two chunks is held back until it is whole, so
    a C1 control written as ``\\xc2`` then ``\\x9b`` is escaped like one
    written at once, and a letter split so is passed as itself.
    """

    def __init__(self) -> None:
        self._held = b""

    @property
    def mid_character(self) -> bool:
        """Whether the last chunk ended inside a character (it is held back)."""
        return bool(self._held)

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (after what was held) can be shown, escaped."""
        data = self._held + data
        whole = len(data) - _unfinished_tail(data)
        self._held = data[whole:]
        return escape_controls(data[:whole])

    def end(self) -> bytes:
        """What is held back, escaped (the stream has ended there)."""
        held, self._held = self._held, b""
        return escape_controls(held)


def _unfinished_tail(data: bytes) -> int:
    """How many bytes at the end of ``data`` start a UTF-8 character that
    has not ended there (0 to 3)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:  # ASCII: nothing unfinished
            return 0
        if byte >= 0xC0:  # a lead byte: of how long a character?
            length = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return back if back < length else 0
    return 0  # continuation bytes only: not a character's start; escaped


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
