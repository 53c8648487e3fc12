"""The operator's terminal and a guest: escapes shown as text, no terminal for the guest.

A real ``hostcall run`` on a real pseudo-terminal, as an operator runs it.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from supervisor.terminal import escape_controls
from tests.harness import STEP_TIMEOUT_S

PLAN = '[plan]\nname = "tty"\n'

GUEST = r"""
import os, sys
print("stdin is a terminal:", os.isatty(0), flush=True)
print("typed:", sys.stdin.readline().strip(), flush=True)
sys.stdout.write("\x1b]0;owned\x07\x1b[2Jfake prompt\r\n")
sys.stdout.flush()
"""


def test_control_characters_are_shown_as_text_and_newlines_kept() -> None:
    assert escape_controls(b"a\x1b[2Jb\n\tc\r\n\x07\xc2\x9bd\xc3\xa9") == (
        b"a\\x1b[2Jb\n\tc\r\n\\x07\\xc2\\x9bd\xc3\xa9"
    )


def _read_until(fd: int, needle: bytes, seen: bytearray) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {bytes(seen)!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's other end has closed
                break
            if not chunk:
                break
            seen += chunk


def test_a_sandboxed_guest_gets_a_pipe_for_stdin_and_its_escapes_reach_the_terminal_as_text(
    tmp_path: Path,
) -> None:
    (tmp_path / "plan.toml").write_text(PLAN)
    master, slave = pty.openpty()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "supervisor.cli",
                "run",
                "--state-dir",
                str(tmp_path / "state"),
                "--plan",
                str(tmp_path / "plan.toml"),
                "--",
                sys.executable,
                "-c",
                GUEST,
            ],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        seen = bytearray()
        _read_until(master, b"stdin is a terminal: False", seen)
        os.write(master, b"hello\n")  # what the operator types reaches the guest
        _read_until(master, b" exited with ", seen)  # the summary
        assert process.wait(STEP_TIMEOUT_S) == 0
    finally:
        os.close(master)
    text = bytes(seen)
    assert b"typed: hello" in text
    assert b"\\x1b]0;owned\\x07\\x1b[2Jfake prompt" in text
    assert b"\x1b]0;owned" not in text and b"\x1b[2J" not in text
